"""Layer-skip self-drafting (Draft & Verify, Zhang et al. ACL 2024; SWIFT, ICLR 2025).

The draft is the target itself with a set of attention and MLP sub-layers skipped: a skipped
sub-layer adds nothing to the residual stream, so the hidden state passes through unchanged.

* No second model and no change to the target: `skipping_view` builds a shallow copy of the
  module path root -> decoder -> layer list whose layers are (shallow) copies with `self_attn` /
  `mlp` swapped for a module returning zeros; a whole skipped layer is an identity. Weights, config
  and modeling code are shared and never modified. A zero attention output is a pass-through also
  for Gemma-3's post-attention / post-feedforward norms, since RMSNorm(0) = 0.
* The draft shares the target's KV cache: the prefix KV was written by the full model, so the
  draft sees exactly what the target saw. Draft forwards append KV only in the attention layers
  they run; afterwards every layer is cropped back, so the target cache is as it was (the dense
  verification pass writes the real KV of accepted tokens).
* While drafting, layers of the cache differ in length. Attention masks are built from the first
  layer of each attention type (full / sliding), so those "anchor" layers must keep their
  attention: then every layer that runs attention holds exactly the anchor's length and masks and
  positions are exact. Positions are passed explicitly.
* Adaptive draft exit: drafting stops when the draft's top probability falls under a threshold
  that follows the observed acceptance (Draft & Verify's rule). Back-off: the length policy
  compares the engine-measured draft / verify costs and acceptance and proposes empty drafts (plain
  decoding steps) while drafting does not pay, probing again now and then (sparrow.policy).
* Lossless sampling: at temperature > 0 drafts are sampled from q and q is returned; greedy
  drafts are argmax (Draft.probs None, the q = 1 rule).

Skip sets are found per model by `sparrow tune layer-skip` (sparrow.training.layer_skip) and stored as small
JSON records (`SkipRecord`); tuned sets for presets ship in `sparrow/skip_sets/<preset>.json`.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from sparrow.config import GREEDY, SamplingConfig
from sparrow.drafters.base import DrafterBase, distinct
from sparrow.drafters.draft_loop import autoregressive_draft
from sparrow.drafters.tree_draft import TreeShape, dynamic_tree, resolve_shape
from sparrow.drafters.vocab import DraftVocab, reduced_head_view, resolve_draft_vocab
from sparrow.errors import UserError
from sparrow.grammar import FREE, Constraint
from sparrow.models import LoadedModel
from sparrow.noise import Randomness
from sparrow.paths import default_cache_dir
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.cached_model import CachedModel, _text_config, additive_mask
from sparrow.runtime.runner import runner_for
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict

# --- skip sets -------------------------------------------------------------------------------------

def _indices(name: str, values: Any, num_layers: int) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < num_layers:
            raise UserError(f"skip_set: {name} layer {v!r} is not a layer index in [0, {num_layers})")
        out.append(v)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class SkipSet:
    """Which sub-layers the draft skips; a layer in both `attention` and `mlp` is skipped whole."""

    num_layers: int
    attention: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise UserError(f"skip_set: num_layers must be an integer >= 1, got {self.num_layers!r}")
        object.__setattr__(self, "attention", _indices("attention", self.attention, self.num_layers))
        object.__setattr__(self, "mlp", _indices("mlp", self.mlp, self.num_layers))
        if len(self.attention) == len(self.mlp) == self.num_layers:
            raise UserError(f"skip_set: all {self.num_layers} layers are skipped; the draft must keep some")

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers skipped whole."""
        return tuple(sorted(set(self.attention) & set(self.mlp)))

    @property
    def num_skipped(self) -> int:
        """Skipped sub-layers (attention and MLP counted separately)."""
        return len(self.attention) + len(self.mlp)

    def with_skipped(self, attention: tuple[int, ...] = (), mlp: tuple[int, ...] = ()) -> SkipSet:
        return SkipSet(self.num_layers, self.attention + tuple(attention), self.mlp + tuple(mlp))

    def to_dict(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "attention": list(self.attention), "mlp": list(self.mlp)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SkipSet:
        try:
            return SkipSet(int(d["num_layers"]), tuple(d.get("attention", ())), tuple(d.get("mlp", ())))
        except (KeyError, TypeError) as e:
            raise UserError(f"skip_set: expected {{num_layers, attention, mlp}}, got {d!r}") from e

    @staticmethod
    def parse(spec: str, num_layers: int) -> SkipSet:
        """'attention=3,5-7;mlp=4;layers=10-12' (ranges inclusive; `layers` = attention and MLP)."""
        parts: dict[str, list[int]] = {"attention": [], "mlp": []}
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            key, _, values = item.partition("=")
            key = key.strip()
            if key not in ("attention", "mlp", "layers") or not _:
                raise UserError(f"skip_set: expected 'attention=..;mlp=..;layers=..', got {spec!r}")
            numbers = []
            for tok in filter(None, (t.strip() for t in values.split(","))):
                m = re.fullmatch(r"(\d+)(?:-(\d+))?", tok)
                if m is None:
                    raise UserError(f"skip_set: {tok!r} in {spec!r} is not a layer index or range a-b")
                lo, hi = int(m[1]), int(m[2] or m[1])
                numbers += range(lo, hi + 1)
            for name in (("attention", "mlp") if key == "layers" else (key,)):
                parts[name] += numbers
        return SkipSet(num_layers, tuple(parts["attention"]), tuple(parts["mlp"]))

    def __str__(self) -> str:
        def ranges(xs: tuple[int, ...]) -> str:
            out, i = [], 0
            while i < len(xs):
                j = i
                while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
                    j += 1
                out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
                i = j + 1
            return ",".join(out)
        return f"attention={ranges(self.attention)};mlp={ranges(self.mlp)}"


@dataclass(frozen=True)
class SkipRecord:
    """A tuned skip set and what the tuner expected and measured for it (the JSON file)."""

    model: str
    skip: SkipSet
    num_draft_tokens: int
    agreement: float  # teacher-forced top-1 agreement of draft and target
    draft_cost: float  # one draft token / one target token (decode step)
    expected_speedup: float
    measured_speedup: float | None
    recommended: bool  # False: the tuner refused it (it loses); the drafter then decodes plainly
    date: str
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, **self.skip.to_dict(), "skip_set": str(self.skip),
                "num_draft_tokens": self.num_draft_tokens, "agreement": self.agreement,
                "draft_cost": self.draft_cost, "expected_speedup": self.expected_speedup,
                "measured_speedup": self.measured_speedup, "recommended": self.recommended,
                "date": self.date, "note": self.note, "details": self.details}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SkipRecord:
        try:
            return SkipRecord(
                model=str(d["model"]),
                skip=SkipSet.from_dict(d),
                num_draft_tokens=int(d["num_draft_tokens"]),
                agreement=float(d["agreement"]),
                draft_cost=float(d["draft_cost"]),
                expected_speedup=float(d["expected_speedup"]),
                measured_speedup=None if d.get("measured_speedup") is None else float(d["measured_speedup"]),
                recommended=bool(d["recommended"]),
                date=str(d["date"]),
                note=str(d.get("note", "")),
                details=dict(d.get("details", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"skip_file: not a layer-skip record ({e})") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> SkipRecord:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"skip_file: no such file: {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"skip_file: {path} is not valid JSON ({e})") from e
        return SkipRecord.from_dict(data)


def record_name(model_name: str) -> str:
    """File name of a model's record: the preset name, hub ids with '/' -> '--'."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", model_name.replace("/", "--")) + ".json"


def user_record_path(model_name: str) -> Path:
    """Where `sparrow tune layer-skip` stores a record by default: <cache>/skip_sets/<name>.json."""
    return default_cache_dir() / "skip_sets" / record_name(model_name)


def find_record(model_name: str) -> SkipRecord | None:
    """The record tuned on this machine (user cache) if any, else the one shipped for the preset."""
    user = user_record_path(model_name)
    if user.is_file():
        return SkipRecord.load(user)
    entry = resources.files("sparrow").joinpath("skip_sets", record_name(model_name))
    if not entry.is_file():
        return None
    return SkipRecord.from_dict(json.loads(entry.read_text()))


# --- the skipping view -----------------------------------------------------------------------------

def _first_input(args: tuple, kwargs: dict) -> Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


class SkippedAttention(nn.Module):
    """Stands for a skipped attention sub-layer: output 0 (residual pass-through), no KV written."""

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        return torch.zeros_like(_first_input(args, kwargs)), None


class SkippedMLP(nn.Module):
    """Stands for a skipped MLP sub-layer: output 0 (residual pass-through)."""

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return torch.zeros_like(_first_input(args, kwargs))


class SkippedLayer(nn.Module):
    """Stands for a decoder layer skipped whole: returns its input hidden states."""

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return _first_input(args, kwargs)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing parameters, buffers and config, with its own submodule table."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # copy.copy shares the dict: editing it would edit the original
    return clone


def find_layers(model: nn.Module, num_layers: int) -> str:
    """Dotted path of the decoder's layer list (a ModuleList of `num_layers` layers with self_attn and mlp)."""
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers" and len(module) == num_layers
                and all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in module)):
            return name
    raise UserError("layer-skip needs a decoder whose layers have `self_attn` and `mlp` sub-modules "
                     f"({type(model).__name__} has none)")


def anchor_layers(model: PreTrainedModel) -> tuple[int, ...]:
    """Layers whose attention must run: the first of each attention type (masks are built from them)."""
    config = _text_config(model.config)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return tuple(sorted({types.index(t) for t in set(types)}))


def check_skip_set(model: PreTrainedModel, skip: SkipSet) -> None:
    num_layers = _text_config(model.config).num_hidden_layers
    if skip.num_layers != num_layers:
        raise UserError(f"skip_set is for a {skip.num_layers}-layer model, the target has {num_layers} layers")
    kept = [i for i in anchor_layers(model) if i in skip.attention]
    if kept:
        raise UserError(f"skip_set: the attention of layer(s) {kept} cannot be skipped (the first layer of each "
                         "attention type builds the attention masks)")


def skipping_view(model: PreTrainedModel, skip: SkipSet) -> PreTrainedModel:
    """`model` with the sub-layers of `skip` skipped; shares every weight, changes nothing in `model`."""
    check_skip_set(model, skip)
    path = find_layers(model, skip.num_layers).split(".")
    root = _shallow(model)
    parent = root
    for name in path[:-1]:
        parent._modules[name] = _shallow(parent._modules[name])
        parent = parent._modules[name]
    layers = []
    for i, layer in enumerate(model.get_submodule(".".join(path))):
        if i in skip.attention and i in skip.mlp:
            layer = SkippedLayer()
        elif i in skip.attention or i in skip.mlp:
            layer = _shallow(layer)
            if i in skip.attention:
                layer._modules["self_attn"] = SkippedAttention()
            if i in skip.mlp:
                layer._modules["mlp"] = SkippedMLP()
        layers.append(layer)
    parent._modules[path[-1]] = nn.ModuleList(layers)
    return root


def crop_layers(cache: Any, length: int) -> None:
    """Crop every cache layer holding more than `length` positions back to `length`."""
    for layer in cache.layers:
        surplus = layer.get_seq_length() - length if layer.is_initialized else 0
        if surplus > 0:
            layer.crop(-surplus)


# --- the drafter -----------------------------------------------------------------------------------

class SkipView:
    """The skipping view over the target's cache, shaped as `dynamic_tree`'s draft model. `length` counts the
    positions the view has appended (skipped attention layers append nothing, so the cache's own length can
    lag); `rewind` crops every layer, never below the target's own positions: drafted KV is never kept."""

    def __init__(self, view: PreTrainedModel, target: CachedModel) -> None:
        self.view, self.target = view, target
        self.start = self.length = target.length  # the target cache holds committed[:-1]

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None) -> TargetOutput:
        n = tokens.numel()
        if positions is None:
            positions = torch.arange(self.length, self.length + n)
        extra = {}
        if mask is not None:  # [n, length + n] bool -> additive [1, 1, n, length + n]
            dtype = next(self.view.parameters()).dtype
            extra["attention_mask"] = additive_mask(mask.to(self.target.device), dtype)[None, None]
        out = self.view(input_ids=tokens.to(self.target.device)[None], cache=self.target.cache,
                        use_cache=True, position_ids=self.target.position_ids(positions), **extra)
        self.length += n
        return TargetOutput(out.logits[0])

    def rewind(self, length: int) -> None:
        self.length = max(self.start, min(length, self.length))
        crop_layers(self.target.cache, self.start)


class LayerSkipDrafter(DrafterBase):
    hidden_layers: tuple[int, ...] = ()  # reads no target hidden states
    name = "layer-skip"

    def __init__(self, model: PreTrainedModel, skip: SkipSet, num_draft_tokens: int = 4, adaptive: bool = True,
                 backoff: bool | None = None, enabled: bool = True, sample_drafts: bool = True,
                 tree: TreeShape | None = None, vocab: DraftVocab | None = None) -> None:
        """tree: draft an EAGLE-2 dynamic tree through the skipping view (models without sliding-window layers).
        vocab: the view's LM head scores only these ids (FR-Spec; sparrow.drafters.vocab)."""
        if tree is not None and "sliding_attention" in (getattr(_text_config(model.config), "layer_types", None) or ()):
            raise UserError("layer-skip: tree drafts need a model without sliding-window layers (use a chain)")
        self.tree = tree
        self.model = model
        self.skip = skip
        self.vocab = vocab
        self.view = skipping_view(model, skip)
        if vocab is not None:  # its LM head scores only vocab.ids
            self.view = reduced_head_view(self.view, vocab)
        self.length = LengthPolicy(
            num_draft_tokens, adaptive=adaptive, backoff=adaptive if backoff is None else backoff
        )
        self.grammar: Constraint = FREE  # structured output (`sparrow.grammar.guiding`): chains draft inside it
        self.enabled = enabled  # False: every draft is empty (plain decoding)
        self.sample_drafts = sample_drafts  # False: argmax drafts also at temperature > 0 (q = 1 rule)
        self.target: CachedModel | None = None

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """The target, and the skipping view of it that drafts (in the target's own cache)."""
        return (self.model, self.view)

    def shared(self) -> tuple[object, ...]:
        return distinct((self.target,))  # the last generation's target runner, whose cache it drafts in

    def prefill(self, prompt: Prompt, target: CachedModel, out: TargetOutput | None = None) -> None:
        if target.model is not self.model:
            raise UserError("layer-skip: the target is not the model this drafter was built for")
        self.target = target  # its cache records the past, so drafted positions can be cropped (CachedModel)
        self.length.reset()

    @torch.inference_mode()
    def step(self, token: Tensor, position: int) -> Tensor:
        """One draft forward of `token` ([1]) at cache position `position` -> [vocab] logits."""
        target = self.target
        positions = target.position_ids(torch.tensor([position]))
        out = self.view(input_ids=token.to(target.device)[None], cache=target.cache, use_cache=True,
                        position_ids=positions, logits_to_keep=1)
        return out.logits[0, -1]

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        assert self.target is not None, "prefill() must run before propose()"
        committed = committed.to(self.target.device)
        start = committed.numel() - 1  # the target cache holds committed[:-1]
        assert self.target.length == start, (self.target.length, start)
        if self.tree is not None:
            if not self.enabled or max_tokens < 1:
                return Draft.empty(self.target.device)
            view = SkipView(self.view, self.target)
            try:
                return dynamic_tree(view, committed, self.tree, max_tokens, sampling)[0]
            finally:
                view.rewind(start)
        steps = self.length.cap(max_tokens if self.enabled else 0)
        try:
            return autoregressive_draft(lambda token, i: self.step(token, start + i), committed[-1:], steps,
                                        sampling if self.sample_drafts else GREEDY, generator, self.length,
                                        grammar=self.grammar if self.vocab is None else FREE)
        finally:
            crop_layers(self.target.cache, start)  # drafted KV is never kept

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput, step: StepStats) -> None:
        if self.tree is None:
            self.length.observe(step)


def resolve_record(target: LoadedModel, skip_set: SkipSet | str | dict | None,
                   skip_file: str | Path | None) -> SkipRecord | SkipSet:
    """An explicit skip set, a record file, or the record shipped for the target's preset name."""
    num_layers = _text_config(target.model.config).num_hidden_layers
    if skip_set is not None and skip_file is not None:
        raise UserError("layer-skip: pass either skip_set or skip_file, not both")
    if isinstance(skip_set, SkipSet):
        return skip_set
    if isinstance(skip_set, dict):
        return SkipSet.from_dict({"num_layers": num_layers, **skip_set})
    if isinstance(skip_set, str):
        return SkipSet.parse(skip_set, num_layers)
    if skip_set is not None:
        raise UserError(f"skip_set: expected a SkipSet, dict or 'attention=..;mlp=..' string, got {skip_set!r}")
    if skip_file is not None:
        return SkipRecord.load(skip_file)
    record = find_record(target.name)
    if record is None:
        raise UserError(f"layer-skip: no tuned skip set ships for model {target.name!r}; run "
                         f"`sparrow tune layer-skip --target {target.name}` and pass skip_file=..., or pass "
                             "skip_set=...")
    return record


DEFAULT_NUM_DRAFT_TOKENS = 4  # for a skip set given without a tuned record


def build_layer_skip(target: LoadedModel, draft: None, num_draft_tokens: int | None, adaptive: bool,
                     skip_set: SkipSet | str | dict | None = None, skip_file: str | Path | None = None,
                     force: bool = False, backoff: bool | None = None, sample_drafts: bool = True,
                     tree_budget: int | str = 0, tree_topk: int = 4, tree_depth: int = 8,
                     draft_vocab: int | str | DraftVocab | None = None) -> LayerSkipDrafter:
    """Registry builder for "layer-skip". Without skip_set / skip_file the set shipped for the preset is used.
    draft_vocab: N (or "auto", or a DraftVocab): the draft scores only the N most frequent target tokens.

    A record the tuner refused (measured to lose) gives a drafter that decodes plainly, with a warning,
    unless force=True.
    """
    if getattr(target.model, "sparrow_quantization", None) is not None:
        raise UserError("drafter 'layer-skip' needs an unquantized target (drop --quant)")
    found = resolve_record(target, skip_set, skip_file)
    enabled = True
    if isinstance(found, SkipRecord):
        skip = found.skip
        if not found.recommended and not force:
            enabled = False
            measured = "not measured" if found.measured_speedup is None else f"measured {found.measured_speedup:.2f}x"
            warnings.warn(f"layer-skip: the tuned skip set for {found.model} loses on the machine it was tuned on "
                          f"(expected {found.expected_speedup:.2f}x, {measured}); decoding plainly. "
                          "Pass force=True to draft with it anyway.", stacklevel=2)
    else:
        skip = found
    if num_draft_tokens is None:  # not given: the k the set was tuned for
        num_draft_tokens = found.num_draft_tokens if isinstance(found, SkipRecord) else DEFAULT_NUM_DRAFT_TOKENS
    runner = runner_for(target.model)
    tree = resolve_shape(tree_budget, tree_topk, tree_depth, runner)
    vocab = resolve_draft_vocab(draft_vocab, target, runner.vocab_size)
    return LayerSkipDrafter(target.model, skip, num_draft_tokens, adaptive, backoff=backoff, enabled=enabled,
                            sample_drafts=sample_drafts, tree=tree, vocab=vocab)

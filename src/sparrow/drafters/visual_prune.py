"""SpecVLM-style visual-prune drafter: a same-family VLM (or the target itself) drafts from a pruned video.

1. Scores (verifier-guided, from the *target's* prefill): score of visual token v = attention from the
   text queries after the last visual token (the last `window` of them) to v, averaged over heads, those
   queries and layers. The queries come from the target's own prefill through the capture wrapper
   (attention_capture.py, bit-identical outputs; the engine runs that one forward inside `watch_prefill`)
   and the keys from its cache, so scoring re-runs nothing: it costs one [heads, t, n] attention product
   per layer (t = text tokens after the video). The draft's own prefill cannot be used: it runs after
   pruning, and an unpruned draft prefill would cost what pruning saves.
2. Selection (`prune_visual_tokens`, pure): budget = int(N * (1 - drop_rate)) visual tokens (at least 1).
   Stage I keeps the smallest set of top-scored tokens covering `mass` of the visual attention mass
   (capped at the budget); Stage II fills the rest uniformly (linspace) from the remaining tokens in
   sequence order. The kept indices are returned in sequence order.
3. Draft prefill on the pruned sequence: the draft model computes its own visual features and merged
   embeddings for the full prompt; a pre-hook on its language model drops the pruned positions from
   `inputs_embeds` (and `position_ids`) right before the decoder runs. Positions:
   * 1-D RoPE (LLaVA-OneVision): the decoder sees no position ids, so the kept tokens are re-indexed
     contiguously (SpecVLM's `len_posi`), and decoding continues from the pruned length.
   * M-RoPE (Qwen2.5-VL): the kept tokens keep their 3-D (t, h, w) positions (re-indexing would
     scramble the grid M-RoPE encodes); text after the video keeps its full-sequence positions
     because the draft's rope delta grows by the number of pruned tokens.
4. Drafting and rollback as the draft-model drafter, through a view that maps token positions to the
   shorter draft cache. The target verifies with its full cache, so the output is exactly the target's.
5. Optional (`draft_kv`): a draft-side KV policy then cuts the kept visual tokens' KV further, per layer and
   KV head, from the draft's own prefill queries (drafters/draft_kv.py).

What pruning saves: the draft decoder's prefill over the dropped tokens and, every draft step, their KV
reads. The draft's vision tower still encodes every frame (a self-draft could reuse the target's visual
features; not done here).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow.drafters.base import distinct
from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.drafters.kv.draft_kv import DraftKVConfig, SequenceView, draft_kv_config, with_draft_kv
from sparrow.drafters.kv.selection import attention_scores
from sparrow.errors import UserError
from sparrow.runtime.attention.capture import QueryCapture
from sparrow.runtime.cached_model import CachedModel, prefill_module
from sparrow.runtime.runner import runner_for
from sparrow.types import Prompt, TargetOutput
from sparrow.vision.prompt import visual_token_positions

DEFAULT_DROP_RATE = 0.9
DEFAULT_MASS = 0.4  # SpecVLM's `percentage`
DEFAULT_WINDOW = 64  # prompt queries captured for scoring (the text after the video should fit)


@dataclass(frozen=True)
class VisualPruning:
    """Which visual tokens (indices into the N visual tokens, ascending) the draft keeps."""

    kept: Tensor  # [budget] int64, sorted, unique
    salient: Tensor  # Stage I: top-scored tokens covering the attention mass, sorted
    uniform: Tensor  # Stage II: spread uniformly over the rest, sorted


def visual_budget(num_visual: int, drop_rate: float) -> int:
    """Visual tokens kept at `drop_rate` (SpecVLM: int(N * (1 - drop_rate)), here without its float
    round-down: 100 tokens at 0.9 keep 10, not 9), at least 1 of N > 0."""
    if not 0.0 <= drop_rate < 1.0:
        raise UserError(f"drop_rate must lie in [0, 1), got {drop_rate!r}")
    return max(1, int(num_visual * (1.0 - drop_rate) + 1e-9)) if num_visual else 0


def plan_pruning(scores: Tensor, budget: int | None = None, drop_rate: float | None = None,
                 mass: float = DEFAULT_MASS) -> VisualPruning:
    """Two-stage selection over [N] non-negative scores; give exactly one of `budget`, `drop_rate`."""
    if scores.ndim != 1:
        raise UserError(f"scores must be 1-D [N], got shape {tuple(scores.shape)}")
    if (budget is None) == (drop_rate is None):
        raise UserError("give exactly one of budget, drop_rate")
    if not 0.0 <= mass <= 1.0:
        raise UserError(f"mass must lie in [0, 1], got {mass!r}")
    n = scores.numel()
    if budget is None:
        budget = visual_budget(n, drop_rate)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= n:
        raise UserError(f"budget must be an integer in [0, {n}], got {budget!r}")
    device = scores.device
    order = scores.float().argsort(descending=True, stable=True)  # [N]
    total = float(scores.float().clamp_min(0).sum())
    if total > 0 and budget > 0:
        covered = scores.float().clamp_min(0)[order].cumsum(0) >= mass * total  # [N]
        stage_one = min(budget, int(covered.nonzero()[0]) + 1 if covered.any() else n)
    else:
        stage_one = 0
    salient = order[:stage_one].sort().values
    rest = torch.ones(n, dtype=torch.bool, device=device)
    rest[salient] = False
    remaining = rest.nonzero()[:, 0]  # sequence order
    fill = budget - stage_one
    pick = torch.linspace(0, remaining.numel() - 1, fill, device=device).long() if fill else remaining[:0]
    uniform = remaining[pick]
    kept = torch.cat([salient, uniform]).sort().values
    return VisualPruning(kept=kept, salient=salient, uniform=uniform)


def prune_visual_tokens(scores: Tensor, budget: int | None = None, drop_rate: float | None = None,
                        mass: float = DEFAULT_MASS) -> Tensor:
    """[budget] int64 indices of the visual tokens to keep, ascending (see `plan_pruning`)."""
    return plan_pruning(scores, budget=budget, drop_rate=drop_rate, mass=mass).kept


def visual_span(config) -> Callable[[Prompt], tuple[int, int]]:
    """For the sparse drafter's `span`: prompt -> (first, last + 1) visual placeholder positions, so a
    sparse self-draft selects among visual KV only (text in between several visual blocks is a candidate
    too); a prompt without visual tokens gets (0, n), i.e. the sparse drafter's text-only default."""

    def span(prompt: Prompt) -> tuple[int, int]:
        visual = visual_token_positions(prompt, config)
        if not visual.numel():
            return 0, prompt.input_ids.numel()
        return int(visual[0]), int(visual[-1]) + 1

    return span


def text_to_visual_scores(queries: list, keys: list[Tensor], visual: Tensor) -> Tensor:
    """[N] mean attention from the text queries after the last visual token to each visual token.

    queries: per layer, captured prompt queries (`.queries` [heads, w, d], `.scaling`) of the last w
    positions; keys: per layer [kv_heads, n, d]; visual: [N] prompt positions, ascending."""
    n = keys[0].shape[1]
    after = n - 1 - int(visual[-1])  # text tokens after the last visual token
    total = torch.zeros(visual.numel(), dtype=torch.float32, device=keys[0].device)
    for entry, k in zip(queries, keys):
        t = max(1, min(after, entry.queries.shape[1]))
        scores = attention_scores(entry.queries[:, -t:], k, entry.scaling)  # [kv_heads, n]
        total += scores.mean(0)[visual.to(k.device)]
    return total / len(keys)


@contextmanager
def pruned_decoder_inputs(model: torch.nn.Module, keep: Tensor):
    """While active, the language model of `model` (and of its `prefill_module`, which runs a quantized target's
    prefills) sees only sequence positions `keep` of its input."""

    def hook(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if embeds is None or embeds.shape[1] <= int(keep[-1]):
            return None
        kwargs["inputs_embeds"] = embeds[:, keep.to(embeds.device)]
        positions = kwargs.get("position_ids")
        if positions is not None:
            kwargs["position_ids"] = positions[..., keep.to(positions.device)]
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = kwargs["attention_mask"][..., keep.to(embeds.device)]
        return args, kwargs

    decoders = {id(m): m.model.language_model for m in (model, prefill_module(model))}.values()
    handles = [decoder.register_forward_pre_hook(hook, with_kwargs=True) for decoder in decoders]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class PrunedView(SequenceView):
    """The draft CachedModel (`runner`) seen in full-sequence token positions: its cache lacks `pruned` (`hidden`)
    prompt entries."""

    def __init__(self, runner: CachedModel) -> None:
        self.inner = self.runner = runner
        self.keep: Tensor | None = None  # [m] prompt positions in the runner's cache, ascending

    @property
    def pruned(self) -> int:
        return self.hidden

    @pruned.setter
    def pruned(self, value: int) -> None:
        self.hidden = value

    def prefill(self, prompt: Prompt, keep: Tensor) -> TargetOutput:
        """Prefill the prompt positions `keep` ([m] ascending, the last prompt token included)."""
        n = prompt.input_ids.numel()
        assert int(keep[-1]) == n - 1, "the last prompt token must be kept"
        with pruned_decoder_inputs(self.runner.model, keep):
            logits = self.runner.prefill(prompt)
        self.pruned = n - keep.numel()
        self.keep = keep
        if hasattr(self.runner, "rope_delta"):  # M-RoPE: text keeps its full-sequence positions
            self.runner.rope_delta += self.pruned
        assert self.runner.length == keep.numel(), (self.runner.length, keep.numel())
        return logits

    def cache_index(self, positions: Tensor) -> Tensor:
        """[k] prompt positions -> cache indices of those still in the runner's cache (pruned ones left out)."""
        assert self.keep is not None, "prefill() must run first"
        keep = self.keep.to(positions.device)
        return torch.searchsorted(keep, positions[torch.isin(positions, keep)])

    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """CachedModel.forward in full-prompt coordinates (the runner's cache lacks the pruned positions)."""
        if positions is not None:
            positions = positions - self.pruned
        if mask is not None:
            mask = mask[:, self.pruned:]
        return self.runner.forward(tokens, positions, mask, hidden_layers)

    def rewind(self, length: int) -> None:
        assert length >= self.pruned, "cannot rewind into the pruned prompt"
        self.runner.rewind(length - self.pruned)


class VisualPruneDrafter(DraftModelDrafter):
    """Draft model (or the target itself) prefilled on the visual tokens the target attends to most."""

    name = "visual-prune"
    watches_prefill = True  # its capture records the target's prefill queries

    def __init__(self, target_model: torch.nn.Module, draft_model: torch.nn.Module, num_draft_tokens: int = 8,
                 adaptive: bool = False, drop_rate: float = DEFAULT_DROP_RATE, mass: float = DEFAULT_MASS,
                 window: int = DEFAULT_WINDOW, draft_kv: DraftKVConfig | None = None) -> None:
        """draft_kv: also cut the visual KV the pruned draft keeps to a budget by a policy (drafters/draft_kv.py)."""
        visual_budget(1, drop_rate)  # validates drop_rate
        if not 0.0 <= mass <= 1.0:
            raise UserError(f"mass must lie in [0, 1], got {mass!r}")
        if getattr(draft_model.config, "vision_config", None) is None:
            raise UserError(f"drafter 'visual-prune' needs a vision-language draft model of the target's family, got "
                             f"the text-only {type(draft_model).__name__}; pass a small VLM as draft, or draft=None "
                             "to self-draft with the target on the pruned visual tokens")
        if not isinstance(getattr(getattr(draft_model, "model", None), "language_model", None), torch.nn.Module):
            raise UserError(f"drafter 'visual-prune' cannot prune {type(draft_model).__name__}: it has no "
                             "`model.language_model` decoder to feed the pruned sequence to")
        self.view = PrunedView(runner_for(draft_model))
        # the draft runner: the view, or the view with its visual KV compacted
        super().__init__(with_draft_kv(self.view, draft_kv), CachedModel(target_model).vocab_size, num_draft_tokens,
                         adaptive, name=self.name)
        self.target_model = target_model
        self.drop_rate, self.mass = drop_rate, mass
        self.capture = QueryCapture(target_model, window)  # records the target's prefill queries, inside watch_prefill
        self.last_pruning: VisualPruning | None = None
        self.last_visual: Tensor | None = None  # [N] prompt positions of the visual tokens

    def watch_prefill(self, target: CachedModel) -> QueryCapture:
        """The context the engine runs the target's prefill in: it records that forward's queries."""
        return self.capture

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """The draft model, and the target, whose attention the query capture switches."""
        return distinct((*super().modules(), self.target_model))

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        if target is None or target.model is not self.target_model:
            raise UserError("the visual-prune drafter must be used with the target model it was built on")
        self.length.reset()
        ids = prompt.input_ids.to(target.device)
        n = ids.numel()
        captured = self.capture.take(n, len(target.cache.layers))
        visual = visual_token_positions(prompt, self.target_model.config).to(ids.device)
        draft_visual = visual_token_positions(prompt, self.view.runner.model.config).to(ids.device)
        if not torch.equal(visual, draft_visual):
            raise UserError("draft and target VLMs disagree on the visual placeholder tokens of the prompt")
        if visual.numel():
            keys = [layer.keys[0] for layer in target.cache.layers]  # [kv_heads, n, d]
            scores = text_to_visual_scores(captured, keys, visual)
            self.last_pruning = plan_pruning(scores, drop_rate=self.drop_rate, mass=self.mass)
            keep_mask = torch.ones(n, dtype=torch.bool, device=ids.device)
            keep_mask[visual] = False
            keep_mask[visual[self.last_pruning.kept.to(ids.device)]] = True
            keep = keep_mask.nonzero()[:, 0]
        else:  # text-only prompt: nothing to prune
            self.last_pruning = None
            keep = torch.arange(n, device=ids.device)
        self.last_visual = visual
        self.draft.prefill(prompt, keep)
        self._cached = prompt.input_ids.to(self.draft.device)


def build(target, draft, num_draft_tokens: int, adaptive: bool, drop_rate: float = DEFAULT_DROP_RATE,
          mass: float = DEFAULT_MASS, window: int = DEFAULT_WINDOW, draft_kv: str | None = None,
          draft_kv_budget: int | float | None = None, retrieve_every: int = 0) -> VisualPruneDrafter:
    """Registry builder for "visual-prune" (`target`, `draft` are LoadedModels; without a draft the target
    self-drafts on the pruned visual tokens). draft_kv / draft_kv_budget / retrieve_every: a draft-side KV
    policy over the visual tokens pruning kept (drafters/draft_kv.py)."""
    draft_model = (draft if draft is not None else target).model
    return VisualPruneDrafter(target.model, draft_model, num_draft_tokens, adaptive, drop_rate=drop_rate, mass=mass,
                              window=window, draft_kv=draft_kv_config(draft_kv, draft_kv_budget, retrieve_every))

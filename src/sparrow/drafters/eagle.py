"""`--drafter eagle --head PATH`: an EAGLE-1/3 head (`sparrow.heads`) drafting from the target's hidden states.

The head keeps its own KV cache, one row per position: row t reads the committed token x[t + 1] and the
target's features of position t (the hidden states of the layers it asked for through `hidden_layers`), and
predicts x[t + 2]. Each round:
1. the rows of the newly committed tokens run with the target features `observe` delivered (the target's
   rows [root, *accepted path] of the last verification), so the head's cache always holds target-fed rows
   for committed[:-1];
2. drafting continues from the last row's output: a draft row reads its draft token and its parent row's
   output hidden state (EAGLE's autoregression over features), as a chain of k tokens (`draft_chain`) or an
   EAGLE-2 dynamic tree (`dynamic_tree`, with the head's rows under the tree mask);
3. the draft rows are dropped again: once verified, an accepted token's row is recomputed from the
   target's own features in the next round (so rejections need no other rollback).
Greedy drafts are the argmax; sampled chains return q, so the rejection verifier applies min(1, p/q).

Device split (Dovetail, `draft_device`): the head runs on its own device with copies of the target's embedding
(and EAGLE-1's LM head); everything that crosses goes through a `DeviceLink`: committed ids and hidden states in,
draft ids (and a sampled chain's q) out.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.drafters.base import Drafter, DrafterBase
from sparrow.drafters.draft_loop import draft_chain, drive
from sparrow.drafters.longspec import LongSpecDrafter
from sparrow.drafters.sparrow import SparrowDrafter
from sparrow.drafters.tree_draft import TreeShape, dynamic_tree, resolve_shape
from sparrow.errors import UserError
from sparrow.heads.eagle import EagleHead, causal_mask
from sparrow.heads.layout import default_head_dir, find_head, load_head
from sparrow.heads.link import DeviceLink
from sparrow.heads.longspec import LongSpecHead
from sparrow.models import LoadedModel
from sparrow.noise import Randomness
from sparrow.policy.length import LengthPolicy
from sparrow.policy.tree import TreePolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.runner import runner_for
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict
from sparrow.vision.prompt import visual_token_ids


class HeadRunner:
    """The head as a CachedModel-like object over token indices (what `dynamic_tree` drives): token j >= 1 is
    read by head row j - 1 at position j - 1, so `length` = rows + 1 (token 0 needs no row).

    A forward without a mask feeds the next tokens in order: committed ones (with the pending target features
    of their rows), or one draft token (whose feature is the previous row's output). A forward with a tree
    mask feeds draft nodes; each reads the output of the row of its parent, the latest earlier slot it sees.
    """

    def __init__(self, head: EagleHead, link: DeviceLink) -> None:
        self.head = head
        self.link = link
        self.reset()

    def reset(self) -> None:
        self.cache = self.head.empty_cache()
        self.target_rows = 0  # rows computed from target features (never rewound within a generation)
        w = self.head.fc.weight
        self.pending = w.new_zeros(0, self.head.config.fused_width)  # [m, fused] features of rows target_rows..

    @property
    def length(self) -> int:
        return self.cache.rows + 1

    def add_features(self, hidden: Tensor) -> None:
        """hidden [layers, m, D]: the target's hidden states of the next m positions, in the head's layer order."""
        assert hidden.ndim == 3 and hidden.shape[0] == len(self.head.config.target_layers), tuple(hidden.shape)
        hidden = self.link.to_draft(hidden, "hidden")
        rows = hidden.permute(1, 0, 2).reshape(hidden.shape[1], -1).to(self.pending)  # [m, layers * D]
        self.pending = torch.cat([self.pending, rows])

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None) -> TargetOutput:
        """tokens [n] at token indices length.. (positions: [n] token positions; mask [n, length + n] bool over
        token slots, as CachedModel.forward takes them) -> logits in the target vocabulary: [n, vocab] with a
        tree mask, else [1, vocab] of the last row (all that drafting reads)."""
        n, rows, device = tokens.numel(), self.cache.rows, self.head.fc.weight.device
        tokens = tokens.to(device)
        if mask is None:
            row_positions = torch.arange(rows, rows + n, device=device)
            row_mask = causal_mask(n, rows, device)
            if rows < self.target_rows + self.pending.shape[0]:  # committed tokens: target features
                assert rows == self.target_rows and n <= self.pending.shape[0], (rows, self.target_rows, n)
                hidden = self.head.fuse(self.pending[:n])
                self.pending, self.target_rows = self.pending[n:], rows + n
            else:  # one draft token: its feature is the previous row's output
                assert n == 1 and rows > 0, (n, rows)
                hidden = self.cache.hidden[-1:]
        else:
            assert mask.shape == (n, self.length + n) and positions is not None, (tuple(mask.shape), n, self.length)
            mask = mask.to(device)
            row_mask = mask[:, 1:]  # token 0 has no row
            row_positions = positions.to(device) - 1
            seen = torch.where(row_mask[:, :rows], torch.arange(rows, device=device), -1)  # rows fed before
            parent_rows = seen.max(1).values  # [n]: ancestors are fed in order, so the latest one is the parent
            assert bool((parent_rows >= 0).all()), parent_rows
            hidden = self.cache.hidden[parent_rows]
        out = self.head.run(tokens, hidden, row_positions, row_mask, self.cache)
        if mask is None:  # drafting reads only the last row's logits (a long prompt's rows would not fit)
            out = out[-1:]
        return TargetOutput(self.head.logits(out))

    def rewind(self, length: int) -> None:
        """Keep the rows of tokens < length (never below the target-fed rows)."""
        rows = max(length - 1, 0)
        assert rows >= self.target_rows, (rows, self.target_rows)
        self.cache.crop(min(rows, self.cache.rows))


class EagleDrafter(DrafterBase):
    """Drafts with an EAGLE head from the target features of the layers it reads (`hidden_layers`); the name is
    "eagle", or "eagle+tree" when it drafts EAGLE-2 trees."""

    name = "eagle"

    def __init__(self, head: EagleHead, num_draft_tokens: int = 6, adaptive: bool = False,
                 tree: TreeShape | None = None, link: DeviceLink | None = None) -> None:
        self.head = head
        self.hidden_layers: tuple[int, ...] = head.config.target_layers
        self.name = "eagle+tree" if tree is not None else "eagle"
        self.tree = tree
        device = head.fc.weight.device
        self.link = link if link is not None else DeviceLink(device, device)
        self.runner = HeadRunner(head, self.link)
        self.length = LengthPolicy(num_draft_tokens, adaptive=adaptive, backoff=adaptive)
        self.tree_policy = TreePolicy() if tree is not None and adaptive else None
        self._forwards = 0

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.head,)

    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        if out is None or out.hidden is None:
            raise UserError("the eagle drafter needs the target's hidden states at prefill (run it through the engine)")
        self.length.reset()
        self.runner.reset()
        n = prompt.input_ids.numel()
        assert out.hidden.shape[1] >= n, (tuple(out.hidden.shape), n)
        self.runner.add_features(out.hidden[:, -n:])

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        runner, link = self.runner, self.link
        committed = link.to_draft(committed, "ids")
        c = committed.numel()
        assert runner.target_rows + runner.pending.shape[0] == c - 1, (runner.target_rows, runner.pending.shape, c)
        drafting = self.tree_policy is None or self.tree_policy.draft_now()
        num_tokens = self.length.cap(max_tokens) if self.tree is None else max_tokens * drafting
        if num_tokens < 1:
            return Draft.empty(link.target)
        if self.tree is not None:
            min_prob = self.tree_policy.min_prob if self.tree_policy is not None else 0.0
            draft, self._forwards = dynamic_tree(runner, committed, self.tree, num_tokens, sampling, min_prob)
            return self._to_target(draft)

        def answer(request: tuple[Tensor, int]) -> Tensor:
            token, i = request
            fed = committed[runner.length:] if i == 0 else token
            return runner.forward(fed).logits[-1]

        chain = draft_chain(lambda token, i: (token, i), committed[-1:], num_tokens, sampling, generator, self.length)
        draft = drive(chain, answer)
        runner.rewind(c)  # drop the draft rows: accepted tokens are re-read with the target's features
        return self._to_target(draft)

    def _to_target(self, draft: Draft) -> Draft:
        """The draft on the target's device: ids (and a sampled chain's q) cross the link."""
        if not self.link.split:
            return draft
        to = self.link.to_target
        return Draft(to(draft.tokens, "ids"), None if draft.probs is None else to(draft.probs, "probs"),
                     None if draft.parents is None else to(draft.parents, "ids"))

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput | None = None,
                step: StepStats | None = None) -> None:
        assert out is not None and out.hidden is not None, "the eagle drafter needs the target's hidden states"
        self.follow(out)
        if self.tree is None:
            self.length.observe(step)
        elif self.tree_policy is not None:
            self.tree_policy.observe(step, self._forwards)


    def follow(self, out: TargetOutput) -> None:
        """Take the target's features of a round another drafter (or plain decoding) drafted: the committed rows
        [root, *accepted path] of `out` (the auto drafter keeps an unchosen eagle candidate in step this way)."""
        assert out.hidden is not None, "the eagle drafter needs the target's hidden states"
        self.runner.add_features(out.hidden)


def trained_head(target: str) -> Path:
    """The head for a preset target: the one shipped in the package, else the one `sparrow train head --target
    PRESET` keeps in the user cache (its latest checkpoint); `sparrow.heads.layout.find_head`."""
    found = find_head(target)
    if found is not None:
        return found
    where = default_head_dir(target)
    if where is None:
        raise UserError(f"--drafter eagle needs a head for {target!r}: --head PATH (a directory with config.json and "
                        "model.safetensors, exported by SpecForge or saved by `sparrow train head`)")
    raise UserError(f"no head trained for {target!r} yet: `sparrow train head --target {target}` trains one into "
                    f"{where} (where --drafter eagle finds it; it shows its time estimate as it goes and stops "
                    "cleanly with --time-budget S, --resume continues), or pass --head PATH")


def build(target: LoadedModel, draft: LoadedModel | None, num_draft_tokens: int, adaptive: bool,
          head: str | EagleHead | LongSpecHead | None = None, tree_budget: int | str = 0, tree_topk: int = 4,
          tree_depth: int = 8, draft_device: str | None = None) -> Drafter:
    """Registry builder for "eagle": `head` is a head directory (EAGLE-3 / EAGLE-1 layout, or sparrow's LongSpec
    one) or a head bound to `target`; a chain of k tokens a round, or with `tree_budget` > 0 (or "auto") an
    EAGLE-2 dynamic tree. A LongSpec head drafts with `LongSpecDrafter`, a Sparrow head (an EAGLE-3 head with a
    SparrowSpec) with `SparrowDrafter` (chains). draft_device: run the head there (loaded onto it; a head given
    must already be placed there), the target where it is (Dovetail's split; EAGLE heads only)."""
    if head is None:
        head = str(trained_head(target.name))
    target_device = next(target.model.parameters()).device
    device = _device(draft_device) if draft_device is not None else target_device
    if isinstance(head, str):
        head = load_head(head, target.model, device=device)
    if head.config.arch == "longspec":
        return _longspec(head, target, num_draft_tokens, adaptive, draft_device, tree_budget, tree_topk, tree_depth)
    if getattr(head, "sparrow", None) is not None:
        return _sparrow(head, target, num_draft_tokens, adaptive, draft_device, tree_budget, tree_topk, tree_depth)
    if head.target.embed is not target.model.get_input_embeddings() and device == target_device:
        raise UserError("the EagleHead given as head= is bound to another model than the target")
    if head.fc.weight.device.type != device.type:
        raise UserError(f"the EagleHead given as head= is on {head.fc.weight.device}, not on --draft-device {device}")
    shape = resolve_shape(tree_budget, tree_topk, tree_depth, runner_for(target.model))
    return EagleDrafter(head, num_draft_tokens=num_draft_tokens, adaptive=adaptive, tree=shape,
                        link=DeviceLink(device, target_device))


def _longspec(head: LongSpecHead, target: LoadedModel, num_draft_tokens: int, adaptive: bool, draft_device: str | None,
              tree_budget: int | str, tree_topk: int, tree_depth: int) -> Drafter:
    """A LongSpec head drafts chains or trees over the target's own KV cache (on the target's device)."""
    if draft_device is not None:
        raise UserError("a LongSpec head reads the target's KV cache in place: it cannot run on another device")
    if head.target.embed is not target.model.get_input_embeddings():
        raise UserError("the LongSpec head given as head= is bound to another model than the target")
    config = target.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = list(getattr(text, "layer_types", None) or [])
    if layer_types and layer_types[head.config.kv_layer] != "full_attention":
        raise UserError(f"the LongSpec head reads the KV cache of target layer {head.config.kv_layer}, a "
                        f"{layer_types[head.config.kv_layer]} layer that keeps only a window; it needs a "
                        "full-attention layer")
    shape = resolve_shape(tree_budget, tree_topk, tree_depth, runner_for(target.model))
    return LongSpecDrafter(head, num_draft_tokens=num_draft_tokens, adaptive=adaptive, tree=shape)


def _sparrow(head: EagleHead, target: LoadedModel, num_draft_tokens: int, adaptive: bool, draft_device: str | None,
             tree_budget: int | str, tree_topk: int, tree_depth: int) -> Drafter:
    """A Sparrow head drafts text-anchored chains or trees; the target's visual placeholder ids say which rows it
    skips."""
    if draft_device is not None:
        raise UserError("a Sparrow head drafts on the target's device: leave --draft-device unset")
    if head.target.embed is not target.model.get_input_embeddings():
        raise UserError("the Sparrow head given as head= is bound to another model than the target")
    shape = resolve_shape(tree_budget, tree_topk, tree_depth, runner_for(target.model))
    return SparrowDrafter(head, tuple(visual_token_ids(target.model.config)), num_draft_tokens, adaptive, shape)


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise UserError(f"--draft-device {name!r} is not a device torch knows ({error})") from None

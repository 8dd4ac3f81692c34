"""Draft-side KV policies for drafters that keep their own visual cache: a draft VLM's prompt visual KV cut to a
budget per layer and KV head (MM-ShiftKV, HybridKV, StD's top-K; selectors in kv_compress.py / kv_selection.py).

Applies to `draft-model` with a vision-language draft and to `visual-prune` (a same-family small VLM, or the
target itself, drafting from a pruned video; the policy then cuts the visual tokens pruning kept). `DraftKV`
wraps the drafter's runner (a CachedModel, or visual-prune's PrunedView) and keeps its interface (length,
prefill, forward, rewind in sequence positions), so the drafters' loops, trees and rollback are unchanged:

1. Prefill: the draft's own prefill runs inside a `QueryCapture` on the draft model (bit-identical outputs),
   which records the post-RoPE queries of its last `queries` prompt positions per layer.
2. Selection: per layer and KV head, the policy picks `budget` entries of the visual span of the draft cache
   (its first to its last visual token; text between several visual blocks is a candidate too); all other
   entries (text) are kept (`kv_selection.kept_positions`). A prompt without visual tokens keeps everything.
3. Compaction: each cache layer is gathered to its kept entries, [1, kv_heads, n, d] -> [1, kv_heads, m, d]
   (a different subset per KV head, the same count), and the full tensors are freed: the draft's visual KV
   holds at most `budget` entries per layer and KV head. The kept keys carry RoPE at their real positions,
   and tokens fed later keep their real positions as well: the runner's `position_offset` grows by the
   dropped count (which also shifts M-RoPE decode positions, Qwen2.5-VL, on top of its rope delta), and this
   view maps sequence positions to the shorter cache (length = cache length + dropped), so rollback (rewind)
   and tree masks work as before. Both supported families keep exact positions; no model needs a mask.
4. HybridKV per-round chunk retrieval (`retrieve_every` = R >= 1, policy hybridkv; chunk_retrieval.py): the
   *dynamic* heads' full span KV is kept aside as a retrieval pool (static heads keep their one-shot
   text-prior selection and no pool). The first draft forward of every R-th round (the forward after the
   drafter's rewind, which feeds the newly committed tokens) runs inside a `ChunkRetrieval`: each layer's
   attention, before it runs, re-chooses the chunks of every dynamic head from that forward's own queries
   and writes them into the head's `budget` slots of the cache; the draft attends to them until the next
   retrieval. The pool is extra memory (dynamic heads x span x 2 per layer, on the draft's device); the cache
   the draft attends to stays within the budget.

The target's cache is never touched and verification reads all of it, so the output is exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparrow.drafters.kv.chunk_retrieval import ChunkRetrieval, RetrievalSlots
from sparrow.drafters.kv.compress import SELECTORS, HybridKV, build_selector
from sparrow.drafters.kv.selection import KVSelector, check_budget, kept_positions
from sparrow.errors import UserError
from sparrow.runtime.attention.capture import QueryCapture
from sparrow.runtime.vision import is_vlm
from sparrow.types import Prompt, TargetOutput
from sparrow.vision.prompt import visual_token_positions

if TYPE_CHECKING:
    from sparrow.runtime.cached_model import CachedModel

DEFAULT_BUDGET = 1024  # as the sparse drafter: visual KV entries per layer and KV head
DEFAULT_QUERIES = 32  # last prompt queries the policies score with


@dataclass(frozen=True)
class DraftKVConfig:
    """Which draft visual KV entries a draft VLM keeps."""

    policy: str = "topk"
    """Selection policy: topk (StD: mean attention of the last prompt queries), mm-shiftkv, hybridkv."""
    budget: int | float = DEFAULT_BUDGET
    """Visual KV entries kept per layer and KV head: an int count, or a float fraction in (0, 1]."""
    queries: int = DEFAULT_QUERIES
    """The last `queries` prompt positions' queries score the visual keys at prefill."""
    retrieve_every: int = 0
    """hybridkv only: re-choose the dynamic heads' chunks every R rounds from the draft's current queries
    (0 = the selection stays fixed at prefill)."""
    static_threshold: float = 0.5
    """hybridkv only: a KV head whose prompt queries' attention agrees at least this much is static."""
    chunk: int = 16
    """hybridkv only: entries per retrieved chunk."""

    def __post_init__(self) -> None:
        if self.policy not in SELECTORS:
            raise UserError(f"unknown draft KV policy {self.policy!r}; expected one of: {', '.join(SELECTORS)}")
        check_budget(self.budget)
        for name, minimum in (("queries", 1), ("retrieve_every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise UserError(f"draft KV {name} must be an integer >= {minimum}, got {value!r}")
        if self.retrieve_every and self.policy != "hybridkv":
            raise UserError(f"retrieve_every (per-round chunk retrieval) needs the hybridkv policy, "
                            f"got {self.policy!r}")
        HybridKV(self.static_threshold, self.chunk)  # validates both

    def selector(self, model: torch.nn.Module) -> KVSelector:
        """The policy's selector for `model` (MM-ShiftKV reads its RoPE frequencies)."""
        if self.policy == "hybridkv":
            return HybridKV(self.static_threshold, self.chunk)
        return build_selector(self.policy, model)


def draft_kv_config(draft_kv: str | None, draft_kv_budget: int | float | None,
                    retrieve_every: int = 0) -> DraftKVConfig | None:
    """The builders' options -> a DraftKVConfig (None: no policy, the draft keeps its whole visual KV)."""
    if draft_kv is None and draft_kv_budget is None:
        if retrieve_every:
            raise UserError("retrieve_every needs draft_kv='hybridkv' (--draft-kv hybridkv)")
        return None
    return DraftKVConfig(policy=draft_kv or "topk",
                         budget=DEFAULT_BUDGET if draft_kv_budget is None else draft_kv_budget,
                         retrieve_every=retrieve_every)


def kv_bytes(cache) -> int:
    """Bytes of the keys and values a DynamicCache holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers if getattr(layer, "keys", None) is not None
               for t in (layer.keys, layer.values))


class SequenceView:
    """A draft runner seen in full-sequence positions while the cache under it lacks `hidden` prompt entries (pruned
    or compacted visual tokens): the model, device, vocabulary and length (in sequence positions) of `inner`, the
    runner it wraps, so that a drafter runs it as a runner. `DraftKV` and visual-prune's `PrunedView`."""

    inner: CachedModel | SequenceView
    hidden: int = 0

    @property
    def model(self) -> torch.nn.Module:
        return self.inner.model

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def length(self) -> int:
        return self.inner.length + self.hidden


class DraftKV(SequenceView):
    """A draft runner whose prompt visual KV is compacted by a policy (see the module docstring). Sequence
    coordinates outside, the runner's shorter cache inside; `hidden` (also `dropped`): the entries compaction took."""

    def __init__(self, inner: CachedModel, config: DraftKVConfig) -> None:
        """inner: the drafter's runner, a CachedModel or visual-prune's PrunedView (its interface, in sequence
        positions)."""
        self.inner = inner
        self.runner: CachedModel = getattr(inner, "runner", inner)  # the CachedModel owning the cache
        model = self.runner.model
        if not is_vlm(model):
            raise UserError(f"draft KV policies (--draft-kv) cut a draft's *visual* KV, and the text-only draft "
                            f"{type(model).__name__} keeps none; use a vision-language draft of the target's "
                            "family, or --drafter sparse / visual-prune to self-draft with the target")
        self.config = config
        self.selector = config.selector(model)
        self.capture = QueryCapture(model, config.queries)  # also refuses attention other than sdpa
        self.pool: dict[int, tuple[Tensor, Tensor]] = {}  # retrieval: layer -> dynamic heads' span KV [h, L, d]
        self.retrieval = (ChunkRetrieval(model, self.selector, self._pooled,
                                         config.retrieve_every) if config.retrieve_every else None)
        self.hidden = 0  # prompt entries the compaction removed from the runner's cache
        self.prompt_length = 0  # sequence positions of the prefilled prompt (rewinds never go below)
        self.kept: tuple[Tensor, ...] = ()  # per layer [kv_heads, m] kept entries (pre-compaction cache indices)
        self.span = (0, 0)  # the visual span in the pre-compaction cache
        self._round_start = False  # the next forward is a round's first (it follows a rewind)

    def _pooled(self, layer: int, heads: Tensor) -> tuple[Tensor, Tensor]:
        """The span KV of `layer`'s dynamic heads (`heads`), kept aside at prefill. A method, not a closure: a copy
        of this runner (a drafter's fork) retrieves from its own pool."""
        return self.pool[layer]

    @property
    def dropped(self) -> int:
        """Prompt entries the compaction removed from the runner's cache."""
        return self.hidden

    @dropped.setter
    def dropped(self, value: int) -> None:
        self.hidden = value

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, *args) -> TargetOutput:
        """The inner runner's prefill (args: e.g. visual-prune's kept positions), then selection and compaction."""
        self.dropped, self._round_start = 0, False
        with self.capture:
            out = self.inner.prefill(prompt, *args)
        cache = self.runner.cache
        if any(cache.is_sliding):
            raise UserError("draft KV policies need a draft whose layers all use full attention")
        captured = self.capture.take(self.runner.length, len(cache.layers))
        self.span = self._visual_span(prompt)
        self._compact(captured)
        self.prompt_length = self.length
        return out

    def _visual_span(self, prompt: Prompt) -> tuple[int, int]:
        """(first, last + 1) cache indices of the visual tokens in the runner's cache; (0, 0) without any."""
        visual = visual_token_positions(prompt, self.runner.model.config)
        to_cache = getattr(self.inner, "cache_index", None)  # a PrunedView: prompt positions -> its cache
        if to_cache is not None:
            visual = to_cache(visual)
        return (int(visual[0]), int(visual[-1]) + 1) if visual.numel() else (0, 0)

    def _compact(self, captured: list) -> None:
        cache, n = self.runner.cache, self.runner.length
        start, end = self.span
        kept, layout, selected = [], {}, {}
        self.pool = {}
        for layer, (entry, cached) in enumerate(zip(captured, cache.layers)):
            keys, values = cached.keys, cached.values  # [1, kv_heads, n, d]
            assert keys.shape[0] == 1 and keys.shape[2] == n, (tuple(keys.shape), n)
            if end > start:
                idx = kept_positions(self.selector, entry.queries, keys[0], self.config.budget, 0, 1, self.span,
                                     layer=layer, scaling=entry.scaling)  # [kv_heads, m]
            else:
                idx = torch.arange(n, device=keys.device).expand(keys.shape[1], n)
            m = idx.shape[1]
            if m < n:  # something to drop
                k = m - (n - (end - start))  # span entries kept per head
                selected[layer] = idx[:, start:start + k].clone()  # every head keeps [0, start) first
                if self.retrieval is not None:
                    static = self.selector.last_static[layer].to(keys.device)
                    heads = (~static).nonzero()[:, 0]
                    if heads.numel():
                        layout[layer] = RetrievalSlots(heads, slot=start, start=start)
                        self.pool[layer] = (keys[0, heads, start:end].clone(), values[0, heads, start:end].clone())
                gather = idx[None, :, :, None]
                cached.keys = keys.gather(2, gather.expand(-1, -1, -1, keys.shape[-1]))
                cached.values = values.gather(2, gather.expand(-1, -1, -1, values.shape[-1]))
            kept.append(idx)
        assert len({idx.shape[1] for idx in kept}) == 1, [idx.shape for idx in kept]
        self.kept = tuple(kept)
        self.dropped = n - kept[0].shape[1]
        self.runner.position_offset += self.dropped  # later tokens keep their real positions
        if self.retrieval is not None:
            self.retrieval.reset(layout, selected, next(iter(selected.values())).shape[1] if selected else 0)

    @property
    def visual_entries(self) -> int:
        """Visual-span entries per layer and KV head the draft cache holds (after compaction)."""
        start, end = self.span
        return end - start - self.dropped

    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """The runner's forward in sequence coordinates. positions: [n]; mask: [n, length + n] bool."""
        if positions is not None:
            positions = positions - self.dropped
        if mask is not None:
            assert mask.shape == (tokens.numel(), self.length + tokens.numel()), (tuple(mask.shape), self.length)
            assert bool(mask[:, :self.dropped].all()), "a draft mask must let every token see the whole prompt"
            mask = mask[:, self.dropped:]
        if self._round_start:
            self._round_start = False
            if self.retrieval is not None and self.retrieval.start_round():
                with self.retrieval:
                    return self.inner.forward(tokens, positions, mask, hidden_layers)
        return self.inner.forward(tokens, positions, mask, hidden_layers)

    def rewind(self, length: int) -> None:
        assert length >= self.prompt_length, ("cannot rewind into the compacted prompt", length, self.prompt_length)
        self.inner.rewind(length - self.dropped)
        self._round_start = True


def with_draft_kv(runner: CachedModel, config: DraftKVConfig | None) -> CachedModel:
    """A draft runner (a CachedModel, or visual-prune's PrunedView: anything with its interface) wrapped in
    DraftKV, so its prompt visual KV is compacted by `config`'s policy; `runner` itself when there is none."""
    return runner if config is None else DraftKV(runner, config)

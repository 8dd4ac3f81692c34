"""Sparse-to-Dense (StD) self-draft: the target drafts for itself while attending to a few prompt KV entries.

At prefill, for every layer and KV head, a selector (default: StD's top-K by mean attention from the
last `window` prompt queries, see kv_selection.py) picks `budget` entries of the span; attention sinks,
the recent window and everything outside the span are always kept. The selection is gathered once
into the draft's own DynamicCache and stays fixed. Each round the draft cache first receives the KV
of the tokens committed since the last round, copied from the target's cache (same weights, so that
is their real KV), then drafts with explicit position ids (the true positions: the draft cache is
shorter than the context) and finally drops its drafted entries again. Verification attends to the
target's dense cache, so the output is exactly the target's.

The prompt queries come from the target's own prefill through the capture wrapper
(attention_capture.py), which the engine runs that one forward in (`watch_prefill`): the target's
numerics are untouched, nothing is re-run, and the model is left as it was (no hooks, its attention
implementation switched back). A prompt shorter than sinks + window keeps every entry.

With the HybridKV selector, `retrieve_every` = R >= 1 re-chooses the dynamic heads' chunks every R rounds
from the draft's current queries instead of keeping the prefill's choice (chunk_retrieval.py); the chunks
are read from the target's cache (read only, no copy kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from sparrow.config import SamplingConfig
from sparrow.drafters import visual_prune
from sparrow.drafters.base import DrafterBase, distinct
from sparrow.drafters.draft_loop import autoregressive_draft
from sparrow.drafters.kv import compress as kv_compress
from sparrow.drafters.kv.chunk_retrieval import ChunkRetrieval, RetrievalSlots
from sparrow.drafters.kv.compress import HybridKV
from sparrow.drafters.kv.selection import (
    KVSelector,
    TopKAttention,
    candidate_span,
    check_budget,
    kept_positions,
    resolve_budget,
)
from sparrow.errors import UserError
from sparrow.noise import Randomness
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.attention.capture import QueryCapture
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict

DEFAULT_BUDGET = 1024
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 32

Span = tuple[int, int] | Callable[[Prompt], tuple[int, int]] | None


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")


class SparseDrafter(DrafterBase):
    hidden_layers: tuple[int, ...] = ()  # reads no target hidden states
    name = "sparse"
    watches_prefill = True  # its capture records the target's prefill queries

    def __init__(self, model: PreTrainedModel, num_draft_tokens: int = 8, adaptive: bool = False,
                 budget: int | float = DEFAULT_BUDGET, sinks: int = DEFAULT_SINKS, window: int = DEFAULT_WINDOW,
                 span: Span = None, selector: KVSelector | None = None, retrieve_every: int = 0) -> None:
        """retrieve_every: with a HybridKV selector, re-choose the dynamic heads' chunks every R rounds (0: never)."""
        check_budget(budget)
        _check_count("sinks", sinks, 0)
        _check_count("window", window, 1)
        _check_count("retrieve_every", retrieve_every, 0)
        if span is not None and not callable(span):
            if not (isinstance(span, tuple) and len(span) == 2 and all(isinstance(i, int) and not isinstance(i, bool)
                                                                        for i in span) and 0 <= span[0] <= span[1]):
                raise UserError("span must be None, a callable, or (start, end) ints with 0 <= start <= end, "
                                 f"got {span!r}")
        self.model = model
        self.budget, self.sinks, self.window, self.span = budget, sinks, window, span
        self.selector: KVSelector = selector if selector is not None else TopKAttention()
        self.retrieve_every = retrieve_every
        self._check_retrieval()
        self.retrieval: ChunkRetrieval | None = None  # set at prefill when retrieve_every > 0
        self.length = LengthPolicy(num_draft_tokens, adaptive=adaptive)
        self.capture = QueryCapture(model, window)  # records the target's prefill queries, inside watch_prefill
        self.kept: tuple[Tensor, ...] = ()  # per layer [kv_heads, m] prompt positions in the draft cache
        self.cache: DynamicCache | None = None
        self._target: CachedModel | None = None
        self._synced = 0  # target positions whose KV the draft cache holds (the kept prompt ones, then all)
        self._base = 0  # draft cache length holding exactly those

    def _check_retrieval(self) -> None:
        if self.retrieve_every and not isinstance(self.selector, HybridKV):
            raise UserError("retrieve_every (per-round chunk retrieval) needs the hybridkv draft KV policy, got "
                            f"{getattr(self.selector, 'name', type(self.selector).__name__)!r}")

    def watch_prefill(self, target: CachedModel) -> QueryCapture:
        """The context the engine runs the target's prefill in: it records that forward's queries."""
        return self.capture

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.model,)  # the target, which drafts from a selection of its own KV

    def shared(self) -> tuple[object, ...]:
        return distinct((self._target,))  # the last generation's target runner, whose cache it selects from

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, target: CachedModel, out: TargetOutput | None = None) -> None:
        """Select the draft's prompt KV from the target's just-prefilled cache."""
        if target.model is not self.model:
            raise UserError("the sparse drafter must be used with the target model it was built on")
        self.length.reset()
        n = prompt.input_ids.numel()
        assert target.cache is not None and target.length == n, (target.length, n)
        if any(target.cache.is_sliding):
            raise UserError("drafter 'sparse' needs a model whose layers all use full attention "
                             "(sliding-window layers keep no full prompt cache)")
        captured = self.capture.take(n, len(target.cache.layers))
        span = self.span(prompt) if callable(self.span) else self.span
        self.cache = DynamicCache()
        kept = []
        for layer, (entry, cached) in enumerate(zip(captured, target.cache.layers)):
            keys, values = cached.keys, cached.values  # [1, kv_heads, n, d]
            idx = kept_positions(self.selector, entry.queries, keys[0], self.budget, self.sinks, self.window,
                                 span, layer=layer, scaling=entry.scaling)  # [kv_heads, m]
            gather = idx[None, :, :, None]
            self.cache.update(keys.gather(2, gather.expand(-1, -1, -1, keys.shape[-1])),
                              values.gather(2, gather.expand(-1, -1, -1, values.shape[-1])), layer)
            kept.append(idx)
        self.kept = tuple(kept)
        self._target, self._synced, self._base = target, n, self.cache.get_seq_length()
        self.retrieval = self._retrieval(target, n, span) if self.retrieve_every else None

    def _retrieval(self, target: CachedModel, n: int, span: tuple[int, int] | None) -> ChunkRetrieval:
        """Chunk retrieval over this prefill's selection: the dynamic heads of every layer that dropped entries
        (all layers share one clipped span and budget), reading the span's KV from the target's cache."""
        self._check_retrieval()
        start, end = candidate_span(n, self.sinks, self.window, span)
        k = resolve_budget(self.budget, end - start)
        layout, selected = {}, {}
        if k < end - start:
            for layer, idx in enumerate(self.kept):
                selected[layer] = idx[:, start:start + k].clone()  # every head keeps [0, start) first
                heads = (~self.selector.last_static[layer].to(idx.device)).nonzero()[:, 0]
                if heads.numel():
                    layout[layer] = RetrievalSlots(heads, slot=start, start=start)

        def span_kv(layer: int, heads: Tensor) -> tuple[Tensor, Tensor]:
            cached = target.cache.layers[layer]
            return cached.keys[0, heads, start:end], cached.values[0, heads, start:end]

        retrieval = ChunkRetrieval(self.model, self.selector, span_kv, self.retrieve_every)
        retrieval.reset(layout, selected, k)
        return retrieval

    def _sync(self, upto: int) -> None:
        """Append the target's KV of positions [synced, upto) (committed since the last round)."""
        if upto > self._synced:
            for layer, cached in enumerate(self._target.cache.layers):
                self.cache.update(cached.keys[:, :, self._synced:upto], cached.values[:, :, self._synced:upto], layer)
            self._base += upto - self._synced
            self._synced = upto

    def _forward(self, token: Tensor, position: int) -> Tensor:
        """One draft step: [1] token at true `position` -> [vocab] logits."""
        positions = self._target.position_ids(torch.tensor([position]))
        out = self.model(input_ids=token.reshape(1, 1), cache=self.cache, use_cache=True,
                         position_ids=positions)
        return out.logits[0, -1]

    @torch.inference_mode()
    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        assert self.cache is not None and self._target is not None, "prefill() must run before propose()"
        device = self._target.device
        committed = committed.to(device)
        num_tokens = self.length.cap(max_tokens)
        if num_tokens < 1:
            return Draft.empty(device)
        position = committed.numel() - 1
        assert self._target.length == position, (self._target.length, position)  # target cache == committed[:-1]
        self._sync(position)
        retrieve = self.retrieval is not None and self.retrieval.start_round()

        def step(token: Tensor, i: int) -> Tensor:
            if i == 0 and retrieve:  # the round's first forward re-chooses the dynamic heads' chunks
                with self.retrieval:
                    return self._forward(token, position)
            return self._forward(token, position + i)

        draft = autoregressive_draft(step, committed[-1:], num_tokens, sampling, generator, self.length)
        self.cache.crop(self._base - self.cache.get_seq_length())  # drop the draft's own (sparse) KV
        return draft

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput, step: StepStats) -> None:
        self.length.observe(step)


def build(target, draft: None, num_draft_tokens: int, adaptive: bool, budget: int | float = DEFAULT_BUDGET,
          sinks: int = DEFAULT_SINKS, window: int = DEFAULT_WINDOW, span: Span = None,
          selector: KVSelector | None = None, draft_kv: str | None = None,
          draft_kv_budget: int | float | None = None, retrieve_every: int = 0) -> SparseDrafter:
    """Registry builder for "sparse" (`target` is a LoadedModel). For a VLM the span defaults to the
    visual tokens (Sparse-to-Dense); `draft_kv` names a selection policy (topk, mm-shiftkv, hybridkv),
    `draft_kv_budget` overrides `budget`, and `retrieve_every` (hybridkv) re-chooses chunks every R rounds."""
    if span is None and getattr(target.model.config, "vision_config", None) is not None:
        span = visual_prune.visual_span(target.model.config)
    if draft_kv is not None:
        if selector is not None:
            raise UserError("give either selector= or draft_kv=, not both")
        selector = kv_compress.build_selector(draft_kv, target.model)
    if draft_kv_budget is not None:
        budget = draft_kv_budget
    return SparseDrafter(target.model, num_draft_tokens, adaptive, budget=budget, sinks=sinks, window=window,
                         span=span, selector=selector, retrieve_every=retrieve_every)

"""HybridKV's chunk-wise retrieval during decoding, for a draft's compacted visual KV (per round, not once).

HybridKV (arXiv 2604.05887) keeps *static* heads' prompt KV pruned once at prefill and serves *dynamic* heads
by retrieving chunks of the prompt KV for the current query. A draft whose cache holds, per layer and KV head,
`budget` entries of a span (the sparse drafter, drafters/draft_kv.py) lays them out in one block of
`budget` slots at the same cache index for every head (everything before the span is kept and comes first).
`ChunkRetrieval` re-fills the dynamic heads' slots:

* It is a `QueryCapture` (attention_capture.py): while started, every attention of the draft model's decoder
  layers calls `observe` with that layer's post-RoPE queries and its cached keys/values *before* attention
  runs (outputs otherwise bit-identical to sdpa).
* For each layer with dynamic heads, the queries of the forward (the newly committed tokens) score the full
  span keys of those heads, handed over by `span_kv` (a pool kept aside, or the target's own cache), and
  `HybridKV.retrieve` picks the best chunks; their keys and values are written into the heads' slots of the
  cache in place, so this forward already attends to them, and later ones until the next retrieval.
* The drafter runs one forward a round inside it, every `every` rounds (`start_round`).

Lossless: it only changes what the draft attends to; the target verifies with its own full cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow.drafters.kv.compress import HybridKV
from sparrow.runtime.attention.capture import QueryCapture

SpanKV = Callable[[int, Tensor], tuple[Tensor, Tensor]]
"""(layer, heads [h] int64) -> the full span's keys and values of those KV heads, each [h, L, d]."""


@dataclass(frozen=True)
class RetrievalSlots:
    """Where one layer's dynamic heads keep their span selection in the draft cache."""

    heads: Tensor  # [h] int64 KV heads classified dynamic
    slot: int  # cache index of the first of the `budget` span slots (the same for every head)
    start: int  # the span's first position (selected positions are start + span offsets)


class ChunkRetrieval(QueryCapture):
    """Per-round chunk retrieval for the dynamic heads of `model`'s draft cache (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, selector: HybridKV, span_kv: SpanKV, every: int) -> None:
        super().__init__(model, 1)
        assert every >= 1, every
        self.selector, self.span_kv, self.every = selector, span_kv, every
        self.layout: dict[int, RetrievalSlots] = {}  # layer -> its dynamic heads' slots (layers without: absent)
        self.selected: dict[int, Tensor] = {}  # layer -> [kv_heads, budget] selected span positions
        self.budget = 0
        self.rounds = 0  # rounds since `reset`
        self.retrievals = 0  # layer retrievals run since `reset`
        self.changes = 0  # ... that changed some head's selection

    def reset(self, layout: dict[int, RetrievalSlots], selected: dict[int, Tensor], budget: int) -> None:
        """A new prefill's selection: per layer the dynamic heads' slots and every head's [kv_heads, budget]
        selected positions."""
        assert all(selected[layer].shape[1] == budget for layer in layout), budget
        self.layout, self.selected, self.budget = layout, selected, budget
        self.rounds = self.retrievals = self.changes = 0

    def start_round(self) -> bool:
        """Count a draft round; True when its first forward should run inside this retrieval."""
        self.rounds += 1
        return bool(self.layout) and self.rounds % self.every == 0

    def observe(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                scaling: float | None) -> None:
        """query [1, heads, t, d]; key/value [1, kv_heads, n, d]: the cache's own tensors, rewritten in place."""
        layer = module.layer_idx
        slots = self.layout.get(layer)
        if slots is None or query.shape[2] == key.shape[2]:  # no dynamic head here, or a prefill
            return
        heads, kv_heads, t, d = query.shape[1], key.shape[1], query.shape[2], query.shape[3]
        scale = float(scaling) if scaling is not None else d ** -0.5
        q = query[0].reshape(kv_heads, heads // kv_heads, t, d)[slots.heads].reshape(-1, t, d)  # [h * g, t, d]
        span_keys, span_values = self.span_kv(layer, slots.heads)  # [h, L, d]
        assert span_keys.shape[0] == slots.heads.numel(), (tuple(span_keys.shape), slots.heads.tolist())
        offsets = self.selector.retrieve(q, span_keys, self.budget, scale)  # [h, budget]
        index = offsets[..., None].expand(-1, -1, d)
        window = slice(slots.slot, slots.slot + self.budget)
        key[0, slots.heads, window] = span_keys.gather(1, index).to(key.dtype)
        value[0, slots.heads, window] = span_values.gather(1, index).to(value.dtype)
        chosen = offsets + slots.start
        self.changes += int(not torch.equal(self.selected[layer][slots.heads], chosen))
        self.selected[layer][slots.heads] = chosen
        self.retrievals += 1

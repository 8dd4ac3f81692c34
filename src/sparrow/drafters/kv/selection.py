"""Which prompt KV entries a sparse self-draft keeps: the selector interface and the StD top-K rule.

A selector sees, for one layer, the post-RoPE queries of the last w prompt positions and the
prompt's keys, and returns `budget` positions per KV head inside a span. `kept_positions` adds what
is always kept (attention sinks, the recent window, everything outside the span). Any selector is
lossless for speculative decoding: it only changes what the draft attends to, the target verifies
with its full cache.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from sparrow.errors import UserError


class KVSelector(Protocol):
    def __call__(self, queries: Tensor, keys: Tensor, budget: int, span: tuple[int, int], *, layer: int,
                 scaling: float) -> Tensor:
        """queries [heads, w, d] (last w prompt positions), keys [kv_heads, n, d], 1 <= budget <= end - start
        -> [kv_heads, budget] int64 positions in [start, end), each row sorted ascending."""


def attention_scores(queries: Tensor, keys: Tensor, scaling: float) -> Tensor:
    """[heads, w, d] x [kv_heads, n, d] -> [kv_heads, n]: the attention each key gets from the w queries
    (the last w of the n positions, causal among themselves), averaged over queries and the heads of
    each GQA group. Computed in float32."""
    heads, w, d = queries.shape
    kv_heads, n, _ = keys.shape
    assert heads % kv_heads == 0 and w <= n, (tuple(queries.shape), tuple(keys.shape))
    group = heads // kv_heads
    q = queries.float().reshape(kv_heads, group * w, d)
    logits = torch.bmm(q, keys.float().transpose(1, 2)).mul_(scaling).reshape(kv_heads, group, w, n)
    query_pos = torch.arange(n - w, n, device=keys.device)[:, None]
    future = torch.arange(n, device=keys.device)[None, :] > query_pos  # [w, n]
    logits.masked_fill_(future, float("-inf"))
    return logits.softmax(-1).mean(dim=(1, 2))


class TopKAttention:
    """Sparse-to-Dense (StD): the top-`budget` keys of the span by mean attention from the last queries."""

    def __call__(self, queries: Tensor, keys: Tensor, budget: int, span: tuple[int, int], *, layer: int,
                 scaling: float) -> Tensor:
        start, end = span
        scores = attention_scores(queries, keys, scaling)[:, start:end]
        return scores.topk(budget, dim=-1).indices.add_(start).sort(dim=-1).values


def resolve_budget(budget: int | float, candidates: int) -> int:
    """Entries to keep out of `candidates`: an int is a count (capped at the candidates), a float a fraction."""
    if isinstance(budget, float):
        return min(candidates, max(1, round(budget * candidates))) if candidates else 0
    return min(candidates, budget)


def check_budget(budget: int | float) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise UserError(f"budget must be an int >= 1 or a fraction in (0, 1], got {budget!r}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise UserError(f"budget as a fraction must lie in (0, 1], got {budget!r}")
    if isinstance(budget, int) and budget < 1:
        raise UserError(f"budget must be an int >= 1 or a fraction in (0, 1], got {budget!r}")


def candidate_span(n: int, sinks: int, window: int, span: tuple[int, int] | None) -> tuple[int, int]:
    """The span to select in, clipped to [sinks, n - window) (may be empty: start == end). A prompt shorter
    than sinks + window leaves it empty: every entry is kept."""
    lo = min(sinks, n)
    hi = max(lo, n - window)
    if span is None:
        return lo, hi
    start, end = span
    if not (isinstance(start, int) and isinstance(end, int)) or not 0 <= start <= end <= n:
        raise UserError(f"span must be (start, end) prompt positions with 0 <= start <= end <= {n}, got {span!r}")
    start, end = min(max(start, lo), hi), min(max(end, lo), hi)
    return start, end


def kept_positions(selector: KVSelector, queries: Tensor, keys: Tensor, budget: int | float, sinks: int,
                   window: int, span: tuple[int, int] | None, *, layer: int, scaling: float) -> Tensor:
    """[kv_heads, m] sorted prompt positions to keep for one layer: sinks, the recent window, everything
    outside the span, and the selector's choice inside it. keys [kv_heads, n, d]."""
    kv_heads, n, _ = keys.shape
    start, end = candidate_span(n, sinks, window, span)
    device = keys.device
    outside = torch.cat([torch.arange(0, start, device=device), torch.arange(end, n, device=device)])
    k = resolve_budget(budget, end - start)
    if k == end - start:  # nothing to drop
        return torch.arange(n, device=device).expand(kv_heads, n).contiguous()
    chosen = selector(queries, keys, k, (start, end), layer=layer, scaling=scaling)
    assert chosen.shape == (kv_heads, k), f"selector returned {tuple(chosen.shape)}, expected {(kv_heads, k)}"
    assert bool(((chosen >= start) & (chosen < end)).all()), "selector returned positions outside the span"
    return torch.cat([outside.expand(kv_heads, -1), chosen.to(device)], dim=1).sort(dim=1).values

"""Measuring what a forward costs (the only policy code that runs a model): cost curves over draft lengths (a batch's
step costs are measured by `sparrow.decoding.batch.measure_rows`)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from sparrow.policy.estimates import CostCurve
from sparrow.runtime.cached_model import CachedModel
from sparrow.timing import now
from sparrow.types import Prompt

if TYPE_CHECKING:  # an annotation only: drafters build on the policies
    from sparrow.drafters.base import Drafter


DUMMY_ID_STRIDE = 7919
"""Timing runs feed ids i * stride % vocab: a prime stride spreads them over any vocabulary, like text."""



def _forward_seconds(model: CachedModel, tokens: torch.Tensor) -> float:
    """Seconds of one forward of `tokens` after the cached context, which is kept as it was."""
    keep, start = model.length, now(model.device)
    model.forward(tokens.to(model.device))
    seconds = now(model.device) - start
    model.rewind(keep)
    return seconds



def measured_lengths(max_tokens: int) -> list[int]:
    """The forward lengths `measure_cost_curve` times (the rest are interpolated): 1, powers of 2, max_tokens + 1."""
    return sorted({1, max_tokens + 1, *(2 ** i for i in range(1, max_tokens.bit_length()))})



def measure_cost_curve(target: CachedModel, max_tokens: int, draft: CachedModel | None = None,
                       context_tokens: int = 64, repeats: int = 3) -> CostCurve:
    """Median seconds of target forwards of n = 1, 2, 4, ... and max_tokens + 1 tokens (interpolated in
    between; timed in interleaved rounds so drift hits every n alike) and of one draft forward, after a
    `context_tokens` context. Leaves the caches holding that dummy context; prefill() resets them.
    A model context too small for both is measured on what fits (fewer context tokens, then narrower forwards)."""
    limits = [m.context_length for m in (target, draft) if m is not None and m.context_length is not None]
    if limits:
        max_tokens = max(0, min(max_tokens, min(limits) - 2))
        context_tokens = max(1, min(context_tokens, min(limits) - max_tokens - 1))
    vocab = min(target.vocab_size, draft.vocab_size) if draft is not None else target.vocab_size
    ids = torch.arange(context_tokens + max_tokens + 1, dtype=torch.long) * DUMMY_ID_STRIDE % vocab
    context, new = Prompt(input_ids=ids[:context_tokens]), ids[context_tokens:]
    draft_seconds = None
    if draft is not None:
        draft.prefill(context)
        _forward_seconds(draft, new[:1])  # warm-up
        draft_seconds = statistics.median(_forward_seconds(draft, new[:1]) for _ in range(repeats))
    target.prefill(context)
    points = measured_lengths(max_tokens)
    _forward_seconds(target, new)  # warm-up
    times: dict[int, list[float]] = {n: [] for n in points}
    for _ in range(repeats):
        for n in points:
            times[n].append(_forward_seconds(target, new[:n]))
    measured = {n: statistics.median(t) for n, t in times.items()}
    verify = []
    for n in range(1, max_tokens + 2):
        low, high = max(p for p in points if p <= n), min(p for p in points if p >= n)
        w = 0.0 if high == low else (n - low) / (high - low)
        verify.append((1 - w) * measured[low] + w * measured[high])
    return CostCurve(tuple(verify), draft_seconds)



def follow_cost_curve(drafter: Drafter | None, target: CachedModel) -> None:
    """Switch an adaptive draft-model drafter's policy to the cost-aware mode, measured now (k stays the
    maximum); for `auto`, each of its candidates with a draft model. No-op for fixed lengths, drafters without a
    draft model, and drafters already set up."""
    if drafter is None:  # plain decoding
        return
    info = drafter.describe()
    for candidate in info.candidates:  # auto: the same draft model, the same rule
        follow_cost_curve(candidate, target)
    policy, draft = info.length, info.draft
    if policy is not None and policy.adaptive and policy.curve is None and isinstance(draft, CachedModel):
        policy.follow(measure_cost_curve(target, policy.max_tokens, draft))

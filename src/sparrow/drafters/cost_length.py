"""CostAwareLength: the draft length that maximises tokens per second on the measured cost curve.

With bf16 dense kernels verifying k <= 8 tokens costs about one token, so "draft many" wins.
Weight-only quantized kernels make one token ~4x cheaper but a k-token verify only slightly
cheaper, so verify cost grows with k and the best k is smaller. The curve is measured once at
load: one target forward of n = 1 .. max_tokens + 1 tokens, and one draft forward of a token.

Each round drafts k tokens and yields, with per-token acceptance a (Leviathan et al. 2023, eq. 1),

    E[tokens](k) = (1 - a^(k + 1)) / (1 - a)        (accepted prefix + one bonus/recovered token)
    cost(k)      = k * draft_ms + verify_ms[k + 1]

and the round cap is argmax_k E[tokens](k) / cost(k). The acceptance a is estimated online: each
round is a run of Bernoulli trials that stops at the first rejection, so a = accepted / (accepted +
rejections), with a prior and exponential forgetting so it follows the text.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from sparrow.cached_model import CachedModel
from sparrow.drafters.length import DraftLength
from sparrow.types import Prompt


def expected_tokens(acceptance: float, num_draft_tokens: int) -> float:
    """Tokens per round: accepted drafts plus the bonus/recovered token."""
    if acceptance >= 1.0:
        return num_draft_tokens + 1.0
    return (1 - acceptance ** (num_draft_tokens + 1)) / (1 - acceptance)


def best_length(acceptance: float, draft_ms: float, verify_ms: tuple[float, ...], max_tokens: int) -> int:
    """argmax over k in 1..max_tokens of expected tokens per millisecond; verify_ms[n - 1] = n tokens."""
    assert len(verify_ms) >= max_tokens + 1, (len(verify_ms), max_tokens)
    rates = [expected_tokens(acceptance, k) / (k * draft_ms + verify_ms[k]) for k in range(1, max_tokens + 1)]
    return 1 + max(range(max_tokens), key=rates.__getitem__)


@dataclass
class CostAwareLength(DraftLength):
    """DraftLength whose round cap follows the measured cost curve and the observed acceptance."""

    draft_ms: float = 0.0
    verify_ms: tuple[float, ...] = ()  # [max_tokens + 1]: verify_ms[n - 1] = one target forward of n tokens
    prior_acceptance: float = 0.8
    prior_rounds: float = 4.0  # weight of the prior, in rounds
    forgetting: float = 0.95  # per round
    _accepted: float = field(default=0.0, repr=False)
    _rejected: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if len(self.verify_ms) < self.max_tokens + 1:
            raise ValueError(f"verify_ms needs {self.max_tokens + 1} entries, got {len(self.verify_ms)}")
        super().__post_init__()

    @property
    def acceptance(self) -> float:
        return self._accepted / max(self._accepted + self._rejected, 1e-9)

    def reset(self) -> None:
        super().reset()
        self._accepted = self.prior_acceptance * self.prior_rounds
        self._rejected = (1 - self.prior_acceptance) * self.prior_rounds
        self.cap = best_length(self.acceptance, self.draft_ms, self.verify_ms, self.max_tokens)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self._accepted = self.forgetting * self._accepted + num_accepted
        self._rejected = self.forgetting * self._rejected + (num_accepted < num_drafted)
        self.cap = best_length(self.acceptance, self.draft_ms, self.verify_ms, self.max_tokens)


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _forward_ms(model: CachedModel, tokens: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of one forward of `tokens` ([n]) after the cached context (kept as it is)."""
    keep = model.length
    tokens = tokens.to(model.device)
    times = []
    for _ in range(repeats):
        t0 = _sync(model.device)
        model.forward(tokens)
        times.append(_sync(model.device) - t0)
        model.rewind(keep)
    return statistics.median(times) * 1000


def measure_cost_curve(target: CachedModel, draft: CachedModel, max_tokens: int, context_tokens: int = 64,
                       repeats: int = 3) -> tuple[float, tuple[float, ...]]:
    """(draft_ms, verify_ms) with verify_ms[n - 1] for n = 1 .. max_tokens + 1 tokens.

    Measures n = 1, 2, 4, 8, ... and max_tokens + 1 on a `context_tokens` context; interpolates
    linearly in between. Leaves both caches holding the dummy context; prefill() resets them.
    """
    vocab = min(target.vocab_size, draft.vocab_size)
    ids = torch.arange(context_tokens + max_tokens + 1, dtype=torch.long) * 7919 % vocab
    context, new = Prompt(input_ids=ids[:context_tokens]), ids[context_tokens:]
    draft.prefill(context)
    _forward_ms(draft, new[:1], 1)  # warm-up
    draft_ms = _forward_ms(draft, new[:1], repeats)
    target.prefill(context)
    points = sorted({1, max_tokens + 1, *(2**i for i in range(1, 8) if 2**i < max_tokens + 1)})
    _forward_ms(target, new[: points[-1]], 1)  # warm-up
    measured = {n: _forward_ms(target, new[:n], repeats) for n in points}
    verify_ms = []
    for n in range(1, max_tokens + 2):
        low = max(p for p in points if p <= n)
        high = min(p for p in points if p >= n)
        w = 0.0 if high == low else (n - low) / (high - low)
        verify_ms.append((1 - w) * measured[low] + w * measured[high])
    return draft_ms, tuple(verify_ms)


def follow_cost_curve(drafter: object, target: CachedModel) -> None:
    """Replace an adaptive draft-model drafter's heuristic length by a CostAwareLength (k stays the
    maximum). No-op for fixed lengths (exactly k was asked for), drafters without a draft model,
    and drafters already set up.
    """
    length = getattr(drafter, "length", None)
    draft = getattr(drafter, "draft", None)
    if not isinstance(length, DraftLength) or isinstance(length, CostAwareLength) or not length.adaptive:
        return
    if not isinstance(draft, CachedModel):
        return
    draft_ms, verify_ms = measure_cost_curve(target, draft, length.max_tokens)
    drafter.length = CostAwareLength(length.max_tokens, draft_ms=draft_ms, verify_ms=verify_ms)

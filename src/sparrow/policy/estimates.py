"""The numbers behind every draft-length decision: expected tokens, decayed estimates of acceptance and cost, and
the back-off probe schedule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MIN_SPREAD = 0.25



def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens committed by a round that drafts k tokens: the accepted prefix plus the bonus token."""
    return k + 1.0 if acceptance >= 1.0 else (1 - acceptance ** (k + 1)) / (1 - acceptance)



def tokens_per_second(
    acceptance: float, k: int, draft: Callable[[int], float], verify: Callable[[int], float]
) -> float:
    """E[tokens](k) / (draft(k) + verify(k + 1)); k = 0 is a plain decoding step (no draft cost)."""
    seconds = (draft(k) if k else 0.0) + verify(k + 1)
    return expected_tokens(acceptance, k) / max(seconds, 1e-12)



def best_length(acceptance: float, draft: Callable[[int], float], verify: Callable[[int], float], max_tokens: int,
                minimum: int = 1) -> int:
    """argmax over k in minimum..max_tokens of tokens per second (the shorter on ties; 0 = plain decoding)."""
    return max(range(minimum, max_tokens + 1), key=lambda k: tokens_per_second(acceptance, k, draft, verify))



@dataclass
class AcceptanceEstimate:
    """Per-token acceptance from decayed accept/reject counts, starting from a prior."""

    prior: float = 0.8
    prior_rounds: float = 2.0  # weight of the prior, in rounds
    decay: float = 0.9  # per observed round, so the estimate follows the text

    def __post_init__(self) -> None:
        self.accepted, self.rejected = self.prior * self.prior_rounds, (1 - self.prior) * self.prior_rounds

    @property
    def value(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-12)

    def observe(self, drafted: int, accepted: int, weight: float = 1.0) -> None:
        """One round; `weight` scales the old evidence beyond the usual decay (1: none)."""
        if drafted > 0:
            keep = self.decay * weight
            self.accepted = keep * self.accepted + accepted
            self.rejected = keep * self.rejected + (accepted < drafted)



@dataclass
class DecayedLine:
    """seconds ~ a + b * tokens by exponentially decayed least squares (the mean, for a constant x)."""

    decay: float = 0.9  # per observation
    origin: bool = False  # while the tokens have no spread: a line through the origin (True) or flat
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)  # w, x, y, xx, xy

    @property
    def known(self) -> bool:
        return self._sums[0] > 0

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        """One observation; `weight` scales the old ones beyond the usual decay (1: none)."""
        keep = self.decay * weight
        self._sums = [keep * s + t for s, t in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def line(self) -> tuple[float, float]:
        """(a, b) with b >= 0 and a >= 0; needs at least one observation."""
        w, sx, sy, sxx, sxy = self._sums
        assert w > 0, "no observation yet"
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var >= MIN_SPREAD:
            b = max(0.0, (sxy / w - mx * my) / var)
            if my - b * mx >= 0:
                return my - b * mx, b
        if (self.origin or var >= MIN_SPREAD) and mx > 0:  # no spread, or a negative intercept: y = b x
            return 0.0, my / mx
        return my, 0.0

    def __call__(self, x: float) -> float:
        a, b = self.line()
        return a + b * x



@dataclass
class ProbeSchedule:
    """Rounds between probes of an option that is not used: `start`, doubling after each losing probe."""

    start: int = 4
    limit: int = 64

    def __post_init__(self) -> None:
        self.interval, self.next = self.start, 0

    def restart(self, first: int) -> None:
        """The first probe at round `first`, then every `start` rounds."""
        self.interval, self.next = self.start, first

    def due(self, round_: int) -> bool:
        return round_ >= self.next

    def wait(self, round_: int, won: bool | None = None) -> None:
        """Schedule the next probe after round `round_`; a losing probe doubles the interval, a winning one resets
        it."""
        if won is not None:
            self.interval = self.start if won else min(2 * self.interval, self.limit)
        self.next = round_ + self.interval


@dataclass(frozen=True)
class CostCurve:
    """Measured once at load: seconds of one target forward of n = 1 .. k + 1 tokens and of one draft step."""

    verify_seconds: tuple[float, ...]  # [k + 1]: verify_seconds[n - 1] = n tokens
    draft_seconds: float | None = None  # one draft-model forward of one token; None: no draft model


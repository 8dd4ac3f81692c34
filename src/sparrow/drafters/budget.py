"""DraftBudget: how many draft steps pay off next round, from costs and acceptance measured online.

A round that drafts `k` steps proposes about `m = ratio * k - held_back` target tokens (a
cross-vocabulary drafter holds its last, still unstable, token back) and costs
`k * draft_step + verify(m)`, with `verify(m) = verify_base + verify_per_token * m`; it commits
`1 + alpha + ... + alpha^m` tokens on average when each proposed token is accepted with
probability `alpha` given the ones before it. Plain decoding commits 1 token per `verify_base`.
`choose()` returns the `k` in [0, max_steps] with the most tokens per second, so a drafter that
does not pay backs off to `k = 0` (an empty draft: the round is one plain decoding step).

While backed off nothing new is learnt about `alpha`, so every `probe_interval` skipped rounds
one probe round drafts anyway; the interval doubles after each probe that does not change the
decision (up to `max_probe_interval`), and returns to its start once drafting pays again.

Every estimate is an exponentially decayed average (`decay` per observation), so the budget
follows a generation that moves between easy (copying) and hard (free writing) stretches.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Decayed:
    """Exponentially decayed weighted sums for a mean and a least-squares line."""

    decay: float
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) of y over x, or None while x has no spread."""
        if self.w == 0:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.25:
            return None
        slope = (self.xy / self.w - mx * my) / var
        return my - slope * mx, slope


@dataclass
class DraftBudget:
    max_steps: int
    """Upper bound on draft steps per round."""
    held_back: int = 0
    """Tokens of each round's draft that are never proposed."""
    decay: float = 0.9
    probe_interval: int = 4
    max_probe_interval: int = 64
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    _verify: _Decayed = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"k (num_draft_tokens) must be an integer >= 1, got {self.max_steps!r}")
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must lie in (0, 1), got {self.decay}")
        self.reset()

    def reset(self) -> None:
        self._verify = _Decayed(self.decay)
        self._accepted = self.prior_alpha * self.prior_weight  # decayed accepted proposals
        self._rejected = (1 - self.prior_alpha) * self.prior_weight  # decayed first rejections
        self._step_seconds: float | None = None  # one draft forward
        self._ratio = 1.0  # target tokens proposed per draft step
        self._skipped = 0
        self._interval = self.probe_interval

    # --- measurements -------------------------------------------------------------------------
    def record_draft(self, steps: int, proposed: int, seconds: float) -> None:
        if steps > 0:
            per_step = seconds / steps
            d = self.decay
            self._step_seconds = per_step if self._step_seconds is None else d * self._step_seconds + (1 - d) * per_step
            self._ratio = d * self._ratio + (1 - d) * (proposed + self.held_back) / steps

    def record_verify(self, proposed: int, seconds: float) -> None:
        self._verify.add(proposed, seconds)

    def record_verdict(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        d = self.decay
        self._accepted = d * self._accepted + accepted
        self._rejected = d * self._rejected + (accepted < proposed)

    # --- decision ------------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        """Probability that a proposed token is accepted given the ones before it were."""
        return self._accepted / (self._accepted + self._rejected)

    def verify_cost(self) -> tuple[float, float] | None:
        """(seconds of a one-token target round, extra seconds per proposed token), once measured."""
        if self._verify.w == 0:
            return None
        line = self._verify.line()
        if line is None:  # no spread in m yet: assume each proposed token adds 10% to a round
            base = self._verify.y / self._verify.w / (1 + 0.1 * self._verify.x / self._verify.w)
            return base, 0.1 * base
        base, per_token = line
        return max(base, 1e-6), max(per_token, 0.0)

    def tokens_per_second(self, steps: int) -> float:
        verify = self.verify_cost()
        assert verify is not None and self._step_seconds is not None
        base, per_token = verify
        m = max(0, int(self._ratio * steps) - self.held_back)
        alpha = min(self.alpha, 0.999)
        expected = (1 - alpha ** (m + 1)) / (1 - alpha)
        return expected / (steps * self._step_seconds + base + per_token * m)

    def choose(self) -> int:
        """Draft steps for the next round (0 = skip drafting this round)."""
        if self._step_seconds is None or self.verify_cost() is None:
            return self.max_steps  # nothing measured yet: draft, and measure
        best = max(range(self.max_steps + 1), key=self.tokens_per_second)
        if best > 0:
            self._skipped, self._interval = 0, self.probe_interval
            return best
        self._skipped += 1
        if self._skipped < self._interval:
            return 0
        self._skipped, self._interval = 0, min(2 * self._interval, self.max_probe_interval)
        return self.max_steps  # probe: refresh alpha with a full-length draft

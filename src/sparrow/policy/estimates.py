"""The numbers behind every draft decision: expected tokens, the one decayed-statistics type (`Decayed`) that every
estimate of acceptance and cost is made of, and the one back-off rule (`BackOff`) every policy follows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MIN_SPREAD = 0.25
"""Variance of the token counts (tokens^2) under which a line's slope is not identifiable."""


Acceptance = "float | AcceptanceEstimate | Sequence[float]"


def expected_tokens(acceptance: Acceptance, k: int) -> float:
    """Tokens committed by a round that drafts k tokens: the accepted prefix plus the bonus token. A number: every
    draft token accepted with that probability given the ones before it (geometric); an estimate: its accepted
    lengths as observed (`AcceptanceEstimate.tokens`); a sequence: the rate at each draft position (1 + sum_j prod_i
    q_i, as `AcceptanceEstimate.curve`), at least k of them."""
    if isinstance(acceptance, AcceptanceEstimate):
        return acceptance.tokens(k)
    if isinstance(acceptance, Sequence):
        total, survive = 1.0, 1.0
        for q in acceptance[:k]:
            survive *= q
            total += survive
        return total
    return k + 1.0 if acceptance >= 1.0 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def tokens_per_second(acceptance: Acceptance, k: int, draft: Callable[[int], float],
                      verify: Callable[[int], float]) -> float:
    """E[tokens](k) / (draft(k) + verify(k + 1)); k = 0 is a plain decoding step (no draft cost)."""
    seconds = (draft(k) if k else 0.0) + verify(k + 1)
    return expected_tokens(acceptance, k) / max(seconds, 1e-12)


def best_length(acceptance: Acceptance, draft: Callable[[int], float], verify: Callable[[int], float],
                max_tokens: int, minimum: int = 1) -> int:
    """argmax over k in minimum..max_tokens of tokens per second (the shorter on ties; 0 = plain decoding)."""
    return max(range(minimum, max_tokens + 1), key=lambda k: tokens_per_second(acceptance, k, draft, verify))


@dataclass
class Decayed:
    """Exponentially decayed sums of quantities observed together: each `add` keeps `decay` of the old sums and adds
    the new values, so the statistics follow the text and the machine. By convention the first quantity is the
    weight of an observation (1 per round, or the tokens a round committed) and `mean(i)` = sums[i] / sums[0] is a
    decayed mean (seconds per round) or rate (seconds per token); a prior is a starting sum."""

    decay: float = 0.9  # per observation
    sums: tuple[float, ...] = (0.0, 0.0)  # the starting sums (a prior, or zeros): as many as the quantities

    @property
    def known(self) -> bool:
        return self.sums[0] > 0

    def add(self, *values: float, weight: float = 1.0) -> None:
        """One observation; `weight` scales the old ones beyond the usual decay (1: none)."""
        keep = self.decay * weight
        self.sums = tuple(keep * s + v for s, v in zip(self.sums, values, strict=True))

    def scale(self, factor: float) -> None:
        """The old observations count `factor` times as much (a stale estimate before a probe, a new request)."""
        self.sums = tuple(factor * s for s in self.sums)

    def mean(self, i: int = 1) -> float:
        """sums[i] / sums[0]; needs an observation."""
        assert self.known, "no observation yet"
        return self.sums[i] / self.sums[0]


@dataclass
class AcceptanceEstimate:
    """Acceptance from decayed counts, starting from a prior: one per-token rate, and the rate at each draft position.

    `value`: a round is a run of trials that stops at the first rejection, so acceptance = accepted / (accepted +
    rejections), the one rate of a geometric model. It overestimates long drafts where acceptance falls along the
    draft or varies between rounds (a mix of easy and hard text): `tokens(k)` uses instead the rate q_i at each
    position i, from the rounds that reached it (accepted >= i - 1 of a draft allowed i tokens or more), each pulled
    toward `value` by `prior_rounds` rounds' weight, so that E[tokens](k) = 1 + sum_{j<=k} prod_{i<=j} q_i is the
    geometric one until rounds were observed there."""

    prior: float = 0.8
    prior_rounds: float = 2.0  # weight of the prior, in rounds
    decay: float = 0.9  # per observed round, so the estimate follows the text
    positions: int = 32  # draft positions with their own rate; beyond, `value`

    def __post_init__(self) -> None:
        prior = (self.prior * self.prior_rounds, (1 - self.prior) * self.prior_rounds)
        self.counts = Decayed(self.decay, prior)  # (accepted, rejected)
        self.reached = Decayed(self.decay, (0.0,) * (2 * self.positions))  # per position: (tried, accepted)

    @property
    def value(self) -> float:
        accepted, rejected = self.counts.sums
        return accepted / max(accepted + rejected, 1e-12)

    def observe(self, drafted: int, accepted: int, weight: float = 1.0, reach: int | None = None) -> None:
        """One round; `weight` scales the old evidence beyond the usual decay (1: none). reach: the draft length the
        round was allowed (its cap; default what it drafted): a draft that stopped short of it failed there."""
        if drafted <= 0:
            return
        self.counts.add(accepted, float(accepted < drafted), weight=weight)
        reach = min(drafted if reach is None else reach, self.positions)
        tried = [float(i < reach and accepted >= i) for i in range(self.positions)]
        won = [float(i < reach and accepted > i) for i in range(self.positions)]
        self.reached.add(*tried, *won, weight=weight)

    def rate(self, position: int) -> float:
        """q at a draft position (1-based): its observed rate, with `value` as a prior of `prior_rounds` rounds."""
        return self._rates(position)[-1]

    def _rates(self, n: int) -> list[float]:
        """q at positions 1..n."""
        prior, sums, p = self.value, self.reached.sums, self.positions
        return [(sums[p + i] + self.prior_rounds * prior) / (sums[i] + self.prior_rounds) if i < p else prior
                for i in range(n)]

    def curve(self, n: int) -> list[float]:
        """[E[tokens](k) for k = 0..n]: `tokens` of every draft length up to n at once."""
        out, survive = [1.0], 1.0
        for q in self._rates(n):
            survive *= q
            out.append(out[-1] + survive)
        return out

    def tokens(self, k: int) -> float:
        """Expected tokens committed by a round allowed k draft tokens (the accepted prefix plus the bonus token)."""
        return self.curve(k)[-1]


@dataclass
class DecayedLine:
    """seconds ~ a + b * tokens by exponentially decayed least squares (the mean, for a constant x)."""

    decay: float = 0.9  # per observation
    origin: bool = False  # while the tokens have no spread: a line through the origin (True) or flat
    _sums: Decayed = field(init=False, repr=False)  # w, x, y, xx, xy

    def __post_init__(self) -> None:
        self._sums = Decayed(self.decay, (0.0,) * 5)

    @property
    def known(self) -> bool:
        return self._sums.known

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        """One observation; `weight` scales the old ones beyond the usual decay (1: none)."""
        self._sums.add(1.0, x, y, x * x, x * y, weight=weight)

    def line(self) -> tuple[float, float]:
        """(a, b) with b >= 0 and a >= 0; needs at least one observation."""
        mx, my, mxx, mxy = (self._sums.mean(i) for i in range(1, 5))
        var = mxx - mx * mx
        if var >= MIN_SPREAD:
            b = max(0.0, (mxy - mx * my) / var)
            if my - b * mx >= 0:
                return my - b * mx, b
        if (self.origin or var >= MIN_SPREAD) and mx > 0:  # no spread, or a negative intercept: y = b x
            return 0.0, my / mx
        return my, 0.0

    def __call__(self, x: float) -> float:
        a, b = self.line()
        return a + b * x


@dataclass
class BackOff:
    """The back-off rule of every policy (chain length, tree, batch, auto's candidates): use an option (drafting, a
    candidate) at every step where it pays; where it does not, use it only as a probe, `start` steps after it last
    paid, then at intervals that double after each probe (up to `limit`) until it pays again. Nothing is learnt about
    an unused option, so without probes a stale estimate would keep it out for good; with them a losing option costs
    one step in `limit` at most."""

    start: int = 4
    limit: int = 64

    def __post_init__(self) -> None:
        self.interval, self.next = self.start, 0
        self.probing = False  # whether the last decide() answered yes for a probe

    def restart(self, first: int) -> None:
        """The first probe at step `first`, then at doubling intervals from `start`."""
        self.interval, self.next = self.start, first

    def due(self, step: int) -> bool:
        """Whether a step of the option at `step` would be a probe (if it does not pay)."""
        return step >= self.next

    def decide(self, pays: bool, step: int) -> bool:
        """Use the option at `step` (steps count up)? Yes when it pays (the schedule restarts), or as a probe."""
        self.probing = not pays and self.due(step)
        if pays:
            self.restart(step + self.start)
        elif self.probing:
            self.interval = min(2 * self.interval, self.limit)
            self.next = step + self.interval
        return pays or self.probing


@dataclass(frozen=True)
class CostCurve:
    """Measured once at load: seconds of one target forward of n = 1 .. k + 1 tokens and of one draft step."""

    verify_seconds: tuple[float, ...]  # [k + 1]: verify_seconds[n - 1] = n tokens
    draft_seconds: float | None = None  # one draft-model forward of one token; None: no draft model

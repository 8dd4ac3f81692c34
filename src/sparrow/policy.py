"""One speculation policy: how many tokens to draft this round, from acceptance and measured costs.

A round that drafts k tokens, each accepted with probability a given the ones before it, commits
(Leviathan et al. 2023, eq. 1)

    E[tokens](k) = (1 - a^(k + 1)) / (1 - a)        (the accepted prefix + one bonus/recovered token)

and costs draft(k) + verify(k + 1) seconds; plain decoding (k = 0) commits one token per verify(1).
The best length is argmax_k E[tokens](k) / (draft(k) + verify(k + 1)). Everything is learnt from the
rounds the engine measured (`StepStats`), never from a drafter's own clock:

* a: decayed Bernoulli counts with a prior. A round is a run of trials that stops at the first
  rejection, so a = accepted / (accepted + rejections);
* draft(k), verify(n): decayed least-squares lines over (tokens, seconds); plain decoding's cost per
  token comes from the rounds that drafted nothing, else from the verify line at n = 1;
* back-off: while drafting does not pay (k = 0 wins), rounds are plain decoding steps. Nothing is
  learnt about a meanwhile, so a probe round drafts after `probe_interval` plain rounds; the interval
  doubles after each probe that does not change the decision, and restarts once drafting pays. While
  drafting pays, a draft is never longer than the best length (the cap rule may only shorten it).

`LengthPolicy` modes: fixed (exactly k: `--fixed`); adaptive (the default: the cap grows by 2 after a
fully accepted draft and shrinks by 1 otherwise, and drafting stops early under a confidence threshold
that follows the acceptance rate, Draft & Verify's rule; once rounds have been measured the cap is never
above the best length on the measured lines, so a CPU where verification is expensive drafts less); cost-aware (`follow`: the cap is the best
length on the measured cost curve, for quantized kernels whose verify cost grows with n).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparrow.runtime.cached_model import CachedModel
from sparrow.timing import now
from sparrow.types import Prompt, StepStats
from sparrow.errors import UserError

MIN_SPREAD = 0.25
"""Variance of the token counts (tokens^2) under which a line's slope is not identifiable."""
DUMMY_ID_STRIDE = 7919
"""Timing runs feed ids i * stride % vocab: a prime stride spreads them over any vocabulary, like text."""


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens committed by a round that drafts k tokens: the accepted prefix plus the bonus token."""
    return k + 1.0 if acceptance >= 1.0 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def tokens_per_second(acceptance: float, k: int, draft: Callable[[int], float], verify: Callable[[int], float]) -> float:
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


@dataclass(frozen=True)
class CostCurve:
    """Measured once at load: seconds of one target forward of n = 1 .. k + 1 tokens and of one draft step."""

    verify_seconds: tuple[float, ...]  # [k + 1]: verify_seconds[n - 1] = n tokens
    draft_seconds: float | None = None  # one draft-model forward of one token; None: no draft model


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
        """Schedule the next probe after round `round_`; a losing probe doubles the interval, a winning one resets it."""
        if won is not None:
            self.interval = self.start if won else min(2 * self.interval, self.limit)
        self.next = round_ + self.interval


@dataclass
class LengthPolicy:
    """How many tokens a drafter drafts each round; see the module docstring."""

    max_tokens: int
    adaptive: bool = False
    """False: exactly max_tokens every round (`--fixed`): no confidence exit, no cap rule, no back-off."""
    backoff: bool = False
    """Draft 0 tokens while drafting is measured not to pay (drafters whose drafting costs real compute)."""
    threshold: float = 0.4  # initial confidence threshold (adaptive)
    target_acceptance: float = 0.8  # the threshold rises while the acceptance EMA is below this, else falls
    threshold_step: float = 0.05
    max_threshold: float = 0.95  # never stop after every draft token
    smoothing: float = 0.5  # weight of the old acceptance EMA per round
    grow: int = 2  # cap step after a fully accepted draft (transformers' "heuristic" schedule)
    shrink: int = 1  # cap step after a rejection
    decay: float = 0.9  # per observed round: acceptance counts and cost lines
    probe_interval: int = 4
    max_probe_interval: int = 64
    probe_weight: float = 0.2
    """Weight left to the acceptance evidence from before a probe: the text moved on while backed off."""
    curve: CostCurve | None = field(default=None, init=False)  # set by follow(): the cap follows the cost curve

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UserError(f"k (num_draft_tokens) must be an integer >= 1, got {self.max_tokens!r}")
        self.acceptance = AcceptanceEstimate(decay=self.decay)
        self.verify = DecayedLine(self.decay)  # (tokens in the forward, seconds) of every round
        self.plain = DecayedLine(self.decay)  # the same, rounds without a draft only: their mean
        self.draft = DecayedLine(self.decay, origin=True)  # (draft tokens, seconds) of drafting rounds
        self.probes = ProbeSchedule(self.probe_interval, self.max_probe_interval)
        self._round, self.last_cap, self._probing = 0, 0, False  # last_cap: what the last cap() allowed
        self.reset()

    def reset(self) -> None:
        """A new request: the cap rule and threshold restart; costs and acceptance carry over (same models)."""
        self._cap = self.max_tokens
        self.confidence_threshold = self.threshold if self.adaptive and self.curve is None else 0.0
        self._ema = self.target_acceptance

    def follow(self, curve: CostCurve) -> None:
        """Cost-aware mode, starting from a measured curve (no-op for a fixed length)."""
        if not self.adaptive:
            return
        self.curve, self.confidence_threshold = curve, 0.0
        for n, seconds in enumerate(curve.verify_seconds, start=1):
            self.verify.add(n, seconds)
        self.plain.add(1, curve.verify_seconds[0])
        if curve.draft_seconds is not None:
            self.draft.add(1, curve.draft_seconds)

    # --- the decision ------------------------------------------------------------------------------
    def verify_seconds(self, n: int) -> float:
        return self.plain(1) if n == 1 and self.plain.known else self.verify(n)

    def rate(self, k: int) -> float:
        """Expected tokens per second when drafting k tokens (k = 0: plain decoding)."""
        return tokens_per_second(self.acceptance.value, k, self.draft, self.verify_seconds)

    def cap(self, max_tokens: int) -> int:
        """Tokens to draft this round, at most `max_tokens` (0: a plain decoding step)."""
        limit = max(0, min(max_tokens, self.max_tokens))
        self._round += 1
        k, self._probing = limit, False
        if self.adaptive and limit:
            if self.curve is None:
                k = min(limit, self._cap)
                if not self.backoff and self.verify.known and self.draft.known:  # (back-off applies it below)
                    k = min(k, best_length(self.acceptance.value, self.draft, self.verify_seconds, limit))
            elif self.verify.known and self.draft.known:
                k = best_length(self.acceptance.value, self.draft, self.verify_seconds, limit)
        if self.backoff and k and self.verify.known and self.draft.known:  # else: draft, and measure
            rates = [self.rate(j) for j in range(limit + 1)]
            best = max(range(1, limit + 1), key=rates.__getitem__) if self.adaptive else k  # fixed: k or nothing
            if rates[best] > rates[0]:  # drafting pays; never longer than the length expected to be best
                self.probes.restart(self._round + self.probes.start)
                k = min(k, best)
            elif self.probes.due(self._round):  # a probe: the acceptance estimate is stale (it may still lose)
                self.probes.wait(self._round, won=False)
                self._probing, k = True, min(k, best)
            else:
                k = 0
        self.last_cap = k
        return k

    def keep_drafting(self, confidence: float) -> bool:
        """Whether to draft another token after one whose draft probability was `confidence`."""
        return confidence >= self.confidence_threshold

    # --- learning ----------------------------------------------------------------------------------
    def observe(self, step: StepStats) -> None:
        """The engine-measured round that followed the last cap()."""
        drafted, accepted = step.num_draft_tokens, step.num_accepted
        self.verify.add(drafted + 1, step.verify_seconds)
        if drafted == 0:
            self.plain.add(1, step.verify_seconds)
        if drafted or self.last_cap:  # a drafting round (a plain one spends next to nothing in propose)
            self.draft.add(drafted, step.draft_seconds)
        if drafted == 0:
            return
        self.acceptance.observe(drafted, accepted, self.probe_weight if self._probing else 1.0)
        if self.adaptive and self.curve is None:
            self._cap = min(self.max_tokens, self._cap + self.grow) if accepted == drafted else max(1, self._cap - self.shrink)
            self._ema = self.smoothing * self._ema + (1 - self.smoothing) * accepted / drafted
            delta = self.threshold_step if self._ema < self.target_acceptance else -self.threshold_step
            self.confidence_threshold = min(self.max_threshold, max(0.0, self.confidence_threshold + delta))


def follow_cost_curve(drafter: object, target: CachedModel) -> None:
    """Switch an adaptive draft-model drafter's policy to the cost-aware mode, measured now (k stays the
    maximum); for `auto`, each of its candidates with a draft model. No-op for fixed lengths, drafters without a
    draft model, and drafters already set up."""
    for candidate in getattr(drafter, "candidates", {}).values():  # auto: the same draft model, the same rule
        follow_cost_curve(candidate, target)
    policy, draft = getattr(drafter, "length", None), getattr(drafter, "draft", None)
    if isinstance(policy, LengthPolicy) and policy.adaptive and policy.curve is None and isinstance(draft, CachedModel):
        policy.follow(measure_cost_curve(target, policy.max_tokens, draft))


@dataclass
class TreePolicy:
    """LengthPolicy's counterpart for trees, whose cost and yield do not follow one length k. From decayed
    sums over the engine-measured tree rounds:

    * back-off: drafting rounds' seconds per committed token against plain decoding's (the rounds without
      a draft; one is forced after `warmup` tree rounds to measure it). While plain decoding is faster,
      draft nothing and probe on a doubling schedule (`backoff=False`: always draft, e.g. inside auto).
    * `min_prob`: when another tree level is worth a draft forward. EAGLE-2's scores approximate the chance
      the target accepts a path, so a level whose best path has draft probability p adds about p tokens for
      one draft forward: it pays while p * (seconds per committed token) > (seconds per draft forward).
    """

    backoff: bool = True
    decay: float = 0.9
    warmup: int = 3
    probe_interval: int = 4
    max_probe_interval: int = 64
    probe_weight: float = 0.2  # weight left to the drafting evidence from before a probe
    floor: float = 0.02  # min_prob: never stop expanding for a path more likely than this...
    ceiling: float = 0.9  # ...and always stop under this

    def __post_init__(self) -> None:
        self.tokens = self.seconds = 0.0  # decayed sums over drafting rounds: committed tokens, round seconds
        self.forwards = self.draft_seconds = 0.0  # the same: draft forwards, drafting seconds
        self.plain = DecayedLine(self.decay)
        self.probes = ProbeSchedule(self.probe_interval, self.max_probe_interval)
        self._round = self._drafted = 0

    def draft_now(self) -> bool:
        """Whether this round drafts (False: a plain decoding step)."""
        self._round += 1
        if not self.backoff:
            return True
        if not self.plain.known:
            return self._drafted < self.warmup
        if not self.seconds or self.tokens / self.seconds > 1.0 / self.plain(1):
            self.probes.restart(self._round + self.probes.start)
            return True
        if self.probes.due(self._round):
            self.probes.wait(self._round, won=False)
            self.tokens, self.seconds = self.probe_weight * self.tokens, self.probe_weight * self.seconds
            return True
        return False

    @property
    def min_prob(self) -> float:
        if not self.forwards or not self.seconds:
            return self.floor
        per_forward, per_token = self.draft_seconds / self.forwards, self.seconds / self.tokens
        return min(self.ceiling, max(self.floor, per_forward / per_token))

    def observe(self, step: StepStats, forwards: int = 1) -> None:
        """The engine-measured round; `forwards`: the draft forwards its tree took."""
        if step.num_draft_tokens == 0:
            self.plain.add(1, step.verify_seconds)
            return
        self._drafted += 1
        new = (step.num_accepted + 1, step.draft_seconds + step.verify_seconds, forwards, step.draft_seconds)
        old = (self.tokens, self.seconds, self.forwards, self.draft_seconds)
        self.tokens, self.seconds, self.forwards, self.draft_seconds = (self.decay * o + n for o, n in zip(old, new))

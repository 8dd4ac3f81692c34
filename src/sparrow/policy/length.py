"""One speculation policy: how many tokens to draft this round, from acceptance and measured costs.

A round that drafts k tokens, each accepted with probability a given the ones before it, commits
(Leviathan et al. 2023, eq. 1)

    E[tokens](k) = (1 - a^(k + 1)) / (1 - a)        (the accepted prefix + one bonus/recovered token)

and costs draft(k) + verify(k + 1) seconds; plain decoding (k = 0) commits one token per verify(1).
The best length is argmax_k E[tokens](k) / (draft(k) + verify(k + 1)). Everything is learnt from the
rounds the engine measured (`StepStats`), never from a drafter's own clock:

* a: decayed Bernoulli counts with a prior. A round is a run of trials that stops at the first
  rejection, so a = accepted / (accepted + rejections); E[tokens](k) itself is taken from the rate at each
  draft position as observed, with the geometric formula above as its prior (`AcceptanceEstimate.tokens`);
* draft(k), verify(n): decayed least-squares lines over (tokens, seconds); plain decoding's cost per
  token comes from the rounds that drafted nothing, else from the verify line at n = 1;
* back-off (`sparrow.policy.estimates.BackOff`, every policy's rule): while drafting does not pay (k = 0 wins),
  rounds are plain decoding steps. Nothing is learnt about a meanwhile, so a probe round drafts after
  `probe_interval` plain rounds; the interval doubles after each probe that does not change the decision,
  and restarts once drafting pays. While drafting pays, a draft is never longer than the best length (the
  cap rule may only shorten it).

`LengthPolicy` modes: fixed (exactly k: `--fixed`); adaptive (the default: the cap grows by 2 after a
fully accepted draft and shrinks by 1 otherwise, and drafting stops early under a confidence threshold
that follows the acceptance rate, Draft & Verify's rule; once rounds have been measured the cap is never
above the best length on the measured lines, so a CPU where verification is expensive drafts less); cost-aware
(`follow`: the cap is the best
length on the measured cost curve, for quantized kernels whose verify cost grows with n).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparrow.errors import UserError
from sparrow.policy.estimates import (
    AcceptanceEstimate,
    BackOff,
    CostCurve,
    Decayed,
    DecayedLine,
    best_length,
    tokens_per_second,
)
from sparrow.types import StepStats


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
        self.plain = Decayed(self.decay)  # (1, seconds) of the rounds without a draft: their mean
        self.draft = DecayedLine(self.decay, origin=True)  # (draft tokens, seconds) of drafting rounds
        self.probes = BackOff(self.probe_interval, self.max_probe_interval)
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
        self.plain.add(1.0, curve.verify_seconds[0])
        if curve.draft_seconds is not None:
            self.draft.add(1, curve.draft_seconds)

    # --- the decision ------------------------------------------------------------------------------
    def verify_seconds(self, n: int) -> float:
        return self.plain.mean() if n == 1 and self.plain.known else self.verify(n)

    def rate(self, k: int) -> float:
        """Expected tokens per second when drafting k tokens (k = 0: plain decoding)."""
        return tokens_per_second(self.acceptance, k, self.draft, self.verify_seconds)

    def cap(self, max_tokens: int) -> int:
        """Tokens to draft this round, at most `max_tokens` (0: a plain decoding step)."""
        limit = max(0, min(max_tokens, self.max_tokens))
        self._round += 1
        k, self._probing = limit, False
        if self.adaptive and limit:
            if self.curve is None:
                k = min(limit, self._cap)
                if not self.backoff and self.verify.known and self.draft.known:  # (back-off applies it below)
                    k = min(k, best_length(self.acceptance, self.draft, self.verify_seconds, limit))
            elif self.verify.known and self.draft.known:
                k = best_length(self.acceptance, self.draft, self.verify_seconds, limit)
        if self.backoff and k and self.verify.known and self.draft.known:  # else: draft, and measure
            rates = [self.rate(j) for j in range(limit + 1)]
            best = max(range(1, limit + 1), key=rates.__getitem__) if self.adaptive else k  # fixed: k or nothing
            # never longer than the length expected to be best; a probe's acceptance estimate is stale
            k = min(k, best) if self.probes.decide(rates[best] > rates[0], self._round) else 0
            self._probing = self.probes.probing
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
            self.plain.add(1.0, step.verify_seconds)
        if drafted or self.last_cap:  # a drafting round (a plain one spends next to nothing in propose)
            self.draft.add(drafted, step.draft_seconds)
        if drafted == 0:
            return
        reach = min(drafted, accepted + 1) if step.tree else None  # a tree's nodes are not draft positions
        self.acceptance.observe(drafted, accepted, self.probe_weight if self._probing else 1.0, reach)
        if self.adaptive and self.curve is None:
            self._cap = (
                min(self.max_tokens, self._cap + self.grow) if accepted == drafted else max(1, self._cap - self.shrink)
            )
            self._ema = self.smoothing * self._ema + (1 - self.smoothing) * accepted / drafted
            delta = self.threshold_step if self._ema < self.target_acceptance else -self.threshold_step
            self.confidence_threshold = min(self.max_threshold, max(0.0, self.confidence_threshold + delta))



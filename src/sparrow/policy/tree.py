"""How a tree drafter decides whether to draft a tree this round, and how large."""

from __future__ import annotations

from dataclasses import dataclass

from sparrow.policy.estimates import BackOff, Decayed
from sparrow.types import StepStats


@dataclass
class TreePolicy:
    """LengthPolicy's counterpart for trees, whose cost and yield do not follow one length k. From decayed
    sums over the engine-measured tree rounds:

    * back-off (`BackOff`): drafting rounds' seconds per committed token against plain decoding's (the rounds
      without a draft; one is forced after `warmup` tree rounds to measure it). While plain decoding is faster,
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
        self.rounds = Decayed(self.decay)  # drafting rounds: (committed tokens, round seconds)
        self.forwards = Decayed(self.decay)  # the same rounds: (draft forwards, drafting seconds)
        self.plain = Decayed(self.decay)  # plain rounds: (1, seconds)
        self.probes = BackOff(self.probe_interval, self.max_probe_interval)
        self._round = self._drafted = 0

    def draft_now(self) -> bool:
        """Whether this round drafts (False: a plain decoding step)."""
        self._round += 1
        if not self.backoff:
            return True
        if not self.plain.known:
            return self._drafted < self.warmup
        tokens, seconds = self.rounds.sums
        if not self.probes.decide(not seconds or tokens / seconds > 1.0 / self.plain.mean(), self._round):
            return False
        if self.probes.probing:  # the evidence is stale: let the probe count most
            self.rounds.scale(self.probe_weight)
        return True

    @property
    def min_prob(self) -> float:
        if not self.forwards.known or not self.rounds.sums[1]:
            return self.floor
        per_forward, per_token = self.forwards.mean(), self.rounds.mean()
        return min(self.ceiling, max(self.floor, per_forward / per_token))

    def observe(self, step: StepStats, forwards: int = 1) -> None:
        """The engine-measured round; `forwards`: the draft forwards its tree took."""
        if step.num_draft_tokens == 0:
            self.plain.add(1.0, step.verify_seconds)
            return
        self._drafted += 1
        self.rounds.add(step.num_accepted + 1, step.draft_seconds + step.verify_seconds)
        self.forwards.add(forwards, step.draft_seconds)

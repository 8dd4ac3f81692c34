"""The draft budget of a batch step (`sparrow.decoding.batch.Batch`): how many tokens every sequence may draft.

A step of B sequences that drafts k tokens each costs k draft positions of B sequences plus one verify forward of
T = sum(k_b + 1) tokens, and commits sum E_b[tokens](k) (each sequence's accepted lengths as observed,
`sparrow.policy.estimates.AcceptanceEstimate.tokens`). The step's cap is the k with the most tokens per second,
k = 0 (a plain step: B tokens for verify(B)) included, from each sequence's acceptance and two cost tables
interpolated between measured steps (`CostTable`), both seeded by measurements before the first step: a draft
model's batched forward grows with its rows as the target's does with its tokens, so as the batch grows drafts get
shorter, and stop where they no longer pay (`BackOff`). A draft that first feeds many committed tokens alone (a lazy
prompt prefill, the steps it sat out) prices that catch-up from a third table, a single sequence's forward of n
tokens, each sequence's share spread over the tokens it has left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sparrow.policy.estimates import AcceptanceEstimate, BackOff, Decayed


class Estimated(Protocol):
    """What the batch policy reads of a running sequence (`sparrow.decoding.batch.Generation`)."""

    acceptance: AcceptanceEstimate


@dataclass
class CostTable:
    """Seconds of one forward of T tokens: decayed means per power-of-two bin of T, linear between the bins
    (flat below the first, the last segment's slope beyond the last). A CPU's forward costs about the same
    for 1 or 16 tokens (it reads the weights either way), then grows with T; one straight line fits neither."""

    decay: float = 0.9  # per observation, within its bin

    def __post_init__(self) -> None:
        self.bins: dict[int, Decayed] = {}  # bit length of T -> (1, T, seconds)
        self._points: list[tuple[float, float]] | None = None  # the bins' (T, seconds) means, sorted (until an add)

    @property
    def known(self) -> bool:
        return bool(self.bins)

    def add(self, tokens: int, seconds: float) -> None:
        self.bins.setdefault(tokens.bit_length(), Decayed(self.decay, (0.0, 0.0, 0.0))).add(1.0, tokens, seconds)
        self._points = None

    def __call__(self, tokens: float) -> float:
        if self._points is None:
            self._points = monotone(sorted((b.mean(1), b.mean(2)) for b in self.bins.values()))
        points = self._points
        assert points, "no observation yet"
        if len(points) == 1:
            x, y = points[0]
            return y * max(1.0, tokens / x)
        if tokens <= points[0][0]:
            return points[0][1]
        (x0, y0), (x1, y1) = next((pair for pair in zip(points, points[1:]) if tokens <= pair[1][0]),
                                  (points[-2], points[-1]))
        slope = (y1 - y0) / (x1 - x0)
        if tokens > x1:  # beyond the last bin: never flatter than the whole table
            slope = max(slope, (y1 - points[0][1]) / (x1 - points[0][0]))
        return y0 + slope * (tokens - x0)


def monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(tokens, seconds) sorted by tokens, each seconds raised to the most of the fewer tokens': a forward of more
    tokens never costs less. Without it a noisy bin (a probe's 23-token step timed with its draft's catch-up) sat
    above the next one, the slope beyond the last bin went flat, and at 22 rows of the 1.5B (Zen 5) verifying 22,
    44 or 66 tokens all looked like 0.29 s: 22 lazy drafts caught up (3.0 s) for drafts that did not pay."""
    out, top = [], 0.0
    for x, y in points:
        top = max(top, y)
        out.append((x, top))
    return out


@dataclass
class BatchPolicy:
    """The draft cap of a batch step: the k with the most expected tokens per second (see the module doc).

    Costs are the batch's own: verify(T) for a target forward of T tokens, and draft(B) seconds per draft
    position for B sequences drafting together (a draft model runs one batched forward per position). While no
    draft length pays, steps are plain; every `probe` such steps (doubling up to `max_probe` while it keeps
    losing) one step drafts the best length anyway, so acceptance and draft costs stay measured."""

    decay: float = 0.9
    adaptive: bool = True  # False: every sequence drafts what its own drafter chooses (tests, --fixed)
    probe: int = 4
    max_probe: int = 64
    # drafting must beat a plain step's rate by this share: the cost tables' error (Zen 5, 12 rows of the 1.5B:
    # k = 1 predicted 7 % faster than plain, measured 8 % slower)
    margin: float = 0.1

    def __post_init__(self) -> None:
        self.verify = CostTable(self.decay)  # (tokens in the batched forward, seconds)
        self.draft = CostTable(self.decay)  # (sequences drafting, seconds per draft position)
        self.feed = CostTable(self.decay)  # (tokens one sequence's draft feeds alone, seconds): catch-ups
        self.probes = BackOff(self.probe, self.max_probe)
        self.probes.restart(self.probe)  # the first decisions stand on the seeded costs and the drafters' priors
        self._step = 0
        self.probing = False  # whether the last cap was a probe (drafting that does not pay)

    def seed(self, points: list[tuple[int, float]], draft: list[tuple[int, float]] = (),
             feed: list[tuple[int, float]] = ()) -> None:
        """Measured costs before serving: (tokens, seconds) of batched target forwards of one token in each of that
        many rows, (rows, seconds) of draft-model forwards alike (`sparrow.decoding.batch.measure_rows`): a
        draft position's cost, and (tokens, seconds) of one sequence's draft forward of that many tokens
        (`sparrow.decoding.batch.measure_feeds`): a catch-up's. Batched: on a Zen 5 (bfloat16 1.5B) one sequence's
        64-token forward took 0.31 s and a 32-row step of one token each ~0.68 s, so seeds from one sequence made
        every step look 2-3x cheaper; and priced as that many batched rows, a lazy prompt prefill looked ~2x what
        the draft's own prefill costs (load test run h, docs/results/load-test.md)."""
        for tokens, seconds in points:
            self.verify.add(tokens, seconds)
        for rows, seconds in draft:
            self.draft.add(rows, seconds)
        for tokens, seconds in feed:
            self.feed.add(tokens, seconds)

    def rate(self, seqs: Sequence[Estimated], limits: list[int], k: int,
             curves: list[list[float]] | None = None, charges: Sequence[float] = ()) -> float:
        """Expected tokens per second of a step whose drafts are capped at k (unknown draft costs count as 0).
        curves: each sequence's `AcceptanceEstimate.curve` up to its limit (computed here when not given).
        charges: each drafting sequence's catch-up seconds per token it commits (`charges`; none by default)."""
        ks = [min(k, limit) for limit in limits]
        curves = curves or [seq.acceptance.curve(j) for seq, j in zip(seqs, ks)]
        tokens = sum(curve[j] for curve, j in zip(curves, ks))
        drafting = sum(1 for j in ks if j)
        seconds = max(ks) * self.draft(drafting) if drafting and self.draft.known else 0.0
        seconds += sum(charge * curve[j] for charge, curve, j in zip(charges, curves, ks) if charge and j)
        return tokens / max(seconds + self.verify(sum(ks) + len(ks)), 1e-12)

    def charges(self, behind: Sequence[int], limits: list[int]) -> list[float]:
        """Seconds of catch-up each sequence's drafting pays per token it commits: behind: tokens each sequence's
        draft would first feed alone (0: none, or few enough to share the batch's draft forward). A draft pays its
        catch-up once, so each token it commits is charged that feed over the tokens the sequence has left; 0 where
        nothing lags or the feed table is unmeasured."""
        if not self.feed.known:
            return [0.0] * len(limits)
        return [self.feed(lag) / (limit + 1) if lag else 0.0 for lag, limit in zip(behind, limits)]

    def cap(self, seqs: Sequence[Estimated], limits: list[int], behind: Sequence[int] = ()) -> int:
        """Tokens each sequence may draft this step (each also at most its own limit); behind: see `charges`. A
        sequence alone follows its drafter's own policy, which already weighs its draft and verify costs.
        `probing` says afterwards whether the cap is a probe."""
        top = max(limits, default=0)
        self._step += 1
        self.probing = False
        if top == 0 or len(seqs) < 2 or not self.adaptive or not self.verify.known:
            return top
        curves = [seq.acceptance.curve(limit) for seq, limit in zip(seqs, limits)]
        charges = self.charges(behind, limits)
        rates = [self.rate(seqs, limits, k, curves, charges=charges) for k in range(top + 1)]
        best = max(range(1, top + 1), key=rates.__getitem__)
        pays = self.beats(rates[best], rates[0])
        if not pays and not self.could_pay(seqs, limits, rates[0]):
            return 0  # no probe: not even drafts accepted whole would pay at these costs
        use = self.probes.decide(pays, self._step)
        self.probing = self.probes.probing
        return best if use else 0

    def beats(self, rate: float, plain: float) -> bool:
        """Whether drafting at `rate` tokens per second pays over a plain step's `plain`, by the margin."""
        return rate > plain * (1 + self.margin)

    def could_pay(self, seqs: Sequence[Estimated], limits: list[int], plain: float) -> bool:
        """Whether some cap would beat `plain` tokens per second (by the margin) if every draft were accepted whole.
        Where none would, a probe (which measures acceptance) cannot change the decision, and it costs a drafting
        step plus each draft's catch-up over everything committed since it last ran."""
        whole = [[float(j + 1) for j in range(limit + 1)] for limit in limits]
        return any(self.beats(self.rate(seqs, limits, k, whole), plain) for k in range(1, max(limits) + 1))

    def observe(self, tokens: int, seconds: float, drafting: int = 0, positions: int = 0,
                draft_seconds: float = 0.0) -> None:
        """A step: its verify forward of `tokens` tokens took `seconds`; `drafting` sequences drafted up to
        `positions` tokens in `draft_seconds`."""
        self.verify.add(tokens, seconds)
        if drafting and positions:
            self.draft.add(drafting, draft_seconds / positions)

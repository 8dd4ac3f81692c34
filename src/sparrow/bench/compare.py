"""A fair timing of speculative against plain decoding (`sparrow generate --compare`).

Both paths run once untimed first (a short generation each: kernels, the allocator and the weights' pages are
warm before any clock starts), then alternately in ABBA order (A = speculative, B = plain: A B B A A B ...), so
a drift of the machine's speed (another job, the CPU's clock) weighs on both alike; each is reported as the
median of its runs, with their min-max spread. Every run's output is compared: speculative decoding is lossless
only if each run equals the plain output token for token.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from sparrow.types import GenerationResult

SPECULATIVE, PLAIN = "A", "B"
DEFAULT_RUNS = 2  # per path: one ABBA; make run's 128 tokens then cost ~2x one pair of runs


def abba(runs: int) -> str:
    """The order of ``runs`` runs per path: "AB", "BA" alternating ("ABBA" for 2, "ABBAAB" for 3)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    return "".join("AB" if i % 2 == 0 else "BA" for i in range(runs))


@dataclass(frozen=True)
class Timing:
    """The tokens/s of one path's timed runs, in the order they ran."""

    rates: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def low(self) -> float:
        return min(self.rates)

    @property
    def high(self) -> float:
        return max(self.rates)


@dataclass(frozen=True)
class Comparison:
    speculative: tuple[GenerationResult, ...]  # the timed runs of each path, in the order they ran
    plain: tuple[GenerationResult, ...]
    order: str  # e.g. "ABBA"

    @property
    def speculative_timing(self) -> Timing:
        return Timing(tuple(r.tokens_per_second for r in self.speculative))

    @property
    def plain_timing(self) -> Timing:
        return Timing(tuple(r.tokens_per_second for r in self.plain))

    @property
    def identical(self) -> bool:
        """Whether every run (speculative and plain) produced the first plain run's tokens."""
        reference = self.plain[0].token_ids
        return all(r.token_ids == reference for r in (*self.speculative, *self.plain))

    @property
    def speedup(self) -> float | None:
        """Median speculative tokens/s over median plain tokens/s (None: a figure the clock could not give)."""
        fast, slow = self.speculative_timing.median, self.plain_timing.median
        if not (math.isfinite(fast) and math.isfinite(slow)) or slow <= 0:
            return None
        return fast / slow


def compare(speculative: Callable[[], GenerationResult], plain: Callable[[], GenerationResult],
            warm_up: Callable[[], object], runs: int = DEFAULT_RUNS) -> Comparison:
    """Run ``warm_up`` (untimed: a short generation on each path), then ``speculative`` and ``plain`` ``runs``
    times each in ABBA order (see ``abba``)."""
    order = abba(runs)
    warm_up()
    results: dict[str, list[GenerationResult]] = {SPECULATIVE: [], PLAIN: []}
    for path in order:
        results[path].append((speculative if path == SPECULATIVE else plain)())
    return Comparison(tuple(results[SPECULATIVE]), tuple(results[PLAIN]), order)

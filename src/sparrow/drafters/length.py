"""DraftLength: how many tokens to draft next round, fixed or adapted online.

Adaptive mode combines two rules:
* the round cap grows by 2 after a fully accepted draft and shrinks by 1 otherwise
  (transformers' "heuristic" schedule), within [1, max_tokens];
* drafting stops early when the draft's top probability falls under a confidence threshold,
  and the threshold follows the observed acceptance rate (Draft & Verify's rule): an
  exponential moving average of the per-round acceptance rate below `target_acceptance`
  raises the threshold, above it lowers it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLength:
    max_tokens: int
    adaptive: bool = False
    threshold: float = 0.4
    target_acceptance: float = 0.8
    step: float = 0.05
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"k (num_draft_tokens) must be an integer >= 1, got {self.max_tokens!r}")
        self.reset()

    def reset(self) -> None:
        self.cap = self.max_tokens
        self.confidence_threshold = self.threshold if self.adaptive else 0.0
        self._ema = self.target_acceptance

    def keep_drafting(self, confidence: float) -> bool:
        """Whether to draft another token after one whose draft probability was `confidence`."""
        return confidence >= self.confidence_threshold

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if not self.adaptive or num_drafted == 0:
            return
        self.cap = min(self.max_tokens, self.cap + 2) if num_accepted == num_drafted else max(1, self.cap - 1)
        self._ema = self.smoothing * self._ema + (1 - self.smoothing) * num_accepted / num_drafted
        delta = self.step if self._ema < self.target_acceptance else -self.step
        self.confidence_threshold = min(0.95, max(0.0, self.confidence_threshold + delta))

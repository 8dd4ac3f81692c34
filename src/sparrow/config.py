"""Frozen, validated configuration for sampling and generation."""

from __future__ import annotations

from dataclasses import dataclass
from sparrow.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from logits. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig()


@dataclass(frozen=True)
class StoppingConfig:
    """When a generation ends. All rules are exact even inside an accepted draft block."""

    max_new_tokens: int = 128
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if any(not s for s in self.stop_strings):
            raise UserError("stop strings must not be empty")


def check_seed(seed: object, argument: str = "seed") -> int | None:
    """A sampling seed is None or an integer in [0, 2**64) (what torch.Generator.manual_seed takes)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise UserError(f"{argument} must be an integer in [0, 2**64), got {seed!r}")
    return seed

"""Frozen, validated configuration for sampling and generation, and the checks behind it.

Each check takes the argument's name as the caller spells it (`temperature` in the API, `--temperature` in
the CLI, `max_tokens` in the server), so the same rule gives the same message wherever a value comes in; its
UserError's `field` is sparrow's name. A request's options are checked by `sparrow.request.check_options`
alone; the dataclasses below check their own fields again only as their invariant.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from sparrow.errors import UserError

# The smallest positive temperature. Below it sampling is greedy in all but name: logits are divided by T, and
# any logit gap >= 1e-3 (bfloat16 logits near 10 are 0.06 apart) becomes a factor exp(-100) at T = 1e-5.
# Far below it logits / T overflows float32 (1e-38 turns every logit into inf and the probabilities into nan).
MIN_TEMPERATURE = 1e-5


def check_temperature(temperature: object, argument: str = "temperature") -> float:
    """A temperature is 0 (greedy) or a finite number >= MIN_TEMPERATURE."""
    if not _real(temperature) or not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        raise UserError(f"{argument} must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {temperature!r}",
                        field="temperature")
    return float(temperature)


def check_top_k(top_k: object, argument: str = "top_k") -> int:
    """top-k is an integer >= 0 (0 disables it)."""
    if not _integer(top_k) or top_k < 0:
        raise UserError(f"{argument} must be an integer >= 0 (0 disables it), got {top_k!r}", field="top_k")
    return int(top_k)


def check_top_p(top_p: object, argument: str = "top_p") -> float:
    """top-p is a number in (0, 1] (1 disables it)."""
    if not _real(top_p) or not 0 < top_p <= 1:
        raise UserError(f"{argument} must be in (0, 1] (1 disables it), got {top_p!r}", field="top_p")
    return float(top_p)


def check_max_new_tokens(max_new_tokens: object, argument: str = "max_new_tokens") -> int:
    """At least one new token."""
    if not _integer(max_new_tokens) or max_new_tokens < 1:
        raise UserError(f"{argument} must be an integer >= 1, got {max_new_tokens!r}", field="max_new_tokens")
    return int(max_new_tokens)


def check_seed(seed: object, argument: str = "seed") -> int | None:
    """A sampling seed is None or an integer in [0, 2**64) (what torch.Generator.manual_seed takes)."""
    if seed is None:
        return None
    if not _integer(seed) or not 0 <= seed < 2**64:
        raise UserError(f"{argument} must be an integer in [0, 2**64), got {seed!r}", field="seed")
    return int(seed)


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from logits. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_top_k(self.top_k)
        check_top_p(self.top_p)

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
        check_max_new_tokens(self.max_new_tokens)
        if any(not s for s in self.stop_strings):
            raise UserError("stop must not be an empty string", field="stop")

"""Value objects that cross the boundaries between drafter, target, verifier and engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Prompt:
    """What the target (and a drafter) prefill with."""

    input_ids: Tensor  # [n] int64, target vocabulary
    model_inputs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the prefill forward only (pixel_values, image_grid_thw, ...)."""

    def __post_init__(self) -> None:
        assert self.input_ids.ndim == 1, f"Prompt.input_ids must be 1-D, got {tuple(self.input_ids.shape)}"


@dataclass(frozen=True)
class Draft:
    """A proposed continuation of the committed tokens, in the *target* vocabulary."""

    tokens: Tensor  # [k] int64, k >= 0
    probs: Tensor | None = None
    """[k, vocab] draft distribution q each token was sampled from; None means a point mass
    (argmax or n-gram drafts), which the rejection verifier treats with the q = 1 rule."""

    def __post_init__(self) -> None:
        assert self.tokens.ndim == 1, f"Draft.tokens must be 1-D, got {tuple(self.tokens.shape)}"
        if self.probs is not None:
            assert self.probs.ndim == 2 and self.probs.shape[0] == self.tokens.numel(), (
                f"Draft.probs must be [k, vocab] with k={self.tokens.numel()}, got {tuple(self.probs.shape)}"
            )

    def __len__(self) -> int:
        return self.tokens.numel()

    @staticmethod
    def empty(device: torch.device | str) -> Draft:
        return Draft(tokens=torch.empty(0, dtype=torch.long, device=device))


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided for one round."""

    tokens: Tensor  # [num_accepted + 1]: the accepted draft prefix, then one bonus or recovered token
    num_accepted: int  # 0 .. len(draft)

    def __post_init__(self) -> None:
        assert self.tokens.ndim == 1 and self.tokens.numel() == self.num_accepted + 1, (
            f"Verdict.tokens must hold num_accepted + 1 = {self.num_accepted + 1} tokens, got {tuple(self.tokens.shape)}"
        )


@dataclass(frozen=True)
class StepStats:
    """One speculative round."""

    num_draft_tokens: int
    num_accepted: int
    draft_seconds: float
    verify_seconds: float


@dataclass(frozen=True)
class GenerationStats:
    """Aggregate statistics of one generation (vLLM's metric names where they exist)."""

    steps: int  # target forwards after prefill (speculative rounds, or plain decoding steps)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # [max k]: how often draft position i was accepted
    drafted_per_position: tuple[int, ...]  # [max k]: how often draft position i was proposed
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per target forward, the bonus token included (1.0 for plain decoding)."""
        return (self.num_accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position))

    @staticmethod
    def from_steps(steps: list[StepStats], prefill_seconds: float) -> GenerationStats:
        width = max((s.num_draft_tokens for s in steps), default=0)
        accepted, drafted = [0] * width, [0] * width
        for s in steps:
            for i in range(s.num_draft_tokens):
                drafted[i] += 1
                accepted[i] += i < s.num_accepted
        return GenerationStats(
            steps=len(steps),
            num_draft_tokens=sum(s.num_draft_tokens for s in steps),
            num_accepted_tokens=sum(s.num_accepted for s in steps),
            accepted_per_position=tuple(accepted),
            drafted_per_position=tuple(drafted),
            prefill_seconds=prefill_seconds,
            draft_seconds=sum(s.draft_seconds for s in steps),
            verify_seconds=sum(s.verify_seconds for s in steps),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": list(self.acceptance_per_position),
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
        }


@dataclass(frozen=True)
class GenerationResult:
    """Output of one generation: new tokens only (the prompt is not repeated)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or context)
    seconds: float  # wall time of the whole generation, prefill included
    stats: GenerationStats

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

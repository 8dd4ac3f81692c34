"""Verifiers: decide which draft tokens the target accepts. Registry by name."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.errors import UserError
from sparrow.noise import Randomness
from sparrow.types import Draft, Verdict
from sparrow.verifiers.greedy import GreedyVerifier
from sparrow.verifiers.loose import LooseVerifier
from sparrow.verifiers.rejection import RejectionVerifier


class Verifier(Protocol):
    name: str

    def verify(
        self,
        draft: Draft,
        target_logits: Tensor,  # [len(draft) + 1, vocab]: row 0 scores the last committed token
        sampling: SamplingConfig,
        generator: Randomness,  # positional noise (seeded requests): offset 0 = the first draft token's position
    ) -> Verdict: ...


VERIFIERS: dict[str, type] = {"greedy": GreedyVerifier, "rejection": RejectionVerifier,
                               "loose": LooseVerifier}  # loose is LOSSY (LooseVerifier.lossy); never "auto"


def build_verifier(name: str, sampling: SamplingConfig, tokenizer=None) -> Verifier:
    """`auto` picks greedy matching at temperature 0 and lossless rejection sampling otherwise.
    `tokenizer` (optional) lets the lossy "loose" verifier tell filler tokens from visual facts."""
    if name == "auto":
        name = "greedy" if sampling.greedy else "rejection"
    if name not in VERIFIERS:
        raise UserError(f"unknown verifier {name!r}; expected one of: auto, {', '.join(VERIFIERS)}")
    if name == "greedy" and not sampling.greedy:
        raise UserError(f"verifier 'greedy' needs temperature 0, got temperature={sampling.temperature}")
    if name == "loose" and tokenizer is not None:
        return LooseVerifier.for_tokenizer(tokenizer, len(tokenizer))
    return VERIFIERS[name]()


__all__ = ["Verifier", "VERIFIERS", "build_verifier", "GreedyVerifier", "RejectionVerifier", "LooseVerifier"]

"""Drafters propose tokens for the target to verify. Registry by name."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.drafters.length import DraftLength
from sparrow.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from sparrow.types import Draft, Prompt, Verdict


class Drafter(Protocol):
    name: str

    def prefill(self, prompt: Prompt) -> None:
        """Start a new generation from `prompt`."""

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        """Up to `max_tokens` draft tokens continuing `committed` ([n] prompt + generated tokens)."""

    def observe(self, draft: Draft, verdict: Verdict) -> None:
        """Feedback after verification (adaptive draft length, bookkeeping)."""


DRAFTERS = ("draft-model", "prompt-lookup", "none")

__all__ = ["Drafter", "DRAFTERS", "DraftModelDrafter", "PromptLookupDrafter", "DraftLength", "find_continuation"]

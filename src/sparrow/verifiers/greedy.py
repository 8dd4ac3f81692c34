"""Greedy verification: accept draft tokens while they equal the target's argmax."""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.types import Draft, Verdict


class GreedyVerifier:
    name = "greedy"

    def verify(
        self,
        draft: Draft,
        target_logits: Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Verdict:
        k = len(draft)
        assert target_logits.ndim == 2 and target_logits.shape[0] == k + 1, (tuple(target_logits.shape), k)
        choice = target_logits.argmax(-1)  # [k + 1]: the target's token after each prefix
        mismatch = (draft.tokens != choice[:k]).nonzero()
        num_accepted = int(mismatch[0]) if mismatch.numel() else k
        # The accepted drafts equal the target's choices, so the verdict is the target's own prefix:
        # accepted drafts, then the correction (first mismatch) or the bonus (all accepted).
        return Verdict(tokens=choice[: num_accepted + 1].clone(), num_accepted=num_accepted)

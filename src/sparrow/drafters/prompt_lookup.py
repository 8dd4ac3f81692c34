"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the
context's suffix (Saxena 2023; transformers' prompt_lookup_num_tokens; vLLM's ngram proposer).
Drafts are deterministic, so the rejection verifier uses the q = 1 rule for them."""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow.cached_model import CachedModel
from sparrow.config import SamplingConfig
from sparrow.drafters.length import DraftLength
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict


def find_continuation(context: Tensor, min_n: int, max_n: int, k: int) -> Tensor:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram.

    context [T] int64. Tries n = max_n .. min_n; returns an empty tensor when nothing matches.
    Example: context = [1 2 3 9 1 2], n = 2: suffix [1 2] matched at 0, continuation [3 9 1 ...].
    """
    assert context.ndim == 1, tuple(context.shape)
    length = context.numel()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[-n:]
        windows = context[:-1].unfold(0, n, 1)  # [T - n, n]: window i = context[i : i + n], i < T - n
        hits = (windows == suffix).all(-1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return context[start : start + k]
    return context[:0]


class PromptLookupDrafter:
    hidden_layers: tuple[int, ...] = ()  # reads no target hidden states
    name = "prompt-lookup"

    def __init__(self, num_draft_tokens: int = 16, min_n: int = 1, max_n: int = 3, adaptive: bool = False) -> None:
        """adaptive: the round cap grows after fully accepted drafts and shrinks after rejections, so
        long copies get long drafts while spurious matches (code, free text) stop costing verify width."""
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.length = DraftLength(num_draft_tokens, adaptive=adaptive)
        self.min_n, self.max_n = min_n, max_n

    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        self.length.reset()

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        k = min(max_tokens, self.length.cap)
        return Draft(tokens=find_continuation(committed, self.min_n, self.max_n, k))

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput | None = None,
                step: StepStats | None = None) -> None:
        self.length.observe(len(draft), verdict.num_accepted)

"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the
context's suffix (Saxena 2023; transformers' prompt_lookup_num_tokens; vLLM's ngram proposer).
Drafts are deterministic, so the rejection verifier uses the q = 1 rule for them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.drafters.base import DrafterBase
from sparrow.drafters.tree_draft import TreeShape, resolve_shape
from sparrow.errors import UserError
from sparrow.noise import Randomness
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.runner import runner_for
from sparrow.tree import merge_paths
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict


def find_continuation(context: Tensor, min_n: int, max_n: int, k: int) -> Tensor:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram.

    context [T] int64. Tries n = max_n .. min_n; returns an empty tensor when nothing matches.
    Example: context = [1 2 3 9 1 2], n = 2: suffix [1 2] matched at 0, continuation [3 9 1 ...].
    """
    found = find_continuations(context, min_n, max_n, k, limit=1)
    return found[0] if found else context[:0]


def find_continuations(context: Tensor, min_n: int, max_n: int, k: int, limit: int) -> list[Tensor]:
    """Up to `limit` distinct continuations of at most k tokens: what followed earlier matches of the context's
    suffix n-grams, longest n first, most recent match first (context [T] int64; slices of it)."""
    return [context[start:end] for start, end in matches(context, min_n, max_n, k, limit)[1]]


def matches(context: Tensor, min_n: int, max_n: int, k: int, limit: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The context on the host and where `find_continuations`' continuations lie in it ([start, end) each). The
    search runs on the host: one device-to-host copy of the context (none on a CPU, where it is a view)."""
    assert context.ndim == 1, tuple(context.shape)
    ids = context.cpu().numpy()
    found: list[tuple[int, int]] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_n, ids.size - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [T - n, n]: window i = ids[i : i + n]
        for hit in np.flatnonzero((windows == ids[-n:]).all(-1))[::-1].tolist():
            span = (hit + n, min(hit + n + k, ids.size))
            key = tuple(ids[span[0] : span[1]].tolist())
            if key and key not in seen:
                seen.add(key)
                found.append(span)
                if len(found) == limit:
                    return ids, found
    return ids, found


class PromptLookupDrafter(DrafterBase):
    hidden_layers: tuple[int, ...] = ()  # reads no target hidden states
    name = "prompt-lookup"
    free_to_ask = True  # auto asks it every round

    def __init__(self, num_draft_tokens: int = 16, min_n: int = 1, max_n: int = 3, adaptive: bool = False,
                 tree: TreeShape | None = None, backoff: bool | None = None) -> None:
        """adaptive: the round cap grows after fully accepted drafts and shrinks after rejections, so
        long copies get long drafts while spurious matches (code, free text) stop costing verify width.
        backoff (default: adaptive): draft nothing while the measured rounds say drafting does not pay. A lookup
        costs next to nothing, but every drafted token widens the target's forward, and where that is not free
        (float32 on an AVX2 CPU: a 2-token forward of a 1.5B cost 1.7x a 1-token one) spurious one-token matches that
        the
        target rejects made decoding slower than plain (0.76x on a code prompt); see `LengthPolicy`.
        tree: merge the continuations of up to `tree.topk` different matches into one trie: the best match
        keeps the chain's length (the round cap), the others at most `tree.depth` tokens; at most
        `tree.budget` nodes beyond the best match's, and never more than `propose`'s `max_tokens`."""
        if min_n < 1 or max_n < min_n:
            raise UserError(f"prompt lookup needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.length = LengthPolicy(
            num_draft_tokens, adaptive=adaptive, backoff=adaptive if backoff is None else backoff
        )
        self.min_n, self.max_n = min_n, max_n
        self.tree = tree
        self._first = 0  # length of the best match's continuation in the last draft

    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        self.length.reset()

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        k = self.length.cap(max_tokens)
        if self.tree is None:
            return Draft(tokens=find_continuation(committed, self.min_n, self.max_n, k))
        ids, found = matches(committed, self.min_n, self.max_n, k, self.tree.topk)
        if not found:
            self._first = 0
            return Draft.empty(committed.device)
        depth = min(self.tree.depth, max_tokens)
        paths = [ids[start:end].tolist() for start, end in found]
        tokens, parents = merge_paths([paths[0], *(path[:depth] for path in paths[1:])])
        self._first = len(paths[0])
        # Creation order keeps it a tree (a node after its parent); the best match (<= k <= max_tokens) stays whole.
        size = min(max_tokens, max(self._first, min(tokens.numel(), self.tree.budget)))
        return Draft(tokens=tokens[:size].to(committed.device), parents=parents[:size].to(committed.device))

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput | None = None,
                step: StepStats | None = None) -> None:
        if draft.parents is None:
            self.length.observe(step)
        else:  # the cap rule follows the best match's continuation
            self.length.observe(
                replace(step, num_draft_tokens=self._first, num_accepted=min(verdict.num_accepted, self._first))
            )


def build(target, draft: None, num_draft_tokens: int, adaptive: bool, tree_budget: int | str = 0, tree_topk: int = 4,
          tree_depth: int = 8, backoff: bool | None = None, min_n: int = 1, max_n: int = 3) -> PromptLookupDrafter:
    """Registry builder for "prompt-lookup"; `tree_budget` > 0 merges several matches into a trie ("auto": sized
    from the target's measured verify cost curve); min_n / max_n: the shortest / longest n-gram matched
    (vLLM's prompt_lookup_min / prompt_lookup_max)."""
    PromptLookupDrafter(min_n=min_n, max_n=max_n)  # validates before a cost curve is measured
    tree = resolve_shape(tree_budget, tree_topk, tree_depth, runner_for(target.model))
    return PromptLookupDrafter(num_draft_tokens=num_draft_tokens, min_n=min_n, max_n=max_n, adaptive=adaptive,
                               tree=tree, backoff=backoff)

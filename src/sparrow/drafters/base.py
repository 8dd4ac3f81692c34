"""The drafter interface: what the engine calls, and what it hands back after each round."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from torch import Tensor

from sparrow.runtime.cached_model import CachedModel
from sparrow.config import SamplingConfig
from sparrow.noise import Randomness
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict


class Drafter(Protocol):
    """Optional: `watch_prefill(target) -> context manager`, which the engine runs the target's prefill inside
    (drafters that read what that forward computes, e.g. its queries: sparse, visual-prune)."""

    name: str
    hidden_layers: tuple[int, ...]
    """Target hidden-state layers this drafter reads (transformers' `hidden_states` indexing); () = none,
    so the target computes nothing extra for drafters that do not need it."""

    def prefill(self, prompt: Prompt, target: CachedModel, out: TargetOutput) -> None:
        """Start a new generation from `prompt`. `target` has just prefilled it (`out`: the logits of the last
        prompt row and, if asked for, the hidden states of every prompt row). Self-drafters may read the
        target's cache and append to it while drafting, but must leave it cropped back to its length."""

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        """A chain or a tree of at most `max_tokens` draft nodes continuing `committed` ([n] prompt + generated)."""

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput, step: StepStats) -> None:
        """Feedback after verification: `out` holds the target's outputs for the committed rows of the round
        ([root, *accepted path]: num_accepted + 1 rows, the last of which predicted the bonus/recovered
        token), and `step` the engine-measured draft and verify seconds."""


def watching_prefill(drafter: Drafter, target: CachedModel) -> AbstractContextManager:
    """The context to run the target's prefill in for `drafter`: its `watch_prefill(target)`, else none."""
    watch = getattr(drafter, "watch_prefill", None)
    return watch(target) if watch is not None else nullcontext()

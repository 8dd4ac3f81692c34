"""The drafter interface: what the engine calls, and what it hands back after each round."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.grammar import FREE, Constraint
from sparrow.noise import Randomness
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict

if TYPE_CHECKING:  # annotations only: these modules build on this one
    from sparrow.drafters.draft_loop import DraftSteps
    from sparrow.drafters.tree_draft import TreeShape
    from sparrow.drafters.vocab import DraftVocab
    from sparrow.policy.length import LengthPolicy
    from sparrow.policy.tree import TreePolicy


class Drafter(Protocol):
    """Everything the house (the engine, the batch, the policies, auto, the CLI and bench) uses of a drafter.

    The first five are what every drafter defines; `DrafterBase` gives the rest their defaults, so a drafter
    overrides only what it has."""

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

    # optional members (defaults in DrafterBase)
    length: LengthPolicy | None
    """The drafter's draft-length policy, which the batch reads for its first estimate; None: it has none."""
    tree_policy: TreePolicy | None
    """The policy that decides whether to draft a tree this round; None: chains only."""
    tree: TreeShape | None
    """The tree shape it drafts (--tree-budget), for the CLI's report; None: chains."""
    vocab: DraftVocab | None
    """Its reduced draft vocabulary (FR-Spec), for the CLI's report; None: the full vocabulary."""
    draft: CachedModel | None
    """The runner of its draft model, whose cost curve the policies measure; None: no draft model."""
    candidates: Mapping[str, Drafter]
    """The drafters it chooses among (auto); empty for every other drafter."""
    counts: Callable[[], Mapping[str, int]] | None
    """Rounds per option of the last request (auto), for bench's rows; None: not a chooser."""
    lazy_prefill: bool | None
    """Whether its draft model prefills on the first proposal instead of at prefill (a batch sets it, so a draft
    nobody drafts with is never prefilled); None: it has no draft model to prefill."""
    propose_steps: Callable[[Tensor, int, SamplingConfig, Randomness], DraftSteps] | None
    """`propose` as a generator of draft forwards, which the batch runs together with other requests' forwards
    (`sparrow.drafters.draft_loop`); None: proposals run one drafter at a time."""

    grammar: Constraint
    """Structured output: the grammar its drafts should stay inside (the pipeline sets it per request); drafters
    that ignore it are cut at the grammar by the engine, which is still lossless, only slower."""
    free_to_ask: bool
    """Proposing costs next to nothing (a lookup in the text: prompt lookup, suffix), so auto asks it every round."""

    def catch_up(self, committed: Tensor) -> None:
        """Feed the tokens committed while another drafter drafted (auto switching to this one) in one forward;
        a no-op for drafters without a draft model cache."""

    def behind(self, committed: Tensor) -> int:
        """Committed tokens its draft model would feed before its next draft (a lazy prompt prefill, the rounds it
        sat out); 0 without a draft model cache. A batch probes only with drafts nearly in step."""

    def park(self, committed: Tensor) -> None:
        """A generation of `committed` ended between rounds: hand the draft model's cache (as far as it holds
        `committed`) to its prefix cache, if it has one (`Pipeline(prefix_cache=...)`); a no-op by default."""

    def watch_prefill(self, target: CachedModel) -> AbstractContextManager:
        """A context the engine runs the target's prefill inside (drafters that read what that forward computes,
        e.g. its queries: sparse, visual-prune); a no-op by default."""

    watches_prefill: bool
    """Whether `watch_prefill` records the target's prefill forward; a batch then prefills its request alone
    (a shared prefill forward of several prompts is not one prompt's forward)."""

    enabled: bool
    """False: it drafts nothing (a layer-skip set measured to lose decodes plainly), so auto leaves it out."""

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """Every module it runs or changes (its draft model and views of it, a head, the target itself for
        self-drafters, its candidates' for auto): a generation holds their locks (`sparrow.locks`), and a fork
        shares them. () for model-free drafters."""

    def fork(self) -> Drafter:
        """A drafter with its own per-generation state (caches, policies) that shares this one's modules, their
        configs, its tokenizers and its process-wide stores (a batch runs one fork per sequence)."""


class DrafterBase:
    """The defaults of the Drafter protocol's optional members: a drafter with none of them."""

    hidden_layers: tuple[int, ...] = ()
    length: LengthPolicy | None = None
    tree_policy: TreePolicy | None = None
    tree: TreeShape | None = None
    vocab: DraftVocab | None = None
    draft: CachedModel | None = None
    candidates: Mapping[str, Drafter] = MappingProxyType({})
    counts: Callable[[], Mapping[str, int]] | None = None
    lazy_prefill: bool | None = None
    propose_steps: Callable[[Tensor, int, SamplingConfig, Randomness], DraftSteps] | None = None
    free_to_ask: bool = False
    watches_prefill: bool = False
    grammar: Constraint = FREE
    enabled: bool = True

    def catch_up(self, committed: Tensor) -> None:
        pass

    def behind(self, committed: Tensor) -> int:
        return 0

    def park(self, committed: Tensor) -> None:
        pass

    def watch_prefill(self, target: CachedModel) -> AbstractContextManager:
        return nullcontext()

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return ()

    def shared(self) -> tuple[object, ...]:
        """What a fork shares besides `modules()` and their configs: process-wide stores, read-only tables over
        tokenizers, and the target runner of the last generation (the fork's prefill replaces it)."""
        return ()

    def fork(self) -> Drafter:
        """A deep copy that keeps `modules()`, the configs of every module in them (a query capture switches a
        decoder layer's own config) and `shared()` as they are."""
        modules = self.modules()
        configs = [sub.config for module in modules for sub in module.modules() if "config" in vars(sub)]
        return copy.deepcopy(self, {id(obj): obj for obj in (*modules, *configs, *self.shared())})


def distinct(objects: Iterable[object]) -> tuple:
    """`objects` without repeats (by identity) and without None, in order."""
    found = {id(obj): obj for obj in objects if obj is not None}
    return tuple(found.values())

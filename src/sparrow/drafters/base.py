"""The drafter interface: what the round calls, what a batch manages (`Batching`), and what a drafter tells those
that choose among, measure or report on drafters (`DrafterInfo`)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
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


class Batching(Protocol):
    """The side of a drafter with its own draft-model KV cache that a batch and `auto` manage (`Drafter.batching`):
    the draft-model and quantized-self drafters (`DraftModelDrafter`)."""

    lazy_prefill: bool
    """Whether its draft model prefills on the first proposal instead of at prefill (a batch sets it, so a draft
    nobody drafts with is never prefilled)."""

    def propose_steps(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                      generator: Randomness) -> DraftSteps:
        """`propose` as a generator of draft forwards, which the batch runs together with other requests' forwards
        (`sparrow.drafters.draft_loop`)."""

    def behind(self, committed: Tensor) -> int:
        """Committed tokens its draft model would feed before its next draft (a lazy prompt prefill, the rounds it
        sat out). A batch probes only with drafts nearly in step."""

    def catch_up(self, committed: Tensor) -> None:
        """Feed the tokens committed while another drafter drafted (auto switching to this one) in one forward."""


class Memory(Protocol):
    """A drafter's store of earlier requests (`DrafterInfo.memory`)."""

    def clear(self) -> None:
        """Forget every request it holds."""


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter is, for those that choose among, measure or report on drafters (auto, the policies, the
    server's cost seeding, bench, the CLI's report): `Drafter.describe()`, read when asked."""

    draft: CachedModel | None = None
    """The runner of its draft model, whose cost curve the policies measure; None: no draft model."""
    length: LengthPolicy | None = None
    """Its draft-length policy (the batch reads it for its first estimate); None: it has none."""
    tree_policy: TreePolicy | None = None
    """The policy that decides whether to draft a tree this round; None: chains only (or full trees always)."""
    tree: TreeShape | None = None
    """The tree shape it drafts (--tree-budget), for the CLI's report; None: chains."""
    vocab: DraftVocab | None = None
    """Its reduced draft vocabulary (FR-Spec), for the CLI's report; None: the full vocabulary."""
    candidates: tuple[Drafter, ...] = ()
    """The drafters it chooses among (auto); empty for every other drafter."""
    rounds_per_option: Mapping[str, int] | None = None
    """Rounds per option of its last request (auto), for bench's rows; None: it chooses nothing."""
    free_to_ask: bool = False
    """Proposing costs next to nothing (a lookup in the text: prompt lookup, suffix), so auto asks it every round."""
    watches_prefill: bool = False
    """Whether `watch_prefill` records the target's prefill forward; a batch then prefills its request alone
    (a shared prefill forward of several prompts is not one prompt's forward)."""
    enabled: bool = True
    """False: it drafts nothing (a layer-skip set measured to lose decodes plainly), so auto leaves it out."""
    memory: tuple[Memory, ...] = ()
    """What it keeps of earlier requests and drafts from (suffix's store of outputs): `forget_requests` empties it."""


class Drafter(Protocol):
    """What the round, the batch and the pipeline call on a drafter every generation, and nothing else: what
    auto, the policies, bench and the CLI's report read is one record (`describe()`), what only a batch manages
    one object (`batching`).

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
    grammar: Constraint
    """Structured output: the grammar its drafts should stay inside (the pipeline sets it per request); drafters
    that ignore it are cut at the grammar by the engine, which is still lossless, only slower."""

    def watch_prefill(self, target: CachedModel) -> AbstractContextManager:
        """A context the engine runs the target's prefill inside (drafters that read what that forward computes,
        e.g. its queries: sparse, visual-prune; they say so in `describe().watches_prefill`); a no-op by default."""

    def park(self, committed: Tensor) -> None:
        """A generation of `committed` ended between rounds: hand the draft model's cache (as far as it holds
        `committed`) to its prefix cache, if it has one (`Pipeline(prefix_cache=...)`); a no-op by default."""

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """Every module it runs or changes (its draft model and views of it, a head, the target itself for
        self-drafters, its candidates' for auto): a generation holds their locks (`sparrow.locks`), and a fork
        shares them. () for model-free drafters."""

    def fork(self) -> Drafter:
        """A drafter with its own per-generation state (caches, policies) that shares this one's modules, their
        configs, its tokenizers and its process-wide stores (a batch runs one fork per sequence)."""

    batching: Batching | None
    """Its own draft-model cache, as a batch manages it (drafting in steps, lazy prefill, how far behind it is)
    and auto switches to it (catch-up); None: it has none, and proposes one drafter at a time."""

    def describe(self) -> DrafterInfo:
        """What it is (its draft model, policies, tree, vocabulary, candidates, ...), read now."""


class DrafterBase:
    """The defaults of the Drafter protocol's optional members: a drafter with none of them. `describe()` reports
    the fields below, which a drafter sets as it has them."""

    hidden_layers: tuple[int, ...] = ()
    grammar: Constraint = FREE
    batching: Batching | None = None
    # what describe() reports (DrafterInfo's fields)
    draft: CachedModel | None = None
    length: LengthPolicy | None = None
    tree_policy: TreePolicy | None = None
    tree: TreeShape | None = None
    vocab: DraftVocab | None = None
    free_to_ask: bool = False
    watches_prefill: bool = False
    enabled: bool = True
    memory: tuple[Memory, ...] = ()

    def describe(self) -> DrafterInfo:
        return DrafterInfo(draft=self.draft, length=self.length, tree_policy=self.tree_policy, tree=self.tree,
                           vocab=self.vocab, free_to_ask=self.free_to_ask, watches_prefill=self.watches_prefill,
                           enabled=self.enabled, memory=self.memory)

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


def draft_runners(drafter: Drafter | None) -> tuple[CachedModel, ...]:
    """The runners of the draft models `drafter` drafts with: its own and, for auto, its candidates' (each once, in
    order); () for plain decoding and model-free drafters."""
    if drafter is None:
        return ()
    info = drafter.describe()
    return distinct((info.draft, *(runner for candidate in info.candidates for runner in draft_runners(candidate))))


def forget_requests(drafter: Drafter | None) -> None:
    """Empty what `drafter` (and, for auto, each candidate) keeps of earlier requests (`DrafterInfo.memory`), so that
    its next request drafts as the first of a fresh process would: `generate --compare` and `sparrow bench
    --repeats` time each run of a repeated prompt so, not drafting from its own earlier answer."""
    if drafter is None:
        return
    info = drafter.describe()
    for memory in info.memory:
        memory.clear()
    for candidate in info.candidates:
        forget_requests(candidate)


def verify_rows(drafter: Drafter | None) -> int | None:
    """The most rows a target forward of a generation with `drafter` scores, as far as its policies say: 1 (the last
    committed token) plus its longest draft (its length policy's max_tokens, its tree's budget; for auto, its
    candidates' largest); 1 for plain decoding; None where a drafter (or a candidate) states neither. Structured
    output can add forced tokens beyond it (a compiled runner then compiles that size when first asked for)."""
    if drafter is None:
        return 1
    info = drafter.describe()
    if info.candidates:
        rows = [verify_rows(candidate) for candidate in info.candidates]
        return None if None in rows else max(rows)
    drafts = [n for n in (info.length.max_tokens if info.length else None, info.tree.budget if info.tree else None)
              if n is not None]
    return 1 + max(drafts) if drafts else None


def distinct(objects: Iterable[object]) -> tuple:
    """`objects` without repeats (by identity) and without None, in order."""
    found = {id(obj): obj for obj in objects if obj is not None}
    return tuple(found.values())

"""A separate, smaller draft model with the target's vocabulary and its own KV cache.

At temperature > 0 draft tokens are sampled from q (after the same temperature / top-k /
top-p as the target) and q is returned, so the verifier applies min(1, p/q); at
temperature 0 they are the draft's argmax (a point mass).

Rollback is lazy: the drafter remembers which tokens its cache holds and, at the next
proposal, crops to the longest prefix still shared with the committed tokens and feeds the
rest. That covers rejected drafts and the fully accepted case, where the last draft token
was never fed (gpt-fast's "fill last token into draft model"), in one rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.drafters.base import Drafter, DrafterBase, distinct
from sparrow.drafters.draft_loop import DraftSteps, Forward, draft_chain, drive
from sparrow.drafters.kv.draft_kv import draft_kv_config, with_draft_kv
from sparrow.drafters.tree_draft import TreeShape, dynamic_tree, resolve_shape
from sparrow.drafters.vocab import DraftVocab, reduced_head_view, resolve_draft_vocab
from sparrow.errors import UserError
from sparrow.grammar import FREE, Constraint
from sparrow.models import LoadedModel
from sparrow.noise import Randomness
from sparrow.policy.length import LengthPolicy
from sparrow.policy.tree import TreePolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.prefix_cache import PrefixCache
from sparrow.runtime.runner import runner_for
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict


def common_prefix_length(a: Tensor, b: Tensor) -> int:
    n = min(a.numel(), b.numel())
    return int((a[:n].to(b.device) == b[:n]).cumprod(0).sum())  # one read (a GPU's nonzero would be two)


class DraftModelDrafter(DrafterBase):
    hidden_layers: tuple[int, ...] = ()  # reads no target hidden states
    name = "draft-model"

    def __init__(self, draft: CachedModel, target_vocab_size: int, num_draft_tokens: int = 6,
                 adaptive: bool = False, tree: TreeShape | None = None, name: str = "draft-model",
                 vocab: DraftVocab | None = None) -> None:
        """tree: draft an EAGLE-2 dynamic tree of that shape each round instead of a chain of k tokens
        (the drafter's name then ends in "+tree"). name: "quantized-self" for the int4 copy of the target.
        vocab: score only these target ids (FR-Spec; sparrow.drafters.vocab), through a reduced-head view."""
        if draft.vocab_size != target_vocab_size:
            raise UserError(
                f"draft model vocabulary ({draft.vocab_size} tokens) does not match the target's "
                f"({target_vocab_size} tokens); the draft-model drafter needs the same tokenizer"
            )
        self.name = f"{name}+tree" if tree is not None else name
        self.vocab = vocab
        self.draft_model = draft.model  # the model itself: the view below shares it (its lock, the model caches)
        self.draft = draft if vocab is None else runner_for(reduced_head_view(draft.model, vocab))
        self.tree = tree
        self.length = LengthPolicy(num_draft_tokens, adaptive=adaptive, backoff=adaptive)  # --fixed: exactly k
        self.tree_policy = TreePolicy() if tree is not None and adaptive else None  # --fixed: full trees, always
        self._forwards = 0  # draft forwards of the last tree
        self._cached = torch.empty(0, dtype=torch.long)  # [draft.length] tokens whose KV the cache holds
        self.lazy_prefill = False
        """Prefill the draft at the first proposal that drafts (a batch whose policy never drafts never pays for
        it); off for single generations, whose first round's draft time would then include the prefill."""
        self._prompt: Prompt | None = None  # lazy_prefill: the prompt not prefilled yet
        self.grammar: Constraint = FREE
        """Structured output (`sparrow.grammar.guiding`): chains draft only what the grammar allows (not with a
        reduced draft vocabulary, whose -inf rows could leave no allowed token)."""

    @property
    def batching(self) -> DraftModelDrafter:
        """Itself: it drafts in steps (`propose_steps`), prefills lazily in a batch, says how far `behind` its cache
        is and catches up when auto switches to it."""
        return self

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """The draft model, and the reduced-head view its runner drafts through (with a draft vocabulary)."""
        return distinct((self.draft_model, self.draft.model))

    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        self.length.reset()
        self._prompt = prompt
        if not self.lazy_prefill:
            self._prefill_now()

    def _prefill_now(self) -> None:
        assert self._prompt is not None
        self.draft.prefill(self._prompt)
        self._cached = self._prompt.input_ids.to(self.draft.device)
        self._prompt = None

    def _valid(self, committed: Tensor) -> int:
        """Cached tokens that still hold: the common prefix with `committed`, leaving at least its last to feed."""
        return min(common_prefix_length(self._cached, committed), committed.numel() - 1)

    def catch_up(self, committed: Tensor) -> None:
        """Feed the draft every committed token it lacks but the last, in one forward, so that the next proposal
        starts as a round right after its own does (one or two tokens fed). Called by a drafter that used others
        meanwhile (auto), which times it apart: it is the cost of switching, not of drafting."""
        if self._prompt is not None:
            self._prefill_now()
        committed = committed.to(self.draft.device)
        valid = self._valid(committed)
        if committed.numel() - 1 - valid < 2:  # no more than a round after its own feeds anyway
            return
        self.draft.rewind(valid)
        self.draft.forward(committed[valid:-1])
        self._cached = committed[:-1]

    def park(self, committed: Tensor) -> None:
        """The draft's cache, cut to the committed tokens it holds, into its runner's prefix cache (a lazy draft
        that never prefilled has none)."""
        if self._store() is None or self._prompt is not None or self.draft.cache is None:
            return
        committed = committed.to(self.draft.device)
        self.draft.held = committed[:self._valid(committed)].tolist()
        self.draft.park()
        self._cached = self._cached[:0]

    def shared(self) -> tuple[object, ...]:
        """The draft runner's prefix cache: one for every fork."""
        return distinct((self._store(),))

    def _store(self) -> PrefixCache | None:
        """The draft runner's prefix cache (runners with their own KV policies have none)."""
        return getattr(self.draft, "prefix_cache", None)

    def behind(self, committed: Tensor) -> int:
        if self._prompt is not None:  # not prefilled yet: the prompt and every token since
            return committed.numel()
        return committed.numel() - 1 - self._valid(committed.to(self.draft.device))

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        return drive(self.propose_steps(committed, max_tokens, sampling, generator), Forward.run)

    def propose_steps(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                      generator: Randomness) -> DraftSteps:
        """`propose` as a generator of draft `Forward`s (chains; a tree drafts at once), so a batch can run
        the forwards of several sequences' drafters together."""
        committed = committed.to(self.draft.device)
        drafting = self.tree_policy is None or self.tree_policy.draft_now()
        num_tokens = self.length.cap(max_tokens) if self.tree is None else max_tokens * drafting
        if num_tokens < 1:
            return Draft.empty(self.draft.device)
        if self._prompt is not None:
            self._prefill_now()
        # Roll back to what is still valid, then feed everything after it (at least the last token).
        valid = self._valid(committed)
        self.draft.rewind(valid)
        if self.tree is not None:
            self._cached = committed
            min_prob = self.tree_policy.min_prob if self.tree_policy is not None else 0.0
            draft, self._forwards = dynamic_tree(self.draft, committed, self.tree, num_tokens, sampling, min_prob)
            return draft
        fed = []  # draft tokens fed after `committed`: the cache holds their KV

        def request(token: Tensor, i: int) -> Forward:
            if i:
                fed.append(token)
            return Forward(self.draft, token if i else committed[valid:])

        grammar = self.grammar if self.vocab is None else FREE
        draft = yield from draft_chain(request, committed[-1:], num_tokens, sampling, generator, self.length,
                                       grammar=grammar)
        self._cached = torch.cat([committed, *fed])
        return draft

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput | None = None,
                step: StepStats | None = None) -> None:
        if self.tree is None:
            self.length.observe(step)
        elif self.tree_policy is not None:
            self.tree_policy.observe(step, self._forwards)


def draft_model_drafters(drafter: Drafter | None) -> list[DraftModelDrafter]:
    """The draft-model / quantized-self drafters among `drafter` and, for auto, its candidates: those whose draft
    runner the pipeline compiles, warms up and gives a prefix cache."""
    if drafter is None:
        return []
    candidates = drafter.describe().candidates
    return [d for d in (candidates or (drafter,)) if isinstance(d, DraftModelDrafter)]


def build(target: LoadedModel, draft: LoadedModel, num_draft_tokens: int, adaptive: bool,
          tree_budget: int | str = 0, tree_topk: int = 4, tree_depth: int = 8,
          draft_vocab: int | str | DraftVocab | None = None, draft_kv: str | None = None,
          draft_kv_budget: int | float | None = None, retrieve_every: int = 0) -> DraftModelDrafter:
    """Registry builder for "draft-model" (and the base of "quantized-self"): a chain of k tokens a round, or
    with `tree_budget` > 0 (or "auto": from the measured verify cost curve) an EAGLE-2 dynamic tree.
    draft_vocab: N (or "auto", or a DraftVocab): the draft scores only the N most frequent target tokens.
    draft_kv / draft_kv_budget / retrieve_every: a VLM draft keeps only a budget of its visual KV, chosen by
    a policy (topk, mm-shiftkv, hybridkv; drafters/draft_kv.py)."""
    kv_config = draft_kv_config(draft_kv, draft_kv_budget, retrieve_every)  # validated before any measuring
    target_runner, draft_runner = runner_for(target.model), runner_for(draft.model)
    shape = resolve_shape(tree_budget, tree_topk, tree_depth, target_runner)
    vocab = resolve_draft_vocab(draft_vocab, target, target_runner.vocab_size)
    return DraftModelDrafter(with_draft_kv(draft_runner, kv_config), target_runner.vocab_size,
                             num_draft_tokens=num_draft_tokens, adaptive=adaptive, tree=shape, vocab=vocab)

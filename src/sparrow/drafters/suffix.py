"""Suffix Decoding (Oliaro et al., NeurIPS 2025; Snowflake Arctic Inference, in vLLM and SGLang): model-free
drafts from counted suffix tries over the request's own prompt and output, and over earlier outputs.

Two tries (`sparrow.drafters.suffix_tree`):
* the request's own: its prompt and its output so far, built at prefill and grown every round;
* a process-wide `SuffixStore` over outputs (earlier requests', and the running ones'), shared by every copy
  of the drafter, i.e. by all requests of one served model; bounded (FIFO eviction of whole outputs).
  Another request's text only ever reaches a draft: the target verifies every draft token, so each output
  stays the target's own output for that request.

Each round, for every suffix of the committed tokens (length m < depth) that occurred before with a
continuation, in either trie, the continuations form a candidate: from the pattern's node, children in order
of count, each with the estimated probability count / (counts of its siblings) times its parent's. Nodes are
taken best-first while that path probability stays >= `min_token_prob` (Arctic's rule), at most
`max_spec_factor x m` deep (longer matches earn longer drafts) and the round cap deep (`LengthPolicy`: it
grows after fully accepted drafts, shrinks after rejections and backs off to plain steps where drafting does
not pay). A chain follows the most frequent child; with a tree shape (`tree_budget`), up to `topk` children
per node and `budget` nodes become a tree for the engine's tree verification. A chain the tries' depth cuts
short (a pattern of m tokens continues at most depth - m tokens) goes on from the longest match of the context
plus the chain, within the same `max_spec_factor x m`. The candidate with the highest score (the sum of its
nodes' path probabilities: the expected accepted tokens) is drafted.

How far to draft (adaptive mode): the counts tell what followed a pattern, not how far to trust a short one, so
sparrow keeps the acceptance of a draft token by the length of the pattern it continues (`MatchRates`; 1, 2, 3,
4-5, 6-8, 9-15, >= 16 tokens): a draft from an m-token match whose first j tokens were accepted continues a match
of m + j tokens. The chain is then followed past Arctic's `max_spec_factor x m` allowance, up to the round cap,
and a round drafts the length with the most expected tokens per second under those rates and the measured draft
and verify costs:

    n* = argmax_{0 <= n <= len(chain)} (1 + sum_{i<=n} prod_{j<i} q(m + j)) / (draft(n) + verify(n + 1))

(n* = 0: a plain step). So where a wider verify forward is not free (float32 on a CPU), short matches that the
target mostly rejects (new text) stop costing verify width, while a short match inside a copy (an edited word,
then the copy resumes) drafts the long continuation at once, as prompt lookup would, once long matches have
proved reliable. A match length judged not to pay drafts again as a probe (Arctic's allowance) after a doubling
interval, since its estimate goes stale.

Drafts are deterministic functions of the committed tokens and the store, so the rejection verifier applies
the q = 1 rule to them (lossless at any temperature).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Sequence

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.drafters.base import DrafterBase
from sparrow.drafters.suffix_tree import StoreLimits, SuffixStore, SuffixTrie, matches
from sparrow.drafters.tree_draft import TreeShape, resolve_shape
from sparrow.errors import UserError
from sparrow.noise import Randomness
from sparrow.policy.estimates import BackOff, Decayed, best_length
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.runner import runner_for
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict

MATCH_BOUNDS = (1, 2, 3, 4, 6, 9, 16)
"""The match lengths from which each acceptance rate of `MatchRates` counts (1, 2, 3, 4-5, 6-8, 9-15, >= 16)."""
PROBE_WEIGHT = 0.2
"""Weight left to a match length's old acceptance evidence when it is drafted again as a probe."""


@dataclass
class MatchRates:
    """P(a draft token is accepted | the draft tokens before it were), by the length of the pattern it continues.

    Whether a continuation repeats depends mostly on how much context matched (one earlier occurrence of a single
    token says little; of a 9-token pattern, much), which the counts alone do not tell. A draft from an m-token
    match whose first j tokens were accepted continues a match of m + j tokens, so every draft position is a
    trial of its own length's rate. Each rate: decayed (trials, accepted) from a prior of `prior_trials` trials at
    `prior`, the same for every length: with a prior that rose with the length (1 - 1 / (length + 1)), a fresh
    drafter followed 2-token matches 5 tokens deep on new text before any evidence, and Spec-Bench quick's qa
    question ran at 0.93-0.94x plain in two runs (1.00x with the flat prior; smollm2-135m float32, Zen 5)."""

    decay: float = 0.9  # per trial
    prior: float = 0.5
    prior_trials: float = 2.0
    counts: list[Decayed] = field(init=False)

    def __post_init__(self) -> None:
        self.counts = [Decayed(self.decay, (self.prior_trials, self.prior_trials * self.prior)) for _ in MATCH_BOUNDS]

    @staticmethod
    def bucket(m: int) -> int:
        """The rate an m-token match counts in (m >= 1)."""
        return bisect_right(MATCH_BOUNDS, m) - 1

    def rates(self, m: int, n: int) -> list[float]:
        """The rate at each of the n positions of a draft from an m-token match."""
        return [self.counts[self.bucket(m + j)].mean() for j in range(n)]

    def observe(self, m: int, drafted: int, accepted: int, weight: float = 1.0) -> None:
        """One round's draft from an m-token match: position j was tried if the j before it were accepted. `weight`
        scales the old evidence of the match's own length (a probe's fresh trial stands against a stale estimate)."""
        for j in range(min(accepted + 1, drafted)):
            self.counts[self.bucket(m + j)].add(1.0, float(j < accepted), weight=weight if j == 0 else 1.0)


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix Decoding's knobs (vLLM's `suffix_decoding_*` keys where they exist; the same defaults)."""

    max_tree_depth: int = 24
    """Longest pattern + continuation the tries hold (vLLM: suffix_decoding_max_tree_depth)."""
    max_spec_factor: float = 1.0
    """A pattern matched over m tokens drafts at most max_spec_factor x m tokens."""
    min_token_prob: float = 0.1
    """Draft a node only while its path's estimated probability (from the counts) is at least this."""
    max_cached_requests: int = 10000
    """Outputs the shared store keeps (0: no store, the request's own trie only)."""
    max_cached_tokens: int = 100_000
    """Tokens the shared store keeps (its nodes <= this x max_tree_depth, ~160 bytes each)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tree_depth, bool) or not isinstance(self.max_tree_depth, int) or self.max_tree_depth < 2:
            raise UserError(f"suffix max_tree_depth must be an integer >= 2, got {self.max_tree_depth!r}")
        if not isinstance(self.max_spec_factor, (int, float)) or not self.max_spec_factor > 0:
            raise UserError(f"suffix max_spec_factor must be a number > 0, got {self.max_spec_factor!r}")
        if not isinstance(self.min_token_prob, (int, float)) or not 0 <= self.min_token_prob <= 1:
            raise UserError(f"suffix min_token_prob must lie in [0, 1], got {self.min_token_prob!r}")
        StoreLimits(self.max_cached_requests, self.max_cached_tokens)  # validates


@dataclass(frozen=True)
class Candidate:
    """A speculation from one matched pattern: nodes best first (a parent before its children)."""

    tokens: list[int]
    parents: list[int]  # -1: the root (the last committed token)
    probs: list[float]  # each node's path probability (a chain's never grow along it)
    score: float  # sum of the nodes' path probabilities: expected accepted tokens under the counts
    first: int  # length of the most probable path (the chain the length policy follows)
    match: int = 0  # length of the matched pattern
    allowance: int = 0  # Arctic's depth for it: max_spec_factor x match (within the round's cap)


def speculate(trie: SuffixTrie, node: int, max_depth: int, min_prob: float, budget: int, topk: int) -> Candidate:
    """Best-first expansion below a pattern's `node` of `trie`: at most `budget` nodes, `max_depth` deep, `topk`
    children per node, each path's probability >= `min_prob` (a chain: budget = max_depth, topk = 1)."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    depth: list[int] = []
    score = 0.0
    tie = count()  # heap ties: earlier pushes first (a parent's children in count order)
    heap: list[tuple[float, int, int, int, int, int]] = []  # (-path prob, tie, parent, token, node, depth)
    counts = trie.count

    def push(parent: int, below: int, prob: float, level: int) -> None:
        kids = trie.children(below)
        total = sum(counts[child] for child in kids)
        kids.sort(key=lambda child: (-counts[child], trie.token[child]))
        for child in kids[:topk]:
            token = trie.token[child]
            p = prob * counts[child] / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, next(tie), parent, token, child, level))

    push(-1, node, 1.0, 1)
    while heap and len(tokens) < budget:
        negative, _, parent, token, child, level = heapq.heappop(heap)
        index = len(tokens)
        tokens.append(token)
        parents.append(parent)
        probs.append(-negative)
        depth.append(level)
        score -= negative
        if level < max_depth:
            push(index, child, -negative, level + 1)
    first, node_index = 0, -1
    while True:  # the most probable path: each node's first child in draft order
        node_index = next((i for i in range(node_index + 1, len(tokens)) if parents[i] == node_index), None)
        if node_index is None:
            break
        first += 1
    return Candidate(tokens, parents, probs, score, first)


class SuffixDrafter(DrafterBase):
    hidden_layers: tuple[int, ...] = ()  # reads no target hidden states
    name = "suffix"
    free_to_ask = True  # a lookup in two tries: auto asks it every round its lookups' drafts are not used

    def __init__(self, num_draft_tokens: int = 16, adaptive: bool = False, config: SuffixConfig = SuffixConfig(),
                 tree: TreeShape | None = None, backoff: bool | None = None,
                 store: SuffixStore | None = None) -> None:
        """store: the shared trie over outputs (default: a new one, shared by this drafter's forks)."""
        self.config = config
        backoff = adaptive if backoff is None else backoff
        self.length = LengthPolicy(num_draft_tokens, adaptive=adaptive, backoff=backoff)
        self.tree = tree
        limits = StoreLimits(config.max_cached_requests, config.max_cached_tokens)
        self.store = store if store is not None else SuffixStore(config.max_tree_depth, limits)
        self.memory = (self.store,)  # describe(): what forget_requests empties
        self._local = SuffixTrie(config.max_tree_depth)
        self._seq = -1  # this request's sequence in the store
        self._synced = 0  # committed tokens already in the request's own trie
        self._first = 0  # the most probable path's length in the last draft
        self._rates = MatchRates(decay=self.length.decay)
        self._probes = [BackOff(self.length.probe_interval, self.length.max_probe_interval) for _ in MATCH_BOUNDS]
        for probes in self._probes:  # a bucket just measured not to pay needs no probe at once
            probes.restart(probes.start)
        self._round = 0
        self._last: tuple[list[int], int, bool, Tensor] | None = None  # the last draft: tokens, match length, a
        # probe, the tensor drafted

    def shared(self) -> tuple[object, ...]:
        """The store over outputs: one per served model, shared by every fork."""
        return (self.store,)

    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        self.length.reset()
        self._local = SuffixTrie(self.config.max_tree_depth)
        ids = prompt.input_ids.tolist()
        self._local.extend(0, ids)
        self._synced = len(ids)
        self._seq = self.store.start()

    def _sync(self, committed: Tensor) -> list[int]:
        """Feed the tokens committed since the last round (all output: the prompt went in at prefill) to the
        request's trie and to the store; returns the context the tries match (the longest suffix they can). Both
        leave the tensor in one device-to-host copy of the tail they span, not the whole sequence."""
        window = max(self._local.depth, self.store.trie.depth) - 1  # the longest suffix a trie can match
        first = max(0, min(self._synced, committed.numel() - window)) if window > 0 else 0
        tail = committed[first:].tolist()
        new = tail[self._synced - first:]
        if new:
            self._local.extend(0, new)
            if self.store.enabled:
                self.store.extend(self._seq, new)
            self._synced += len(new)
        return tail[-window:] if window > 0 else tail

    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig,
                generator: Randomness) -> Draft:
        context = self._sync(committed)
        self._first, self._last = 0, None
        self._round += 1
        k = self.length.cap(max_tokens)
        if k == 0:
            return Draft.empty(committed.device)
        best = self._best(context, k, max_tokens)
        if best is None or not best.tokens:
            return Draft.empty(committed.device)
        size, probe = self._worth(best)
        if size == 0:
            return Draft.empty(committed.device)
        self._first = min(best.first, size)
        drafted = best.tokens[:size] if self.tree is None else best.tokens
        tokens = torch.tensor(drafted, dtype=torch.long, device=committed.device)
        self._last = (drafted, best.match, probe, tokens)
        if self.tree is None:
            return Draft(tokens=tokens)
        return Draft(tokens=tokens, parents=torch.tensor(best.parents, dtype=torch.long, device=committed.device))

    def _continue(self, trie: SuffixTrie, context: Sequence[int], chain: Candidate, depth: int) -> Candidate:
        """A chain the trie's depth cut short (a pattern of m tokens continues at most trie.depth - m) goes on, up to
        the `depth` its match allows, from the longest match of the context followed by the chain so far, its path
        probabilities times the chain's last, while they stay >= `min_token_prob`."""
        tokens, probs, min_prob = list(chain.tokens), list(chain.probs), self.config.min_token_prob
        while len(tokens) < depth:
            window = [*context, *tokens][-(trie.depth - 1):]
            node = next((n for m in range(len(window), 0, -1)
                         if (n := trie.find(window[len(window) - m:])) is not None and trie.has_children(n)), None)
            if node is None:
                break
            more = speculate(trie, node, depth - len(tokens), min_prob / probs[-1], depth - len(tokens), 1)
            if not more.tokens:
                break
            tokens += more.tokens
            probs += [p * probs[-1] for p in more.probs]
        return replace(chain, tokens=tokens, parents=list(range(-1, len(tokens) - 1)), probs=probs,
                       score=sum(probs), first=len(tokens))

    def _worth(self, best: Candidate) -> tuple[int, bool]:
        """(tokens worth drafting of the chain `best`, whether it is a probe): the length with the most expected
        tokens per second under the rates of its match length (`MatchRates`) and the measured draft and verify
        costs; 0 where a plain step is faster. A match length judged not to pay drafts again as a probe, within
        Arctic's allowance, after `probe_interval` rounds, the interval doubling while it keeps losing (its
        estimate is stale). All of it (within the allowance) with a fixed length (`adaptive` off) and while the
        costs are unmeasured."""
        length, size = self.length, best.first
        if not length.adaptive or not (length.verify.known and length.draft.known):
            return min(size, best.allowance), False
        rates = self._rates.rates(best.match, size)
        n = best_length(rates, length.draft, length.verify_seconds, size, minimum=0)
        if self._probes[MatchRates.bucket(best.match)].decide(n > 0, self._round):
            return (n, False) if n else (min(size, best.allowance), True)
        return 0, False

    def _best(self, context: Sequence[int], k: int, max_tokens: int) -> Candidate | None:
        """The highest-scoring candidate over both tries and every matched pattern length, each `max_spec_factor x m`
        deep (Arctic's rule); with measured costs (adaptive), the chosen chain then goes on up to the round cap `k`
        for `_worth` to cut (see the module's docstring)."""
        c = self.config
        if self.tree is None:
            budget, topk, depth_cap = k, 1, k
        else:
            budget, topk, depth_cap = min(self.tree.budget, max_tokens), self.tree.topk, min(k, self.tree.depth)
        best: Candidate | None = None
        source = None
        sources = [(self._local, None)]
        if self.store.enabled:
            sources.append((self.store.trie, self.store.locked()))
        for trie, lock in sources:
            with lock if lock is not None else nullcontext():
                for m, node in matches(trie, context):
                    depth = min(depth_cap, int(c.max_spec_factor * m))
                    if depth < 1 or (best is not None and best.score >= (depth if topk == 1 else budget)):
                        continue  # cannot beat the best (a score is at most its node count)
                    nodes = depth if topk == 1 else budget  # a chain: its depth
                    candidate = self._speculate(trie, context, node, m, depth, nodes, topk)
                    if best is None or candidate.score > best.score:
                        best, source = replace(candidate, match=m, allowance=depth), (trie, lock, node)
        length = self.length
        extend = self.tree is None and length.adaptive and length.verify.known and length.draft.known
        if best is not None and extend and best.first == best.allowance < depth_cap:
            trie, lock, node = source
            with lock if lock is not None else nullcontext():
                longer = self._speculate(trie, context, node, best.match, depth_cap, depth_cap, 1)
            best = replace(longer, match=best.match, allowance=best.allowance)
        return best

    def _speculate(self, trie: SuffixTrie, context: Sequence[int], node: int, m: int, depth: int, nodes: int,
                   topk: int) -> Candidate:
        """`speculate` below the m-token pattern's `node`; a chain the trie's depth cut short goes on (`_continue`)."""
        candidate = speculate(trie, node, depth, self.config.min_token_prob, nodes, topk)
        if topk == 1 and len(candidate.tokens) < depth and m + len(candidate.tokens) == trie.depth:
            candidate = self._continue(trie, context, candidate, depth)
        return candidate

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput | None = None,
                step: StepStats | None = None) -> None:
        if draft.parents is None:
            self.length.observe(step)
        else:  # the cap rule follows the most probable path
            self.length.observe(replace(step, num_draft_tokens=self._first,
                                        num_accepted=min(verdict.num_accepted, self._first)))
        if self._last is not None and (draft.tokens is self._last[3] or self._last[0] == draft.tokens.tolist()):
            _, match, probe, _ = self._last  # this round's draft, not an older one (auto's shadows); the same tensor
            # as drafted (no read back) unless a caller copied it
            drafted = self._first
            self._rates.observe(match, drafted, min(verdict.num_accepted, drafted), PROBE_WEIGHT if probe else 1.0)
            self._last = None


def build(target, draft: None, num_draft_tokens: int | None, adaptive: bool, tree_budget: int | str = 0,
          tree_topk: int = 4, tree_depth: int = 8, backoff: bool | None = None, max_tree_depth: int = 24,
          max_spec_factor: float = 1.0, min_token_prob: float = 0.1, max_cached_requests: int = 10000,
          max_cached_tokens: int = 100_000) -> SuffixDrafter:
    """Registry builder for "suffix"; `tree_budget` > 0 drafts trees ("auto": sized from the target's measured
    verify cost curve). num_draft_tokens None: max_tree_depth, as vLLM (the adaptive length drafts less where
    that does not pay)."""
    config = SuffixConfig(max_tree_depth, max_spec_factor, min_token_prob, max_cached_requests, max_cached_tokens)
    num_draft_tokens = max_tree_depth if num_draft_tokens is None else num_draft_tokens
    tree = resolve_shape(tree_budget, tree_topk, tree_depth, runner_for(target.model))
    return SuffixDrafter(num_draft_tokens, adaptive=adaptive, config=config, tree=tree, backoff=backoff)

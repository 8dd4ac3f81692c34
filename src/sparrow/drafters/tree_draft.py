"""Draft trees: EAGLE-2's dynamic tree over any draft model, and the tree's shape options.

EAGLE-2 (Li et al. 2024, `topK_genrate`): the draft's confidence is well calibrated, so the product of
draft probabilities along a path approximates the chance the target accepts the whole path.
1. Top-k children of the root (the last committed token) are the first frontier.
2. Expansion, at most `depth` levels: the frontier (k nodes) runs through the draft in ONE forward with
   a tree mask (each node sees the committed prefix and its own ancestors, at position = depth); every
   frontier node gets its top-k children, scored by cumulative log-probability; the best k of the k^2
   children are the next frontier. All children join the candidate pool.
3. Reranking: the `budget` best candidates by cumulative score form the tree the target verifies (fewer
   where the engine allows fewer draft tokens: near max_new_tokens).
   Scores never increase from parent to child, and ties go to the earlier (parent-first) node, so the
   best `budget` nodes are always a tree.
Expansion stops early when no frontier node can beat the budget-th best candidate any more: its
children would not be kept (a CPU saving: fewer draft forwards).

The children are chosen deterministically (top-k), so the rejection verifier applies the q = 1 rule
to them (`Draft.probs is None`) at any temperature; the scores use the same temperature / top-k /
top-p as the target when sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.errors import UserError
from sparrow.policy.measure import measure_cost_curve
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Draft


@dataclass(frozen=True)
class TreeShape:
    """How big a draft tree may grow. budget: nodes the target verifies per round; topk: children per
    expanded node (and the frontier's width); depth: the longest path."""

    budget: int
    topk: int = 4
    depth: int = 8

    def __post_init__(self) -> None:
        for name in ("budget", "topk", "depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"tree_{name} must be an integer >= 1, got {value!r}")


def _log_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """[..., vocab] draft log-probabilities used to rank children (the raw softmax when greedy)."""
    if sampling.greedy:
        return logits.float().log_softmax(-1)
    return S.probs(logits, sampling).log()


def dynamic_tree(draft, committed: Tensor, shape: TreeShape, max_tokens: int, sampling: SamplingConfig,
                 min_prob: float = 0.0) -> tuple[Draft, int]:
    """An EAGLE-2 tree continuing `committed` ([c] int64), drafted by `draft` (a CachedModel-like object whose
    cache holds a proper prefix of `committed`). Leaves the draft cache holding all of `committed`.
    Returns (a Draft with parents, at most min(`shape.budget`, `max_tokens`) nodes, so no deeper than
    `max_tokens` either (the engine's budget: tokens left before max_new_tokens); the number of
    draft forwards run). Expansion also stops once the best frontier path's draft probability is below
    `min_prob` (another level would cost a draft forward for too little expected gain; see policy.TreePolicy).
    """
    c = committed.numel()
    assert draft.length < c, (draft.length, c)
    budget, depth_cap = min(shape.budget, max_tokens), min(shape.depth, max_tokens)
    logp = _log_probs(draft.forward(committed[draft.length:]).logits[-1], sampling)  # [vocab]
    tokens: list[Tensor] = []  # per level: [m] candidate tokens
    scores: list[Tensor] = []  # per level: [m] cumulative log-probs
    parents: list[Tensor] = []  # per level: [m] global index of the parent (-1 = root)
    top = logp.topk(min(shape.topk, logp.numel()))
    tokens.append(top.indices)
    scores.append(top.values)
    parents.append(torch.full_like(top.indices, -1))
    frontier = torch.arange(top.indices.numel(), device=logp.device)  # global indices of the frontier
    fed: list[int] = []  # global node index of each draft-cache slot after the committed prefix
    ancestors: dict[int, list[int]] = {}  # global node -> its ancestors' global indices (root excluded)
    all_parents = parents[0].tolist()
    forwards = 1
    for level in range(1, depth_cap):
        flat_scores = torch.cat(scores)
        if min_prob > 0 and float(flat_scores[frontier].max()) < math.log(min_prob):
            break
        if flat_scores.numel() >= budget:  # can any frontier child still make the cut?
            cut = flat_scores.topk(budget).values[-1]
            frontier = frontier[flat_scores[frontier] > cut]
        frontier = frontier[torch.isfinite(flat_scores[frontier])]
        if frontier.numel() == 0:
            break
        flat_tokens = torch.cat(tokens)
        nodes = frontier.tolist()
        for node in nodes:
            parent = all_parents[node]
            ancestors[node] = [*ancestors[parent], parent] if parent >= 0 else []
        # One draft forward over the frontier: each node sees the prefix, its fed ancestors and itself.
        slot = {node: i for i, node in enumerate(fed)}
        n = len(nodes)
        mask = torch.zeros(n, draft.length + n, dtype=torch.bool, device=logp.device)
        mask[:, :c] = True
        for row, node in enumerate(nodes):
            for a in ancestors[node]:
                mask[row, c + slot[a]] = True
            mask[row, draft.length + row] = True
        positions = torch.full((n,), c - 1 + level, device=logp.device)
        logits = draft.forward(flat_tokens[frontier], positions, mask).logits  # [n, vocab]
        forwards += 1
        fed.extend(nodes)
        child = _log_probs(logits, sampling).topk(min(shape.topk, logits.shape[-1]))  # [n, topk]
        child_scores = (flat_scores[frontier][:, None] + child.values).flatten()
        offset = flat_scores.numel()
        tokens.append(child.indices.flatten())
        scores.append(child_scores)
        level_parents = frontier[:, None].expand_as(child.indices).flatten()
        parents.append(level_parents)
        all_parents.extend(level_parents.tolist())
        best = child_scores.topk(min(shape.topk, child_scores.numel())).indices
        frontier = best + offset
    draft.rewind(c)  # drop the expanded frontier nodes; keep the committed tokens
    flat_scores, flat_tokens, flat_parents = torch.cat(scores), torch.cat(tokens), torch.cat(parents)
    finite = torch.isfinite(flat_scores).nonzero().flatten()
    order = torch.sort(-flat_scores[finite], stable=True).indices  # best first; ties: parent first
    keep = finite[order[:budget]].sort().values  # creation order: parents before children
    remap = torch.full((flat_scores.numel() + 1,), -1, dtype=torch.long, device=keep.device)
    remap[keep + 1] = torch.arange(keep.numel(), device=keep.device)  # global index + 1 -> kept index
    kept_parents = flat_parents[keep]
    assert bool(((kept_parents == -1) | torch.isin(kept_parents, keep)).all()), "kept nodes are not a tree"
    new_parents = remap[kept_parents + 1]
    return Draft(tokens=flat_tokens[keep], parents=new_parents), forwards


MAX_AUTO_BUDGET = 32
AUTO_SLACK = 1.25
"""`budget="auto"`: the most nodes whose verify forward costs at most AUTO_SLACK x the verify forward of the
chain it replaces (depth + 1 tokens), on this device's measured cost curve. Where verification is nearly
free up to dozens of tokens (GPUs, CPUs with bf16 matrix units) that is a wide tree; where every verified
token costs (CPUs without them) it shrinks toward the chain."""


def auto_shape(verify_seconds: tuple[float, ...], topk: int, depth: int) -> TreeShape:
    """The `budget="auto"` shape on a measured curve (verify_seconds[n - 1]: one target forward of n tokens)."""
    chain = verify_seconds[min(depth, len(verify_seconds) - 1)]  # depth + 1 tokens: the chain it replaces
    fits = [n for n in range(1, len(verify_seconds)) if verify_seconds[n] <= AUTO_SLACK * chain]  # n nodes + root
    return TreeShape(max([topk, *fits]), topk, depth)


def resolve_shape(
    budget: int | str | None, topk: int, depth: int, target: CachedModel | None = None
) -> TreeShape | None:
    """TreeShape from user options; None (a chain) for budget 0/None; "auto" measures `target`'s verify cost
    curve (n = 1 .. MAX_AUTO_BUDGET + 1 tokens) once."""
    if budget in (None, 0):
        return None
    TreeShape(1, topk, depth)  # validates topk and depth before anything is measured
    if budget == "auto":
        if target is None:
            raise UserError("tree_budget='auto' needs a target to measure its verify cost curve")
        return auto_shape(measure_cost_curve(target, MAX_AUTO_BUDGET).verify_seconds, topk, depth)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise UserError(f"tree_budget must be an integer >= 0 or 'auto', got {budget!r}")
    return TreeShape(budget, topk, depth)

"""Greedy verification: accept draft tokens while they equal the target's argmax (chains and trees).

Chain: accept the longest prefix of the draft that equals the target's argmax at each row.
Tree: node i matches when tokens[i] is the target's argmax at its parent's row (row parents[i] + 1);
a node is accepted when it and all its ancestors match; the accepted path is the root-to-leaf path of
the deepest accepted node (ties: the lowest index). Either way the verdict ends with the target's
argmax after the accepted path: the correction (a mismatch) or the bonus (the path reached a leaf).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow import tree
from sparrow.config import SamplingConfig
from sparrow.sampling import greedy
from sparrow.types import Draft, Verdict


class GreedyVerifier:
    name = "greedy"

    def verify(
        self,
        draft: Draft,
        target_logits: Tensor,  # [n + 1, vocab]: row 0 scores the root, row i + 1 scores node i
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Verdict:
        n = len(draft)
        assert target_logits.ndim == 2 and target_logits.shape[0] == n + 1, (tuple(target_logits.shape), n)
        choice = greedy(target_logits)  # [n + 1]: the target's token after each row
        if draft.parents is None:
            return verify_chain(draft.tokens.to(choice.device), choice)
        return verify_tree(draft.tokens.to(choice.device), draft.parents.to(choice.device), choice)


def verify_chain(tokens: Tensor, choice: Tensor) -> Verdict:
    """tokens: [k] draft chain; choice: [k + 1] target argmax per row."""
    k = tokens.numel()
    host = torch.cat([tokens.to(choice.device), choice]).tolist()  # the round's one device-to-host copy
    drafted, chosen = host[:k], host[k:]
    num_accepted = next((i for i, (a, b) in enumerate(zip(drafted, chosen)) if a != b), k)
    # The accepted drafts equal the target's choices, so the verdict is the target's own prefix:
    # accepted drafts, then the correction (first mismatch) or the bonus (all accepted).
    return Verdict(tokens=choice[: num_accepted + 1].clone(), num_accepted=num_accepted,
                   ids=tuple(chosen[: num_accepted + 1]))


def verify_tree(tokens: Tensor, parents: Tensor, choice: Tensor) -> Verdict:
    """tokens, parents: [n] draft tree; choice: [n + 1] target argmax per row."""
    match = tokens == choice[parents + 1]  # [n]: node i equals the target's choice after its parent
    ancestry = tree.ancestor_mask(parents)  # [n, n]: node i and its ancestors
    accepted = (~ancestry | match[None, :]).all(-1)  # [n]: the whole root-to-node path matches
    depth = torch.where(accepted, ancestry.sum(-1), 0)  # [n]: 0 for rejected nodes
    if tokens.numel() == 0:
        path = tokens.new_empty(0)
    else:  # the deepest accepted node (argmax: the first, i.e. lowest-index, maximum); empty if none is accepted
        best = depth.argmax()
        # [depth]: ancestors have smaller indices than their descendants, so index order runs root to leaf.
        path = (ancestry[best] & accepted[best]).nonzero()[:, 0]
    # Each path token is the target's choice at the row before it; the last row gives the bonus/correction.
    rows = torch.cat([path.new_zeros(1), path + 1])  # [depth + 1]
    return Verdict(tokens=choice[rows], num_accepted=path.numel(), path=path)

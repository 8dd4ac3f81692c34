"""Draft trees: parent pointers -> depths, ancestor masks, positions, paths (pure tensor helpers).

A tree of n draft nodes hangs under a root, the last committed token. Nodes are in topological
order: `parents[i]` is -1 (the root) or an earlier node. One scoring forward runs the n + 1 rows
[root, *nodes] after `start` cached positions; row 0 is the root, row i + 1 is node i.

    parents  = [-1, -1, 0, 0, 2]        root -> {0, 1}; 0 -> {2, 3}; 2 -> {4}
    depth    = [ 1,  1, 2, 2, 3]        node i sits at position start + depth[i]
    ancestry = node i sees itself and its ancestors (row i of `ancestor_mask`)

The attention mask of the scoring forward lets every row see the whole cached prefix, the root,
and its own ancestors; positions are `start + depth`, so each root-to-leaf path is scored exactly
as if it had been fed as a chain (EAGLE's tree mask and `tree_position_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def chain_parents(n: int, device: torch.device | str | None = None) -> Tensor:
    """[n] parents of a chain: -1, 0, 1, ..., n - 2."""
    return torch.arange(-1, n - 1, device=device)


def ancestor_mask(parents: Tensor) -> Tensor:
    """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    for i, parent in enumerate(parents.tolist()):  # topological order: a parent's row is complete before
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def depths(parents: Tensor) -> Tensor:
    """[n] int64 depth of each node (1 for the root's children)."""
    return ancestor_mask(parents).sum(-1)


def path_to(node: int, parents: Tensor) -> Tensor:
    """[depth(node)] node indices from the root's child down to `node` (empty for node -1)."""
    path, parents_list = [], parents.tolist()
    while node >= 0:
        path.append(node)
        node = parents_list[node]
    return torch.tensor(path[::-1], dtype=torch.long, device=parents.device)


def children(parents: Tensor) -> list[list[int]]:
    """[n + 1] lists of child node indices, in order; entry 0 is the root's, entry i + 1 is node i's."""
    kids: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for i, parent in enumerate(parents.tolist()):
        kids[parent + 1].append(i)
    return kids


def on_first_branch(parents: Tensor, path: Tensor) -> bool:
    """Whether every node of `path` (root to leaf) is its parent's first child (the lowest index among siblings)."""
    first: dict[int, int] = {}
    for i, parent in enumerate(parents.tolist()):
        first.setdefault(parent, i)
    parent = -1
    for node in path.tolist():
        if first[parent] != node:
            return False
        parent = node
    return True


@dataclass(frozen=True)
class TreeLayout:
    """Positions and attention mask of one scoring forward over [root, *nodes] after `start` cached positions."""

    positions: Tensor  # [n + 1] int64 cache-index positions: start + depth (root: start)
    mask: Tensor  # [n + 1, start + n + 1] bool: True = may attend

    @staticmethod
    def of(parents: Tensor, start: int) -> TreeLayout:
        n = parents.numel()
        device = parents.device
        rows = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
        rows[:, 0] = True  # everyone sees the root
        rows[1:, 1:] = ancestor_mask(parents)
        mask = torch.cat([torch.ones(n + 1, start, dtype=torch.bool, device=device), rows], dim=1)
        positions = torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths(parents)]) + start
        return TreeLayout(positions, mask)


def merge_paths(paths: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Merge token sequences into one trie: (tokens [n], parents [n]), first-seen order among siblings.

    Example: [[5, 6, 7], [5, 8], [9]] -> tokens [5, 6, 7, 8, 9], parents [-1, 0, 1, 0, -1].
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for seq in paths:
        node = -1
        for token in seq:
            key = (node, int(token))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(token))
                parents.append(node)
            node = index[key]
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)

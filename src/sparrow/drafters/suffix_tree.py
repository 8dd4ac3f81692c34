"""Counted suffix tries for Suffix Decoding: which continuations followed a pattern, and how often.

A `SuffixTrie` holds every suffix, cut to `depth` tokens, of every position of a few token sequences: the
node for pattern P counts the positions where P occurred, and its children are the tokens that followed.
Sequences grow one token at a time (a request's output) and can be removed again (eviction):

    trie = SuffixTrie(depth=4)
    trie.extend(0, [1, 2, 3, 1, 2])   # sequence 0
    node = trie.find([1, 2])           # trie.count[node] == 2; one child, token 3, count 1

Appending a token touches the `depth` nodes of the suffixes that end there (O(depth) dictionary operations);
removing a sequence replays its tokens and decrements. Uncompressed (one node per distinct pattern), so the
node count is at most tokens x depth (~160 bytes a node); `SuffixStore` bounds it by evicting the oldest
sequences.

Arctic Inference keeps a path-compressed suffix tree in C++ (nodes reference spans of a stored sequence);
this is its simple Python counterpart, measured small against a target forward (docs/results/suffix.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sparrow.errors import UserError

ROOT = 0
_SHIFT = 32  # a child's key: (parent << _SHIFT) | token (token ids < 2**32)


class SuffixTrie:
    """The depth-cut suffixes of a set of growing sequences, with occurrence counts (see the module doc).

    Nodes are ints (ROOT = 0) in flat int lists, and the edges one dict of int keys: no Python object per node,
    so the cyclic garbage collector has nothing to walk (one object per node made appends ~15x slower: GC passes
    over hundreds of thousands of tracked nodes)."""

    def __init__(self, depth: int) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise UserError(f"suffix tree depth must be an integer >= 1, got {depth!r}")
        self.depth = depth
        self._edge: dict[int, int] = {}  # (parent << _SHIFT) | token -> child
        self.count = [0]  # node -> positions the pattern occurred at
        self.token = [-1]  # node -> its last token
        self._parent = [-1]
        self._first = [-1]  # node -> its newest child (-1: none); children chain through _sibling
        self._sibling = [-1]
        self._free: list[int] = []  # node ids to reuse
        self._tokens: dict[int, list[int]] = {}  # sequence id -> its tokens
        self._open: dict[int, list[int]] = {}  # sequence id -> nodes of its suffixes of length 0 .. depth - 1

    @property
    def nodes(self) -> int:
        """Nodes below the root: the memory in use."""
        return len(self.count) - 1 - len(self._free)

    def __contains__(self, seq: int) -> bool:
        return seq in self._tokens

    def tokens(self) -> int:
        """Tokens of all sequences held."""
        return sum(map(len, self._tokens.values()))

    def length(self, seq: int) -> int:
        return len(self._tokens.get(seq, ()))

    def children(self, node: int) -> list[int]:
        """The child nodes of `node`."""
        kids, child = [], self._first[node]
        while child >= 0:
            kids.append(child)
            child = self._sibling[child]
        return kids

    def has_children(self, node: int) -> bool:
        return self._first[node] >= 0

    def _new_child(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self.count[node], self.token[node], self._parent[node] = 0, token, parent
            self._first[node], self._sibling[node] = -1, self._first[parent]
        else:
            node = len(self.count)
            self.count.append(0)
            self.token.append(token)
            self._parent.append(parent)
            self._first.append(-1)
            self._sibling.append(self._first[parent])
        self._first[parent] = node
        self._edge[(parent << _SHIFT) | token] = node
        return node

    def _drop(self, node: int) -> None:
        """Unlink a node whose count reached 0 (its children, all at 0, are dropped on their own turn)."""
        parent = self._parent[node]
        del self._edge[(parent << _SHIFT) | self.token[node]]
        if self._first[parent] == node:
            self._first[parent] = self._sibling[node]
        else:
            prev = self._first[parent]
            while self._sibling[prev] != node:
                prev = self._sibling[prev]
            self._sibling[prev] = self._sibling[node]
        self._free.append(node)

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `seq` (a new one if unknown): count the suffixes ending at each."""
        stored = self._tokens.setdefault(seq, [])
        frontier = self._open.setdefault(seq, [ROOT])
        edge, count = self._edge, self.count
        for token in tokens:
            token = int(token)
            if not 0 <= token < 1 << _SHIFT:
                raise UserError(f"suffix tree token ids must lie in [0, 2**32), got {token}")
            stored.append(token)
            grown = [ROOT]
            for node in frontier:
                child = edge.get((node << _SHIFT) | token)
                if child is None:
                    child = self._new_child(node, token)
                count[child] += 1
                grown.append(child)
            frontier = grown[: self.depth]
        self._open[seq] = frontier

    def remove(self, seq: int) -> None:
        """Forget sequence `seq`: replay its suffixes, decrementing; patterns no longer seen are dropped."""
        stored = self._tokens.pop(seq, None)
        self._open.pop(seq, None)
        if stored is None:
            return
        frontier = [ROOT]
        for token in stored:
            grown = [ROOT]
            for node in frontier:
                child = self._edge[(node << _SHIFT) | token]
                self.count[child] -= 1
                if self.count[child] == 0:  # its whole subtree is at 0 too (counts never grow downwards)
                    self._drop(child)
                grown.append(child)
            frontier = grown[: self.depth]

    def find(self, pattern: Sequence[int]) -> int | None:
        """The node of `pattern` (at most `depth` tokens), or None if it never occurred."""
        node = ROOT
        for token in pattern:
            node = self._edge.get((node << _SHIFT) | token)
            if node is None:
                return None
        return node


@dataclass(frozen=True)
class StoreLimits:
    """How much a `SuffixStore` may hold; the oldest sequences go first when either is exceeded."""

    max_sequences: int = 10000  # vLLM's suffix_decoding_max_cached_requests
    max_tokens: int = 100_000  # tokens over all sequences; nodes <= max_tokens x depth

    def __post_init__(self) -> None:
        for name in ("max_sequences", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"suffix {name} must be an integer >= 0, got {value!r}")


class SuffixStore:
    """The process-wide trie over earlier outputs, shared by every fork of one drafter (the requests of one
    server model; `SuffixDrafter.shared`). Thread-safe. Bounded by `StoreLimits`: beyond
    them the oldest sequences (FIFO by start) are evicted; a sequence alone over `max_tokens` stops growing."""

    def __init__(self, depth: int, limits: StoreLimits = StoreLimits()) -> None:
        self.trie = SuffixTrie(depth)
        self.limits = limits
        self._order: OrderedDict[int, None] = OrderedDict()  # sequence ids, oldest first
        self._next = 0
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.limits.max_sequences > 0 and self.limits.max_tokens > 0

    def start(self) -> int:
        """A new sequence's id (evicting the oldest if the store is full of sequences)."""
        with self._lock:
            seq, self._next = self._next, self._next + 1
            if not self.enabled:
                return seq
            self._order[seq] = None
            while len(self._order) > self.limits.max_sequences:
                self._evict_oldest()
            return seq

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append to sequence `seq` (nothing if it was evicted): evicts older sequences to stay in bounds."""
        with self._lock:
            if seq not in self._order:
                return
            while self._tokens + len(tokens) > self.limits.max_tokens and next(iter(self._order)) != seq:
                self._evict_oldest()
            room = self.limits.max_tokens - self._tokens
            tokens = tokens[: max(room, 0)]
            if tokens:
                self.trie.extend(seq, tokens)
                self._tokens += len(tokens)

    def clear(self) -> None:
        """Forget every sequence (their ids are not reused)."""
        with self._lock:
            self.trie = SuffixTrie(self.trie.depth)
            self._order.clear()
            self._tokens = 0

    def locked(self) -> threading.Lock:
        """Hold while reading `trie` (other threads may be feeding it)."""
        return self._lock

    def sequences(self) -> int:
        return len(self._order)

    def tokens(self) -> int:
        return self._tokens

    def _evict_oldest(self) -> None:
        seq, _ = self._order.popitem(last=False)
        self._tokens -= self.trie.length(seq)
        self.trie.remove(seq)


def matches(trie: SuffixTrie, context: Sequence[int], min_length: int = 1) -> list[tuple[int, int]]:
    """(m, node) for each suffix of `context` of length m (min_length <= m < depth) whose node has children,
    longest first."""
    found = []
    longest = min(len(context), trie.depth - 1)
    for m in range(longest, min_length - 1, -1):
        node = trie.find(context[len(context) - m:])
        if node is not None and trie.has_children(node):
            found.append((m, node))
    return found

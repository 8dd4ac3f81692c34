"""Prefix caching (vLLM's automatic prefix caching, SGLang's radix cache, llama.cpp's `cache_prompt`): the KV caches
of earlier sequences, kept so that a prompt that begins like one of them prefills only the rest.

An agent's requests repeat their beginnings (the system prompt, the tool schema, the file under edit, the turns so
far), and a prefill is as slow as a dozen decode steps on a CPU: with the prefix cache, a request pays for the
tokens after the longest prefix it shares with a kept sequence. `CachedModel.prefill` parks its old cache here and
takes the best match; entries are whole `DynamicCache`s (a prompt that extends an entry takes it over; one that
shares part of it gets a copy of that part), least recently used evicted first, at most `max_tokens` positions
over all entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from os.path import commonprefix

from transformers import DynamicCache

from sparrow.errors import UserError

MIN_REUSE = 16
"""Fewer shared tokens than this are prefilled again (a chat template's first tokens are not worth an entry)."""


@dataclass
class PrefixCache:
    """Kept KV caches by the token ids whose positions they hold; `max_tokens` positions in all (LRU)."""

    max_tokens: int
    entries: OrderedDict[tuple[int, ...], DynamicCache] = field(default_factory=OrderedDict)  # oldest first

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UserError(f"prefix_cache must be a positive number of tokens, got {self.max_tokens!r}")

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.entries)

    def park(self, ids: list[int], cache: DynamicCache) -> None:
        """Keep `cache`, which holds the KV of `ids` (positions 0..len(ids) - 1, nothing beyond), as the newest
        entry; the least recently used go while the entries hold more than `max_tokens` positions."""
        if len(ids) < MIN_REUSE or len(ids) > self.max_tokens:
            return
        key = tuple(ids)
        self.entries.pop(key, None)
        self.entries[key] = cache
        while self.tokens > self.max_tokens:
            self.entries.popitem(last=False)

    def shared(self, ids: list[int]) -> int:
        """The positions `take(ids)` would reuse (0: none)."""
        return self._best(ids)[1]

    def _best(self, ids: list[int]) -> tuple[tuple[int, ...] | None, int]:
        """(the entry sharing the longest prefix with `ids`, the positions a prefill of `ids` reuses from it: at
        most len(ids) - 1), or (None, 0) below MIN_REUSE."""
        best, shared, ids = None, 0, tuple(ids)
        for key in self.entries:
            n = len(commonprefix([key, ids]))
            if n > shared:
                best, shared = key, n
        shared = min(shared, len(ids) - 1)
        return (best, shared) if best is not None and shared >= MIN_REUSE else (None, 0)

    def take(self, ids: list[int], empty: Callable[[], DynamicCache]) -> tuple[DynamicCache, int] | None:
        """(a cache holding the first n positions of the entry that shares the longest prefix with `ids`, n); n <=
        len(ids) - 1, since the last prompt row's logits must be computed; None below MIN_REUSE. An entry that
        `ids` extends whole leaves the cache and is returned (the new sequence supersedes it); of a longer one, the
        shared positions are copied into `empty()` and the entry stays for the requests that share more of it."""
        best, shared = self._best(ids)
        if best is None:
            return None
        if shared == len(best):
            return self.entries.pop(best), shared
        self.entries.move_to_end(best)
        source, cache = self.entries[best], empty()
        for index, layer in enumerate(source.layers):
            cache.update(layer.keys[..., :shared, :], layer.values[..., :shared, :], index)  # copies (a cat)
        return cache, shared

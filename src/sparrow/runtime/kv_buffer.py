"""A KV cache layer that appends in place: transformers' DynamicLayer with its keys and values kept in a buffer that
grows ahead of them.

transformers' `DynamicLayer.update` appends a step's keys with `torch.cat`: every forward copies the layer's whole
cache into a fresh allocation (a new mapping of zeroed pages once it passes the allocator's threshold), so a decoding
step costs O(context) in copies on top of attention. On the 1.5B preset (Intel Xeon family 6 model 207, 2 threads;
the GGUF matmuls taken out to see the rest: `benchmarks/gguf_step.py --variants eager,dynamic --skip-matmuls`) a
one-token step spent 13.4 / 17.3 / 47.8 ms outside its matmuls at 100 / 1,000 / 3,000 cached tokens, and 13.0 /
13.2 / 31.3 ms with this layer.

`BufferedLayer` writes a forward's keys and values into slots length .. length + n - 1 of a buffer
[b, kv_heads, capacity, d] and hands attention the view of slots :length + n; when they do not fit, the buffer is
replaced by one with `headroom(length)` slots to spare (at least `HEADROOM`, an eighth of the length beyond that:
at most 12.5 % more memory than the keys, and each key is copied about eight times over a long generation instead
of once a step). `crop` (a rewind) only moves the length: the slots after it are overwritten by the next forward.

It stays a DynamicLayer to everything else: `keys` / `values` are its views (shape [b, kv_heads, length, d]), so
code that writes into them (`CachedModel.keep` compacting a tree's kept nodes) writes the buffer, and code that
assigns them new tensors (a draft KV policy evicting entries, offloading) is followed: the next call adopts the
assigned tensors as the buffer. The values attention reads are the same numbers in the same order, so a model's
outputs are bit for bit those of transformers' layer (tests/runtime/test_kv_buffer.py).
"""

from __future__ import annotations

from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

HEADROOM = 256
"""Slots a new or grown buffer leaves after the keys it holds, at the least."""


def headroom(length: int) -> int:
    """Spare slots a buffer grown to hold `length` keys gets: an eighth of them, at least HEADROOM."""
    return max(HEADROOM, length // 8)


class BufferedLayer(DynamicLayer):
    """A full-attention cache layer whose keys / values [b, kv_heads, length, d] are views of a growing buffer."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.length = 0
        self._buffers: tuple[Tensor, Tensor] | None = None  # [b, kv_heads, capacity, d] each
        self._views: tuple[Tensor | None, Tensor | None] = (None, None)  # what `keys` / `values` were last set to

    @property
    def capacity(self) -> int:
        return 0 if self._buffers is None else self._buffers[0].shape[-2]

    def _sync(self) -> None:
        """Adopt keys / values that code outside assigned (they are then the buffer, full)."""
        if self.keys is self._views[0] and self.values is self._views[1]:
            return
        if self.keys is None or self.keys.numel() == 0:
            self._buffers, self.length = None, 0
        else:
            self._buffers, self.length = (self.keys, self.values), self.keys.shape[-2]
        self._views = (self.keys, self.values)

    def _expose(self) -> None:
        keys, values = self._buffers
        self.keys, self.values = keys[..., : self.length, :], values[..., : self.length, :]
        self._views = (self.keys, self.values)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """key_states / value_states [b, kv_heads, n, d] -> keys, values [b, kv_heads, length + n, d] (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._sync()
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            size = end + headroom(end)
            grown = tuple(new.new_empty(*new.shape[:-2], size, new.shape[-1]) for new in (key_states, value_states))
            if start:
                for old, buffer in zip(self._buffers, grown):
                    buffer[..., :start, :] = old[..., :start, :]
            self._buffers = grown
        self._buffers[0][..., start:end, :] = key_states
        self._buffers[1][..., start:end, :] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        self._sync()
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions (transformers >= 5's convention; 0 or an empty layer: nothing)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of positions to drop, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._sync()
        if self._buffers is None:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._expose()

    def reset(self) -> None:
        self._buffers, self._views, self.length = None, (None, None), 0
        super().reset()


def buffered(cache: DynamicCache) -> DynamicCache:
    """`cache` with its (empty) plain full-attention layers replaced by BufferedLayers; sliding-window and other
    layers stay transformers' own."""
    cache.layers = [BufferedLayer() if type(layer) is DynamicLayer and not layer.is_initialized else layer
                    for layer in cache.layers]
    return cache


__all__ = ["HEADROOM", "BufferedLayer", "buffered", "headroom"]

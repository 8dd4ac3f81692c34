"""BufferedLayer (sparrow.runtime.kv_buffer): a cache layer that appends in place gives transformers' DynamicLayer's
numbers bit for bit, through prefills, steps, verify forwards, rewinds, tree compaction and buffer growth."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from sparrow.runtime import kv_buffer
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.kv_buffer import BufferedLayer, buffered, headroom
from sparrow.types import Prompt
from tests.conftest import tiny_gemma3


def plain_cache(runner: CachedModel) -> None:
    """Make `runner` use transformers' own DynamicCache (the reference)."""
    def empty() -> DynamicCache:
        cache = DynamicCache(config=runner.model.config)
        cache.activate_past_recording()
        return cache
    runner._empty = empty


def test_cached_model_uses_buffered_full_attention_layers(target_model):
    runner = CachedModel(target_model)
    runner.prefill(Prompt(torch.arange(5, 15)))
    assert all(type(layer) is BufferedLayer for layer in runner.cache.layers)
    assert runner.length == 10 and runner.cache.layers[0].keys.shape[-2] == 10


def test_sliding_window_layers_stay_transformers_own():
    cache = buffered(DynamicCache(config=tiny_gemma3().config))
    kinds = {type(layer) for layer in cache.layers}
    assert kinds == {BufferedLayer, DynamicSlidingWindowLayer}


@pytest.mark.parametrize("room", [1, 3, 256])
def test_same_logits_and_keys_as_dynamic_layer(target_model, monkeypatch, room):
    """Steps of 1-5 tokens, rewinds and a tree's keep, with buffers that overflow often (room 1, 3) or never:
    the logits and every cached key and value are bit for bit transformers' layer's."""
    monkeypatch.setattr(kv_buffer, "HEADROOM", room)
    ours, theirs = CachedModel(target_model), CachedModel(target_model)
    plain_cache(theirs)
    prompt = Prompt(torch.tensor([3, 17, 42, 99, 7, 8, 150, 33]))
    assert torch.equal(ours.prefill(prompt).logits, theirs.prefill(prompt).logits)
    generator = torch.Generator().manual_seed(0)
    grown = set()
    for step in range(24):
        n = 1 + step % 5
        tokens = torch.randint(0, 300, (n,), generator=generator)
        a, b = ours.forward(tokens).logits, theirs.forward(tokens).logits
        assert torch.equal(a, b), step
        if step % 3 == 1:  # reject some of the "draft": rewind by up to n - 1
            back = ours.length - int(torch.randint(0, n, (1,), generator=generator))
            ours.rewind(back), theirs.rewind(back)
        elif step % 3 == 2 and n >= 4:  # a tree's keep: root + nodes 0 and 2 of the n - 1 scored
            start = ours.length - n
            ours.keep(start, torch.tensor([0, 2])), theirs.keep(start, torch.tensor([0, 2]))
        grown.add(ours.cache.layers[0].capacity)
        for mine, reference in zip(ours.cache.layers, theirs.cache.layers):
            assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)
        assert ours.length == theirs.length
    if room < 256:
        assert len(grown) > 2  # the buffers were replaced as they filled


def test_growth_keeps_spare_room_bounded():
    layer = BufferedLayer()
    keys = torch.randn(1, 2, 1000, 4)
    layer.update(keys, keys.clone())
    assert layer.length == 1000 and layer.capacity == 1000 + headroom(1000) == 1256
    for _ in range(300):
        layer.update(keys[..., :1, :], keys[..., :1, :])
        assert layer.length <= layer.capacity <= layer.length + headroom(layer.length)
    assert headroom(10_000) == 1250  # an eighth beyond HEADROOM: at most 12.5 % more memory than the keys


def test_rewind_keeps_the_buffer_and_the_next_forward_overwrites():
    layer = BufferedLayer()
    first = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(1, 2, 6, 3)
    layer.update(first, -first)
    buffer = layer._buffers[0]
    layer.crop(-2)
    assert layer.get_seq_length() == 4 and layer._buffers[0] is buffer
    new = torch.full((1, 2, 1, 3), 7.0)
    keys, values = layer.update(new, -new)
    assert layer._buffers[0] is buffer and keys.shape == (1, 2, 5, 3)
    assert torch.equal(keys[..., :4, :], first[..., :4, :]) and torch.equal(keys[..., 4:, :], new)
    assert torch.equal(values, -keys)


def test_assigned_keys_are_adopted():
    """Code that assigns a layer's keys / values (a draft KV policy evicting entries) is followed."""
    layer = BufferedLayer()
    states = torch.randn(1, 2, 8, 3)
    layer.update(states, states + 1)
    keep = torch.tensor([0, 3, 5])
    layer.keys, layer.values = layer.keys[..., keep, :], layer.values[..., keep, :]
    assert layer.get_seq_length() == 3
    keys, values = layer.update(states[..., :1, :], states[..., :1, :] + 1)
    assert torch.equal(keys, torch.cat([states[..., keep, :], states[..., :1, :]], dim=-2))
    assert torch.equal(values, keys + 1)
    layer.crop(-4)
    assert layer.get_seq_length() == 0 and layer.keys.shape[-2] == 0


def test_crop_refuses_a_positive_count_as_transformers_does():
    layer = BufferedLayer()
    layer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="negative"):
        layer.crop(1)
    reference = DynamicLayer()
    reference.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError):
        reference.crop(1)


def test_reset_empties_the_layer():
    layer = BufferedLayer()
    layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.capacity == 0
    keys, _ = layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert keys.shape == (1, 1, 1, 2)

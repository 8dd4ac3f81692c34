"""sparrow.runtime.decoder: the Llama / Qwen2 forward without transformers' plumbing gives transformers' logits,
hidden states and KV cache bit for bit (steps, causal chains, tree masks, rewinds; float32 and bfloat16; exact
copies), and any model it cannot vouch for (another architecture, a subclass, hooks) keeps transformers' forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2ForCausalLM

from sparrow.runtime import batch_invariant, decoder
from sparrow.runtime.attention import decode as decode_attention
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Prompt
from tests.conftest import tiny_gemma3, tiny_model


def pair(model: torch.nn.Module) -> tuple[CachedModel, CachedModel]:
    """(a runner on the decoder's forward, one on transformers' own)."""
    fast, reference = CachedModel(model), CachedModel(model)
    reference.decoder = None
    assert fast.decoder is not None
    return fast, reference


def same(a: CachedModel, b: CachedModel, **forward) -> None:
    out_a, out_b = a.forward(**forward), b.forward(**forward)
    assert torch.equal(out_a.logits, out_b.logits)
    assert (out_a.hidden is None) == (out_b.hidden is None)
    if out_a.hidden is not None:
        assert torch.equal(out_a.hidden, out_b.hidden)
    assert a.length == b.length
    for layer_a, layer_b in zip(a.cache.layers, b.cache.layers, strict=True):
        assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(layer_a.values, layer_b.values)


def walk(model: torch.nn.Module) -> None:
    """Steps, a causal chain, hidden states, a tree with its mask and positions, a rewind, a kept branch."""
    fast, reference = pair(model)
    prompt = Prompt(torch.arange(3, 20))
    for runner in (fast, reference):
        runner.prefill(prompt)
    same(fast, reference, tokens=torch.tensor([7]))
    same(fast, reference, tokens=torch.tensor([9, 4, 11, 30]))
    same(fast, reference, tokens=torch.tensor([5]), hidden_layers=(0, 1, -1))
    same(fast, reference, tokens=torch.tensor([6, 8, 2]), hidden_layers=(2,))
    start = fast.length
    for runner in (fast, reference):
        runner.rewind(start - 2)
    start = fast.length
    # a tree: root, two children of the root, one grandchild under the second child
    tokens, parents = torch.tensor([12, 40, 41, 42]), [-1, 0, 0, 2]
    mask = torch.zeros(4, start + 4, dtype=torch.bool)
    mask[:, :start] = True
    depth = []
    for node, parent in enumerate(parents):
        mask[node, start + node] = True
        while parent >= 0:
            mask[node, start + parent] = True
            parent = parents[parent]
        depth.append(int(mask[node, start:].sum()) - 1)
    positions = start + torch.tensor(depth)
    same(fast, reference, tokens=tokens, positions=positions, mask=mask)
    for runner in (fast, reference):
        runner.keep(start, torch.tensor([1, 2]))
    same(fast, reference, tokens=torch.tensor([13, 14]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["sdpa", "sparrow_sdpa", "eager"])
def test_forward_is_transformers_own_bit_for_bit(arch, dtype, attention):
    model = copy.deepcopy(tiny_model(arch, seed=3, num_layers=3)).to(dtype)
    if attention == "sparrow_sdpa":
        decode_attention.use(model)
    else:
        model.set_attn_implementation(attention)
    assert model.config._attn_implementation == attention
    walk(model)


def test_exact_copy_takes_the_same_path_bit_for_bit(arch):
    """Row-wise attention and exact linears (switched in place after the plan too) are called as transformers
    calls them."""
    model = tiny_model(arch, seed=4, num_layers=2).to(torch.bfloat16)
    walk(batch_invariant.exact_copy(model))
    switched_later = copy.deepcopy(model)
    fast, reference = pair(switched_later)
    batch_invariant.make_exact(switched_later)
    for runner in (fast, reference):
        runner.prefill(Prompt(torch.arange(3, 12)))
    same(fast, reference, tokens=torch.tensor([7, 8, 9]))


def test_other_models_keep_transformers_forward():
    assert decoder.plan(tiny_gemma3(num_layers=2)) is None  # sliding-window layers, another architecture

    class Custom(Qwen2ForCausalLM):
        pass

    model = tiny_model("qwen2", seed=0)
    assert decoder.plan(Custom(model.config)) is None  # a subclass may compute something else
    hooked = copy.deepcopy(model)
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert decoder.plan(hooked) is None
    wrapped = copy.deepcopy(model)
    wrapped.model.layers[0].self_attn.forward = lambda *args, **kwargs: None  # a wrapper the decoder would skip
    assert decoder.plan(wrapped) is None


def test_hooks_set_later_run_through_transformers(target_model):
    """A hook set on the model after the runner was made (a counter of forwards) is called: the runner goes
    through transformers' forward while it is there, and back to the decoder's after."""
    runner = CachedModel(target_model)
    runner.prefill(Prompt(torch.arange(3, 12)))
    calls = []
    handle = target_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        runner.forward(torch.tensor([5]))
        assert calls == [1]
    finally:
        handle.remove()
    runner.forward(torch.tensor([6]))
    assert calls == [1] and not runner.decoder.hooked()


def test_a_forward_replaced_later_is_called(target_model):
    """A wrapper set on the model's forward (a test's counter of forwards) is called, as hooks are."""
    runner = CachedModel(target_model)
    runner.prefill(Prompt(torch.arange(3, 12)))
    forward, calls = target_model.forward, []

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    target_model.forward = counted
    try:
        runner.forward(torch.tensor([5, 6]))
    finally:
        del target_model.forward
    runner.forward(torch.tensor([7]))
    assert calls == [1]

"""The training choices issue #42 (item 3) measures: Muon beside AdamW (`new_optimiser(kind="muon")`) and a head
started from its target's last decoder layer (`fresh_head(init="layer")`)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sparrow.errors import UserError
from sparrow.training.heads import INITS, fresh_head
from sparrow.training.loop import MuonAdamW, new_optimiser

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request) -> torch.nn.Module:
    return tiny_model(request.param, seed=0)


def test_muon_takes_the_weight_matrices_but_the_lm_heads_and_adamw_the_rest(model):
    head = fresh_head(model, "eagle3", 0, torch.arange(200))
    optimiser = new_optimiser(head, 1e-3, frozen=("lm_head",), kind="muon")
    assert isinstance(optimiser, MuonAdamW)
    muon = {id(p) for group in optimiser.muon.param_groups for p in group["params"]}
    adamw = {id(p) for group in optimiser.adamw.param_groups for p in group["params"]}
    named = dict(head.named_parameters())
    assert muon == {id(p) for name, p in named.items() if p.ndim == 2 and not name.startswith("lm_head")}
    assert adamw == {id(p) for name, p in named.items() if p.ndim == 1}  # the norms
    assert not head.lm_head.weight.requires_grad
    trained = new_optimiser(head, 1e-3, kind="muon")  # a trained LM head goes to AdamW, not Muon
    assert id(head.lm_head.weight) in {id(p) for g in trained.adamw.param_groups for p in g["params"]}
    assert len(optimiser.param_groups) == 2
    with pytest.raises(UserError, match="optimizer must be one of adamw, muon, got 'sgd'"):
        new_optimiser(head, 1e-3, kind="sgd")


def test_a_muon_step_moves_every_trainable_weight_and_its_state_round_trips(model):
    head = fresh_head(model, "eagle3", 0, torch.arange(200))
    optimiser = new_optimiser(head, 1e-2, frozen=("lm_head",), kind="muon")
    before = {name: p.detach().clone() for name, p in head.named_parameters()}
    for group in optimiser.param_groups:  # what a schedule does
        group["lr"] = 5e-3
    x = torch.randn(5, 3 * 64)
    loss = head.draft_logits(head.fc(x)).logsumexp(-1).sum() + head.midlayer.mlp.down_proj.weight.sum()
    loss = loss + head.midlayer.hidden_norm.weight.sum()
    loss.backward()
    optimiser.step()
    moved = {name for name, p in head.named_parameters() if not torch.equal(p, before[name])}
    assert {"fc.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight", "norm.weight"} <= moved
    assert "lm_head.weight" not in moved
    again = new_optimiser(head, 1e-2, frozen=("lm_head",), kind="muon")
    again.load_state_dict(optimiser.state_dict())
    assert again.state_dict()["parts"][0]["state"].keys() == optimiser.state_dict()["parts"][0]["state"].keys()
    optimiser.zero_grad()
    assert head.fc.weight.grad is None


def test_a_head_starts_from_the_targets_last_layer_with_init_layer(model):
    head = fresh_head(model, "eagle3", 0, torch.arange(200), init="layer")
    last, d = model.model.layers[-1], 64
    mine = head.midlayer
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(mine.self_attn, name).weight[:, d:], getattr(last.self_attn, name).weight)
    assert torch.equal(mine.self_attn.o_proj.weight, last.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(mine.mlp, name).weight, getattr(last.mlp, name).weight)
    assert torch.equal(mine.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(head.fc.weight[:, -d:], torch.eye(d))  # the highest fused layer passes through
    assert torch.equal(head.lm_head.weight, model.lm_head.weight[:200])  # and what init="lm_head" does
    plain = fresh_head(model, "eagle3", 0, torch.arange(200))
    assert torch.equal(plain.lm_head.weight, head.lm_head.weight)
    assert not torch.equal(plain.midlayer.mlp.up_proj.weight, head.midlayer.mlp.up_proj.weight)
    assert torch.equal(plain.midlayer.self_attn.q_proj.weight[:, :d], mine.self_attn.q_proj.weight[:, :d])  # random


def test_a_narrower_or_wider_mlp_takes_the_targets_first_units(model):
    narrow = fresh_head(model, "eagle3", 0, None, init="layer", intermediate_size=96)
    wide = fresh_head(model, "eagle3", 0, None, init="layer", intermediate_size=160)
    last = model.model.layers[-1].mlp
    assert torch.equal(narrow.midlayer.mlp.gate_proj.weight, last.gate_proj.weight[:96])
    assert torch.equal(narrow.midlayer.mlp.down_proj.weight, last.down_proj.weight[:, :96])
    assert torch.equal(wide.midlayer.mlp.up_proj.weight[:128], last.up_proj.weight)
    assert wide.midlayer.mlp.up_proj.weight[128:].abs().max() < 0.2  # the rest stays random (std 0.02)


def test_init_none_leaves_the_lm_head_random_and_bad_inits_are_refused(model):
    assert INITS == ("none", "lm_head", "layer")
    random = fresh_head(model, "eagle3", 0, torch.arange(200), init="none")
    assert not torch.equal(random.lm_head.weight, model.lm_head.weight[:200])
    with pytest.raises(UserError, match="init must be one of none, lm_head, layer"):
        fresh_head(model, "eagle3", 0, None, init="mlp")
    with pytest.raises(UserError, match="EAGLE-3 head with concatenation fusion"):
        fresh_head(model, "eagle3", 0, None, init="layer", fusion="gated")


def test_a_target_layer_unlike_llamas_is_refused_in_one_line(model, monkeypatch):
    monkeypatch.setattr(model.model.layers[-1], "mlp", torch.nn.Identity())
    with pytest.raises(UserError, match="no mlp.gate_proj, mlp.up_proj, mlp.down_proj .*--init-from-target lm_head"):
        fresh_head(model, "eagle3", 0, None, init="layer")

"""Layer-skip self-drafting: lossless (greedy and sampling), the target untouched, the shared cache
restored, clear errors for bad skip sets, and the tuner's record and refusal rule."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import tiny_gemma3, tiny_model

from sparrow.config import SamplingConfig
from sparrow.drafters import build_drafter
from sparrow.drafters.layer_skip import LayerSkipDrafter, SkipRecord, SkipSet, skipping_view
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.runtime.cached_model import CachedModel
from sparrow.training.layer_skip import AgreementProxy, CostModel, calibration_sequences, tune_layer_skip
from sparrow.types import Prompt

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]
ROUNDS = [("mlp=3", 1, False), ("attention=2;mlp=1", 4, False), ("layers=2-3", 4, True), ("attention=1-3", 8, True)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def target(request, tokenizer) -> LoadedModel:
    model = tiny_gemma3() if request.param == "gemma3" else tiny_model(request.param, seed=0, num_layers=4)
    return LoadedModel(model, tokenizer, f"tiny-{request.param}")


@pytest.fixture(scope="module")
def plain(target) -> dict[str, list[int]]:
    pipe = Pipeline(target, None)
    return {p: pipe.generate_plain(p, max_new_tokens=40).token_ids for p in PROMPTS}


def layer_skip(target: LoadedModel, spec: str, k: int, adaptive: bool, **options) -> LayerSkipDrafter:
    return build_drafter("layer-skip", target, None, k, adaptive, skip_set=spec, backoff=False, **options)


@pytest.mark.parametrize("spec, k, adaptive", ROUNDS)
def test_greedy_equals_plain(target, plain, spec, k, adaptive):
    pipe = Pipeline(target, layer_skip(target, spec, k, adaptive))
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=40)
        assert result.token_ids == plain[prompt], (spec, prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    assert 0 < accepted <= drafted


def test_greedy_equals_plain_with_the_rejection_verifier_and_backoff(target, plain):
    drafter = build_drafter("layer-skip", target, None, 4, True, skip_set="mlp=2-3")  # back-off on (adaptive)
    pipe = Pipeline(target, drafter, "rejection")
    results = [pipe.generate(p, max_new_tokens=40) for p in PROMPTS]
    assert [r.token_ids for r in results] == [plain[p] for p in PROMPTS]
    assert sum(r.stats.num_accepted_tokens for r in results) > 0


def test_backoff_makes_plain_steps(target, plain):
    """When the policy says drafting does not pay, drafts are empty and each round is a plain step."""
    drafter = build_drafter("layer-skip", target, None, 4, True, skip_set="mlp=3", backoff=True)
    drafter.length.cap = lambda max_tokens: 0
    result = Pipeline(target, drafter).generate(PROMPTS[0], max_new_tokens=40)
    assert result.token_ids == plain[PROMPTS[0]]
    assert result.stats.num_draft_tokens == 0 and result.stats.steps == 39


def test_target_config_weights_and_modules_unchanged(target):
    model = target.model
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [(name, type(m)) for name, m in model.named_modules()]
    pipe = Pipeline(target, layer_skip(target, "attention=1-2;mlp=0,3", 4, True))
    pipe.generate(PROMPTS[0], max_new_tokens=20)
    pipe.generate(PROMPTS[1], max_new_tokens=20, temperature=0.8, seed=1)
    assert json.dumps(model.config.to_dict(), sort_keys=True, default=str) == config
    assert [(name, type(m)) for name, m in model.named_modules()] == modules
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_k=20)])
def test_propose_leaves_the_target_cache_as_it_was(target, sampling):
    runner = CachedModel(target.model)
    ids = Pipeline(target, None).encode(PROMPTS[2]).input_ids
    runner.prefill(Prompt(ids[:-1]))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers]
    drafter = layer_skip(target, "attention=2;mlp=1", 6, adaptive=False)
    drafter.prefill(Prompt(ids[:-1]), runner)
    draft = drafter.propose(ids, 6, sampling, torch.Generator().manual_seed(0))
    assert len(draft) == 6 and (draft.probs is None) == sampling.greedy
    assert runner.length == ids.numel() - 1
    for layer, (keys, values) in zip(runner.cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_agreement_proxy_matches_real_draft_steps(target):
    """The tuner's batched, masked proxy equals the drafter's logits step by step (full-model prefix KV)."""
    sequences, starts = calibration_sequences(target, PROMPTS[:1], 8)
    skip = SkipSet.parse("attention=2;mlp=1,3", target.model.config.num_hidden_layers)
    proxy = AgreementProxy(target.model, sequences, starts)
    seq, start = sequences[0], starts[0]
    runner, drafter = CachedModel(target.model), LayerSkipDrafter(target.model, skip, 1, adaptive=False)
    agree = 0
    for p in range(start - 1, seq.numel() - 1):
        runner.prefill(Prompt(seq[:p]))
        drafter.prefill(Prompt(seq[:p]), runner)
        full = runner.forward(seq[p:p + 1]).logits[-1].argmax()
        runner.rewind(p)
        agree += int(drafter.step(seq[p:p + 1], p).argmax() == full)
    assert proxy.score(skip).agreement == pytest.approx(agree / (seq.numel() - start))


# --- sampling: the emitted tokens follow the target's distribution ---------------------------------

def joint_counts(pipe: Pipeline, sampling: SamplingConfig, n: int) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        ids = pipe.generate(PROMPTS[0], max_new_tokens=2, temperature=sampling.temperature, top_k=sampling.top_k,
                            seed=seed).token_ids
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    return counts


def target_joint(target: LoadedModel, sampling: SamplingConfig) -> dict[tuple[int, int], float]:
    from sparrow import sampling as S

    runner = CachedModel(target.model)
    ids = Pipeline(target, None).encode(PROMPTS[0]).input_ids
    first = S.probs(runner.prefill(Prompt(ids)).logits[-1], sampling)
    joint = {}
    for a in first.nonzero().flatten().tolist():
        runner.rewind(ids.numel())
        second = S.probs(runner.forward(torch.tensor([a])).logits[-1], sampling)
        for b in second.nonzero().flatten().tolist():
            joint[(a, b)] = float(first[a] * second[b])
    return joint


@pytest.mark.parametrize("sample_drafts", [True, False], ids=["sampled-q", "argmax-q1"])
def test_sampling_preserves_the_target_distribution(tokenizer, sample_drafts):
    target = LoadedModel(tiny_model("qwen2", seed=0, num_layers=4), tokenizer, "tiny")
    sampling, n = SamplingConfig(temperature=1.0, top_k=3), 600
    drafter = build_drafter("layer-skip", target, None, 2, False, skip_set="attention=1-3", backoff=False,
                            sample_drafts=sample_drafts)
    pipe = Pipeline(target, drafter, "rejection")
    counts, expected = joint_counts(pipe, sampling, n), target_joint(target, sampling)
    assert set(counts) <= set(expected)
    for pair, p in expected.items():  # 6 standard deviations + 5, as in test_distribution.py
        assert abs(counts.get(pair, 0) - n * p) <= 6 * (n * p * (1 - p)) ** 0.5 + 5, (pair, counts, expected)


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, match", [
    ("mlp=4", "not a layer index"),
    ("layers=0-3", "all 4 layers are skipped"),
    ("attention=0", "cannot be skipped"),
    ("mlp=x", "not a layer index or range"),
    ("heads=1", "expected 'attention="),
])
def test_bad_skip_sets_are_clear_value_errors(tokenizer, spec, match):
    target = LoadedModel(tiny_model("llama", seed=0, num_layers=4), tokenizer, "tiny")
    with pytest.raises(ValueError, match=match):
        build_drafter("layer-skip", target, None, 4, skip_set=spec)


def test_missing_record_and_unknown_file_are_clear_value_errors(tokenizer, tmp_path):
    target = LoadedModel(tiny_model("llama", seed=0, num_layers=4), tokenizer, "no-such-model")
    with pytest.raises(ValueError, match="no tuned skip set ships for model 'no-such-model'"):
        build_drafter("layer-skip", target, None, 4)
    with pytest.raises(ValueError, match="skip_file: no such file"):
        build_drafter("layer-skip", target, None, 4, skip_file=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="skip_file: not a layer-skip record"):
        build_drafter("layer-skip", target, None, 4, skip_file=tmp_path / "bad.json")
    with pytest.raises(ValueError, match="skip_set is for a 28-layer model"):
        skipping_view(target.model, SkipSet(28, mlp=(3,)))


# --- the tuner ------------------------------------------------------------------------------------

def fake_costs(saved: float) -> CostModel:
    """A draft step costs one target step less `saved` per skipped sub-layer; verification is flat."""
    return CostModel(verify_seconds=(1.0, 1.0, 1.0, 1.0, 1.0), full_draft_seconds=1.0, attention_seconds=saved,
                     mlp_seconds=saved)


def test_tuner_writes_a_valid_record_and_recommends_a_winner(tokenizer, tmp_path):
    target = LoadedModel(tiny_model("qwen2", seed=0, num_layers=4), tokenizer, "tiny")
    record = tune_layer_skip(target, max_k=4, prompts=PROMPTS[:2], new_tokens=8, costs=fake_costs(0.24),
                             measure=lambda skip, k: 1.3)
    assert record.recommended and record.expected_speedup > 1 and record.measured_speedup == 1.3
    assert record.skip.num_skipped > 0
    record.save(tmp_path / "tiny.json")
    loaded = SkipRecord.load(tmp_path / "tiny.json")
    assert loaded == record
    drafter = build_drafter("layer-skip", target, None, 4, skip_file=tmp_path / "tiny.json")
    assert drafter.enabled and drafter.skip == record.skip


def test_tuner_refuses_a_losing_set_and_the_drafter_then_decodes_plainly(tokenizer, tmp_path):
    target = LoadedModel(tiny_model("qwen2", seed=0, num_layers=4), tokenizer, "tiny")
    record = tune_layer_skip(target, max_k=4, prompts=PROMPTS[:2], new_tokens=8, costs=fake_costs(0.24),
                             measure=lambda skip, k: 0.8)  # expected to win, measured to lose
    assert not record.recommended and "refused" in record.note
    expensive = tune_layer_skip(target, max_k=4, prompts=PROMPTS[:2], new_tokens=8, costs=fake_costs(0.0),
                                measure=lambda skip, k: 2.0)  # a draft as costly as the target never wins
    assert not expensive.recommended and expensive.expected_speedup <= 1
    record.save(tmp_path / "losing.json")
    with pytest.warns(UserWarning, match="loses"):
        drafter = build_drafter("layer-skip", target, None, 4, skip_file=tmp_path / "losing.json")
    result = Pipeline(target, drafter).generate(PROMPTS[0], max_new_tokens=10)
    assert result.stats.num_draft_tokens == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forced = build_drafter("layer-skip", target, None, 4, skip_file=tmp_path / "losing.json", force=True)
    assert forced.enabled


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("spec", ["mlp=3", "attention=1-2;mlp=1"])  # skipped attention: those caches lag
def test_tree_drafts_equal_plain(target, plain, spec, verifier):
    if target.name == "tiny-gemma3":
        with pytest.raises(ValueError, match="sliding-window"):
            layer_skip(target, spec, 4, False, tree_budget=8)
        return
    pipe = Pipeline(target, layer_skip(target, spec, 4, False, tree_budget=10, tree_topk=3, tree_depth=5), verifier)
    drafted = accepted = trees = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=40)
        assert result.token_ids == plain[prompt], (spec, prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
        trees += result.stats.tree_steps
        assert pipe.runner.length == len(pipe.encode(prompt).input_ids) + len(result.token_ids) - 1
    assert trees > 0 and 0 < accepted <= drafted

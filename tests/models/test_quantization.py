"""Weight-only quantization: kernels against dense math, lossless quantized drafts, quantized targets
that speculate losslessly relative to themselves, the copy built once (memory and disk), the source
model never modified, and the cost-aware draft length.

Tiny float32 Llama / Qwen2 models with kernel-friendly shapes (hidden 128, MLP 256, vocab 320):
the int4 kernels need in_features divisible by the group size and out_features by 8.
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import sparrow
from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.models import quantization as Q
from sparrow.pipeline import Pipeline
from sparrow.policy.estimates import CostCurve, best_length, expected_tokens
from sparrow.policy.length import LengthPolicy
from sparrow.policy.measure import measure_cost_curve
from sparrow.runtime import quant
from sparrow.runtime.batch_invariant import source
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import StepStats

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]
GROUP = 64


def kernel_friendly_model(arch: str, seed: int) -> torch.nn.Module:
    common = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    torch.manual_seed(seed)  # tests only: model construction draws from the global generator
    model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**common)))
    with torch.no_grad():  # sharper logits than the default init, so greedy text is not all ties
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model.float().eval()


@pytest.fixture(scope="module")
def target(arch, tokenizer) -> LoadedModel:
    return LoadedModel(kernel_friendly_model(arch, seed=0), tokenizer, "tiny")


@pytest.fixture(scope="module")
def plain(target) -> dict[str, list[int]]:
    pipe = Pipeline(target, None)
    return {p: pipe.generate_plain(p, max_new_tokens=40).token_ids for p in PROMPTS}


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_all(pipe: Pipeline, expected: dict[str, list[int]]) -> tuple[int, int]:
    drafted = accepted = 0
    for prompt, tokens in expected.items():
        result = pipe.generate(prompt, max_new_tokens=len(tokens))
        assert result.token_ids == tokens, (prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    return drafted, accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, tolerance", [(8, 0.02), (4, 0.2)])
def test_quantized_linear_is_close_to_dense(bits, tolerance, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True).to(dtype)
    layer = quant.QuantizedLinear.from_linear(linear, bits, GROUP)
    for shape in [(1, 256), (8, 256), (2, 5, 256)]:
        x = torch.randn(shape, dtype=dtype)
        expected, actual = linear(x).float(), layer(x)
        assert actual.shape == expected.shape and actual.dtype == dtype
        assert (actual.float() - expected).norm() / expected.norm() < tolerance


def test_quantize_model_copies_and_never_modifies_the_source(target):
    before = snapshot(target.model)
    copy = Q.quantize_model(target.model, "int4", GROUP)
    info = copy.sparrow_quantization
    assert info.bits == 4 and not info.skipped and "lm_head" in info.quantized
    assert all(not isinstance(m, quant.QuantizedLinear) for m in target.model.modules())
    assert type(copy.lm_head) is quant.QuantizedLinear
    assert copy.model.embed_tokens.weight is target.model.model.embed_tokens.weight  # shared, not copied
    assert Q.weight_bytes(copy) < Q.weight_bytes(target.model)
    ids = torch.tensor([[1, 2, 3, 4]])
    agree = (copy(ids).logits.argmax(-1) == target.model(ids).logits.argmax(-1)).float().mean()
    assert agree >= 0.5
    after = snapshot(target.model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_layers_the_kernel_cannot_take_are_skipped_or_refused():
    odd = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Linear(64, 100))  # 96 % 64 != 0, 100 % 8 != 0
    with pytest.raises(ValueError, match="takes none"):
        Q.quantize_model(odd, 4, 64)
    mixed = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 100))
    info = Q.quantize_model(mixed, 4, 64).sparrow_quantization
    assert info.quantized == ("0",) and info.skipped == ("1",)
    assert Q.quantize_model(odd, 8).sparrow_quantization.quantized == ("0", "1")  # int8: any N, K % 16 == 0
    ragged = torch.nn.Sequential(torch.nn.Linear(72, 64), torch.nn.Linear(64, 100))  # the CPU int8 kernel: K % 16
    assert Q.quantize_model(ragged, 8).sparrow_quantization.skipped == ("0",)


@pytest.mark.parametrize("bits", ["int4", "int8", "w8a8"])
def test_quantized_self_greedy_equals_plain(target, plain, bits):
    before = snapshot(target.model)
    for verifier in ("greedy", "rejection"):
        drafter = build_drafter("quantized-self", target, None, 4, adaptive=True, bits=bits, group_size=GROUP)
        assert drafter.name == "quantized-self" and drafter.length.curve is not None  # cost-aware
        drafted, accepted = run_all(Pipeline(target, drafter, verifier), plain)
        assert accepted > 0
    after = snapshot(target.model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the target's weights are never modified


@pytest.mark.parametrize("bits", ["int4", "int8", "w8a8"])
def test_quantized_draft_model_greedy_equals_plain(target, plain, bits):
    draft = LoadedModel(perturbed(target.model, 0.05, seed=1), target.tokenizer, "close")
    pipe = sparrow.load(target, drafter="draft-model", draft=draft, num_draft_tokens=4, draft_quant=bits)
    assert pipe.drafter.draft.model.sparrow_quantization.name == Q.parse_quant(bits)
    assert pipe.drafter.length.curve is not None  # load() is adaptive by default: the cost curve
    # the target stays unquantized: its exact copy (sparrow.runtime.batch_invariant), sharing its weights
    assert source(pipe.runner.model) is target.model and not hasattr(pipe.runner.model, "sparrow_quantization")
    drafted, accepted = run_all(pipe, plain)
    assert accepted > 0


@pytest.mark.parametrize("quant", ["int4", "int8", "w8a8"])
def test_quantized_target_speculative_equals_its_own_plain_decoding(target, quant):
    trees = [("draft-model", target, {"tree_budget": 8, "tree_topk": 2, "tree_depth": 4})] if quant == "w8a8" else []
    for drafter, draft, options in [("draft-model", target, {}), ("prompt-lookup", None, {}), *trees]:
        pipe = sparrow.load(target, drafter=drafter, draft=draft, num_draft_tokens=4, quant=quant, draft_quant=(
            "int4" if draft is not None else None), adaptive=False, **options)  # fixed k: back-off is timed
        assert pipe.runner.model.sparrow_quantization.name == quant
        accepted = tree_steps = 0
        for prompt in PROMPTS:
            expected = pipe.generate_plain(prompt, max_new_tokens=40).token_ids
            result = pipe.generate(prompt, max_new_tokens=40)
            assert result.token_ids == expected, (drafter, prompt)
            accepted += result.stats.num_accepted_tokens
            tree_steps += result.stats.tree_steps
        assert accepted > 0 and (tree_steps > 0) == bool(options)  # trees verified through row-wise attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_is_close_to_dense_and_each_token_ignores_the_others(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True).to(dtype)
    layer = quant.DynamicInt8Linear.from_linear(linear)
    x = torch.randn(32, 256, dtype=dtype)
    x[::3, 5] *= 40  # an outlier channel in some tokens: their range, not the batch's, must set their scale
    full = layer(x)
    # 7-bit activations where the CPU has no VNNI (fbgemm's reduce_range, against int16 saturation): twice the step
    bound = 0.1 if layer.reduce_range else 0.05  # measured: 0.058 with 7 bits on an AVX2-only AMD EPYC
    assert full.dtype == dtype and ((full.float() - linear(x).float()).norm() / linear(x).float().norm()) < bound
    for start, size in [(0, 1), (3, 1), (4, 2), (7, 5), (11, 8), (20, 12)]:
        assert torch.equal(layer(x[start:start + size]), full[start:start + size])  # bit for bit
    assert torch.equal(layer(x[None, :4]), full[None, :4]) and torch.equal(layer(torch.zeros(2, 256, dtype=dtype)),
                                                                           linear.bias.expand(2, -1))
    # the control: fbgemm's own per-call activation range makes a token depend on its neighbours
    rows = torch.cat([x.float(), torch.zeros(32, layer.pads.shape[1])], dim=1)
    alone = torch.ops.quantized.linear_dynamic(rows[:1], layer.params, layer.reduce_range)
    assert not torch.equal(alone, torch.ops.quantized.linear_dynamic(rows, layer.params, layer.reduce_range)[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_w8a8_verify_forward_equals_one_token_steps_bit_for_bit(dtype):
    from transformers import DynamicCache

    copy = Q.quantize_model(kernel_friendly_model("qwen2", seed=0).to(dtype), "w8a8")
    assert copy.config._attn_implementation == "sparrow_rowwise"  # row-wise attention in short forwards
    ids = torch.randint(0, 320, (1, 30), generator=torch.Generator().manual_seed(0))
    prompt, block = ids[:, :20], ids[:, 20:]
    with torch.inference_mode():
        cache = DynamicCache()
        copy(prompt, cache=cache)
        steps = torch.cat([copy(block[:, i:i + 1], cache=cache).logits for i in range(10)], dim=1)
        cache = DynamicCache()
        copy(prompt, cache=cache)
        verify = torch.cat([copy(block[:, :4], cache=cache).logits,
                            copy(block[:, 4:], cache=cache).logits], dim=1)
    assert torch.equal(steps, verify)


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q / k / v with and without biases
def test_w8a8_siblings_in_one_call_equal_separate_calls_bit_for_bit(family, monkeypatch):
    model = kernel_friendly_model(family, seed=0)
    copy = Q.quantize_model(model, "w8a8")
    with monkeypatch.context() as patch:
        patch.setattr(Q, "group_siblings", lambda model: None)
        separate = Q.quantize_model(model, "w8a8")
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():  # the whole model: a prefill and its logits, bit for bit
        assert torch.equal(copy(ids).logits, separate(ids).logits) and not any(
            isinstance(m, quant.DynamicInt8Linear) and m.group is not None for m in separate.modules())
    layers = len(model.model.layers)
    groups = {id(m.group) for m in copy.modules() if isinstance(m, quant.DynamicInt8Linear) and m.group is not None}
    assert len(groups) == 2 * layers  # each layer's q / k / v and gate / up: 3 + 2 calls become 2
    attention = copy.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for name in ("q_proj", "k_proj", "v_proj"):  # each member alone == a fresh ungrouped layer with its weights
        member = getattr(attention, name)
        alone = quant.DynamicInt8Linear(member.in_features, member.out_features, member.int8_weight(), member.scales,
                                    member.bias, member.reduce_range)
        expected = alone(x)
        got = member(x)
        assert got.is_contiguous() and torch.equal(got, expected), name
        assert torch.equal(member(x), expected)  # the same member again recomputes (its slot was taken)
    group = attention.q_proj.group
    k = attention.k_proj(x)
    assert torch.equal(attention.k_proj(x.clone()), k)  # another input object: computed afresh, the same values
    z = x.clone()
    attention.q_proj(z), attention.k_proj(z)
    assert group._input is z  # v's columns are held until v takes them
    attention.v_proj(z)
    assert group._input is None  # every member took its columns: nothing kept between forwards
    y = x.clone()
    attention.q_proj(y)
    y.mul_(2)  # changed in place after q: k must not take columns computed from the old values
    assert torch.equal(
        attention.k_proj(y),
        quant.DynamicInt8Linear(
            model.config.hidden_size,
            attention.k_proj.out_features,
            attention.k_proj.int8_weight(),
            attention.k_proj.scales,
            attention.k_proj.bias,
            attention.k_proj.reduce_range,
        )(y),
    )


def test_w8a8_refuses_other_devices_and_round_trips_the_disk_cache(target, tmp_path):
    with pytest.raises(ValueError, match="w8a8 runs on the CPU only"):
        quant.check_device("w8a8", torch.device("cuda"), torch.float32)
    built = Q.quantize_model(target.model, "w8a8", cache_entry=tmp_path / "w8a8")
    loaded = Q.quantize_model(target.model, "w8a8", cache_entry=tmp_path / "w8a8")
    assert loaded.sparrow_quantization.from_disk and not built.sparrow_quantization.from_disk
    assert Q.describe(loaded).startswith("w8a8") and len(loaded.sparrow_quantization.quantized) == 15  # lm_head too
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(loaded(ids).logits, built(ids).logits)


def test_quantized_copy_is_built_once_and_reused_from_disk(target, tmp_path, monkeypatch):
    first = Q.quantized_copy(target, "int8", GROUP)
    assert Q.quantized_copy(target, "int8", GROUP).model is first.model  # in-process: once per model and bits
    assert Q.quantized_copy(target, "int4", GROUP).model is not first.model
    entry = tmp_path / "tiny-int4"
    built = Q.quantize_model(target.model, 4, GROUP, cache_entry=entry)
    assert (entry / Q.WEIGHTS_FILE).is_file() and not built.sparrow_quantization.from_disk

    def no_requantizing(*args, **kwargs):
        raise AssertionError("quantized again although the disk cache matches")

    monkeypatch.setattr(quant.QuantizedLinear, "from_linear", no_requantizing)
    loaded = Q.quantize_model(target.model, 4, GROUP, cache_entry=entry)
    assert loaded.sparrow_quantization.from_disk
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(loaded(ids).logits, built(ids).logits)


def test_bad_quantization_arguments_fail_before_loading(target):
    with pytest.raises(ValueError, match="quant 'int3'"):
        sparrow.load("no-such-model", drafter="none", quant="int3")
    with pytest.raises(ValueError, match="quantized-self"):
        sparrow.load("no-such-model", drafter="quantized-self", quant="int4")
    with pytest.raises(ValueError, match="draft_quant"):
        sparrow.load("no-such-model", drafter="prompt-lookup", draft_quant="int8")
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_model(target.model, 4, group_size=48)


def test_cost_aware_length_follows_the_cost_curve():
    flat = tuple(0.1 for _ in range(9))  # bf16-like: verifying 8 tokens costs one
    steep = tuple(0.025 + 0.02 * n for n in range(1, 10))  # quantized-like: verify cost grows with n
    draft = lambda k: 0.01 * k  # noqa: E731
    assert best_length(0.9, draft, lambda n: flat[n - 1], 8) == 8
    assert best_length(0.9, draft, lambda n: steep[n - 1], 8) < 8
    assert best_length(0.3, draft, lambda n: flat[n - 1], 8) < best_length(0.95, draft, lambda n: flat[n - 1], 8)
    assert expected_tokens(1.0, 4) == 5 and abs(expected_tokens(0.5, 1) - 1.5) < 1e-12
    length = LengthPolicy(8, adaptive=True)
    length.follow(CostCurve(verify_seconds=flat, draft_seconds=0.01))
    assert length.cap(8) == best_length(0.8, draft, lambda n: flat[n - 1], 8) > 4  # from the prior acceptance
    for _ in range(30):
        k = length.cap(8)
        length.observe(StepStats(k, 0, draft(k), flat[k]))  # nothing accepted: drafting long stops paying
    assert length.cap(8) < 8 and length.acceptance.value < 0.2


def test_measure_cost_curve_covers_every_length(target):
    runner = CachedModel(target.model)
    curve = measure_cost_curve(runner, 5, CachedModel(target.model), context_tokens=8, repeats=1)
    assert curve.draft_seconds > 0 and len(curve.verify_seconds) == 6 and all(t > 0 for t in curve.verify_seconds)


def test_a_draft_copy_prefills_with_the_shared_dense_weights(target):
    copy = Q.quantized_copy(target, "int4", GROUP, dense=Q.LONG).model
    assert copy.lm_head.dense is target.model.lm_head.weight  # shared, not copied
    packed = Q.quantized_copy(target, "int4", GROUP, dense=None).model
    assert Q.weight_bytes(copy) == Q.weight_bytes(packed)  # a decoding step reads the packed weights only
    long_ids = torch.arange(quant.DENSE_FROM_TOKENS)[None] % 300
    assert torch.equal(copy(long_ids).logits, target.model(long_ids).logits)  # prefill: the dense path
    short_ids = long_ids[:, :4]
    assert not torch.equal(copy(short_ids).logits, target.model(short_ids).logits)  # decode: the int4 kernel


def test_a_target_copy_prefills_with_its_dense_source_and_decodes_quantized(target):
    from sparrow.runtime.cached_model import CachedModel, prefill_module
    from sparrow.types import Prompt

    copy = Q.quantized_copy(target, "int4", GROUP).model  # a target's default: dense=PREFILL
    packed = Q.quantized_copy(target, "int4", GROUP, dense=None).model
    prefill = prefill_module(copy)
    assert prefill is not copy and prefill_module(packed) is packed and prefill_module(target.model) is target.model
    assert prefill.lm_head.weight is target.model.lm_head.weight  # the source's weights, shared, not copied
    assert prefill not in list(copy.modules()) and Q.weight_bytes(copy) == Q.weight_bytes(packed)
    ids = torch.arange(12) % 300
    runner, dense = CachedModel(copy), CachedModel(target.model)
    first = runner.prefill(Prompt(input_ids=ids)).logits
    assert torch.equal(first, dense.prefill(Prompt(input_ids=ids)).logits)  # the prompt: the dense model
    assert not torch.equal(first, CachedModel(packed).prefill(Prompt(input_ids=ids)).logits)  # negative control
    assert not torch.equal(runner.forward(ids[:1]).logits, dense.forward(ids[:1]).logits)  # then: the int4 kernel
    w8a8 = Q.quantized_copy(target, "w8a8").model
    assert prefill_module(w8a8) is w8a8  # fbgemm's int8 kernel scales with the rows: it prefills itself
    with pytest.raises(Q.UserError, match="dense must be one of"):
        Q.quantized_copy(target, "int4", GROUP, dense="always")


def test_generate_summary_names_the_quantized_target_it_was_identical_to():
    from rich.console import Console

    from sparrow.cli.generate import summary

    record = {"drafter": "auto", "target": "t", "dtype": "float32", "quant": "w8a8", "draft_quant": "w8a8",
              "new_tokens": 8, "seconds": 1.0, "tokens_per_second": 8.0, "draft_vocab": None, "tree": None,
              "mean_accepted_tokens": 2.0, "acceptance_rate": 0.5, "baseline": {"tokens_per_second": 4.0},
              "speedup": 2.0, "identical": True}
    console = Console(record=True, width=200)
    console.print(summary(record, "greedy"))
    text = console.export_text()
    assert "float32, target w8a8, draft w8a8" in text and "yes (of the w8a8 target)" in text
    console.print(summary({**record, "quant": None, "draft_quant": None}, "greedy"))
    assert "w8a8" not in console.export_text()  # a float target: nothing said about quantization


def test_quant_auto_picks_the_targets_format_by_the_measurement(target, monkeypatch, tmp_path):
    """--quant auto: the format this machine measured fastest over a decoding step and a verify quantizes the target,
    and speculative decoding equals that quantized target's own plain decoding, with drafts accepted; where no
    format pays (or with --compile, w8a8 excluded) the target stays dense."""
    from sparrow.runtime import hardware

    monkeypatch.setenv("SPARROW_DTYPE_BENCHMARK", "1")
    monkeypatch.setenv("SPARROW_HARDWARE_CACHE", str(tmp_path))
    costs = {"float32": {"1": 3.0, "8": 3.3}, "bfloat16": {"1": 3.1, "8": 9.9}, "int8": {"1": 1.0, "8": 2.5},
             "int4": {"1": 0.8, "8": 6.0}, "w8a8": {"1": 1.2, "8": 1.6}}
    monkeypatch.setattr(hardware, "measure", lambda *a, **k: {
        "costs": costs, "quant_activations": "float32", "unit": "ms per matmul",
        "shape": list(hardware.BENCH_SHAPE), "seconds": 0.01})
    hardware.clear_cache()
    try:
        assert hardware.choose_target_quant("cpu")[0] == "w8a8"  # fastest over both (int4 is, at 1 row)
        assert hardware.choose_target_quant("cpu", exclude=("w8a8",))[0] == "int8"
        assert Q.target_format(target.model, "auto", compile=True) == "int8"
        pipe = sparrow.load(target, drafter="draft-model", draft=target, num_draft_tokens=4, quant="auto")
        assert pipe.runner.model.sparrow_quantization.name == "w8a8"
        accepted = 0
        for prompt in PROMPTS:
            result = pipe.generate(prompt, max_new_tokens=24)
            assert result.token_ids == pipe.generate_plain(prompt, max_new_tokens=24).token_ids
            accepted += result.stats.num_accepted_tokens
        assert accepted > 0
        assert sparrow.load(target, drafter="quantized-self", quant="auto").runner.model is target.model  # dense
        from sparrow.loading import PipelineCache

        cached = PipelineCache().get(target, drafter="none", quant="auto")
        assert cached.runner.model.sparrow_quantization.name == "w8a8"
        monkeypatch.setattr(hardware, "MIN_TARGET_QUANT_SPEEDUP", 10.0)
        hardware.clear_cache()
        fmt, reason = hardware.choose_target_quant("cpu")
        assert fmt is None and "the target stays dense" in reason
        assert sparrow.load(target, drafter="none", quant="auto").runner.model is target.model
        assert sparrow.load(target, drafter="none", quant="none").runner.model is target.model
    finally:
        hardware.clear_cache()

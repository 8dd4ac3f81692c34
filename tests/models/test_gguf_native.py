"""--quant gguf (sparrow.models.gguf_native): a model built from a GGUF file's own blocks. On a tiny qwen2 written
as Q8_0 / Q4_K / Q6_K (tests/gguf_helpers.py): every linear runs on the file's blocks; with float activations it is
the dequantized model (to float32 rounding); greedy speculative decoding (prompt lookup, a draft model) equals its
own plain decoding token for token; bad files and bad uses are refused with one line. With the real preset
installed, the same on qwen2.5-coder-0.5b."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_tokenizer
from gguf_helpers import write_gguf
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

import sparrow
from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.models.gguf_native import build_model, load_gguf_model
from sparrow.models.quantization import describe, parse_quant
from sparrow.pipeline import Pipeline
from sparrow.runtime import gguf_kernels
from sparrow.runtime.gguf_linear import GGUFEmbedding, GGUFLinear
from sparrow.types import Prompt

pytestmark = pytest.mark.skipif(not gguf_kernels.available(), reason="the GGUF kernels could not be built here")

PROMPTS = ["def add(a, b):", "The quick brown fox", "Paris is the capital of France. Paris is"]


def tiny_qwen2(seed: int = 0) -> nn.Module:
    """Dims that are whole Q4_K / Q6_K super-blocks (256)."""
    torch.manual_seed(seed)  # tests only: model construction draws from the global generator
    config = Qwen2Config(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits, so greedy text is not all ties
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def source() -> nn.Module:
    return tiny_qwen2()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, source):
    return write_gguf(source, tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf", tiny_tokenizer())


@pytest.fixture(scope="module")
def target(gguf_file) -> LoadedModel:
    loaded = load_gguf_model(str(gguf_file), progress=False)
    loaded.model.generation_config.eos_token_id = None
    return loaded


def dequantized_copy(model: nn.Module) -> nn.Module:
    """The same model with every GGUF layer replaced by its dequantized float32 weights (the reference)."""
    import copy

    dense = copy.deepcopy(model)
    for name, module in list(dense.named_modules()):
        parent, _, child = name.rpartition(".")
        owner = dense.get_submodule(parent) if parent else dense
        if isinstance(module, GGUFLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(module.dequantized())
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            setattr(owner, child, linear)
        elif isinstance(module, GGUFEmbedding):
            weight = gguf_kernels.dequantize(module.blocks, module.qtype, module.embedding_dim)
            setattr(owner, child, nn.Embedding.from_pretrained(weight))
    return dense.eval()


def test_every_linear_runs_on_the_files_blocks(target, source):
    model = target.model
    assert sum(isinstance(m, GGUFLinear) for m in model.modules()) == \
        sum(isinstance(m, nn.Linear) for m in source.modules())
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert {gguf_kernels.TYPE_NAMES[m.qtype] for m in model.modules() if isinstance(m, GGUFLinear)} == \
        {"Q8_0", "Q4_K", "Q6_K"}
    assert describe(model) == "gguf (15 layers)" and model.sparrow_quantization.skipped == ()
    # Q4_K runs packed (16 rows interleaved, made at load), Q6_K where the kernels run AVX-512 VNNI, Q8_0 on the
    # file's bytes
    kinds = {(m.qtype, m.kernel_type) for m in model.modules() if isinstance(m, GGUFLinear)}
    q6 = gguf_kernels.Q6_KX16 if gguf_kernels.isa() == "avx512_vnni" else gguf_kernels.Q6_K
    assert kinds == {(gguf_kernels.Q8_0, gguf_kernels.Q8_0), (gguf_kernels.Q4_K, gguf_kernels.Q4_KX16),
                     (gguf_kernels.Q6_K, q6)}
    # the file's weights are the source's to 4-bit rounding (a check that names and rows are where they belong)
    up = model.model.layers[1].mlp.up_proj
    err = (up.dequantized() - source.model.layers[1].mlp.up_proj.weight).abs().max()
    assert err < 0.2 * source.model.layers[1].mlp.up_proj.weight.abs().max()


def test_float_activations_equal_the_dequantized_model(gguf_file, target):
    model, _, _ = build_model(gguf_file, int8=False)
    assert all(m.kernel_type == m.qtype for m in model.modules() if isinstance(m, GGUFLinear))  # float: not packed
    ids = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        mine = model(ids).logits
        ref = dequantized_copy(model)(ids).logits
        int8 = target.model(ids).logits
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)
    assert (int8 - ref).abs().max() < 0.05 * ref.abs().max()  # 8-bit activations: close, not equal


@pytest.fixture(scope="module")
def baselines(target) -> dict[str, list[int]]:
    pipe = Pipeline(target, None)
    return {p: pipe.generate_plain(p, max_new_tokens=40).token_ids for p in PROMPTS}


@pytest.mark.parametrize("k", [2, 5])
def test_prompt_lookup_equals_plain(target, baselines, k):
    pipe = sparrow.load(target, quant="gguf", drafter="prompt-lookup", draft=None, num_draft_tokens=k,
                        progress=False)
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=40)
        assert result.token_ids == baselines[prompt], prompt
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("k", [3, 8])
def test_draft_model_equals_plain(target, source, baselines, k):
    """The draft: the dense source model, perturbed (drafts partly accepted)."""
    draft = LoadedModel(perturbed(source, 0.02, seed=1), target.tokenizer, "draft")
    pipe = sparrow.load(target, quant="gguf", drafter="draft-model", draft=draft, num_draft_tokens=k,
                        progress=False)
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=40)
        assert result.token_ids == baselines[prompt], (prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    assert 0 < accepted <= drafted


@pytest.mark.parametrize("target_format", ["gguf", "dense"])
def test_a_draft_model_on_its_gguf_blocks_equals_plain(gguf_file, source, target, baselines, tmp_path, target_format):
    """--draft-quant gguf: the draft model (another GGUF file: the source perturbed) is built from its file's blocks
    and, under a target on GGUF blocks or a dense one, speculative output equals that target's plain decoding, with
    drafts accepted. (The draft's format never changes the output: the target verifies.)"""
    draft_file = write_gguf(perturbed(source, 0.02, seed=1), tmp_path / "draft.gguf", tiny_tokenizer())
    dense = LoadedModel(dequantized_copy(target.model), target.tokenizer, "dense")
    chosen = target if target_format == "gguf" else dense
    pipe = sparrow.load(chosen, drafter="draft-model", draft=str(draft_file), draft_quant="gguf",
                        num_draft_tokens=4, adaptive=False, progress=False)  # fixed: the draft is as big as the target
    assert pipe.drafter.draft_model.sparrow_quantization.format == "gguf"
    assert any(isinstance(m, GGUFLinear) for m in pipe.drafter.draft_model.modules())
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=40)
        expected = baselines[prompt] if target_format == "gguf" else \
            Pipeline(dense, None).generate_plain(prompt, max_new_tokens=40).token_ids
        assert result.token_ids == expected, (prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    assert 0 < accepted < drafted  # drafts partly accepted: the perturbed draft is another model


def test_rows_of_a_gguf_linear_are_its_columns(target):
    """GGUFLinear.rows (a draft's reduced vocabulary on GGUF blocks): the file's blocks of those rows; in the same
    layout (a multiple of 16 rows where the layer packs) its outputs are the layer's columns bit for bit, and
    dequantized they are the layer's rows in any layout."""
    generator = torch.Generator().manual_seed(3)
    for layer in (m for m in target.model.modules() if isinstance(m, GGUFLinear)):
        x = torch.randn(3, layer.in_features, generator=generator)
        even = torch.arange(0, layer.out_features, 2)[: 16 * (layer.out_features // 32)]
        rows = layer.rows(even)
        assert rows.kernel_type == layer.kernel_type and rows.out_features == even.numel()
        assert torch.equal(rows(x), layer(x)[:, even])
        assert torch.equal(rows.dequantized(), layer.dequantized()[even])
        few = torch.tensor([1, 5, 7])
        assert layer.rows(few).kernel_type == layer.qtype  # 3 rows: the file's layout
        assert torch.equal(layer.rows(few).dequantized(), layer.dequantized()[few])


def test_a_gguf_draft_with_a_reduced_vocabulary_equals_plain(source, target, baselines, tmp_path):
    """--draft-quant gguf with --draft-vocab: the draft's LM head keeps the GGUF blocks of the kept rows."""
    from sparrow.drafters.vocab import ReducedHead

    draft_file = write_gguf(perturbed(source, 0.02, seed=1), tmp_path / "draft.gguf", tiny_tokenizer())
    pipe = sparrow.load(target, drafter="draft-model", draft=str(draft_file), draft_quant="gguf", draft_vocab=160,
                        num_draft_tokens=4, adaptive=False, progress=False)
    heads = [m for m in pipe.drafter.draft.model.modules() if isinstance(m, ReducedHead)]
    assert len(heads) == 1 and isinstance(heads[0].project, GGUFLinear) and heads[0].project.out_features == 160
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=40)
        assert result.token_ids == baselines[prompt], (prompt, result.stats)
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_verify_rows_equal_one_token_steps(target):
    """The exact target (as sparrow.load builds it for --quant gguf): logits of a k-token forward equal k one-token
    forwards bit for bit."""
    pipe = Pipeline(target, build_drafter("prompt-lookup", target, None, 4))
    model = sparrow.load(target, quant="gguf", drafter="none", draft=None, progress=False).target.model
    assert pipe is not None
    from transformers import DynamicCache

    ids = torch.randint(0, 320, (1, 14), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        cache = DynamicCache()
        model(ids[:, :8], cache=cache, use_cache=True)
        batch = model(ids[:, 8:], cache=cache, use_cache=True).logits[0]
        cache = DynamicCache()
        model(ids[:, :8], cache=cache, use_cache=True)
        steps = torch.cat([model(ids[:, i:i + 1], cache=cache, use_cache=True).logits[0] for i in range(8, 14)])
    assert torch.equal(batch, steps)


def test_a_compiled_gguf_target_verifies_exactly(gguf_file):
    """compile=True compiles a GGUF target (static cache, inductor; the GGUF matmuls opaque custom ops) and it stays
    exact: the kernels keep their rows, and attention pads its packed query rows past torch's short blocks
    (`decode.padding`), so a k-row compiled verify gives its k one-row compiled steps' logits bit for bit, and
    speculative output == the compiled target's own plain output, drafts accepted. (This tiny model's one-row step,
    2 packed rows of dim 64, is a short block: unpadded, its verify rows were 2e-6 away from its steps.)"""
    from sparrow.runtime import compiled
    from sparrow.runtime.attention import decode

    target = load_gguf_model(str(gguf_file), progress=False)  # not the module's: an exact pipeline switched that one
    target.model.generation_config.eos_token_id = None
    assert compiled.row_invariant(target.model)
    pipe = sparrow.load(target, quant="gguf", drafter="prompt-lookup", draft=None, num_draft_tokens=3,
                        adaptive=False, compile=True, progress=False)
    assert pipe.compiled and pipe.exact
    assert isinstance(pipe.runner, compiled.StaticCachedModel) and pipe.runner.compiled
    assert decode.padding(2, 64, torch.float32) > 0 or not decode.short_blocks(64, torch.float32)
    runner = pipe.runner
    assert runner.buckets == compiled.FINE_BUCKETS  # GGUF kernels: rows cost compute
    ids = torch.tensor(pipe.tokenizer(PROMPTS[2])["input_ids"])
    assert ids.numel() >= 11
    with torch.inference_mode():
        runner.prefill(Prompt(ids[:6]))
        block = runner.forward(ids[6:10]).logits  # bucket 4
        runner.rewind(6)
        five = runner.forward(ids[6:11]).logits  # 5 rows: the 6-row bucket, one row of padding
        runner.rewind(6)
        steps = torch.cat([runner.forward(ids[i:i + 1]).logits for i in range(6, 11)])
    assert torch.equal(block, steps[:4]) and torch.equal(five, steps)
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=24)
        assert result.token_ids == pipe.generate_plain(prompt, max_new_tokens=24).token_ids, prompt
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0, "no draft was accepted: nothing was tested"


def test_bad_files_and_uses_are_refused(tmp_path, gguf_file, source):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])
    with pytest.raises(UserError, match="not a readable GGUF file"):
        load_gguf_model(str(cut), progress=False)
    with pytest.raises(UserError, match="preset .* or a .gguf file"):
        load_gguf_model(str(tmp_path), progress=False)
    with pytest.raises(UserError, match="not as a loaded model"):
        sparrow.load(LoadedModel(source, tiny_tokenizer(), "dense"), quant="gguf", drafter="none", draft=None,
                     progress=False)
    assert parse_quant("gguf", "draft_quant", auto=True) == "gguf"
    with pytest.raises(UserError, match="quantized copy of the target"):
        sparrow.load(str(gguf_file), drafter="quantized-self", draft_quant="gguf", progress=False)
    with pytest.raises(UserError, match="neither a preset nor a .gguf file"):
        sparrow.load(str(gguf_file), quant="gguf", drafter="draft-model", draft=str(tmp_path), draft_quant="gguf",
                     progress=False)
    with pytest.raises(UserError, match="loaded from a GGUF file"):
        sparrow.load(str(gguf_file), quant="gguf", drafter="draft-model", draft=LoadedModel(source, tiny_tokenizer(),
                     "dense"), draft_quant="gguf", progress=False)
    with pytest.raises(UserError, match="CPU only"):
        load_gguf_model(str(gguf_file), device="meta", progress=False)
    assert parse_quant("GGUF", "quant") == "gguf"


@pytest.mark.real_model
def test_real_preset_decodes_identically_with_drafters():
    from sparrow.models.presets import PRESETS, is_installed

    if not is_installed(PRESETS["qwen2.5-coder-0.5b"]):
        pytest.skip("preset qwen2.5-coder-0.5b not installed")
    prompt = "Write a Python function `is_prime(n)` that checks whether n is a prime number."
    target = load_gguf_model("qwen2.5-coder-0.5b", progress=False)
    draft = load_gguf_model("qwen2.5-coder-0.5b", progress=False)  # its own blocks again: no float copy to make
    plain = None
    for drafter in ("none", "prompt-lookup", "draft-model"):
        pipe = sparrow.load(target, drafter=drafter, draft=draft if drafter == "draft-model" else None,
                            progress=False)
        result = pipe.generate(prompt, max_new_tokens=32, chat=True)
        plain = result.token_ids if plain is None else plain
        assert result.token_ids == plain, drafter
        assert drafter != "draft-model" or result.stats.num_accepted_tokens > 0


# --- --quant auto: the file's own blocks where this machine measured them fastest --------------------------------


def measured(monkeypatch, tmp_path, gguf_ms: float) -> None:
    """A stable fake measurement (float32 activations) whose gguf row costs `gguf_ms` at 1 row; w8a8 runs 8 rows in
    2.0 ms, float32 in 3.3."""
    from sparrow.runtime import hardware

    monkeypatch.setenv("SPARROW_DTYPE_BENCHMARK", "1")
    monkeypatch.setenv("SPARROW_HARDWARE_CACHE", str(tmp_path / "hardware"))
    costs = {"float32": {"1": 3.0, "8": 3.3}, "bfloat16": {"1": 3.1, "8": 9.9}, "int8": {"1": 1.0, "8": 2.5},
             "w8a8": {"1": 1.5, "8": 2.0}, "gguf": {"1": gguf_ms, "8": 1.5 * gguf_ms}}
    monkeypatch.setattr(hardware, "measure", lambda *a, **k: {
        "costs": costs, "quant_activations": "float32", "unit": "ms per matmul",
        "shape": list(hardware.BENCH_SHAPE), "seconds": 0.01})
    hardware.clear_cache()


def one_tensor_file(path, arch: str, qtype) -> str:
    """A GGUF file of architecture `arch` holding one [4, 256] layer weight of GGML type `qtype`."""
    import gguf
    import numpy as np
    from gguf_helpers import quantize

    values = np.random.default_rng(0).normal(size=(4, 256)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), arch)
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("blk.0.ffn_up.weight", values)
    else:
        writer.add_tensor("blk.0.ffn_up.weight", quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_which_files_run_on_their_blocks(gguf_file, tmp_path):
    """`--quant auto` considers the file's blocks only where `--quant gguf` runs most of its layers on them."""
    from gguf import GGMLQuantizationType as T

    from sparrow.models.gguf_source import gguf_file as is_gguf_source
    from sparrow.models.gguf_source import runs_on_blocks

    assert runs_on_blocks(str(gguf_file)) and is_gguf_source("qwen2.5-coder-1.5b")
    assert not is_gguf_source("tiny") and not is_gguf_source(None) and not runs_on_blocks("tiny")
    assert not runs_on_blocks(str(tmp_path / "missing.gguf"))
    assert runs_on_blocks(one_tensor_file(tmp_path / "q4k.gguf", "qwen2", T.Q4_K))
    assert not runs_on_blocks(one_tensor_file(tmp_path / "f32.gguf", "qwen2", T.F32))  # no blocks the kernels take
    assert not runs_on_blocks(one_tensor_file(tmp_path / "gemma.gguf", "gemma3", T.Q4_K))  # not built natively
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:100])
    assert not runs_on_blocks(str(cut))


def test_quant_auto_loads_the_files_blocks_where_they_measured_fastest(gguf_file, monkeypatch, tmp_path):
    """--quant auto on a GGUF source: where the GGUF kernels ran a step and a verify fastest, the target is built
    from the file's blocks (never a dense copy), and speculative decoding equals its own plain decoding; where they
    did not, auto is left to the loaded dense target; with compile alike."""
    from sparrow.drafters.plan import resolve_plan
    from sparrow.loading import PipelineCache
    from sparrow.models.gguf_source import settle_gguf
    from sparrow.runtime import hardware

    spec = str(gguf_file)
    measured(monkeypatch, tmp_path, gguf_ms=0.5)
    try:
        assert resolve_plan(spec, drafter="prompt-lookup", quant="auto").quant == "gguf"
        assert resolve_plan(spec, drafter="quantized-self", quant="auto").quant is None  # needs a dense target
        # with compile too: a GGUF target compiles and stays exact (before, auto never took its blocks there)
        assert resolve_plan(spec, drafter="prompt-lookup", quant="auto", compile=True).quant == "gguf"
        assert settle_gguf("int8", spec, "cpu", "auto") == "int8"
        pipe = sparrow.load(spec, quant="auto", drafter="prompt-lookup", num_draft_tokens=3, progress=False)
        assert pipe.target.model.sparrow_quantization.format == "gguf"
        for prompt in PROMPTS[1:]:
            result = pipe.generate(prompt, max_new_tokens=24)
            assert result.token_ids == pipe.generate_plain(prompt, max_new_tokens=24).token_ids
        cached = PipelineCache().get(spec, drafter="none", quant="auto")
        assert cached.target.model.sparrow_quantization.format == "gguf"
        measured(monkeypatch, tmp_path / "slow", gguf_ms=3.0)  # now slower than int8 and w8a8
        assert resolve_plan(spec, drafter="prompt-lookup", quant="auto").quant == "auto"
    finally:
        hardware.clear_cache()


def test_draft_quant_auto_runs_a_gguf_draft_on_its_blocks_where_they_measured_fastest(gguf_file, target, source,
                                                                                     monkeypatch, tmp_path):
    """--draft-quant auto (the CLI's default) for a draft with a GGUF source: its file's own blocks where the GGUF
    kernels ran one row fastest (loaded from the file, no dense draft); else, and for a draft that is no GGUF source,
    the format is settled on the loaded dense draft as before."""
    from sparrow.drafters.plan import resolve_plan
    from sparrow.runtime import hardware

    spec = str(gguf_file)
    measured(monkeypatch, tmp_path, gguf_ms=0.5)  # one row: gguf 0.5 ms, int8 1.0, w8a8 1.5, float32 3.0
    try:
        fmt, reason = hardware.choose_draft_quant("cpu", gguf=True)
        assert fmt == "gguf" and "6.0x faster than float32 at 1 row" in reason and "own blocks" in reason, reason
        assert hardware.choose_draft_quant("cpu")[0] == "int8"  # no GGUF source: as before
        assert hardware.choose_draft_quant("cpu", gguf=True, dtype=torch.bfloat16)[0] == "gguf"  # 8-bit activations
        assert resolve_plan(target, drafter="draft-model", draft=spec, draft_quant="auto").draft_quant == "gguf"
        dense = LoadedModel(source, tiny_tokenizer(), "dense")
        assert resolve_plan(target, drafter="draft-model", draft=dense, draft_quant="auto").draft_quant == "auto"
        pipe = sparrow.load(target, drafter="draft-model", draft=spec, draft_quant="auto", num_draft_tokens=3,
                            progress=False)
        assert pipe.drafter.draft_model.sparrow_quantization.format == "gguf"
        result = pipe.generate(PROMPTS[0], max_new_tokens=24)
        assert result.token_ids == pipe.generate_plain(PROMPTS[0], max_new_tokens=24).token_ids
        measured(monkeypatch, tmp_path / "slow", gguf_ms=3.0)  # int8 now runs one row fastest
        assert resolve_plan(target, drafter="draft-model", draft=spec, draft_quant="auto").draft_quant == "auto"
    finally:
        hardware.clear_cache()


def test_generate_serve_and_bench_take_quant_gguf_and_auto_settles_to_it(gguf_file, monkeypatch, tmp_path):
    """The three commands take the same --quant values; auto, where the GGUF kernels measured fastest, runs the
    file's blocks (generate: end to end; serve and bench: the format their loaders are given)."""
    import json

    from typer.testing import CliRunner

    import sparrow.bench.command
    from sparrow.cli import app
    from sparrow.runtime import hardware

    seen = []

    def no_loading(config, progress=True):
        seen.append(config.quant)
        raise UserError("stop before loading")

    def no_serving(plan):
        seen.append(plan.quant)
        raise UserError("stop before loading")

    class LoadAtOnce:
        def __init__(self, loader, **options):
            loader()

    monkeypatch.setattr(sparrow.bench.command, "load_models", no_loading)
    monkeypatch.setattr(sparrow, "load", no_serving)
    monkeypatch.setattr("sparrow.serve.Scheduler", LoadAtOnce)
    measured(monkeypatch, tmp_path, gguf_ms=0.5)
    try:
        for value in ("gguf", "auto"):
            result = CliRunner().invoke(app, ["bench", "--quick", "--methods", "plain,prompt-lookup", "--target",
                                              str(gguf_file), "--quant", value, "--out", str(tmp_path / "out"),
                                              "--no-progress", "--device", "cpu"])
            assert result.exit_code == 2 and "stop before loading" in result.output, result.output
            result = CliRunner().invoke(app, ["serve", "--target", str(gguf_file), "--drafter", "prompt-lookup",
                                              "--quant", value])
            assert result.exit_code == 2 and "stop before loading" in result.output, result.output
        assert seen == ["gguf"] * 4
        monkeypatch.undo()  # sparrow.load back; the measurement again:
        measured(monkeypatch, tmp_path, gguf_ms=0.5)
        result = CliRunner().invoke(app, ["generate", "The quick brown fox", "--target", str(gguf_file), "--drafter",
                                          "prompt-lookup", "--quant", "auto", "--max-new-tokens", "6", "--json"])
        assert result.exit_code == 0, result.output
        record = json.loads(result.stdout)
        assert record["quant"] == "gguf" and record["lossless_relative_to"] == "the gguf-quantized target"
    finally:
        hardware.clear_cache()

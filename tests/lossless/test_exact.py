"""Exact verification (`sparrow.runtime.batch_invariant`): each row of a short multi-token forward equals a one-token
forward at that position bit for bit, so greedy speculative output equals plain decoding token for token in
bfloat16 and on int4 / int8 quantized targets, through `sparrow.load` (what the CLI and server call), with
drafts accepted; negative controls: without it the rows differ bitwise."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_model
from transformers import Qwen2Config, Qwen2ForCausalLM

import sparrow
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.models.quantization import quantize_model
from sparrow.pipeline import Pipeline
from sparrow.runtime.batch_invariant import EACH_ROW, PAIR, exact_copy, exact_linear, is_exact, make_exact, probe
from sparrow.runtime.cached_model import prefill_module
from sparrow.runtime.runner import runner_for
from sparrow.types import Prompt

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is", "for i in range(10):",
           "The dog sleeps. The", "print(i * i)"]
TOKENS = 48


def rows_and_steps(model: torch.nn.Module, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the last k tokens of `ids`: from one k-token forward after a prefill of the rest, and from k
    one-token forwards."""
    runner = runner_for(model)
    runner.prefill(Prompt(input_ids=ids[:-k]))
    rows = runner.forward(ids[-k:]).logits
    runner.rewind(ids.numel() - k)
    steps = torch.cat([runner.forward(ids[ids.numel() - k + j:][:1]).logits for j in range(k)])
    return rows, steps


def rows_differ(model: torch.nn.Module, tokenizer) -> bool:
    """Whether some verify rows of `model` differ from its one-token steps (k = 2..9 after two context lengths)."""
    for text in (" ".join(PROMPTS), " ".join(PROMPTS * 3)):
        ids = torch.tensor(tokenizer(text)["input_ids"])
        if any(not torch.equal(*rows_and_steps(model, ids, k)) for k in range(2, 10)):
            return True
    return False


def check_rows(exact: torch.nn.Module, batched: torch.nn.Module | None, tokenizer) -> None:
    """Verify rows == one-token steps bit for bit on `exact` for k = 2..9 after two context lengths; and, the
    negative control, somewhere not on `batched` (the same model without exact forwards), when given."""
    for text in (" ".join(PROMPTS), " ".join(PROMPTS * 3)):
        ids = torch.tensor(tokenizer(text)["input_ids"])
        for k in range(2, 10):
            rows, steps = rows_and_steps(exact, ids, k)
            assert torch.equal(rows, steps), (ids.numel(), k)
    if batched is not None:
        assert rows_differ(batched, tokenizer)  # negative control: without exact forwards some rows differ


def tiny_128(seed: int = 0) -> torch.nn.Module:
    """Tiny Qwen2 whose linear layers the int4 kernel takes (in_features a multiple of the group size 128)."""
    torch.manual_seed(seed)  # tests only: model construction draws from the global generator
    config = Qwen2Config(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model.float().eval()


# --- the layers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_linear_rows_equal_one_row_forwards(dtype):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(512, 256, generator=g) * 0.05).to(dtype)
    x = torch.randn(1, 17, 256, generator=g).to(dtype)
    batched = exact_linear(x, weight, None, probe(weight, None))
    for j in range(17):
        assert torch.equal(batched[0, j], exact_linear(x[:, j : j + 1], weight, None)[0, 0])
    each = exact_linear(x, weight, None, EACH_ROW)  # the fallback for kernels failing the probe: exact too
    assert all(torch.equal(each[0, j], exact_linear(x[:, j : j + 1], weight, None)[0, 0]) for j in range(17))


def test_make_exact_switches_attention_and_dense_linears_only(tokenizer):
    model = tiny_model("qwen2", seed=0)
    counts = make_exact(model)
    assert counts[PAIR] + counts[EACH_ROW] == sum(type(m) is torch.nn.Linear for m in model.modules())
    assert model.config._attn_implementation == "sparrow_rowwise"
    assert make_exact(model) == counts  # idempotent


def test_exact_copy_leaves_the_users_model_alone(tokenizer):
    model = tiny_model("llama", seed=0)
    loaded = LoadedModel(model, tokenizer, "tiny")
    copy = exact_copy(loaded.model)
    assert is_exact(copy) and not is_exact(model) and exact_copy(loaded.model) is copy
    assert model.config._attn_implementation != "sparrow_rowwise"
    assert all("forward" not in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)
    assert copy.lm_head.weight is model.lm_head.weight  # weights shared, not copied


# --- rows == steps, with negative controls -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_verify_rows_equal_one_token_steps(tokenizer, arch):
    model = tiny_model(arch, seed=0).to(torch.bfloat16)
    check_rows(exact_copy(model), None, tokenizer)


def test_bfloat16_rows_differ_without_exact_forwards_on_some_model(tokenizer):
    """The negative control of the test above. Which tiny model shows it depends on the CPU's bf16 kernels: on an
    AVX2-only EPYC (bf16 converted inside the kernel) the qwen2 one's rows matched its steps, the llama one's not."""
    assert any(rows_differ(tiny_model(arch, seed=0).to(torch.bfloat16), tokenizer) for arch in ("llama", "qwen2"))


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_verify_rows_equal_one_token_steps(tokenizer, quant, dtype):
    model = tiny_128().to(dtype)
    exact = quantize_model(model, quant)
    make_exact(exact)
    check_rows(exact, quantize_model(model, quant), tokenizer)  # the int kernels are row-invariant, attention not


# --- speculative == plain through sparrow.load --------------------------------------------------------------


def generate_all(pipe: Pipeline, prompts: list[str] = PROMPTS) -> tuple[int, int]:
    """Speculative == plain on every prompt; returns (drafted, accepted)."""
    drafted = accepted = 0
    for prompt in prompts:
        result = pipe.generate(prompt, max_new_tokens=TOKENS)
        assert result.token_ids == pipe.generate_plain(prompt, max_new_tokens=TOKENS).token_ids, prompt
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    return drafted, accepted


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_speculative_equals_plain(tokenizer, arch, drafter):
    model = tiny_model(arch, seed=0).to(torch.bfloat16)
    target = LoadedModel(model, tokenizer, "tiny")
    draft = LoadedModel(perturbed(model, 0.05, seed=1), tokenizer, "close") if drafter != "prompt-lookup" else None
    pipe = sparrow.load(target, drafter=drafter, draft=draft, num_draft_tokens=4, adaptive=False, draft_quant="none",
                        exact=True)
    assert is_exact(pipe.target.model)
    drafted, accepted = generate_all(pipe)
    assert 0 < accepted <= drafted


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_quantized_target_speculative_equals_its_plain_decoding(tokenizer, quant, dtype, drafter):
    model = tiny_128().to(dtype)
    target = LoadedModel(model, tokenizer, "tiny-128")
    draft = LoadedModel(model, tokenizer, "same") if drafter == "draft-model" else None
    pipe = sparrow.load(target, drafter=drafter, draft=draft, num_draft_tokens=4, adaptive=False, quant=quant,
                        draft_quant="none")
    assert pipe.target.model.sparrow_quantization.name == quant and is_exact(pipe.target.model)
    assert prefill_module(pipe.target.model) is not pipe.target.model  # prefills with its dense source model
    long_prompt = "Paris is the capital of France. " * 8 + "Paris is"  # > MAX_ROWS tokens: a batched prefill
    drafted, accepted = generate_all(pipe, [*PROMPTS, long_prompt])
    assert 0 < accepted <= drafted


def test_exact_is_on_by_default_for_quantized_targets_only(tokenizer):
    target = LoadedModel(tiny_128(), tokenizer, "tiny-128")
    assert not is_exact(sparrow.load(target, drafter="prompt-lookup").target.model)
    assert is_exact(sparrow.load(target, drafter="prompt-lookup", quant="int8").target.model)


def test_exact_compile_without_a_draft_model_is_refused_before_loading():
    """exact=True keeps the target eager, so compile=True compiles only a draft model (tests/runtime/test_compiled.py);
    a drafter without one is refused."""
    with pytest.raises(UserError, match="compile=True .* exact=True"):
        sparrow.load("no-such-model-is-loaded", drafter="prompt-lookup", exact=True, compile=True)
    with pytest.raises(UserError, match="exact must be"):
        sparrow.load("no-such-model-is-loaded", drafter="prompt-lookup", exact="yes")


def test_cli_refuses_exact_with_compile_in_one_line_before_loading():
    from typer.testing import CliRunner

    from sparrow.cli import app

    result = CliRunner().invoke(app, ["generate", "hi", "--target", "no-such-model-is-loaded", "--drafter",
                                      "prompt-lookup", "--exact", "--compile"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--compile" in errors[0] and "Traceback" not in result.output


def test_sparrow_generate_takes_exact_as_load_does(tokenizer, monkeypatch):
    model = tiny_model("qwen2", seed=0).to(torch.bfloat16)
    target = LoadedModel(model, tokenizer, "tiny")
    draft = LoadedModel(perturbed(model, 0.05, seed=1), tokenizer, "close")
    cache = sparrow.PipelineCache(size=2)
    monkeypatch.setattr(sparrow, "PIPELINES", cache)
    models = dict(target=target, drafter="draft-model", draft=draft, num_draft_tokens=4, adaptive=False,
                  dtype="bfloat16", draft_quant="none")
    for prompt in PROMPTS[:3]:
        result = sparrow.generate(prompt, exact=True, max_new_tokens=TOKENS, **models)
        pipe = cache.get(**models, exact=True)  # the pipeline generate kept (one per exact setting)
        assert pipe.exact and len(cache) == 1
        assert result.token_ids == pipe.generate_plain(prompt, max_new_tokens=TOKENS).token_ids, prompt
        assert 0 < result.stats.num_accepted_tokens
    sparrow.generate(PROMPTS[0], exact=False, max_new_tokens=4, **models)
    assert len(cache) == 2 and not cache.get(**models, exact=False).exact
    with pytest.raises(UserError, match="exact must be True, False or None"):
        sparrow.generate(PROMPTS[0], exact="yes", **models)

"""Bad input gets a clear error naming the argument; the CLI exits non-zero with one line."""

from __future__ import annotations

import json
import re

import pytest
from conftest import tiny_model
from typer.testing import CliRunner

from sparrow.cli import app
from sparrow.drafters import build_drafter
from sparrow.loading import load
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline


@pytest.fixture(scope="module")
def pipe(loaded_target) -> Pipeline:
    return Pipeline(loaded_target, build_drafter("prompt-lookup", loaded_target, None, 4))


@pytest.mark.parametrize(
    ("prompt", "options", "match"),
    [
        ("", {}, "prompt"),
        ("   ", {}, "prompt"),
        ([], {}, "prompt"),
        ([1, 10**6], {}, "prompt token ids"),
        ("hi", {"max_new_tokens": 0}, "max_new_tokens"),
        ("hi", {"max_new_tokens": 2000}, "max_new_tokens"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"top_k": -2}, "top_k"),
        ("hi", {"stop": [""]}, "stop"),
        ("hello " * 1100, {}, "prompt is .* tokens long"),
    ],
)
def test_bad_requests_raise_value_error_naming_the_argument(pipe, prompt, options, match):
    with pytest.raises(ValueError, match=match):
        pipe.generate(prompt, **options)


def test_bad_pipeline_arguments(loaded_target, tokenizer):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_drafter("prompt-lookup", loaded_target, None, 0)
    with pytest.raises(ValueError, match="unknown drafter 'medusa'"):
        build_drafter("medusa", loaded_target)
    with pytest.raises(ValueError, match="needs a draft model"):
        build_drafter("draft-model", loaded_target, None)
    with pytest.raises(ValueError, match="unknown verifier"):
        Pipeline(loaded_target, None, verifier="typical")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        load(loaded_target, drafter="prompt-lookup", num_draft_tokens=0)
    with pytest.raises(ValueError, match="unknown drafter"):
        load(loaded_target, drafter="hydra")
    with pytest.raises(ValueError, match="--drafter eagle needs a head for .*: --head PATH"):
        load(loaded_target, drafter="eagle")


def test_vocab_mismatch_names_both_sizes(loaded_target, tokenizer):
    other = LoadedModel(tiny_model("llama", seed=3, vocab_size=500), tokenizer, "other")
    with pytest.raises(ValueError, match=r"\(500 tokens\).*\(320 tokens\)"):
        build_drafter("draft-model", loaded_target, other, 4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, loaded_target):
    path = tmp_path_factory.mktemp("tiny-model")
    loaded_target.model.save_pretrained(path)
    loaded_target.tokenizer.save_pretrained(path)
    return str(path)


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["", "--drafter", "prompt-lookup"], "prompt must not be empty"),
        (["hi", "--drafter", "prompt-lookup", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["hi", "--drafter", "prompt-lookup", "-k", "0"], "-k/--num-draft-tokens"),
        (["hi", "--drafter", "prompt-lookup", "--temperature", "-1"], "--temperature"),
        (["hi", "--drafter", "prompt-lookup", "--top-p", "2"], "--top-p"),
        (["hi", "--draft", "no-such-model"], "no-such-model"),
    ],
)
def test_cli_errors_are_one_line(model_dir, args, match, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("generate", *args, "--target", model_dir, "--dtype", "float32")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and match in errors[0], result.output
    assert result.output.rstrip().splitlines()[-1] == errors[0]
    assert "Traceback" not in result.output


def test_cli_unknown_target_preset(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("generate", "hi", "--target", "llama-9000", "--drafter", "none")
    assert result.exit_code == 2 and "llama-9000" in result.output and "Traceback" not in result.output


def test_cli_unknown_drafter_exits_non_zero(model_dir):
    result = cli("generate", "hi", "--target", model_dir, "--drafter", "medusa")
    assert result.exit_code != 0 and "medusa" in result.output


def test_cli_json_compare_prints_one_object(model_dir):
    result = cli("generate", "The quick brown fox", "--target", model_dir, "--drafter", "draft-model", "--draft",
                 model_dir, "--dtype", "float32", "--max-new-tokens", "12", "-k", "4", "--fixed", "--compare", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    for key in ("text", "token_ids", "new_tokens", "seconds", "tokens_per_second", "mean_accepted_tokens",
                "acceptance_rate", "drafter", "target", "baseline", "identical", "speedup"):
        assert key in record
    assert record["identical"] is True and record["new_tokens"] == 12
    assert record["baseline"]["token_ids"] == record["token_ids"]
    assert record["acceptance_rate"] == 1.0 and record["mean_accepted_tokens"] > 3  # draft == target


def test_unknown_drafter_option_names_it_and_the_accepted_ones(loaded_target):
    with pytest.raises(ValueError, match=r"'prompt-lookup' does not accept option 'bogus'; its options: .*tree_budget"):
        load(loaded_target, drafter="prompt-lookup", bogus=1)
    with pytest.raises(ValueError, match=r"'none' does not accept option 'budget'"):
        build_drafter("none", loaded_target, budget=4)


def test_a_drafter_registered_later_is_accepted(loaded_target, monkeypatch):
    from sparrow.drafters import REGISTRY, DrafterEntry, PromptLookupDrafter, drafter_names

    def build_mine(target, draft, num_draft_tokens, adaptive, min_n: int = 1):
        return PromptLookupDrafter(num_draft_tokens=num_draft_tokens, min_n=min_n)

    monkeypatch.setitem(REGISTRY, "mine", DrafterEntry(build_mine, default_num_draft_tokens=3))
    assert "mine" in drafter_names()
    pipe = load(loaded_target, drafter="mine", min_n=2)
    assert isinstance(pipe.drafter, PromptLookupDrafter) and pipe.drafter.min_n == 2
    with pytest.raises(ValueError, match="its options: min_n"):
        build_drafter("mine", loaded_target, max_n=2)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--tree-budget", "lots"], "--tree-budget must be an integer >= 0 or 'auto', got 'lots'"),
        (["--tree-budget", "-1"], "--tree-budget"),
        (["--tree-budget", "8", "--tree-topk", "0"], "--tree-topk must be an integer >= 1"),
        (["--tree-budget", "auto", "--tree-depth", "0"], "--tree-depth must be an integer >= 1"),
        (["--drafter", "sparse", "--tree-budget", "8"], "drafter 'sparse' does not accept option 'tree_budget'"),
    ],
)
def test_cli_tree_flags_fail_before_loading(args, match, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("generate", "hi", "--target", "no-such-model-dir", *args)  # loading it would fail differently
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"error: {result.output.strip().removeprefix('error: ')}"]
    assert match in result.output and "Traceback" not in result.output


def test_cli_json_reports_the_tree(model_dir):
    args = ["generate", "a b a b a b a b", "--target", model_dir, "--drafter", "prompt-lookup", "--dtype", "float32",
            "--max-new-tokens", "6", "--json"]
    assert json.loads(cli(*args).stdout)["tree"] is None  # a chain
    result = cli(*args, "--tree-budget", "8", "--tree-depth", "3")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tree"] == {"budget": 8, "topk": 4, "depth": 3}


def test_cli_debug_shows_user_errors_with_their_traceback():
    result = cli("--debug", "generate", "", "--drafter", "prompt-lookup")
    assert result.exit_code == 2, result.output  # still a user error: --debug only adds the traceback
    assert "Traceback (most recent call last):" in result.stderr and "UserError" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == "error: prompt must not be empty"


def test_cli_internal_errors_keep_their_traceback(monkeypatch):
    import sparrow

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(sparrow, "load", broken)
    result = cli("generate", "hi", "--drafter", "prompt-lookup")
    assert result.exit_code == 1, result.output  # a bug: never 2, never the one-line `error:` of user errors
    assert "Traceback (most recent call last):" in result.stderr
    assert "RuntimeError: CUDA error: device-side assert triggered" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("internal error: RuntimeError: CUDA error")
    assert not any(line.startswith("error:") for line in result.output.splitlines())


# --- refused before any model loads: the options and the models' config.json --------------------------------


@pytest.fixture
def no_loading(monkeypatch):
    """sparrow.load's loader replaced by a failure: a test passes only where the refusal comes before loading."""
    import sparrow.loading

    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(sparrow.loading, "load_model", fail)


def config_only(directory, config) -> str:
    """A model directory holding only `config`'s config.json: loading it would fail (no weights)."""
    config.save_pretrained(directory)
    return str(directory)


def softcapped_config():
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0)


@pytest.mark.parametrize(
    ("family", "options", "match"),
    [
        ("llama", {"drafter": "draft-model", "draft": None}, "drafter 'draft-model' needs a draft model"),
        ("llama", {"drafter": "eagle"}, "--drafter eagle needs a head for "),
        ("llama", {"drafter": "eagle", "head": "/no/such/head"}, "--head '/no/such/head' is not a directory"),
        ("llama", {"drafter": "layer-skip"}, "no tuned skip set ships for model "),
        ("llama", {"drafter": "quantized-self", "draft_vocab": 1000},
         "--draft-vocab 1000 is over the target's vocabulary of 320 tokens"),
        ("llama", {"drafter": "prompt-lookup", "quant": "w8a8", "compile": True},
         "compile=True (--compile) with a w8a8 target runs eagerly"),
        ("llama", {"drafter": "draft-model", "draft": "gemma3", "compile": True},
         "compile: models with sliding-window or non-attention layers (the draft model)"),
        ("gemma3", {"drafter": "sparse"}, "drafter 'sparse' needs a target whose layers all use full attention"),
        ("gemma3", {"drafter": "prompt-lookup", "compile": True}, "compile: models with sliding-window"),
        ("gemma3", {"drafter": "layer-skip", "skip_set": {"num_layers": 2, "mlp": [1]}, "tree_budget": 4},
         "--drafter layer-skip with a draft tree (--tree-budget) needs a target without sliding-window layers"),
        ("gemma2", {"drafter": "quantized-self", "draft_vocab": 100}, "final logit soft-capping"),
        # the draft model sharing no vocabulary (a preset target with the default draft of another family)
        ("llama", {"drafter": "draft-model", "draft": "llama-500"},
         "has another vocabulary than target '{target}' (500 against 320 tokens), and --drafter draft-model needs "
         "the same one: pass --draft with the target's tokenizer, or --drafter cross-vocab"),
    ],
)
def test_what_the_models_config_rules_out_is_refused_before_loading(family, options, match, tmp_path, no_loading):
    from conftest import tiny_gemma3

    def config(name):
        if name == "gemma2":
            return softcapped_config()
        if name == "llama-500":
            return tiny_model("llama", seed=0, vocab_size=500).config
        return (tiny_gemma3(num_layers=2) if name == "gemma3" else tiny_model(name, seed=0)).config

    if isinstance(options.get("draft"), str):
        options = {**options, "draft": config_only(tmp_path / "draft", config(options["draft"]))}
    target = config_only(tmp_path / "target", config(family))
    with pytest.raises(ValueError, match=re.escape(match.format(target=target))) as error:
        load(target, **options)
    assert "\n" not in str(error.value)


def test_a_format_without_a_kernel_on_the_device_is_refused_before_loading(tmp_path, no_loading, monkeypatch):
    import torch

    import sparrow.drafters.requirements

    monkeypatch.setattr(sparrow.drafters.requirements, "resolve_device", lambda device: torch.device("cuda"))
    target = config_only(tmp_path, tiny_model("llama", seed=0).config)
    with pytest.raises(ValueError, match="w8a8 runs on the CPU only"):
        load(target, drafter="prompt-lookup", quant="w8a8")


def test_cli_eagle_with_a_missing_head_fails_before_loading(tmp_path, no_loading):
    target = config_only(tmp_path, tiny_model("llama", seed=0).config)
    result = cli("generate", "hi", "--target", target, "--drafter", "eagle", "--head", str(tmp_path / "missing"))
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"error: --head {str(tmp_path / 'missing')!r} is not a directory "
                                                  "(a head: config.json and model.safetensors, exported by SpecForge "
                                                  "or saved by `sparrow train head`)"]

"""vLLM's speculative_config: each key maps as documented; unknown methods and keys, keys that do not apply, and
flags that contradict a key are refused naming them; malformed JSON is a one-line error (before any model loads)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import sparrow
from sparrow.cli import app
from sparrow.drafters.prompt_lookup import PromptLookupDrafter
from sparrow.drafters.suffix import SuffixDrafter
from sparrow.errors import UserError
from sparrow.speculative_config import apply, parse, resolve


def test_each_key_maps_onto_sparrows_options():
    ngram = resolve({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert (ngram.drafter, ngram.num_draft_tokens, ngram.draft, ngram.options) == (
        "prompt-lookup", 5, None, {"max_n": 4, "min_n": 2})
    model = resolve({"method": "draft_model", "model": "qwen2.5-coder-0.5b"})
    assert (model.drafter, model.draft, model.options) == ("draft-model", "qwen2.5-coder-0.5b", {})
    for method in ("eagle", "eagle3"):
        head = resolve({"method": method, "model": "/heads/h", "num_speculative_tokens": 3})
        expected = ("eagle", None, 3, {"head": "/heads/h"})
        assert (head.drafter, head.draft, head.num_draft_tokens, head.options) == expected
    suffix = resolve('{"method": "suffix", "suffix_decoding_max_tree_depth": 32, '
                     '"suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.05, '
                     '"suffix_decoding_max_cached_requests": 100}')
    assert suffix.drafter == "suffix" and suffix.options == {"max_tree_depth": 32, "max_spec_factor": 2.0,
                                                             "min_token_prob": 0.05, "max_cached_requests": 100}


def test_method_is_inferred_like_vllm():
    assert resolve({"model": "d"}).drafter == "draft-model"
    assert resolve({"prompt_lookup_max": 3}).drafter == "prompt-lookup"
    with pytest.raises(UserError, match="needs 'method'"):
        resolve({"num_speculative_tokens": 3})


@pytest.mark.parametrize("config, named", [
    ({"method": "mtp"}, "'mtp'"), ({"method": "medusa"}, "'medusa'"), ({"method": "lookahead"}, "'lookahead'"),
    ({"method": "ngram", "draft_tensor_parallel_size": 1}, "'draft_tensor_parallel_size'"),
    ({"method": "suffix", "speculative_token_tree": "[(0,)]"}, "'speculative_token_tree'"),
    ({"method": "ngram", "model": "x"}, "'model'"),
    ({"method": "draft_model", "model": "x", "prompt_lookup_max": 3}, "'prompt_lookup_max'"),
    ({"method": "ngram", "suffix_decoding_max_tree_depth": 8}, "'suffix_decoding_max_tree_depth'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens'"),
    ({"method": "ngram", "prompt_lookup_min": "2"}, "'prompt_lookup_min'"),
])
def test_unknown_methods_and_keys_are_refused_naming_them(config, named):
    with pytest.raises(UserError, match=named) as e:
        resolve(config)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ['{"method": "ngram"', "[1, 2]", "", "{'method': 'ngram'}"])
def test_malformed_json_is_a_one_line_error(text):
    with pytest.raises(UserError, match="--speculative-config") as e:
        parse(text)
    assert "\n" not in str(e.value)


def test_a_contradicting_flag_is_refused_naming_both():
    with pytest.raises(UserError, match=r"--drafter 'draft-model' contradicts speculative config key 'method'"):
        apply({"method": "suffix"}, {"drafter": "draft-model"})
    with pytest.raises(UserError, match=r"-k/--num-draft-tokens 4 .* 'num_speculative_tokens'"):
        apply({"method": "suffix", "num_speculative_tokens": 8}, {"num_draft_tokens": 4})
    with pytest.raises(UserError, match=r"--head .* 'model'"):
        apply({"method": "eagle", "model": "a"}, {"head": "b"})
    agreeing = apply({"method": "suffix", "num_speculative_tokens": 8}, {"drafter": "suffix", "num_draft_tokens": 8})
    assert agreeing[:3] == ("suffix", None, 8)


def test_python_api_takes_speculative_config(loaded_target):
    pipe = sparrow.load(loaded_target, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert isinstance(pipe.drafter, PromptLookupDrafter)
    assert (pipe.drafter.min_n, pipe.drafter.max_n, pipe.drafter.length.max_tokens) == (2, 4, 3)
    pipe = sparrow.load(loaded_target, speculative_config='{"method": "suffix", "suffix_decoding_min_token_prob": 0.3}')
    assert isinstance(pipe.drafter, SuffixDrafter) and pipe.drafter.config.min_token_prob == 0.3
    with pytest.raises(UserError, match=r"drafter= 'prompt-lookup' contradicts .* 'method'"):
        sparrow.load(loaded_target, drafter="prompt-lookup", speculative_config={"method": "suffix"})


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_the_commands_refuse_bad_configs_in_one_line(command):
    prompt = ["hi"] if command == "generate" else []
    for text, named in (('{"method": ', "not valid JSON"), ('{"method": "mtp"}', "'mtp'"),
                        ('{"method": "suffix", "quantization": "fp8"}', "'quantization'")):
        result = CliRunner().invoke(app, [command, *prompt, "--speculative-config", text])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert lines[-1].startswith("error: ") and named in lines[-1], result.output
    if command != "bench":  # bench lists methods, not a --drafter to contradict
        result = CliRunner().invoke(app, [command, *prompt, "--drafter", "prompt-lookup", "--speculative-config",
                                          '{"method": "suffix"}'])
        assert result.exit_code == 2 and "--drafter 'prompt-lookup' contradicts" in result.output, result.output


def test_bench_adds_the_configs_method_with_its_options(monkeypatch, tmp_path):
    import importlib

    bench_cli = importlib.import_module("sparrow.cli.bench")  # the module (sparrow.cli.bench is also the command)

    seen = {}

    def fake_run(**kwargs):
        seen.update(kwargs)
        report = tmp_path / "report.md"
        report.write_text("ok")
        return report

    monkeypatch.setattr(bench_cli, "run", fake_run)
    config = '{"method": "suffix", "num_speculative_tokens": 12, "suffix_decoding_max_spec_factor": 2.0}'
    result = CliRunner().invoke(app, ["bench", "--quick", "--methods", "plain,prompt-lookup",
                                      "--speculative-config", config])
    assert result.exit_code == 0, result.output
    assert seen["methods"] == "plain,prompt-lookup,suffix" and seen["k"] == 12
    assert seen["drafter_options"] == {"suffix": {"max_spec_factor": 2.0}}
    result = CliRunner().invoke(app, ["bench", "-k", "4", "--speculative-config", config])
    assert result.exit_code == 2 and "-k/--num-draft-tokens 4 contradicts" in result.output

"""`sparrow generate --compare` times both paths fairly: each warmed up untimed, then timed in ABBA order, each
reported as the median of its runs with their min-max; every run's output is checked against plain decoding.
Timings are injected (fake generations with chosen durations): nothing here depends on the machine's speed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import tiny_model, tiny_tokenizer
from typer.testing import CliRunner

from sparrow.bench.compare import abba, compare
from sparrow.cli import app
from sparrow.pipeline import Pipeline
from sparrow.request import Request
from sparrow.types import GenerationResult, GenerationStats

TOKENS = [5, 6, 7, 8]


def fake(seconds: float, token_ids: list[int] = TOKENS) -> GenerationResult:
    stats = GenerationStats(steps=len(token_ids), num_draft_tokens=0, num_accepted_tokens=0,
                            accepted_per_position=(), drafted_per_position=(), prefill_seconds=0.0,
                            draft_seconds=0.0, verify_seconds=0.0)
    return GenerationResult(token_ids=list(token_ids), text="x", finish_reason="length", seconds=seconds, stats=stats)


def test_the_order_is_abba():
    assert [abba(n) for n in (1, 2, 3)] == ["AB", "ABBA", "ABBAAB"]
    with pytest.raises(ValueError):
        abba(0)


def test_warm_up_first_then_abba_and_the_medians():
    calls: list[str] = []
    spec_seconds, plain_seconds = iter([1.0, 4.0, 0.5]), iter([2.0, 8.0, 1.0])

    def speculative():
        calls.append("A")
        return fake(next(spec_seconds))

    def plain():
        calls.append("B")
        return fake(next(plain_seconds))

    comparison = compare(speculative, plain, lambda: calls.append("warm"), runs=3)
    assert calls == ["warm", "A", "B", "B", "A", "A", "B"] and comparison.order == "ABBAAB"
    assert comparison.speculative_timing.rates == (4.0, 1.0, 8.0)  # 4 tokens in 1, 4, 0.5 s
    assert comparison.speculative_timing.median == 4.0 and comparison.plain_timing.median == 2.0
    assert (comparison.plain_timing.low, comparison.plain_timing.high) == (0.5, 4.0)
    assert comparison.speedup == 2.0 and comparison.identical


def test_one_differing_run_makes_the_comparison_not_identical():
    runs = iter([fake(1.0), fake(1.0), fake(1.0), fake(1.0, [5, 6, 7, 9])])  # A B B A: the second A differs
    comparison = compare(lambda: next(runs), lambda: next(runs), lambda: None, runs=2)
    assert not comparison.identical


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model("llama", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def test_cli_compare_reports_medians_of_abba_runs_after_an_untimed_warm_up(model_dir, monkeypatch):
    """The CLI with generations replaced: the warm-up (a few tokens of the prompt) takes 100 s and must not show;
    the timed runs take the injected times, in ABBA order, and the table shows their medians and spread."""
    calls: list[tuple[str, int]] = []
    timed = {"A": iter([1.0, 4.0]), "B": iter([2.0, 8.0])}  # speculative: 4 and 1 tok/s; plain: 2 and 0.5

    def run(path: str):
        def generate(self, request, **options):  # the CLI builds its request once, then generates it
            assert isinstance(request, Request) and not options
            n = request.stopping.max_new_tokens
            calls.append((path, n))
            result = fake(100.0 if n < 12 else next(timed[path]), TOKENS[:n] * 3)
            return replace(result, ran=self.ran(self.drafter))  # what a pipeline's result says ran it
        return generate

    encode = Pipeline.encode
    encoded: list[str] = []

    def counted(self, prompt, *args, **kwargs):
        encoded.append(prompt)
        return encode(self, prompt, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "encode", counted)
    monkeypatch.setattr(Pipeline, "generate", run("A"))
    monkeypatch.setattr(Pipeline, "generate_plain", run("B"))
    args = ["generate", "The quick brown fox", "--target", model_dir, "--draft", model_dir, "--dtype", "float32",
            "--max-new-tokens", "12", "--compare"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert calls == [("A", 8), ("B", 8), ("A", 12), ("B", 12), ("B", 12), ("A", 12)]  # warm-up, then ABBA
    assert encoded == ["The quick brown fox"]  # one request, tokenized once, checked and generated
    record = json.loads(result.stdout)
    assert record["compare"]["order"] == "ABBA" and record["compare"]["runs"] == 2
    assert record["compare"]["speculative"]["tokens_per_second"] == [12.0, 3.0]
    assert record["tokens_per_second"] == 7.5 and record["baseline"]["tokens_per_second"] == 3.75  # medians
    assert record["speedup"] == 2.0 and record["identical"] is True
    timed = {"A": iter([1.0, 4.0, 2.0]), "B": iter([2.0, 8.0, 4.0])}
    calls.clear()
    monkeypatch.setenv("COLUMNS", "300")
    table = CliRunner().invoke(app, [*args, "--compare-runs", "3"]).output
    assert [c[0] for c in calls] == ["A", "B", "A", "B", "B", "A", "A", "B"]
    assert "12 in 2.00 s = 6.00 tok/s (median of 3 runs: 3.00-12.00)" in table
    assert "3.00 tok/s (median of 3 runs: 1.50-6.00)" in table and "2.00x (medians; ABBAAB order" in table
    assert "yes (all 6 runs)" in table


def test_compare_runs_must_be_positive(model_dir):
    result = CliRunner().invoke(app, ["generate", "hi", "--target", model_dir, "--compare", "--compare-runs", "0"])
    assert result.exit_code == 2 and "--compare-runs" in result.output


def test_each_timed_suffix_run_drafts_as_the_first_request_of_a_fresh_process():
    """suffix keeps a store of earlier outputs, and `--compare` repeats one prompt: the second speculative run
    drafted the answer from the first (the 1.5B on a Xeon: 37 tok/s against 15), a speedup no new request gets. Each
    timed run now starts with the store emptied (`forget_requests`), so every run drafts (and accepts) what a fresh
    process's first request does; the negative control: a repeat without forgetting accepts more."""
    from sparrow.cli.generate import run_compare
    from sparrow.drafters import build_drafter
    from sparrow.drafters.base import forget_requests
    from sparrow.models import LoadedModel

    target = LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny")

    def pipe() -> Pipeline:
        return Pipeline(target, build_drafter("suffix", target, None, 8))

    compared = pipe()
    request = compared.request("The quick brown fox jumps over", max_new_tokens=40)
    fresh = pipe().generate(request).stats.num_accepted_tokens
    comparison = run_compare(compared, request, 2)
    assert [r.stats.num_accepted_tokens for r in comparison.speculative] == [fresh, fresh]
    assert comparison.identical
    assert compared.generate(request).stats.num_accepted_tokens > fresh  # the store holds the last run's answer
    forget_requests(compared.drafter)
    assert compared.drafter.store.tokens() == 0 and compared.generate(request).stats.num_accepted_tokens == fresh

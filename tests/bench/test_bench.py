"""sparrow bench: metrics on hand-made rows, question loading, and a whole run on tiny random models."""

from __future__ import annotations

import json
import re

import pytest
from conftest import perturbed, tiny_model, tiny_tokenizer
from typer.testing import CliRunner

import sparrow.bench.command
from sparrow.bench.command import run_to_dir
from sparrow.bench.data import (
    DEFAULT_DATA,
    TASKS,
    Question,
    load_questions,
    read_questions,
    select,
    shortest_per_task,
    task_of,
)
from sparrow.bench.methods import parse_methods
from sparrow.bench.metrics import (
    acceptance_per_position,
    dedupe,
    exact_matches,
    mean_accepted_tokens,
    mean_std,
    speedups,
    summarize,
)
from sparrow.bench.report import read_rows, render_markdown
from sparrow.bench.runner import BenchConfig, Models, Runner, conversation_ids
from sparrow.cli import app
from sparrow.models import LoadedModel
from sparrow.types import GenerationStats, StepStats


def row(method, qid, repeat, tps, *, task="qa", baseline="plain", tokens=(1, 2), steps=None, step_tokens=None,
        accepted=None, drafted=None, run_id="r1"):
    return {"run_id": run_id, "setup_key": "s", "method": method, "baseline": baseline, "question_id": qid,
            "task": task, "category": task, "repeat": repeat, "tokens_per_second": tps,
            "token_hash": str(tokens), "decoding_steps": steps, "step_tokens": step_tokens,
            "accepted_per_position": accepted, "drafted_per_position": drafted}


# ---------------------------------------------------------------- metrics

def test_speedup_is_a_ratio_of_mean_tokens_per_second_not_a_mean_of_ratios():
    method = [row("m", 1, 0, 4.0), row("m", 2, 0, 6.0)]
    base = [row("plain", 1, 0, 2.0), row("plain", 2, 0, 4.0)]
    assert speedups(method, base) == [pytest.approx(5.0 / 3.0)]  # a mean of ratios would be 1.75


def test_speedup_pairs_questions_within_a_repeat_and_skips_unpaired_ones():
    method = [row("m", 1, 0, 4.0), row("m", 2, 0, 100.0), row("m", 1, 1, 6.0)]
    base = [row("plain", 1, 0, 2.0), row("plain", 1, 1, 2.0)]
    assert speedups(method, base) == [pytest.approx(2.0), pytest.approx(3.0)]


def test_mean_accepted_tokens_counts_the_bonus_token_and_pools_steps():
    stats = GenerationStats.from_steps([StepStats(4, 3, 0, 0), StepStats(4, 0, 0, 0)], 0.0)
    assert stats.mean_accepted_tokens == pytest.approx((3 + 1 + 0 + 1) / 2)  # accepted + bonus per round
    rows = [row("m", 1, 0, 1.0, steps=2, step_tokens=5), row("m", 2, 0, 1.0, steps=8, step_tokens=8)]
    assert mean_accepted_tokens(rows) == pytest.approx(13 / 10)  # pooled over steps, not (2.5 + 1) / 2
    assert mean_accepted_tokens([row("plain", 1, 0, 1.0, steps=0, step_tokens=0)]) is None


def test_acceptance_per_position_pools_rounds_of_different_widths():
    rows = [row("m", 1, 0, 1.0, accepted=[3, 1], drafted=[4, 2]), row("m", 2, 0, 1.0, accepted=[1], drafted=[2]),
            row("plain", 1, 0, 1.0)]
    assert acceptance_per_position(rows) == pytest.approx((4 / 6, 1 / 2))


def test_mean_std_and_exact_match():
    assert mean_std([1.0, 2.0, 3.0]) == (pytest.approx(2.0), pytest.approx(1.0))
    assert mean_std([1.5]) == (1.5, 0.0)
    with pytest.raises(ValueError):
        mean_std([])
    method = [row("m", 1, 0, 1.0, tokens=(1, 2)), row("m", 2, 0, 1.0, tokens=(9,)), row("m", 3, 0, 1.0)]
    base = [row("plain", 1, 0, 1.0, tokens=(1, 2)), row("plain", 2, 0, 1.0, tokens=(1,))]
    assert exact_matches(method, base) == (1, 2)


def test_summarize_per_task_and_overall_with_std_over_repeats():
    rows = []
    for repeat, factor in ((0, 2.0), (1, 3.0)):
        for qid, task in ((1, "qa"), (2, "rag")):
            rows.append(row("plain", qid, repeat, 10.0, task=task, steps=9, step_tokens=9))
            rows.append(row("m", qid, repeat, 10.0 * factor, task=task, steps=4, step_tokens=9,
                            accepted=[3, 2], drafted=[4, 4]))
    cells = {(c.task, c.method): c for c in summarize(rows)}
    assert list(dict.fromkeys(t for t, _ in cells)) == ["qa", "rag", "overall"]  # Spec-Bench's task order
    overall = cells[("overall", "m")]
    assert overall.speedup == pytest.approx(2.5) and overall.speedup_std == pytest.approx(0.7071, abs=1e-4)
    assert overall.questions == 2 and overall.repeats == 2
    assert overall.mean_accepted_tokens == pytest.approx(9 / 4)
    assert overall.acceptance_per_position == pytest.approx((0.75, 0.5))
    assert overall.exact == overall.compared == 4
    assert cells[("overall", "plain")].speedup is None and cells[("qa", "plain")].mean_accepted_tokens == 1.0
    markdown = render_markdown(rows)
    assert "| m | plain | 2 | 2 |" in markdown and "2.50x ± 0.71" in markdown


def test_dedupe_keeps_the_latest_run():
    rows = [row("m", 1, 0, 9.0, run_id="b"), row("m", 1, 0, 1.0, run_id="a"), row("m", 2, 0, 5.0, run_id="a")]
    kept = sorted((r["question_id"], r["tokens_per_second"]) for r in dedupe(rows))
    assert kept == [(1, 9.0), (2, 5.0)]


# ---------------------------------------------------------------- data and methods

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["def add(a, b):", "The quick brown fox"]},
    {"question_id": 2, "category": "coding", "turns": ["for i in range(10):"]},
    {"question_id": 3, "category": "qa", "turns": ["Paris is the capital of"]},
    {"question_id": 4, "category": "qa", "turns": ["Berlin is the capital of"]},
    {"question_id": 5, "category": "summarization", "turns": ["The dog sleeps. The quick brown fox jumps over"]},
]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_questions_load_group_and_filter(data):
    questions = read_questions(data)
    assert [q.task for q in questions] == ["mt_bench", "mt_bench", "qa", "qa", "summarization"]
    assert task_of("roleplay") == "mt_bench" and task_of("rag") == "rag"
    assert [q.question_id for q in select(questions, ["qa"])] == [3, 4]
    assert [q.question_id for q in select(questions, ["mt_bench"])] == [1, 2]
    assert [q.question_id for q in select(questions, limit=1)] == [1, 2, 3, 5]
    assert [q.question_id for q in select(questions, per_task=1)] == [1, 3, 5]
    more = [*questions, Question(6, "writing", ("x",)), Question(7, "coding", ("y",))]
    assert [q.question_id for q in select(more, ["mt_bench"], per_task=3)] == [1, 2, 6]  # round-robin categories
    assert questions[0].turns == ("def add(a, b):", "The quick brown fox")
    assert [q.question_id for q in shortest_per_task(questions)] == [1, 3, 5]
    assert [q.question_id for q in shortest_per_task(questions, 2)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("call, message", [
    (lambda d: load_questions(d.parent / "missing.jsonl"), "does not exist"),
    (lambda d: load_questions(d, ["poetry"]), "unknown categories 'poetry'"),
    (lambda d: load_questions(d, limit=0), "limit must be an integer >= 1"),
    (lambda d: load_questions(d, per_task=-1), "per_task must be an integer >= 1"),
])
def test_bad_data_arguments_are_clear_errors(data, call, message):
    with pytest.raises(ValueError, match=message):
        call(data)


def test_malformed_data_line_names_the_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n{\"category\": \"qa\"}\n")
    with pytest.raises(ValueError, match="line 2"):
        read_questions(path)


def test_methods_get_their_baselines_first():
    assert parse_methods("draft-model,hf-assisted") == ["plain", "hf-plain", "draft-model", "hf-assisted"]
    assert parse_methods("prompt-lookup") == ["plain", "prompt-lookup"]
    with pytest.raises(ValueError, match="unknown methods 'medusa'"):
        parse_methods("plain,medusa")
    with pytest.raises(ValueError, match="at least one"):
        parse_methods(" , ")


def test_conversation_continues_with_the_methods_own_answers():
    tok = tiny_tokenizer()
    assert conversation_ids(tok, ["def add(a, b):"], [], chat=True) == tok("def add(a, b):")["input_ids"]
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids = conversation_ids(tok, ["def add(a, b):", "The dog"], ["return a + b"], chat=True)
    assert tok.decode(ids) == "<user>def add(a, b):<assistant>return a + b<user>The dog<assistant>"
    with pytest.raises(AssertionError):
        conversation_ids(tok, ["a", "b"], [], chat=True)


@pytest.mark.parametrize("args, message", [
    (["--data", "/nonexistent/question.jsonl"], "does not exist"),
    (["--methods", "plain,medusa"], "unknown methods"),
    (["--categories", "poetry"], "unknown categories"),
    (["--limit", "0"], "limit must be"),
    (["--max-new-tokens", "0"], "max.new.tokens must be"),  # the flag (--max-new-tokens) or the argument
    (["--repeats", "0"], "repeats must be"),
])
def test_cli_bad_input_fails_before_loading_models(data, args, message):
    if "--data" not in args:
        args = ["--data", str(data), *args]
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2 and "error:" in result.output and re.search(message, result.output)


# ---------------------------------------------------------------- a whole run on tiny models



def test_bench_run_writes_rows_report_and_plots(data, tokenizer, tmp_path, one_thread):
    target_model = tiny_model("llama", seed=0)
    target = LoadedModel(target_model, tokenizer, "tiny")
    draft = LoadedModel(perturbed(target_model, 0.05, seed=1), tokenizer, "tiny-draft")
    methods = ["plain", "draft-model", "prompt-lookup", "hf-plain", "hf-assisted", "hf-prompt-lookup"]
    config = BenchConfig(target="tiny", draft="tiny-draft", cross_draft=None, dtype="float32", k=4, adaptive=False,
                         max_new_tokens=12, turns=2, chat=True, device="cpu")
    questions = load_questions(data, ["mt_bench", "qa"], limit=1)
    out = tmp_path / "out"
    run_to_dir(Runner(methods, Models(target, draft), config), questions, out, repeats=2, warmup=1, progress=False)

    rows = read_rows(out)
    assert len(rows) == len(questions) * len(methods) * 2
    assert {r["method"] for r in rows} == set(methods)
    first = next(r for r in rows if r["question_id"] == 1 and r["method"] == "draft-model")
    assert len(first["token_ids"]) == 2 and first["setup"]["k"] == 4  # both turns of the MT-bench question
    for r in rows:  # float32: every method is lossless against its own baseline
        assert r["identical_to_baseline"] in (True, None), r["method"]
        assert r["new_tokens"] > 0 and r["seconds"] > 0 and r["token_hash"]
    assert all(r["mean_accepted_tokens"] == 1.0 for r in rows if r["method"] in ("plain", "hf-plain"))
    assert sum(r["step_tokens"] for r in rows if r["method"] == "hf-assisted") > sum(
        r["decoding_steps"] for r in rows if r["method"] == "hf-assisted")  # transformers' drafts were accepted too
    drafted = [r for r in rows if r["method"] == "draft-model"]
    assert sum(r["num_accepted_tokens"] for r in drafted) > 0  # it really drafted
    assert all(r["mean_accepted_tokens"] > 1.0 for r in drafted)

    report = (out / "report.md").read_text()
    assert "| draft-model | plain |" in report and "| hf-assisted | hf-plain |" in report
    assert "### Speedup per task" in report and "mt_bench" in report
    for name in ("speedup.png", "acceptance.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    (out / "report.md").unlink()  # the report comes back from the JSONL alone
    result = CliRunner().invoke(app, ["bench", "--report-only", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "report.md").read_text() == report


# ---------------------------------------------------------------- a draft with another vocabulary

def other_tokenizer(vocab_size: int = 288):
    """A byte-level BPE like conftest's, with another vocabulary size (a draft from another model family)."""
    return tiny_tokenizer(vocab_size, eos="</s>")


@pytest.fixture
def mismatched(tokenizer) -> Models:
    """A tiny target (vocabulary 320) and a tiny draft of another vocabulary (288) as --draft."""
    target = LoadedModel(tiny_model("llama", seed=0), tokenizer, "tiny")
    draft_tokenizer = other_tokenizer()
    draft = LoadedModel(tiny_model("qwen2", seed=1, vocab_size=len(draft_tokenizer)), draft_tokenizer, "tiny-other")
    assert draft.model.config.vocab_size != target.model.config.vocab_size
    return Models(target, draft)


def test_methods_whose_draft_has_another_vocabulary_are_skipped_and_reported(data, mismatched, tmp_path, one_thread):
    methods = ["plain", "draft-model", "prompt-lookup", "hf-plain", "hf-assisted"]
    config = BenchConfig(target="tiny", draft="tiny-other", cross_draft=None, dtype="float32", k=4, adaptive=False,
                         max_new_tokens=8, turns=1, chat=True, device="cpu")
    runner = Runner(methods, mismatched, config)
    assert set(runner.skipped) == {"draft-model", "hf-assisted"}
    assert all("288-token vocabulary" in why and "320" in why for why in runner.skipped.values())
    assert runner.methods == ["plain", "hf-plain", "prompt-lookup"]

    out = tmp_path / "out"
    run_to_dir(runner, load_questions(data, ["qa"]), out, warmup=0, progress=False)
    rows = read_rows(out)
    measured = [r for r in rows if "skipped" not in r]
    assert {r["method"] for r in measured} == {"plain", "hf-plain", "prompt-lookup"} and len(measured) == 2 * 3
    assert sorted(r["method"] for r in rows if "skipped" in r) == ["draft-model", "hf-assisted"]
    report = (out / "report.md").read_text()
    assert "### Skipped methods" in report and "| draft-model | the draft tiny-other has a 288-token" in report
    assert "| hf-assisted |" in report and "| prompt-lookup | plain |" in report


def test_quick_bench_with_a_draft_of_another_vocabulary_runs_to_the_end(data, mismatched, tmp_path, monkeypatch,
                                                                       one_thread):
    """`sparrow bench --quick --target smollm2-135m` with the default (Qwen) draft, on tiny stand-ins."""
    monkeypatch.setattr(sparrow.bench.command, "load_models", lambda config, progress=True: mismatched)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "--quick", "--data", str(data), "--out", str(out), "--no-progress",
                                      "--max-new-tokens", "6", "--dtype", "float32", "--warmup", "0"])
    assert result.exit_code == 0, result.output
    assert "skipping draft-model: the draft tiny-other has a 288-token vocabulary" in result.output
    report = (out / "report.md").read_text()
    assert "### Skipped methods" in report
    measured = {r["method"] for r in read_rows(out) if "skipped" not in r}
    assert {"plain", "prompt-lookup", "hf-plain"} <= measured and "draft-model" not in measured


# ---------------------------------------------------------------- the question set ships with the package

def test_default_question_set_is_package_data():
    import inspect
    from pathlib import Path

    import sparrow.bench
    from sparrow.cli.bench import bench

    package = Path(sparrow.bench.__file__).parent
    assert DEFAULT_DATA == package / "spec_bench" / "question.jsonl" and DEFAULT_DATA.is_file()
    assert inspect.signature(bench).parameters["data"].default == DEFAULT_DATA  # `sparrow bench`'s --data
    questions = read_questions(DEFAULT_DATA)
    assert len(questions) == 480 and {q.task for q in questions} == set(TASKS)
    assert (package / "spec_bench" / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "Spec-Bench" in (package / "spec_bench" / "NOTICE").read_text()


def test_pyproject_ships_the_question_set_as_package_data():
    from fnmatch import fnmatch
    from pathlib import Path

    import sparrow

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = Path(sparrow.__file__).parents[2] / "pyproject.toml"  # the checkout's (an editable install)
    if not pyproject.is_file():
        pytest.skip("not run from a checkout")
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["sparrow"]
    for name in ("question.jsonl", "LICENSE", "NOTICE"):
        assert any(fnmatch(f"bench/spec_bench/{name}", p) for p in patterns), name


def test_bench_refuses_what_the_models_configs_rule_out_before_loading(data, tmp_path, monkeypatch):
    """As `sparrow generate` does (`check_models`): sparse drafting on a target with sliding-window layers is refused
    from its config.json alone, in one line, and no model loads."""
    from transformers import Gemma3TextConfig

    target = tmp_path / "windowed"
    Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, sliding_window=8).save_pretrained(target)

    def no_loading(config, progress=True):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(sparrow.bench.command, "load_models", no_loading)
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--methods", "sparse", "--data", str(data),
                                      "--out", str(tmp_path / "out"), "--no-progress", "--dtype", "float32"])
    assert result.exit_code != 0 and "a model was loaded" not in result.output
    assert "drafter 'sparse' needs a target whose layers all use full attention" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("forgets", [True, False], ids=["each-repeat-fresh", "negative-control"])
def test_a_repeat_never_drafts_from_its_own_earlier_answer(data, tokenizer, one_thread, monkeypatch, forgets):
    """suffix drafts from a store of earlier outputs: a second repeat of a question (or the warm-up's question)
    found its own answer there and accepted it whole. Each repeat now starts with the store emptied
    (`Runner.forget`), so a question's repeats draft and accept alike; the negative control (no forgetting) accepts
    more in the second repeat."""
    if not forgets:
        monkeypatch.setattr(Runner, "forget", lambda self: None)
    target = LoadedModel(tiny_model("llama", seed=0), tokenizer, "tiny")
    config = BenchConfig(target="tiny", draft=None, cross_draft=None, dtype="float32", k=8, adaptive=False,
                         max_new_tokens=24, turns=1, chat=False, device="cpu")
    questions = load_questions(data, ["qa"], limit=2)
    rows = Runner(["plain", "suffix"], Models(target, None), config).run(questions, repeats=2, warmup=1)
    accepted = {(r["question_id"], r["repeat"]): r["num_accepted_tokens"] for r in rows if r["method"] == "suffix"}
    same = all(accepted[q, 0] == accepted[q, 1] for q in {q for q, _ in accepted})
    assert same if forgets else sum(accepted[q, 1] for q, _ in accepted) > sum(accepted[q, 0] for q, _ in accepted)
    assert all(r["identical_to_baseline"] for r in rows if r["method"] == "suffix")

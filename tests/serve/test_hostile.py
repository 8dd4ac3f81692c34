"""Hostile CLI input: each row is (argv, exit code, substring); never a traceback for the user's mistakes.

Exit 2 rows: stdout stays empty and stderr ends with exactly one line, `error: ...`, naming the argument
(rows marked `early` must fail before any model is loaded: then that line is all of stderr). Click's own
usage errors also exit 2, in click's format. Exit 0 rows: a valid answer (with --json, one strict JSON object).
An internal error (a bug) exits 1 with its traceback and an `internal error: ...` line, never `error: ...`.
Rows run in-process through typer's CliRunner on a tiny saved model; a few run as real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from typer.testing import CliRunner

from sparrow.cli import app
from sparrow.errors import UserError

MODEL = "@MODEL"  # replaced by the tiny model's directory
BASE = ("--target", MODEL, "--dtype", "float32", "--drafter", "prompt-lookup", "--max-new-tokens", "4")
INVALID_UTF8 = "x\udcffy"  # what Python makes of the argv bytes b"x\xffy" (surrogateescape)


def gen(prompt: str, *extra: str) -> tuple[str, ...]:
    return ("generate", prompt, *BASE, *extra)


TUNE = ("tune", "layer-skip", "--target", MODEL, "--dtype", "float32")
TEMPERATURE = "--temperature must be 0 (greedy) or a finite number >= 1e-05, got "
EARLY, LATE, USAGE, VALID = "early", "late", "usage", "valid"

# (argv, exit code, expected substring, kind): kind `early` fails before any model loads, `late` after the
# target loaded (the check needs its tokenizer or the model itself), `usage` is click's own parse error,
# `valid` must answer.
ROWS = [
    (gen("hi", "--temperature", "inf"), 2, TEMPERATURE + "inf", EARLY),
    (gen("hi", "--temperature", "-inf"), 2, TEMPERATURE + "-inf", EARLY),
    (gen("hi", "--temperature", "nan"), 2, TEMPERATURE + "nan", EARLY),
    (gen("hi", "--temperature", "1e-38"), 2, TEMPERATURE + "1e-38", EARLY),
    (gen("hi", "--temperature", "-1"), 2, TEMPERATURE + "-1.0", EARLY),
    (gen("hi", "--temperature", "inf", "--json"), 2, TEMPERATURE + "inf", EARLY),
    (gen("hi", "--seed", str(2**64)), 2, "--seed must be an integer in [0, 2**64), got 18446744073709551616", EARLY),
    (gen("hi", "--seed", "-1"), 2, "--seed must be an integer in [0, 2**64), got -1", EARLY),
    (gen("hi", "--max-new-tokens", "0"), 2, "--max-new-tokens must be an integer >= 1, got 0", EARLY),
    (gen("hi", "--max-new-tokens", "-5"), 2, "--max-new-tokens must be an integer >= 1, got -5", EARLY),
    (gen("hi", "--top-k", "-1"), 2, "--top-k must be an integer >= 0 (0 disables it), got -1", EARLY),
    (gen("hi", "--top-p", "nan"), 2, "--top-p must be in (0, 1] (1 disables it), got nan", EARLY),
    (gen("hi", "--top-p", "0"), 2, "--top-p must be in (0, 1] (1 disables it), got 0.0", EARLY),
    (gen("hi", "-k", "0"), 2, "-k/--num-draft-tokens must be an integer >= 1, got 0", EARLY),
    (gen("hi", "--stop", ""), 2, "--stop must not be an empty string", EARLY),
    (gen("hi", "--tree-budget", "-1"), 2, "--tree-budget must be an integer >= 0 or 'auto', got '-1'", EARLY),
    (gen("hi", "--tree-budget", "8", "--tree-depth", "0"), 2, "--tree-depth must be an integer >= 1, got 0", EARLY),
    (gen("hi", "--drafter", "visual-prune", "--drop-rate", "nan"), 2, "--drop-rate must be in [0, 1), got nan", EARLY),
    (gen("hi", "--drafter", "sparse", "--draft-kv-budget", "0"), 2, "--draft-kv-budget must be an integer >= 1", EARLY),
    (gen("hi", "--video", "/no/such/clip.mp4", "--frames", "0"), 2, "--frames must be an integer >= 1, got 0", EARLY),
    (gen("hi", "--video", "/no/such/clip.mp4"), 2, "video: no such file or directory: '/no/such/clip.mp4'", EARLY),
    (gen("hi", "--image", "/no/such/cat.png"), 2, "image: no such file: '/no/such/cat.png'", EARLY),
    (gen("hi", "--drafter", "medusa"), 2, "unknown drafter 'medusa'; expected one of: ", EARLY),
    (gen("hi", "--verify", "typical"), 2, "unknown verifier 'typical'; expected one of: auto, ", EARLY),
    (gen("hi", "--quant", "int3"), 2, "invalid quant 'int3': expected one of auto, none, int8, int4", EARLY),
    (gen(""), 2, "prompt must not be empty", EARLY),
    (gen(" \t\n "), 2, "prompt must not be empty", EARLY),
    ((*TUNE, "--time-budget", "nan"), 2, "--time-budget must be a finite number of seconds > 0, got nan", EARLY),
    ((*TUNE, "--time-budget", "0"), 2, "--time-budget must be a finite number of seconds > 0, got 0.0", EARLY),
    ((*TUNE, "-k", "0"), 2, "-k/--num-draft-tokens must be an integer >= 1, got 0", EARLY),
    ((*TUNE, "--new-tokens", "1"), 2, "--new-tokens must be an integer >= 2, got 1", EARLY),
    ((*TUNE, "--confirm-tokens", "-1"), 2, "--confirm-tokens must be an integer >= 0, got -1", EARLY),
    ((*TUNE, "--prompt", " "), 2, "--prompt must not be empty", EARLY),
    (("bench", "--repeats", "0"), 2, "--repeats must be an integer >= 1, got 0", EARLY),
    (("bench", "--limit", "-1"), 2, "--limit must be an integer >= 1, got -1", EARLY),
    (("bench", "--max-new-tokens", "0"), 2, "--max-new-tokens must be an integer >= 1, got 0", EARLY),
    (("bench", "--data", "/no/such/question.jsonl"), 2, "data file '/no/such/question.jsonl' does not exist", EARLY),
    (gen("hi", "--target", "llama-9000"), 2, "model spec 'llama-9000' is not a preset", LATE),
    (gen("hi", "--target", ""), 2, "invalid model spec ''", LATE),
    (gen("hi", "--device", "banana"), 2, "invalid device 'banana'", LATE),
    (gen("hi", "--drafter", "draft-model", "--draft", "/no/such/model"), 2, "model spec '/no/such/model'", LATE),
    (gen("hello " * 1100), 2, "prompt is 5500 tokens long, but the model's context is 1024 tokens", LATE),
    (gen("hi", "--max-new-tokens", str(10**12)), 2, "exceeds the model's context of 1024 tokens", LATE),
    (gen("hi", "--video", f"{MODEL}/config.json"), 2, "video: target '@MODEL' is a text-only model", EARLY),
    (gen("hi", "--image", f"{MODEL}/config.json"), 2, "image: target '@MODEL' is a text-only model", EARLY),
    (gen("hi", "--temperature", "abc"), 2, "Invalid value for '--temperature'", USAGE),
    (gen("hi", "--dtype", "float64"), 2, "Invalid value for '--dtype'", USAGE),
    (gen("hi", "--bogus"), 2, "No such option: --bogus", USAGE),
    (("generate",), 2, "Missing argument 'prompt'", USAGE),
    (gen(INVALID_UTF8, "--json"), 0, '"finish_reason"', VALID),  # decoded with U+FFFD (pipeline.encode)
    (gen("🦜 émoji, RTL \u202eoverride\u202c, combining e\u0301, NBSP\u00a0"), 0, "prompt-lookup", VALID),
    (("generate", *BASE, "--", "-5 apples"), 0, "prompt-lookup", VALID),
    (gen("hi", "--json"), 0, '"drafter": "prompt-lookup"', VALID),
    (gen("hi", "--json", "--compare", "--max-new-tokens", "1"), 0, '"identical": true', VALID),
    (gen("hi", "--json", "--temperature", "1e-5", "--seed", str(2**64 - 1)), 0, '"temperature": 1e-05', VALID),
    (gen("hi", "--temperature", "1", "--top-k", str(10**9), "--seed", "0"), 0, "prompt-lookup", VALID),
    (gen("hi", "--tree-budget", str(10**20)), 0, "budget 100000000000000000000", VALID),
    (gen("hi", "-k", str(10**9)), 0, "prompt-lookup", VALID),
    (gen("hi", "--stop", INVALID_UTF8), 0, "prompt-lookup", VALID),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hostile-model")
    tiny_model("llama", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def offline(monkeypatch, one_thread):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def invoke(argv, model_dir: str):
    return CliRunner().invoke(app, [arg.replace(MODEL, model_dir) for arg in argv])


def strict_json(stdout: str) -> dict:
    """Exactly one line holding one JSON object, without NaN/Infinity."""
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout

    def refuse(constant: str):
        raise AssertionError(f"non-standard JSON constant {constant}")

    record = json.loads(lines[0], parse_constant=refuse)
    assert isinstance(record, dict)
    return record


def check_user_error(stdout: str, stderr: str, match: str, early: bool) -> None:
    """Nothing on stdout; stderr ends with its only `error:` line, which holds `match`; no traceback."""
    assert stdout == "", stdout
    lines = stderr.rstrip("\n").splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == lines[-1] and match in errors[0], stderr
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    if early:
        assert len(lines) == 1, stderr


def row_id(argv: tuple[str, ...]) -> str:
    """The row's arguments without the shared ones (BASE, TUNE's model), at most 60 characters."""
    words = list(argv)
    for shared in (list(BASE), list(TUNE[2:])):
        starts = [i for i in range(len(words)) if words[i:i + len(shared)] == shared]
        if starts:
            del words[starts[0]:starts[0] + len(shared)]
    text = " ".join(words).replace(MODEL, "MODEL")
    return text if len(text) <= 60 else text[:57] + "..."


@pytest.mark.parametrize(("argv", "code", "match", "kind"), ROWS, ids=[row_id(row[0]) for row in ROWS])
def test_hostile_cli_input(model_dir, argv, code, match, kind, monkeypatch):
    if kind == EARLY:  # loading a model now would be a validation gap: make it an internal error
        import sparrow.bench.command
        import sparrow.loading
        import sparrow.models

        def no_loading(*args, **kwargs):
            raise AssertionError("a model was loaded before the arguments were checked")

        for module in (sparrow.models, sparrow.loading, sparrow.bench.command):  # every module that loads one
            monkeypatch.setattr(module, "load_model", no_loading)
    result = invoke(argv, model_dir)
    assert result.exit_code == code, result.output
    match = match.replace(MODEL, model_dir)
    if kind in (EARLY, LATE):
        check_user_error(result.stdout, result.stderr, match, early=kind == EARLY)
    elif kind == USAGE:
        assert result.stdout == "" and match in result.stderr and "Traceback" not in result.stderr, result.output
    else:
        assert match in result.output, result.output
        assert "Traceback" not in result.stderr and "error:" not in result.stderr, result.output
        if "--json" in argv:
            strict_json(result.stdout)
        else:
            assert result.stdout.strip(), result.output


def deep_inside_torch(error: BaseException):
    """A stand-in for the decoding loop (`sparrow.decoding.engine.decode`) that fails with `error`."""

    def decode(*args, **kwargs):
        raise error

    return decode


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be reported asynchronously"),
    AssertionError("draft and target caches disagree"),
    ValueError("Expected parameter probs (Tensor of shape (320,)) of distribution Categorical to satisfy the "
               "constraint Simplex()"),  # a plain ValueError, not a UserError: a bug
    KeyError("past_key_values"),
    TypeError("unsupported operand type(s) for +: 'NoneType' and 'int'"),
], ids=lambda e: type(e).__name__)
def test_internal_errors_exit_1_with_traceback_and_a_bug_line(model_dir, error, monkeypatch):
    import sparrow.pipeline

    monkeypatch.setattr(sparrow.pipeline, "decode", deep_inside_torch(error))
    result = invoke(gen("hi"), model_dir)
    assert result.exit_code == 1, result.output
    lines = result.stderr.rstrip("\n").splitlines()
    assert "Traceback (most recent call last):" in lines, result.stderr
    assert lines[-1].startswith(f"internal error: {type(error).__name__}: ") and "bug in sparrow" in lines[-1]
    assert str(error).splitlines()[0].strip("'") in lines[-1]
    assert not any(line.startswith("error:") for line in lines), result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("rate", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_json_stays_strict_when_a_timer_gives_a_non_finite_figure(model_dir, rate, monkeypatch):
    """A clock that reads 0 (or a rate gone wrong) must not print `Infinity`/`NaN`: those figures are null."""
    from sparrow.types import GenerationResult, GenerationStats

    monkeypatch.setattr(GenerationResult, "tokens_per_second", property(lambda self: rate))
    monkeypatch.setattr(GenerationStats, "acceptance_rate", property(lambda self: rate))
    result = invoke(gen("hi", "--json", "--compare"), model_dir)
    assert result.exit_code == 0, result.output
    record = strict_json(result.stdout)
    assert record["tokens_per_second"] is None and record["baseline"]["tokens_per_second"] is None
    assert record["speedup"] is None and record["acceptance_rate"] is None
    assert record["identical"] is True and record["new_tokens"] == 4


def test_debug_shows_the_traceback_of_a_user_error_and_keeps_exit_2(model_dir):
    result = invoke(("--debug", *gen("hi", "--temperature", "inf")), model_dir)
    assert result.exit_code == 2, result.output
    lines = result.stderr.rstrip("\n").splitlines()
    assert "Traceback (most recent call last):" in lines and "UserError" in result.stderr
    assert lines[-1] == f"error: {TEMPERATURE}inf"


@pytest.mark.parametrize(("error", "match"), [
    (PermissionError(13, "Permission denied", "/models/x/model.safetensors"),
     "error: [Errno 13] Permission denied: '/models/x/model.safetensors'"),
    (UserError("first line names the argument\nsecond line is dropped"),
     "error: first line names the argument"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
     "error: CUDA out of memory. Tried to allocate 20.00 GiB -- the model or the request does not fit"),
], ids=["OSError", "multi-line-UserError", "OutOfMemoryError"])
def test_user_errors_raised_inside_are_one_line(model_dir, error, match, monkeypatch):
    import sparrow.pipeline

    monkeypatch.setattr(sparrow.pipeline, "decode", deep_inside_torch(error))
    result = invoke(gen("hi"), model_dir)
    assert result.exit_code == 2, result.output
    check_user_error(result.stdout, result.stderr, match, early=False)


def test_ctrl_c_exits_130_quietly(model_dir, monkeypatch):
    import sparrow.pipeline

    monkeypatch.setattr(sparrow.pipeline, "decode", deep_inside_torch(KeyboardInterrupt()))
    result = invoke(gen("hi"), model_dir)
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output and "error" not in result.output


# Real processes, for the true exit codes (and argv that is not valid UTF-8).
SPARROW = Path(sys.executable).with_name("sparrow")
INJECT = """import sparrow.pipeline
def decode(*args, **kwargs):
    raise {error}
assert hasattr(sparrow.pipeline, "decode")
sparrow.pipeline.decode = decode
from sparrow.cli import app
app(prog_name="sparrow")
"""


@pytest.mark.parametrize(("argv", "code"), [
    ((str(SPARROW), *gen("hi", "--temperature", "inf")), 2),
    ((str(SPARROW), *gen(b"x\xffy", "--json")), 0),  # type: ignore[arg-type]
    ((sys.executable, "-c", INJECT.format(error="RuntimeError('CUDA error: an illegal memory access')"),
      *gen("hi")), 1),
    ((sys.executable, "-c", INJECT.format(error="KeyboardInterrupt"), *gen("hi")), 130),
], ids=["inf-temperature", "invalid-utf8-argv", "internal-error", "ctrl-c"])
def test_real_process_exit_codes(model_dir, argv, code):
    if not SPARROW.exists():
        pytest.skip(f"no {SPARROW} (the package is not installed in this interpreter's environment)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = [arg.replace(MODEL, model_dir) if isinstance(arg, str) else arg for arg in argv]
    done = subprocess.run(argv, capture_output=True, env=env, timeout=300)
    stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    assert done.returncode == code, stderr
    if code == 2:
        check_user_error(stdout, stderr, TEMPERATURE + "inf", early=True)
    elif code == 0:
        assert strict_json(stdout)["new_tokens"] == 4, stderr
        assert "Traceback" not in stderr and "error:" not in stderr, stderr
    elif code == 1:
        assert "Traceback (most recent call last):" in stderr, stderr
        assert stderr.rstrip("\n").splitlines()[-1].startswith("internal error: RuntimeError: CUDA error: an illegal")
    else:
        assert "Traceback" not in stderr and "error" not in stderr, stderr

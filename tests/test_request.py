"""A request is validated in one place (`sparrow.request`): the options once, the prompt once, every error naming
its field by sparrow's name (`UserError.field`) and its message by the caller's spelling."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from sparrow.errors import UserError
from sparrow.request import DEFAULTS, OPTIONS, Options, build_request, check_options
from sparrow.types import Prompt

SRC = Path(__file__).resolve().parents[1] / "src" / "sparrow"
# The rules of a request's values, and the only modules that may apply them: config.py defines the checks (and its
# dataclasses re-check their own fields as their invariant), request.py is the one validator.
VALIDATORS = {"check_temperature", "check_top_k", "check_top_p", "check_max_new_tokens", "check_seed",
              "SamplingConfig", "StoppingConfig", "stop_strings", "token_ids", "chat_messages", "check_options",
              "build_request", "of"}
ALLOWED = {"config.py", "request.py"}


def called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        if func.attr == "of":  # GrammarSpec.of, not any method called `of`
            return "of" if isinstance(func.value, ast.Name) and func.value.id == "GrammarSpec" else None
        return func.attr
    return None


def test_one_validator():
    """Nothing outside config.py and request.py checks a request's values (calls a check, builds a sampling or
    stopping config, parses stop strings, token ids or a grammar), except the callers that hand a request's options
    to the one validator (`check_options`) or its prompt to `build_request` (the pipeline)."""
    callers: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC).as_posix()
        if relative in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and called_name(node) in VALIDATORS:
                callers.setdefault(called_name(node), set()).add(relative)
    assert callers == {
        "check_options": {"pipeline.py", "serve/protocol.py", "cli/generate.py"},  # the API, the server, the CLI
        "build_request": {"pipeline.py"},  # after tokenizing
        "token_ids": {"pipeline.py"}, "chat_messages": {"pipeline.py"},  # Pipeline.encode's prompt kinds
    }, "a request's values are checked outside sparrow.request: check them there, once"


def test_every_option_has_a_default():
    assert OPTIONS == tuple(DEFAULTS)
    options = check_options({})
    assert options == check_options(DEFAULTS)
    assert options.max_new_tokens == 128 and options.sampling.greedy and options.stop == () and not options.media


@pytest.mark.parametrize(("option", "value", "field"), [
    ("temperature", -1, "temperature"), ("top_k", -1, "top_k"), ("top_p", 0, "top_p"), ("seed", -1, "seed"),
    ("max_new_tokens", 0, "max_new_tokens"), ("stop", [""], "stop"), ("chat", 1, "chat"),
    ("json_schema", 5, "json_schema"), ("regex", "", "regex"), ("bogus", 1, "bogus"),
])
def test_errors_carry_their_field_and_the_callers_spelling(option, value, field):
    with pytest.raises(UserError) as plain:
        check_options({option: value})
    assert plain.value.field == field and str(plain.value).split()[0].strip("'") in (field, "unknown")
    spelled = {field: f"--{field.replace('_', '-')}"}
    with pytest.raises(UserError) as flag:
        check_options({option: value}, spelled)
    assert flag.value.field == field
    if field not in ("json_schema", "regex", "bogus"):  # the grammar's messages and unknown names keep sparrow's
        assert str(flag.value).startswith(spelled[field]), str(flag.value)


def prompt(n: int) -> Prompt:
    return Prompt(input_ids=torch.arange(n))


def test_the_context_check_names_max_new_tokens_as_the_caller_does():
    options = check_options({"max_new_tokens": 10}, {"max_new_tokens": "max_tokens"})
    with pytest.raises(UserError, match=r"^max_tokens=10 with a 95-token prompt exceeds .*at most 5 new") as error:
        build_request(prompt(95), options, eos_token_ids=frozenset(), context_length=100)
    assert error.value.field == "max_new_tokens"
    with pytest.raises(UserError, match="prompt is 100 tokens long") as error:
        build_request(prompt(100), options, eos_token_ids=frozenset(), context_length=100)
    assert error.value.field == "prompt"
    request = build_request(prompt(90), options, eos_token_ids=frozenset({2}), context_length=100)
    assert request.stopping.max_new_tokens == 10 and request.stopping.eos_token_ids == {2}


def test_max_new_tokens_none_is_the_rest_of_the_context():
    options = check_options({"max_new_tokens": None})
    assert isinstance(options, Options) and options.max_new_tokens is None
    assert build_request(prompt(30), options, eos_token_ids=frozenset(), context_length=100
                         ).stopping.max_new_tokens == 70
    assert build_request(prompt(30), options, eos_token_ids=frozenset(), context_length=None
                         ).stopping.max_new_tokens == 1024

"""The plan (sparrow.drafters.plan): one resolver for every door, bad combinations refused before any model loads."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from conftest import tiny_model
from typer.testing import CliRunner

import sparrow
import sparrow.bench.command
from sparrow.cli import app
from sparrow.drafters.plan import SpecPlan, resolve_plan
from sparrow.drafters.registry import REGISTRY, DrafterEntry
from sparrow.errors import UserError
from sparrow.loading import PipelineCache
from sparrow.models import LoadedModel

SRC = Path(sparrow.__file__).resolve().parent
RESOLVER = SRC / "drafters" / "plan.py"
CHECKS = {"check_drafter_args", "check_quant_args", "check_compile", "check_applies", "check_models",
          "check_draft_only_compile", "resolve_draft_quant", "merged", "given_arguments", "with_speculative_config"}
"""What resolving a plan calls: only the resolver may (they are defined in the registry, requirements,
quantization and speculative_config modules)."""
GUARDED = {SRC / "drafters" / "registry.py": {"check_drafter_args"}}
"""build_drafter keeps its own check, for drafters built from loaded models directly (no plan)."""


def resolver_calls(source: str) -> set[str]:
    """The CHECKS `source` calls, as imported names (`check_models(...)` where the module imports it from sparrow)
    or as attributes (`registry.check_drafter_args(...)`)."""
    tree = ast.parse(source)
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("sparrow") for alias in node.names}
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in CHECKS and func.id in imported:
                called.add(func.id)
            elif isinstance(func, ast.Attribute) and func.attr in CHECKS:
                called.add(func.attr)
    return called


def test_no_second_resolver():
    """No module but the resolver calls what resolving a plan calls: a second resolver fails here."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == RESOLVER:
            continue
        calls = resolver_calls(path.read_text()) - GUARDED.get(path, set())
        if calls:
            found[str(path.relative_to(SRC))] = sorted(calls)
    assert not found, f"resolved outside sparrow/drafters/plan.py (call resolve_plan instead): {found}"


def test_the_scan_finds_a_second_resolver():
    second = "from sparrow.drafters.registry import check_drafter_args\ncheck_drafter_args('x', 4)\n"
    assert resolver_calls(second) == {"check_drafter_args"}
    assert resolver_calls("from sparrow.drafters import plan\nplan.with_speculative_config(None)\n") == {
        "with_speculative_config"}
    assert not resolver_calls("def check_models(m):\n    pass\ncheck_models(1)\n")  # a local function of that name


def test_a_plan_is_frozen_and_resolved():
    plan = resolve_plan("no-such-model", draft_quant="auto")  # settled on the loaded draft
    assert (plan.drafter, plan.draft, plan.quant, plan.draft_quant) == ("draft-model", "qwen2.5-coder-0.5b", None,
                                                                         "auto")
    assert resolve_plan("no-such-model", drafter="prompt-lookup", draft_quant="auto").draft is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.drafter = "suffix"
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    plan = resolve_plan("no-such-model", speculative_config=config)
    assert (plan.drafter, plan.num_draft_tokens, plan.drafter_options) == ("prompt-lookup", 3, {"max_n": 4})


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(drafter="sparse", compile=True), "does not run on a compiled target"),
    (dict(drafter="layer-skip", quant="int8"), "needs an unquantized target"),
    (dict(drafter="prompt-lookup", draft_quant="int8"), "draft_quant needs a draft model"),
    (dict(drafter="prompt-lookup", quant="w8a8", compile=True), "compiles only a draft model"),
    (dict(drafter="prompt-lookup", verifier="typical"), "unknown verifier 'typical'"),
    (dict(drafter="prompt-lookup", exact="yes"), "exact must be True, False or None"),
    (dict(drafter="prompt-lookup", prefix_cache=-1), "prefix_cache must be a positive number"),
    (dict(drafter="prompt-lookup", draft_vocab=8), "does not accept option 'draft_vocab'"),
])
def test_bad_combinations_are_refused_before_any_model_loads(monkeypatch, arguments, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("sparrow.loading.load_model", no_loading)
    for door in (sparrow.load, PipelineCache().get):
        with pytest.raises(UserError, match=message) as e:
            door("no-such-model", **arguments)
        assert "\n" not in str(e.value)


def test_flags_are_named_as_the_command_line_spells_them():
    with pytest.raises(UserError, match="--draft-vocab applies to --drafter .* not 'prompt-lookup'"):
        resolve_plan("no-such-model", drafter="prompt-lookup", flags=True, draft_vocab=8)
    with pytest.raises(UserError, match="--drafter 'prompt-lookup' contradicts speculative config key 'method'"):
        resolve_plan("no-such-model", drafter="prompt-lookup", given={"drafter"}, flags=True,
                     speculative_config='{"method": "suffix"}')
    with pytest.raises(UserError, match="--speculative-config is not valid JSON"):
        resolve_plan("no-such-model", flags=True, speculative_config='{"method": ')


def test_draft_only_compile_reads_the_registry(monkeypatch):
    """A drafter registered as compiling a draft model of its own is accepted where only the draft compiles."""
    monkeypatch.setitem(REGISTRY, "mine", DrafterEntry(REGISTRY["draft-model"].build, 4, needs_draft_model=True,
                                                       default_draft="no-such-draft", compiles_draft=True))
    plan = resolve_plan("no-such-model", drafter="mine", quant="w8a8", compile=True, device="cpu")
    assert plan.compile and plan.draft == "no-such-draft"
    monkeypatch.setitem(REGISTRY, "mine", dataclasses.replace(REGISTRY["mine"], compiles_draft=False))
    with pytest.raises(UserError, match="drafter 'mine' drafts without one"):
        resolve_plan("no-such-model", drafter="mine", quant="w8a8", compile=True, device="cpu")


@pytest.fixture(scope="module")
def target(tokenizer) -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tokenizer, "tiny")


def test_load_and_the_cache_build_the_same_pipeline_from_a_plan(target):
    plan = resolve_plan(target, drafter="prompt-lookup", num_draft_tokens=3, adaptive=False, verifier="greedy",
                        prefix_cache=64)
    assert isinstance(plan, SpecPlan)
    cache = PipelineCache(size=2)
    pipes = [sparrow.load(plan), sparrow.load(target, drafter="prompt-lookup", num_draft_tokens=3, adaptive=False,
                                              verifier="greedy", prefix_cache=64), cache.get(plan)]
    assert cache.get(plan) is pipes[2]  # a hit
    for pipe in pipes:  # the cache honours the verifier and the prefix cache too
        assert pipe.verifier == "greedy" and pipe.runner.prefix_cache.max_tokens == 64
    outputs = {tuple(p.generate("the quick brown fox", max_new_tokens=12).token_ids) for p in pipes}
    assert len(outputs) == 1
    with pytest.raises(UserError, match="a SpecPlan carries every argument: drop 'drafter'"):
        sparrow.load(plan, drafter="suffix")


def test_bench_takes_the_quant_values_generate_and_serve_take(tmp_path, monkeypatch):
    seen = {}

    def no_loading(config, progress=True):
        seen["quant"] = config.quant
        raise UserError("stop before loading")

    monkeypatch.setattr(sparrow.bench.command, "load_models", no_loading)
    for value in ("auto", "none", "int8"):
        result = CliRunner().invoke(app, ["bench", "--quick", "--methods", "plain,prompt-lookup", "--quant", value,
                                          "--out", str(tmp_path / "out"), "--no-progress", "--device", "cpu"])
        assert result.exit_code == 2 and "stop before loading" in result.output, result.output
        assert seen.pop("quant") == {"auto": "auto", "none": None}.get(value, value)
    result = CliRunner().invoke(app, ["bench", "--quant", "int3"])
    assert result.exit_code == 2 and "invalid quant 'int3': expected one of auto, none" in result.output

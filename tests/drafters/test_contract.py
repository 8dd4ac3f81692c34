"""The drafter contract stays narrow: the `Drafter` protocol holds what the round, the batch and the pipeline call
every generation (at most 12 members), and the house outside `sparrow.drafters` uses a drafter only through it,
never probing one with getattr / hasattr / isinstance: what auto, the policies, bench and the CLI's report read is
`describe()`'s record, what a batch manages is `batching`."""

from __future__ import annotations

import ast
import inspect
import re
from collections import Counter
from pathlib import Path

from conftest import perturbed

from sparrow.drafters import build_drafter
from sparrow.drafters.base import Drafter, DrafterBase, DrafterInfo, draft_runners
from sparrow.drafters.draft_model import draft_model_drafters
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline

SRC = Path(__file__).resolve().parents[2] / "src" / "sparrow"
PROBES = {"getattr", "hasattr", "isinstance"}
A_DRAFTER = re.compile(r"drafter|candidate", re.IGNORECASE)


def protocol_members(protocol: type) -> set[str]:
    """The names a Protocol class declares: its annotated attributes and its methods."""
    declared = set(vars(protocol).get("__annotations__", {}))
    declared |= {name for name, value in vars(protocol).items() if inspect.isfunction(value)}
    return {name for name in declared if not name.startswith("_")}


MEMBERS = protocol_members(Drafter)


def violations(source: str) -> list[str]:
    """Where `source` probes a drafter (getattr / hasattr / isinstance on an expression naming a drafter or a
    candidate, or isinstance against a drafter class), or reads a member of `<...>.drafter` the protocol lacks."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES and node.args:
            subject = ast.unparse(node.args[0])
            kinds = ast.unparse(node.args[1]) if node.func.id == "isinstance" and len(node.args) > 1 else ""
            if A_DRAFTER.search(subject) or kinds.endswith("Drafter"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr not in MEMBERS:
            owner = node.value
            named = (isinstance(owner, ast.Name) and owner.id == "drafter") or (
                isinstance(owner, ast.Attribute) and owner.attr == "drafter")
            if named:
                found.append(f"line {node.lineno}: {ast.unparse(node)} (not a Drafter member)")
    return found


def test_the_protocol_has_at_most_twelve_members() -> None:
    assert len(MEMBERS) <= 12, sorted(MEMBERS)
    assert {"name", "hidden_layers", "prefill", "propose", "observe"} <= MEMBERS


def test_drafter_base_gives_every_optional_member_a_default() -> None:
    class Minimal(DrafterBase):
        name = "minimal"

        def prefill(self, prompt, target, out): ...
        def propose(self, committed, max_tokens, sampling, generator): ...
        def observe(self, draft, verdict, out, step): ...

    drafter = Minimal()
    assert all(hasattr(drafter, member) for member in MEMBERS)
    assert drafter.describe() == DrafterInfo() and drafter.batching is None
    assert draft_runners(drafter) == () and draft_model_drafters(drafter) == []


def test_nothing_outside_the_drafters_package_probes_a_drafter() -> None:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        if (SRC / "drafters") in path.parents:
            continue
        hits = violations(path.read_text())
        if hits:
            found[str(path.relative_to(SRC))] = hits
    assert not found, found


def test_the_scan_catches_a_planted_probe() -> None:
    planted = {
        'candidates = getattr(drafter, "candidates", None)': 1,
        'if hasattr(drafter, "grammar"): pass': 1,
        "if isinstance(drafter, DraftModelDrafter): pass": 1,
        "ok = isinstance(runner, DraftModelDrafter)": 1,
        "counts = pipe.drafter.counts": 1,
        "shape = drafter.tree": 1,
        "draft = next(c.draft for c in pipe.drafter.describe().candidates)": 0,  # through the record: allowed
        "pipe.drafter.describe().tree, seq.drafter.batching.behind(x), drafter.park(x)": 0,
        "isinstance(runner, CachedModel)": 0,
    }
    for source, hits in planted.items():
        assert len(violations(source)) == hits, (source, violations(source))


def test_auto_reports_its_candidates_runners_and_choices(loaded_target, target_model, tokenizer) -> None:
    draft = LoadedModel(perturbed(target_model, 0.05, seed=1), tokenizer, "close")
    auto = build_drafter("auto", loaded_target, draft, num_draft_tokens=3, suffix=False)
    info = auto.describe()
    assert [c.name for c in info.candidates] == list(auto.candidates)
    assert info.rounds_per_option == {} and not info.watches_prefill
    model = auto.candidates["draft-model"]
    assert draft_model_drafters(auto) == [model] and draft_runners(auto) == (model.draft,)
    assert model.batching is model and model.describe().draft is model.draft
    result = Pipeline(loaded_target, auto).generate([1, 2, 3, 4], max_new_tokens=8)
    rounds = auto.describe().rounds_per_option  # what bench records as "drafter_choices"
    assert rounds == dict(Counter(auto.choices)) and sum(rounds.values()) == result.stats.steps

"""One entrance (issue #43): the server drives the engine and nothing else of a pipeline.

Scans the source of `sparrow.serve`: no module there runs a batch, a pipeline's generation methods or its runner
(`Batch`, `sequence`, `generate`, `generate_plain`, `request`, `encode`, `result`, `release`, `.runner`,
`.tokenizer`, `.drafter`); the scheduler hands jobs to `Engine.submit` and steps the engine. A planted call is
caught, so the scan cannot pass vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sparrow.serve

SERVE = Path(sparrow.serve.__file__).parent
PIPELINE_MEMBERS = {"sequence", "generate", "generate_plain", "request", "as_request", "encode", "result", "release",
                    "runner", "tokenizer", "drafter", "target", "models"}


def reaches_past_the_engine(source: str) -> list[str]:
    """`Batch(...)` and members of a pipeline (a name or attribute called `pipe` / `pipeline`), by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Batch":
            found.append(f"line {node.lineno}: Batch(...)")
        if isinstance(node, ast.Attribute) and node.attr in PIPELINE_MEMBERS:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("pipe", "pipeline"):
                found.append(f"line {node.lineno}: {name}.{node.attr}")
    return sorted(found)


def test_the_server_reaches_a_pipeline_only_through_the_engine():
    offences = {path.name: reaches_past_the_engine(path.read_text()) for path in sorted(SERVE.glob("*.py"))}
    assert {name: found for name, found in offences.items() if found} == {}
    assert "engine.submit(" in (SERVE / "scheduler.py").read_text()


def test_the_scan_catches_a_planted_call():
    planted = "def f(self, job):\n    return self.pipeline.sequence(job.prompt)\n"
    assert reaches_past_the_engine(planted) == ["line 2: pipeline.sequence"]
    assert reaches_past_the_engine("pipe.runner.context_length\nBatch(model)\n") == ["line 1: pipe.runner",
                                                                                     "line 2: Batch(...)"]

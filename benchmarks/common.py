"""Shared by the benchmark scripts: the prompt set, and the markdown table rendered from JSONL rows."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from sparrow.bench.peers import hf_generate  # noqa: F401  (re-exported for the benchmark scripts)

SPEC_BENCH_QUICK = "spec-bench-quick"
"""`load_prompts`' name for the first turns of `sparrow bench --quick`'s questions (the shortest of each task)."""
HERE = Path(__file__).resolve().parent
FOUNDATION, HUMANEVAL = "foundation", "humaneval"
PROMPT_SETS = (FOUNDATION, SPEC_BENCH_QUICK, HUMANEVAL)
"""`load_prompt_sets`' names: benchmarks/prompts.json, the quick Spec-Bench questions, EAGLE's HumanEval questions."""
EAGLE_DATA = HERE.parent.parent / "shared" / "data" / "eagle"
"""EAGLE's evaluation question sets (`humaneval.jsonl`, ...), beside the repository."""


def load_prompts(path: Path, ids: list[str] | None = None) -> list[dict]:
    """Prompts of `path` (benchmarks/prompts.json) with their texts filled in, or of SPEC_BENCH_QUICK (id
    "<task>-<question id>", kind the task); only `ids` if given."""
    if str(path) == SPEC_BENCH_QUICK:
        from sparrow.bench.data import DEFAULT_DATA, read_questions, shortest_per_task

        prompts = [{"id": f"{q.task}-{q.question_id}", "kind": q.task, "prompt": q.turns[0]}
                   for q in shortest_per_task(read_questions(DEFAULT_DATA))]
    else:
        data = json.loads(path.read_text())
        prompts = [{**p, "prompt": p["prompt"].format(**data["texts"])} for p in data["prompts"]]
    return [p for p in prompts if not ids or p["id"] in ids]


def load_prompt_sets(names: list[str], ids: list[str] | None = None, eagle_data: Path = EAGLE_DATA,
                     code_questions: int = 6) -> list[dict]:
    """The prompts of each named set in PROMPT_SETS, each tagged with its `set`; only `ids` if given. The
    HumanEval set is the first `code_questions` questions of `eagle_data`/humaneval.jsonl (first turn, kind
    "humaneval", id "humaneval-<question id>")."""
    unknown = [n for n in names if n not in PROMPT_SETS]
    if unknown:
        raise SystemExit(f"unknown prompt set(s) {', '.join(unknown)}; expected some of: {', '.join(PROMPT_SETS)}")
    prompts = []
    for name in names:
        if name == HUMANEVAL:
            from sparrow.bench.data import read_questions

            path = eagle_data / "humaneval.jsonl"
            if not path.is_file():
                raise SystemExit(f"no HumanEval questions at {path}: pass --eagle-data DIR (EAGLE's question sets)")
            found = [{"id": f"{HUMANEVAL}-{q.question_id}", "kind": HUMANEVAL, "prompt": q.turns[0]}
                     for q in read_questions(path)[:code_questions]]
        else:
            found = load_prompts(HERE / "prompts.json" if name == FOUNDATION else Path(name))
        prompts += [{**p, "set": name} for p in found if not ids or p["id"] in ids]
    return prompts


def render_speedup_table(rows: list[dict], baseline: dict[str, str], per_step: str, identical_key: str) -> str:
    """Markdown: a row per method, a column per prompt kind. Each cell: mean tok/s and, for methods with a
    baseline, the speedup over that baseline's mean tok/s, mean tokens per target forward (`per_step`
    label) and how many outputs are identical (`identical_key` of the rows)."""
    by = defaultdict(list)
    for r in rows:
        by[(r["kind"], r["method"])].append(r)
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = ["| method | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for method in methods:
        cells = []
        for kind in kinds:
            group = by[(kind, method)]
            tps = statistics.mean(r["tokens_per_second"] for r in group)
            cell = f"{tps:.2f} tok/s"
            base = baseline.get(method)
            if base:
                cell += f", **{tps / statistics.mean(r['tokens_per_second'] for r in by[(kind, base)]):.2f}x**"
                accepted = [r["mean_accepted_tokens"] for r in group if r["mean_accepted_tokens"] is not None]
                if accepted:
                    cell += f", {statistics.mean(accepted):.2f} {per_step}"
                same = sum(bool(r[identical_key]) for r in group)
                cell += f", identical {same}/{len(group)}"
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

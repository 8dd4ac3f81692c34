"""Spec-Bench metrics from JSONL rows (one row per question x method x repeat).

* speedup = mean per-question tokens/s of the method / mean per-question tokens/s of its baseline, over the
  questions both ran in the same repeat (a ratio of means, not a mean of ratios); mean +- std over repeats;
* mean accepted tokens = tokens committed per target decoding step, the bonus token included, pooled over
  all steps (sparrow: speculative rounds after the prefill; peers: target forwards of `generate`);
* acceptance per draft position = accepted / drafted at position i, pooled over all rounds;
* exact match = the method's tokens equal its baseline's for the same question and repeat.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sparrow.bench.data import TASKS
from sparrow.bench.methods import PLAIN
from sparrow.errors import UserError

OVERALL = "overall"


@dataclass(frozen=True)
class Cell:
    """One (task, method) of one setup."""

    task: str
    method: str
    baseline: str
    questions: int  # distinct questions
    repeats: int
    tokens_per_second: float  # mean per-question tok/s, averaged over repeats
    speedup: float | None  # None: no baseline rows to compare with (or the method is a baseline)
    speedup_std: float | None
    mean_accepted_tokens: float | None
    acceptance_per_position: tuple[float, ...]
    exact: int  # (question, repeat) pairs identical to the baseline
    compared: int
    seconds: float = 0.0  # wall time of all its generations (to plan bigger runs)
    same_as_plain: int = 0  # (question, repeat) pairs identical to sparrow's plain decoding
    compared_to_plain: int = 0

    @property
    def exact_match_rate(self) -> float | None:
        return self.exact / self.compared if self.compared else None


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        raise UserError("mean_std needs at least one value")
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def dedupe(rows: Iterable[dict]) -> list[dict]:
    """One row per (setup, method, question, repeat): the one of the latest run wins (combining partial runs)."""
    latest: dict[tuple, dict] = {}
    for row in sorted(rows, key=lambda r: r.get("run_id", "")):
        latest[(row.get("setup_key"), row["method"], row["question_id"], row["repeat"])] = row
    return list(latest.values())


def speedups(method_rows: Sequence[dict], base_rows: Sequence[dict]) -> list[float]:
    """One speedup per repeat: ratio of mean tok/s over the questions both sides ran in that repeat."""
    base = {(r["repeat"], r["question_id"]): r["tokens_per_second"] for r in base_rows}
    by_repeat: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in method_rows:
        if (r["repeat"], r["question_id"]) in base:
            by_repeat[r["repeat"]].append((r["tokens_per_second"], base[(r["repeat"], r["question_id"])]))
    out = []
    for repeat in sorted(by_repeat):
        pairs = by_repeat[repeat]
        base_mean = statistics.mean(b for _, b in pairs)
        if base_mean > 0:
            out.append(statistics.mean(m for m, _ in pairs) / base_mean)
    return out


def mean_accepted_tokens(rows: Sequence[dict]) -> float | None:
    """Tokens per decoding step, bonus included, pooled over the rows' steps."""
    steps = sum(r.get("decoding_steps") or 0 for r in rows)
    tokens = sum(r.get("step_tokens") or 0 for r in rows)
    return tokens / steps if steps else None


def acceptance_per_position(rows: Sequence[dict]) -> tuple[float, ...]:
    """accepted / drafted at each draft position, pooled over the rows' rounds (nan where none drafted)."""
    accepted: list[int] = []
    drafted: list[int] = []
    for r in rows:
        for i, (a, d) in enumerate(zip(r.get("accepted_per_position") or [], r.get("drafted_per_position") or [])):
            if i == len(drafted):
                accepted.append(0)
                drafted.append(0)
            accepted[i] += a
            drafted[i] += d
    return tuple(a / d if d else math.nan for a, d in zip(accepted, drafted))  # nan: never drafted there


def exact_matches(method_rows: Sequence[dict], base_rows: Sequence[dict]) -> tuple[int, int]:
    """(identical, compared) over (question, repeat) pairs both sides ran."""
    base = {(r["repeat"], r["question_id"]): r["token_hash"] for r in base_rows}
    pairs = [(r["token_hash"], base[(r["repeat"], r["question_id"])]) for r in method_rows
             if (r["repeat"], r["question_id"]) in base]
    return sum(a == b for a, b in pairs), len(pairs)


def cell(task: str, method: str, rows: Sequence[dict], base_rows: Sequence[dict],
         plain_rows: Sequence[dict] = ()) -> Cell:
    baseline = rows[0]["baseline"]
    by_repeat: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        by_repeat[r["repeat"]].append(r["tokens_per_second"])
    ratios = speedups(rows, base_rows) if method != baseline else []
    speedup, std = mean_std(ratios) if ratios else (None, None)
    exact, compared = exact_matches(rows, base_rows) if method != baseline else (0, 0)
    return Cell(
        task=task,
        method=method,
        baseline=baseline,
        questions=len({r["question_id"] for r in rows}),
        repeats=len(by_repeat),
        tokens_per_second=statistics.mean(statistics.mean(v) for v in by_repeat.values()),
        speedup=speedup,
        speedup_std=std,
        mean_accepted_tokens=mean_accepted_tokens(rows),
        acceptance_per_position=acceptance_per_position(rows),
        exact=exact,
        compared=compared,
        seconds=sum(r.get("seconds", 0.0) for r in rows),
        **dict(
            zip(("same_as_plain", "compared_to_plain"), exact_matches(rows, plain_rows) if method != PLAIN else (0, 0))
        ),
    )


def summarize(rows: Sequence[dict]) -> list[Cell]:
    """Cells per task (Spec-Bench's order) and overall, for every method, of rows of ONE setup
    (the rows of skipped methods, which measured nothing, are left out)."""
    rows = dedupe(r for r in rows if "skipped" not in r)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    present = {r["task"] for r in rows}
    tasks = [t for t in TASKS if t in present] + sorted(present - set(TASKS))
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"])].append(r)
        groups[(OVERALL, r["method"])].append(r)
    cells = []
    for task in [*tasks, OVERALL]:
        for method in methods:
            group = groups.get((task, method))
            if group:
                cells.append(cell(task, method, group, groups.get((task, group[0]["baseline"]), []),
                                  groups.get((task, PLAIN), [])))
    return cells


def split_setups(rows: Iterable[dict]) -> dict[str, list[dict]]:
    """Rows grouped by setup (runs with other models / dtype / max_new_tokens are not comparable)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        out[r.get("setup_key", "")].append(r)
    return dict(out)

"""Spec-Bench questions: loading, category -> task grouping, filtering.

The default question set ships inside the package: spec_bench/question.jsonl (Spec-Bench's 480 questions,
Apache-2.0; LICENSE and NOTICE beside it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sparrow.errors import UserError

DEFAULT_DATA = Path(str(resources.files("sparrow.bench") / "spec_bench" / "question.jsonl"))
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def task_of(category: str) -> str:
    """Spec-Bench's grouping (evaluation/speed.py): the eight MT-bench categories form one task."""
    return "mt_bench" if category in MT_BENCH else category


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]  # user turns; answers come from the model

    @property
    def task(self) -> str:
        return task_of(self.category)


def read_questions(path: str | Path) -> list[Question]:
    """All questions of a Spec-Bench style JSONL file (`question_id`, `category`, `turns`)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file {str(path)!r} does not exist (expected Spec-Bench's question.jsonl; pass --data "
                        "FILE)")
    questions = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = tuple(str(t) for t in row["turns"])
            question = Question(row["question_id"], str(row["category"]), turns)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"data file {str(path)!r}, line {number}: expected a JSON object with "
                             f"question_id, category and turns ({type(e).__name__}: {e})") from None
        if not turns or not all(t.strip() for t in turns):
            raise UserError(f"data file {str(path)!r}, line {number}: turns must be non-empty strings")
        questions.append(question)
    if not questions:
        raise UserError(f"data file {str(path)!r} holds no questions")
    return questions


def select(questions: Sequence[Question], categories: Sequence[str] = (), limit: int | None = None,
           per_task: int | None = None) -> list[Question]:
    """Questions of `categories` (category or task names; all when empty), file order, at most `limit` per
    category and at most `per_task` per task (taken round-robin over the task's categories)."""
    known = dict.fromkeys(q.category for q in questions)
    tasks = dict.fromkeys(q.task for q in questions)
    unknown = [c for c in categories if c not in known and c not in tasks]
    if unknown:
        raise UserError(f"unknown categories {', '.join(map(repr, unknown))}; expected category names "
                         f"({', '.join(known)}) or task names ({', '.join(tasks)})")
    for name, value in (("limit", limit), ("per_task", per_task)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    wanted = set(categories)
    counts: dict[str, int] = {}
    chosen: list[tuple[int, int, Question]] = []  # (rank within its category, file position, question)
    for position, q in enumerate(questions):
        if wanted and q.category not in wanted and q.task not in wanted:
            continue
        rank = counts.get(q.category, 0)
        if limit is not None and rank >= limit:
            continue
        counts[q.category] = rank + 1
        chosen.append((rank, position, q))
    if per_task is not None:  # round-robin over a task's categories: MT-bench's first N span its categories
        taken: dict[str, int] = {}
        kept = []
        for item in sorted(chosen, key=lambda item: item[:2]):
            if taken.get(item[2].task, 0) < per_task:
                taken[item[2].task] = taken.get(item[2].task, 0) + 1
                kept.append(item)
        chosen = kept
    return [q for _, _, q in sorted(chosen, key=lambda item: item[1])]


def shortest_per_task(questions: Sequence[Question], n: int = 1) -> list[Question]:
    """The `n` questions of each task with the shortest first turn, in file order (`--quick`: cheap prefills)."""
    by_task: dict[str, list[Question]] = {}
    for q in questions:
        by_task.setdefault(q.task, []).append(q)
    keep = {id(q) for group in by_task.values() for q in sorted(group, key=lambda q: len(q.turns[0]))[:n]}
    return [q for q in questions if id(q) in keep]


def load_questions(path: str | Path, categories: Sequence[str] = (), limit: int | None = None,
                   per_task: int | None = None) -> list[Question]:
    return select(read_questions(path), categories, limit, per_task)

"""Timed runs of every method on every question -> one JSONL row per question x method x repeat.

Protocol (Spec-Bench): greedy, batch 1, warm-up first, the chat template for the (instruction-style)
questions, methods interleaved per question so drift hits all of them alike. Multi-turn questions
continue each method's own conversation (its own earlier answers), as Spec-Bench does.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from sparrow.bench.data import Question
from sparrow.bench.methods import (
    PLAIN,
    baseline_of,
    is_peer,
    needs_cross_draft,
    needs_draft,
    needs_same_vocabulary,
    parse_methods,
)
from sparrow.bench.peers import run_peer
from sparrow.drafters.base import forget_requests
from sparrow.drafters.registry import REGISTRY, takers
from sparrow.errors import UserError
from sparrow.loading import load
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.measure import follow_cost_curve
from sparrow.runtime.cached_model import CachedModel


@dataclass(frozen=True)
class BenchConfig:
    """Everything that makes two runs comparable (written into every row as `setup`)."""

    target: str
    draft: str | None
    cross_draft: str | None
    dtype: str
    k: int | None  # None: each drafter's default
    adaptive: bool
    max_new_tokens: int
    turns: int  # user turns per question that are generated (1: first turns, Spec-Bench uses all)
    chat: bool
    device: str
    quant: str | None = None
    draft_quant: str | None = None
    lookup_tokens: int = 10  # transformers' prompt_lookup_num_tokens
    temperature: float = 0.0
    head: str | None = None  # the head directory of the "eagle" method
    drafter_options: dict = field(default_factory=dict)  # method -> its drafter options (--speculative-config)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.turns < 1:
            raise UserError(f"turns must be >= 1, got {self.turns}")

    def key(self) -> str:
        fields = asdict(self)
        if fields["head"] is None:  # runs without a head keep the keys of runs from before the field existed
            del fields["head"]
        if not fields["drafter_options"]:  # the same for runs without --speculative-config options
            del fields["drafter_options"]
        return json.dumps(fields, sort_keys=True)


@dataclass(frozen=True)
class Models:
    target: LoadedModel
    draft: LoadedModel | None = None  # same vocabulary (draft-model, hf-assisted, ...)
    cross_draft: LoadedModel | None = None  # another tokenizer (cross-vocab, hf-uad)


def check_models(methods: Sequence[str], models: Models) -> None:
    optional = {m for m in methods if m in REGISTRY and not REGISTRY[m].needs_draft_model}  # "auto": uses one if given
    missing = [m for m in methods if (needs_draft(m) and models.draft is None and m not in optional)
               or (needs_cross_draft(m) and models.cross_draft is None)]
    if missing:
        raise UserError(f"methods {', '.join(missing)} need a draft model (--draft / --cross-draft)")


def unfit_methods(methods: Sequence[str], models: Models) -> dict[str, str]:
    """Methods these models cannot run, each with the reason: those needing a --draft with the target's
    vocabulary when the draft has another one (a run skips them and its report says why)."""
    if models.draft is None:
        return {}
    target_vocab, draft_vocab = CachedModel(models.target.model).vocab_size, CachedModel(models.draft.model).vocab_size
    if draft_vocab == target_vocab:
        return {}
    why = (f"the draft {models.draft.name} has a {draft_vocab}-token vocabulary, the target {models.target.name} "
           f"{target_vocab}: pass a --draft with the target's vocabulary, or use cross-vocab / hf-uad (--cross-draft)")
    return {m: why for m in methods if needs_same_vocabulary(m)}


def build_pipelines(methods: Sequence[str], models: Models, config: BenchConfig) -> dict[str, Pipeline]:
    """One Pipeline per sparrow method, all sharing the one loaded target (and drafts)."""
    pipes = {}
    for method in methods:
        if is_peer(method):
            continue
        name = "none" if method == PLAIN else method
        entry = REGISTRY.get(name)
        draft = models.cross_draft if needs_cross_draft(method) else models.draft
        has_model = entry is not None and entry.takes_draft_model
        draft_quant = config.draft_quant if entry is not None and entry.drafts_with_model else None
        pipe = load(models.target, drafter=name, draft=draft if has_model else None, num_draft_tokens=config.k,
                            adaptive=config.adaptive, progress=False, draft_quant=draft_quant,
                            **({"head": config.head} if name in takers("head") else {}),
                            **config.drafter_options.get(name, {}))
        if config.quant is not None and pipe.drafter is not None:  # a quantized target: k follows the cost curve
            follow_cost_curve(pipe.drafter, pipe.runner)
        pipes[method] = pipe
    return pipes


def conversation_ids(tokenizer: PreTrainedTokenizerBase, users: Sequence[str], answers: Sequence[str],
                     chat: bool) -> list[int]:
    """Prompt ids for the next answer: user turns interleaved with the earlier answers
    (len(answers) == len(users) - 1); the chat template when asked for and the tokenizer has one."""
    assert len(answers) == len(users) - 1
    if chat and tokenizer.chat_template:
        messages = []
        for i, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    parts = [p for pair in zip(users, [*answers, ""]) for p in pair if p]
    return tokenizer("\n\n".join(parts))["input_ids"]


def token_hash(turn_tokens: Sequence[Sequence[int]]) -> str:
    return hashlib.sha1(json.dumps([list(t) for t in turn_tokens]).encode()).hexdigest()[:16]


class Runner:
    """Runs methods on questions with one loaded target; returns JSON-ready rows."""

    def __init__(self, methods: Sequence[str], models: Models, config: BenchConfig) -> None:
        methods = parse_methods(methods)
        check_models(methods, models)
        self.skipped = unfit_methods(methods, models)  # method -> why: not run, one "skipped" row each
        self.methods = [m for m in methods if m not in self.skipped]
        self.models = models
        self.config = config
        self.pipes = build_pipelines(self.methods, models, config)
        self.plain = Pipeline(models.target, None)  # encodes prompts and checks context lengths

    def run_turn(self, method: str, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        """One generation; the statistics of the answer."""
        if is_peer(method):
            self.plain.request(ids, max_new_tokens=max_new_tokens)  # same context checks as sparrow's methods
            out = run_peer(method, self.models.target, torch.tensor(ids, dtype=torch.long), max_new_tokens,
                           self.models.draft, self.models.cross_draft, self.config.lookup_tokens)
            return {"token_ids": out.token_ids, "seconds": out.seconds, "decoding_steps": out.target_forwards,
                    "step_tokens": len(out.token_ids), "target_forwards": out.target_forwards,
                    "finish_reason": "length" if len(out.token_ids) >= max_new_tokens else "stop"}
        pipe = self.pipes[method]
        run = pipe.generate_plain if method == PLAIN else pipe.generate
        result = run(ids, max_new_tokens=max_new_tokens)
        s = result.stats
        return {
            "drafter_choices": result.ran.rounds_per_option,  # auto: rounds per option
            "token_ids": result.token_ids,
            "seconds": result.seconds,
            "decoding_steps": s.steps,
            "step_tokens": s.steps + s.num_accepted_tokens,
            "target_forwards": s.steps + 1,
            "finish_reason": result.finish_reason,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "accepted_per_position": list(s.accepted_per_position),
            "drafted_per_position": list(s.drafted_per_position),
            "prefill_seconds": s.prefill_seconds,
            "draft_seconds": s.draft_seconds,
            "verify_seconds": s.verify_seconds,
        }

    def run_question(self, method: str, question: Question, max_new_tokens: int | None = None) -> dict[str, Any]:
        """All generated turns of one question, summed as Spec-Bench does (tokens / seconds over turns)."""
        n = max_new_tokens or self.config.max_new_tokens
        users = question.turns[: self.config.turns]
        answers: list[str] = []
        turns = []
        for i in range(len(users)):
            ids = conversation_ids(self.models.target.tokenizer, users[: i + 1], answers, self.config.chat)
            turn = self.run_turn(method, ids, n)
            turn["prompt_tokens"] = len(ids)
            answers.append(self.models.target.tokenizer.decode(turn["token_ids"], skip_special_tokens=True))
            turns.append(turn)
        return merge_turns(turns)

    def forget(self) -> None:
        """Every method's drafter forgets earlier requests (suffix's store of outputs, `forget_requests`): each
        repeat runs the questions as a fresh process would, drafting from the answers of the questions before it in
        this repeat, never from its own answer of an earlier repeat or of the warm-up."""
        for pipe in self.pipes.values():
            forget_requests(pipe.drafter)

    def warmup(self, question: Question, runs: int) -> None:
        """One-time kernel, allocator and cache costs stay out of the timings."""
        for _ in range(runs):
            for method in self.methods:
                self.run_question(method, question, max_new_tokens=min(16, self.config.max_new_tokens))

    def run(self, questions: Sequence[Question], repeats: int = 1, warmup: int = 1, first_repeat: int = 0,
            on_row: Callable[[dict], None] | None = None, on_step: Callable[[str, Question], None] | None = None,
            ) -> list[dict]:
        if repeats < 1:
            raise UserError(f"repeats must be >= 1, got {repeats}")
        if not questions:
            raise UserError("no questions selected")
        if warmup:
            self.warmup(questions[0], warmup)
        run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        env = environment(self.models.target)
        rows = []
        for method, why in self.skipped.items():  # no question_id: the report lists these apart from measurements
            row = {"run_id": run_id, "setup": asdict(self.config), "setup_key": self.config.key(), **env,
                   "method": method, "baseline": baseline_of(method), "skipped": why}
            rows.append(row)
            if on_row is not None:
                on_row(row)
        for repeat in range(first_repeat, first_repeat + repeats):
            self.forget()
            for question in questions:
                hashes: dict[str, str] = {}
                for method in self.methods:
                    if on_step is not None:
                        on_step(method, question)
                    out = self.run_question(method, question)
                    hashes[method] = out["token_hash"]
                    base = baseline_of(method)
                    row = {"run_id": run_id, "setup": asdict(self.config), "setup_key": self.config.key(), **env,
                           "method": method, "baseline": base, "question_id": question.question_id,
                           "category": question.category, "task": question.task, "repeat": repeat, **out,
                           "identical_to_baseline": out["token_hash"] == hashes[base] if base in hashes else None,
                           "identical_to_plain": out["token_hash"] == hashes[PLAIN] if PLAIN in hashes else None}
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
        return rows


def merge_turns(turns: list[dict]) -> dict[str, Any]:
    """Per-question totals over turns (token ids kept per turn)."""
    total = sum(t["seconds"] for t in turns)
    new_tokens = sum(len(t["token_ids"]) for t in turns)
    merged: dict[str, Any] = {
        "new_tokens": new_tokens, "seconds": total, "tokens_per_second": new_tokens / total if total > 0 else 0.0,
        "token_ids": [t["token_ids"] for t in turns], "token_hash": token_hash([t["token_ids"] for t in turns]),
        "turn_seconds": [t["seconds"] for t in turns], "prompt_tokens": [t["prompt_tokens"] for t in turns],
        "finish_reasons": [t["finish_reason"] for t in turns],
    }
    for key in ("decoding_steps", "step_tokens", "target_forwards", "num_draft_tokens", "num_accepted_tokens",
                "prefill_seconds", "draft_seconds", "verify_seconds"):
        values = [t[key] for t in turns if key in t]
        merged[key] = sum(values) if values else None
    for key in ("accepted_per_position", "drafted_per_position"):
        if any(key in t for t in turns):
            width = max(len(t.get(key, [])) for t in turns)
            merged[key] = [sum(t.get(key, [])[i] if i < len(t.get(key, [])) else 0 for t in turns)
                           for i in range(width)]
        else:
            merged[key] = None
    choices = [t["drafter_choices"] for t in turns if t.get("drafter_choices")]
    merged["drafter_choices"] = {k: sum(c.get(k, 0) for c in choices) for c in choices for k in c} or None
    steps = merged["decoding_steps"]
    merged["mean_accepted_tokens"] = merged["step_tokens"] / steps if steps else None
    return merged


def environment(target: LoadedModel) -> dict[str, Any]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(target.model.device), "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine()}


def write_rows(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as sink:
        for row in rows:
            sink.write(json.dumps(row) + "\n")

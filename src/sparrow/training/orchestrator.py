"""One orchestrator for training a head, that `sparrow train head` (sparrow.training.trainer, on cached features) and
the GPU recipe (sparrow.training.recipe, on online features) both call: the step loop with its learning-rate
schedule, its stops (steps, time budget; optionally SIGTERM / SIGINT and an error), its checkpoints (every N steps or
every S seconds, and always at the end), the final held-out evaluation, and what a run directory holds around it:
the refusals of `--resume` and of an `--out` that holds a run, JSON-lines logs, eval.json and the quantized export.

What differs between the two is a `Steps` object: one optimiser step (where its features come from), a
checkpoint (what it writes) and the evaluation. Imports: the standard library, torch and sparrow modules that
import only torch and safetensors (the recipe runs on bare device machines).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from sparrow.errors import UserError
from sparrow.heads.layout import export_quantized
from sparrow.training.loop import Evaluation

REPORT = "eval.json"


@dataclass(frozen=True)
class Schedule:
    """When a run steps, checkpoints and stops."""

    lr: float
    warmup: int  # steps of linear learning-rate warmup
    steps: int | None = None  # stop once this many optimiser steps are done in all (resumed ones included)
    until: float | None = None  # time.monotonic() after which no step starts
    checkpoint_steps: int | None = None  # a checkpoint after every this many steps
    checkpoint_seconds: float | None = None  # a checkpoint once this many seconds passed since the last one
    cosine: bool = False  # after the warmup, a cosine decay of the learning rate over the time up to `until`
    steps_reached: str = "done"  # what `stopped` says when `steps` are done
    always_finish: bool = False  # SIGTERM, SIGINT ("signal N") or an exception ("error") end training, not the run


@dataclass(frozen=True)
class Outcome:
    """Where a run stopped, and its head's held-out evaluation there."""

    step: int  # optimiser steps done in total (resumed ones included)
    stopped: str  # Schedule.steps_reached, "time budget", "signal N" or "error"
    error: str | None  # "Type: message" when stopped by an error
    evaluation: Evaluation | None
    seconds: float  # in the step loop


class Steps(Protocol):
    """What differs between the trainers."""

    optimiser: torch.optim.Optimizer
    order: torch.Generator  # the data order

    def step(self, step: int) -> None:
        """Optimiser step number `step` (0-based) on one batch (the learning rate already set)."""

    def checkpoint(self, step: int) -> None:
        """Save what `--resume` needs to continue after `step` steps."""

    def evaluate(self, step: int) -> Evaluation | None:
        """The head on the held-out set after `step` steps (None: no held-out set)."""


def lr_scale(step: int, warmup: int, fraction: float) -> float:
    """The learning rate's factor at optimiser step `step` (0-based) with `fraction` of the training time spent:
    linear warmup over `warmup` steps, then a cosine decay over the time, never below 0.1 (fraction 0: no decay)."""
    return min(1.0, (step + 1) / warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * min(max(fraction, 0.0), 1.0))))


def train(steps: Steps, schedule: Schedule, state: dict[str, Any] | None = None, start_step: int = 0) -> Outcome:
    """Step from `start_step` (resumed: the optimiser and data order of a checkpoint's `state`) until the schedule
    stops, checkpointing as it says; at the end (with `always_finish` also after SIGTERM, SIGINT or an exception)
    the held-out evaluation and a last checkpoint."""
    if state is not None:
        steps.optimiser.load_state_dict(state["optimiser"])
        steps.order.set_state(state["generator"])
    start = last = time.monotonic()
    step, stopped, error, saved = start_step, schedule.steps_reached, None, None
    signalled: list[int] = []
    try:
        with stop_on_signals(signalled) if schedule.always_finish else contextlib.nullcontext():
            while True:
                if signalled:
                    stopped = f"signal {signalled[0]}"
                    break
                if schedule.steps is not None and step >= schedule.steps:
                    stopped = schedule.steps_reached
                    break
                now = time.monotonic()
                if schedule.until is not None and now >= schedule.until:
                    stopped = "time budget"
                    break
                fraction = (now - start) / max(schedule.until - start, 1e-9) if schedule.cosine and schedule.until \
                    else 0.0
                for group in steps.optimiser.param_groups:
                    group["lr"] = schedule.lr * lr_scale(step, schedule.warmup, fraction)
                steps.step(step)
                step += 1
                if (schedule.checkpoint_steps is not None and step % schedule.checkpoint_steps == 0) or (
                        schedule.checkpoint_seconds is not None
                        and time.monotonic() - last >= schedule.checkpoint_seconds):
                    steps.checkpoint(step)
                    saved, last = step, time.monotonic()
    except Exception as failure:
        if not schedule.always_finish:
            raise
        stopped, error = "error", f"{type(failure).__name__}: {failure}"
        print(f"training stopped by {error}; exporting what there is", file=sys.stderr)
    seconds = time.monotonic() - start
    evaluation = steps.evaluate(step)
    if saved != step:  # not twice the same step: the previous checkpoint stays an earlier one
        steps.checkpoint(step)
    return Outcome(step, stopped, error, evaluation, seconds)


@contextlib.contextmanager
def stop_on_signals(signalled: list[int]) -> Iterator[None]:
    """Inside the block SIGTERM and SIGINT append their number to `signalled` instead of ending the process (main
    thread only; elsewhere nothing changes); the previous handlers come back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kinds = (signal.SIGTERM, signal.SIGINT)
    previous = {kind: signal.signal(kind, lambda number, frame: signalled.append(number)) for kind in kinds}
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler)


# --- the run directory -----------------------------------------------------------------------------------------


def check_out(out: Path, resume: bool, checkpoint: Path | None, what: str = "") -> None:
    """`--resume` needs a checkpoint (`checkpoint`: the file found, None when there is none), a fresh run an `out`
    without one; `what` says what else a resume could have continued."""
    if resume and checkpoint is None:
        raise UserError(f"--resume: {str(out)!r} holds no checkpoint{what} to continue")
    if not resume and checkpoint is not None:
        raise UserError(f"--out {str(out)!r} already holds a run: pass --resume to continue it, or give another --out")


def append_row(path: Path, row: dict[str, Any]) -> None:
    """One row of a JSON-lines log."""
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def write_report(out: Path, report: dict[str, Any]) -> None:
    """OUT/eval.json."""
    (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")


def export(head: Any, directory: Path, bits: int) -> dict[str, Any]:
    """The head's int`bits` export in `directory` (written beside and swapped in whole): where, its bytes and
    shards. UserError when the head does not fit the format's size limits."""
    written = export_quantized(head, directory, bits=bits, replace=True)
    return {"dir": str(directory), "bits": bits, "bytes": written.total_bytes, "shards": len(written.shard_bytes)}

"""How a `sparrow train head` run shows its progress: its lines and progress bars on stderr, its report on stdout
(the run's stages: sparrow.training.head_run; the command and its flags: sparrow.cli.train)."""

from __future__ import annotations

import time
from typing import Any

import typer

from sparrow.cli._common import err


class TerminalConsole:
    """sparrow.training.head_run.Console on the terminal (`progress`: bars, or none with --no-progress)."""

    def __init__(self, progress: bool) -> None:
        self.progress = progress

    def say(self, message: str) -> None:
        err.print(message, markup=False, highlight=False, soft_wrap=True)

    def bars(self) -> _Bars:
        return _Bars(self.progress)

    def echo(self, line: str) -> None:
        typer.echo(line)


class _Bars:
    """Progress on stderr (none with --no-progress): on a terminal, rich bars, one task per stage name; elsewhere
    (stderr into a log file, where rich draws nothing until a stage ends) one plain line per stage every
    `log_every` seconds and when the stage completes, with the time left at the stage's rate so far."""

    def __init__(self, enabled: bool, log_every: float = 60.0, clock: Any = time.monotonic) -> None:
        self.enabled, self.log_every, self.clock = enabled, log_every, clock
        self.bar: Any = None
        self.tasks: dict[str, int] = {}
        self.first: dict[str, tuple[float, int]] = {}  # plain lines: stage -> (time, done) when first reported
        self.logged: dict[str, float] = {}  # plain lines: stage -> when its last line was printed

    def __enter__(self) -> _Bars:
        if self.enabled and err.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=False)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, stage: str, done: int, total: int, info: str = "") -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            if stage not in self.tasks:
                self.tasks[stage] = self.bar.add_task(stage, total=total, completed=done, info="")
            self.bar.update(self.tasks[stage], completed=done, total=total, info=info)
            return
        now = self.clock()
        start, start_done = self.first.setdefault(stage, (now, done))
        if done < total and now - self.logged.get(stage, start - self.log_every) < self.log_every:
            return
        self.logged[stage] = now
        rate = (done - start_done) / (now - start) if now > start else 0.0
        left = f", about {_duration((total - done) / rate)} left" if rate > 0 and done < total else ""
        err.print(f"{stage}: {done}/{total} after {_duration(now - start)}{left}" + (f"; {info}" if info else ""),
                  markup=False, highlight=False, soft_wrap=True)

    def callback(self, stage: str, done: int, total: int) -> None:
        self.update(stage, done, total)


def _duration(seconds: float) -> str:
    """4h02m, 6m40s, 35s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"

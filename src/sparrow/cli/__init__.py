"""The `sparrow` command line: assembles the commands into one Typer app (`sparrow = "sparrow.cli:app"`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sparrow.cli.bench import bench
from sparrow.cli.doctor import doctor
from sparrow.cli.generate import generate
from sparrow.cli.models import models_app
from sparrow.cli.serve import serve
from sparrow.cli.train import train_app
from sparrow.cli.tune import tune_app
from sparrow.runtime.memory import keep_freed_memory
from sparrow.runtime.threads import set_threads

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Lossless speculative decoding for LLMs and Video-LLMs.")


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Also print the traceback of user errors (exit code 2); "
                                             "internal errors (exit 1) always print theirs.")] = False,
         threads: Annotated[Optional[int], typer.Option(
             "--threads", min=1, help="torch's compute threads. Default: torch's own, but never more than the CPUs "
             "this process may use (its CPU affinity, and a cgroup CPU quota where one is set).")] = None) -> None:
    """Lossless speculative decoding for LLMs and Video-LLMs."""
    set_threads(threads)
    keep_freed_memory()  # prefills reuse freed memory instead of faulting fresh pages in (sparrow.runtime.memory)


app.command()(generate)
app.command()(bench)
app.command()(serve)
app.command()(doctor)
app.add_typer(models_app, name="models")
app.add_typer(tune_app, name="tune")
app.add_typer(train_app, name="train")

__all__ = ["app"]

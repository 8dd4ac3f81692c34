"""`sparrow tune`: tune drafters for a target on this machine (the search itself: sparrow.training.layer_skip)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sparrow.cli._common import DTYPE_HELP, DType, check_float, check_int, cli_errors, err
from sparrow.errors import UserError

tune_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                       help="Tune drafters for a target on this machine.", no_args_is_help=True)


@tune_app.command("layer-skip")
@cli_errors
def layer_skip(
    target: Annotated[str, typer.Option(help="Target model: preset, local dir or hub id.")] = "qwen2.5-coder-1.5b",
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="Record file (default: <cache>/skip_sets/<target>.json, which --drafter layer-skip loads by name)."
        ),
    ] = None,
    k: Annotated[int, typer.Option("-k", "--num-draft-tokens", help="Largest draft length considered.")] = 8,
    new_tokens: Annotated[int, typer.Option(help="Calibration tokens generated per prompt.")] = 24,
    time_budget: Annotated[
        float, typer.Option(help="Seconds for the search (the confirmation run comes on top).")
    ] = 300.0,
    confirm_tokens: Annotated[
        int, typer.Option(help="Tokens per prompt of the confirming timed run (0 = skip it).")
    ] = 48,
    prompt: Annotated[
        Optional[list[str]], typer.Option(help="Calibration prompt (repeatable; default: built-in code and prose).")
    ] = None,
    dtype: Annotated[DType, typer.Option(help=DTYPE_HELP)] = DType.auto,
    device: Annotated[Optional[str], typer.Option(help="Default: cuda if available, else cpu.")] = None,
) -> None:
    """Search the layer-skip set with the best expected speedup, confirm it by a timed run, save it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sparrow.drafters.layer_skip import user_record_path
    from sparrow.models import load_model
    from sparrow.training.layer_skip import CALIBRATION_PROMPTS, tune_layer_skip

    check_int("-k/--num-draft-tokens", k, 1)
    check_int("--new-tokens", new_tokens, 2)  # agreement is measured on the tokens after the first
    check_float("--time-budget", time_budget, "a finite number of seconds > 0", lambda seconds: seconds > 0)
    check_int("--confirm-tokens", confirm_tokens, 0)
    if any(not p.strip() for p in prompt or ()):
        raise UserError("--prompt must not be empty")
    loaded = load_model(target, dtype=dtype.value, device=device, progress=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=False) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        record = tune_layer_skip(loaded, max_k=k, prompts=tuple(prompt) if prompt else CALIBRATION_PROMPTS,
                                 new_tokens=new_tokens, time_budget=time_budget, confirm_tokens=confirm_tokens,
                                 progress=progress, say=lambda m: bar.console.print(m, markup=False, highlight=False))
    path = out or user_record_path(loaded.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record.save(path)
    measured = "-" if record.measured_speedup is None else f"{record.measured_speedup:.2f}x"
    err.print(f"skip set {record.skip} ({record.skip.num_skipped} sub-layers), k={record.num_draft_tokens}: "
              f"agreement {record.agreement:.2f}, draft cost {record.draft_cost:.2f}, expected "
              f"{record.expected_speedup:.2f}x, measured {measured}", markup=False, highlight=False)
    if record.recommended:
        err.print(f"recommended; saved to {path}", markup=False, highlight=False)
    else:
        err.print(f"NOT recommended ({record.note}): --drafter layer-skip will decode plainly with it; "
                  f"saved to {path}", markup=False, highlight=False)

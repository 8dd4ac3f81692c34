"""`sparrow models`: the preset models, whether each is installed and cached."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def models() -> None:
    """List the preset models and whether each is installed and cached."""
    from sparrow.models import list_presets

    table = Table("preset", "installed", "cached", "description")
    for row in list_presets():
        table.add_row(row["name"], "yes" if row["installed"] else "no", "yes" if row["cached"] else "no",
                      row["description"])
    Console().print(table)

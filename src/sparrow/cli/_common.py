"""What every `sparrow` command shares: the stderr console, the dtype choice and one error path.

User errors (sparrow.errors.UserError; OSError, e.g. a missing file or model) end the command with one line
`error: ...` on stderr and exit code 2. Anything else (a RuntimeError from torch, an AssertionError)
is a bug and keeps its traceback; `sparrow --debug ...` shows the traceback of user errors too.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import Enum
from typing import NoReturn, TypeVar

import typer
from rich.console import Console

from sparrow.errors import UserError

USER_ERRORS = (UserError, OSError)

err = Console(stderr=True)
Command = TypeVar("Command", bound=Callable)


class DType(str, Enum):
    bfloat16 = "bfloat16"
    float32 = "float32"
    float16 = "float16"


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2, no traceback."""
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def cli_errors(command: Command) -> Command:
    """Decorate a command: user errors become `fail(first line of the message)`, unless `sparrow --debug`.

    The wrapper takes Typer's context as an extra first parameter (`ctx`), to read the app's --debug flag."""

    @functools.wraps(command)
    def run(ctx: typer.Context, *args, **kwargs):
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as e:
            if ctx.find_root().params.get("debug"):
                raise
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    signature = inspect.signature(command, eval_str=True)
    context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    run.__signature__ = signature.replace(parameters=[context, *signature.parameters.values()])
    return run  # type: ignore[return-value]

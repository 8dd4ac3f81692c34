"""What every `sparrow` command shares: the stderr console, the dtype choice, flag checks and the error policy.

Exit codes and what stderr shows (commands decorated with `cli_errors`):

- 2, user error: sparrow.errors.UserError (a bad argument, a missing file, a model that does not fit),
  an OSError (no such file, permission denied, disk full) or torch's OutOfMemoryError. Stderr ends with
  exactly one line, `error: <message>`, whose message names the argument and what was expected; no
  traceback. `sparrow --debug ...` prints the traceback above that same line; the exit code stays 2.
  Click's own usage errors (an unknown option, `--top-k abc`) also exit 2, in click's format
  (`Usage: ...` / `Error: Invalid value for '--top-k': ...`).
- 1, internal error: anything else (a RuntimeError or AssertionError, a plain ValueError from deep inside
  torch) is a bug in sparrow, never the user's mistake. Stderr shows the full traceback, then one last line
  `internal error: <Type>: <first line of the message> -- this is a bug in sparrow, not in your input; please
  report it with the traceback above`. The traceback is printed rather than hidden behind --debug because a
  rerun costs minutes of model loading and a sampled run may not fail again.
- 130, Ctrl-C: KeyboardInterrupt is not caught here; Typer turns it into a quiet exit 130.
- 1, broken pipe (`sparrow generate ... | head -c 10`): not caught here; click exits 1 quietly.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import sys
import traceback
from collections.abc import Callable
from enum import Enum
from typing import NoReturn, TypeVar

import click
import typer
from rich.console import Console

from sparrow.errors import UserError

USER_ERRORS = (UserError, OSError)
OUT_OF_MEMORY_HINT = (" -- the model or the request does not fit on this device: try a smaller model, --quant int4, "
                      "fewer tokens, or --device cpu")

err = Console(stderr=True)
Command = TypeVar("Command", bound=Callable)


class DType(str, Enum):
    auto = "auto"  # what this machine runs fastest (sparrow.runtime.hardware.choose_dtype; `sparrow doctor` shows it)
    bfloat16 = "bfloat16"
    float32 = "float32"
    float16 = "float16"


DTYPE_HELP = ("auto (default): what this machine runs fastest (see `sparrow doctor`); bfloat16 for speed, "
              "float32 for exactness.")


def dtype_name(dtype: DType | str, device: str | None = None) -> str:
    """The name of the dtype that runs: "auto" resolved for `device` on this machine (for records and reports)."""
    from sparrow.models import resolve_dtype

    value = dtype.value if isinstance(dtype, DType) else dtype
    return str(resolve_dtype(value, device)).removeprefix("torch.")


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2, no traceback."""
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def check_int(flag: str, value: int | None, low: int) -> None:
    """Refuse an integer flag below `low` (None: the flag was not given)."""
    if value is not None and value < low:
        raise UserError(f"{flag} must be an integer >= {low}, got {value}")


def check_float(flag: str, value: float | None, expected: str, ok: Callable[[float], bool]) -> None:
    """Refuse a float flag that is not finite or fails `ok`; `expected` completes "must be ..."."""
    if value is not None and not (math.isfinite(value) and ok(value)):
        raise UserError(f"{flag} must be {expected}, got {value}")


QUANT_HELP = ("int8|int4 weight-only or w8a8 (CPU: int8 weights and per-token int8 activations, fbgemm) target: "
              "faster; lossless only relative to the quantized target. gguf (CPU): the target runs on its GGUF "
              "file's own 4/6/8-bit blocks (a preset or a .gguf file; no float copy). auto: the format this machine "
              "runs a verification step fastest (measured, see `sparrow doctor`; the GGUF file's blocks among them "
              "for a preset or .gguf target; dense where none pays), again lossless only relative to the target in "
              "that format; none: dense.")
SPECULATIVE_CONFIG_HELP = ("vLLM's speculative config as JSON, e.g. '{\"method\": \"suffix\", "
                           "\"num_speculative_tokens\": 16}': method ngram|draft_model|eagle|eagle3|suffix, model, "
                           "num_speculative_tokens, prompt_lookup_max/min, suffix_decoding_*; a flag given beside it "
                           "must agree.")


def drafter_flags_given() -> frozenset[str]:
    """Which of --drafter / --draft / -k the command line set (not left at their defaults): what a speculative config
    may not contradict (`sparrow.drafters.plan.resolve_plan`'s `given`)."""
    ctx = current_context()
    flags = {"drafter": "drafter", "draft": "draft", "k": "num_draft_tokens"}
    sources = {param: ctx.get_parameter_source(param) if ctx is not None else None for param in flags}
    return frozenset(name for param, name in flags.items()
                     if sources[param] is not None and sources[param].name != "DEFAULT")


def current_context() -> object | None:
    """The running command's click context (Typer runs its own vendored copy of click, so ask both)."""
    for module in ("typer._click.globals", "click"):
        try:
            ctx = importlib.import_module(module).get_current_context(silent=True)
        except (ImportError, AttributeError):
            continue
        if ctx is not None:
            return ctx
    return None


def cli_errors(command: Command) -> Command:
    """Decorate a command with the error policy of the module docstring.

    The wrapper takes Typer's context as an extra first parameter (`ctx`), to read the app's --debug flag."""

    @functools.wraps(command)
    def run(ctx: typer.Context, *args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, BrokenPipeError):
            raise  # typer.Exit from fail(), a usage error, a closed stdout: click's own handling and exit codes
        except Exception as e:  # not KeyboardInterrupt: Typer's exit 130 stays
            if is_user_error(e):
                if ctx.find_root().params.get("debug"):
                    print_traceback(e)
                fail(first_line(e) + ("" if isinstance(e, USER_ERRORS) else OUT_OF_MEMORY_HINT))
            print_traceback(e)
            err.print(f"internal error: {type(e).__name__}: {first_line(e)} -- this is a bug in sparrow, not in "
                      "your input; please report it with the traceback above", markup=False, highlight=False,
                      soft_wrap=True)
            raise typer.Exit(1) from None

    signature = inspect.signature(command, eval_str=True)
    context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    run.__signature__ = signature.replace(parameters=[context, *signature.parameters.values()])
    return run  # type: ignore[return-value]


def is_user_error(e: BaseException) -> bool:
    """UserError, OSError, or torch's out-of-memory error (the model or the request does not fit)."""
    torch = sys.modules.get("torch")  # loaded by then if the error came from it
    out_of_memory = getattr(torch, "OutOfMemoryError", ()) if torch is not None else ()
    return isinstance(e, (*USER_ERRORS, out_of_memory))


def first_line(e: BaseException) -> str:
    """The first non-blank line of the message (the type's name for an empty one)."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def print_traceback(e: BaseException) -> None:
    """The traceback of `e` on stderr, without the frame of `cli_errors`' own wrapper."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    traceback.print_exception(type(e), e, tb, file=sys.stderr)
    sys.stderr.flush()

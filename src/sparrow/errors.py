"""The two kinds of error sparrow raises.

`UserError` (a `ValueError`) is a mistake the caller can fix: a bad argument, a missing file, a model
that does not fit. Its message names the argument and what was expected, and the CLI prints it as one
line with exit code 2. Anything else that escapes is a bug: the CLI exits 1 and shows where it happened.
"""

from __future__ import annotations


class UserError(ValueError):
    """A bad argument, file or model: the message says which and what was expected.

    field: the request option it concerns, by sparrow's name (`max_new_tokens`, `prompt`: `sparrow.request`), when
    one does; the server's HTTP 400 names its own field from it, never from the message."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

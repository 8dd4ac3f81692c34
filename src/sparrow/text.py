"""User text at sparrow's edges: invalid UTF-8 becomes U+FFFD, the same in the CLI, the API and the server.

Text arrives as `bytes` (a file, a socket) or as a `str` that may hold lone surrogates: Python's argv and
`os.fsdecode` turn bytes that are not UTF-8 into U+DC80..U+DCFF (the "surrogateescape" error handler). Both
become the text that decoding the original bytes as UTF-8 with replacement gives, so a prompt or stop string
reads the same whichever door it came in by, and a tokenizer never sees a surrogate.
"""

from __future__ import annotations

import re

from sparrow.errors import UserError

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")
# U+DC80..U+DCFF stand for the bytes 0x80..0xFF (surrogateescape); any other surrogate has no byte behind it
_OTHER_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def clean_text(text: str | bytes | bytearray, argument: str = "text") -> str:
    """`text` as valid Unicode: bytes decoded as UTF-8, a str's escaped bytes decoded again, and whatever
    is not valid UTF-8 replaced by U+FFFD (one per maximal invalid sequence, as `bytes.decode` does).

    >>> clean_text(b"caf\\xc3\\xa9 \\xff") == clean_text("caf\\u00e9 \\udcff") == "caf\\u00e9 \\ufffd"
    True
    """
    if isinstance(text, (bytes, bytearray)):
        return bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise UserError(f"{argument} must be a str (or UTF-8 bytes), got {type(text).__name__}")
    if not _SURROGATE.search(text):
        return text  # the common case: nothing to mend
    text = _OTHER_SURROGATE.sub(REPLACEMENT, text)
    return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")

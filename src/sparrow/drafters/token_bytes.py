"""TokenBytes: the exact bytes each token of a tokenizer stands for, and text <-> tokens in bytes.

Two tokenizers can only be bridged exactly in bytes: a token may hold part of a multi-byte
character (byte-level BPE pieces, SentencePiece `<0xNN>` byte-fallback tokens), which
`tokenizer.decode([id])` turns into U+FFFD. Each token's bytes come from its vocabulary string:

* byte-level BPE (GPT-2, Qwen, SmolLM): every character stands for one byte (`Ġ` = space);
* SentencePiece (Llama, Gemma): `▁` is a space, `<0xNN>` is the byte 0xNN;
* added tokens (`<|im_start|>`, `<eos>`): their content; a BOS the tokenizer inserts stands for nothing.

The bytes of a sequence are the concatenation of its tokens' bytes (no leading-space strip, no
clean-up), so `join(a + b) == join(a) + join(b)` always holds, which decoded strings do not
guarantee.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def valid_utf8_prefix(data: bytes) -> bytes:
    """The longest prefix of `data` that decodes as UTF-8 (cuts an incomplete or broken character)."""
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError as error:
        return data[: error.start]


def _decoder_kinds(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    found, stack = set(), [decoder]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.add(str(node.get("type")))
            if node.get("type") == "Replace" and node.get("pattern", {}).get("String") == "▁":
                found.add("Metaspace")
            stack.extend(node.get("decoders") or [])
    return found


class TokenBytes:
    """Token id -> bytes for one tokenizer, and encoding of byte strings that continue a context."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_kinds(tokenizer)
        alphabet = byte_level_alphabet() if "ByteLevel" in kinds else None
        byte_fallback, metaspace = "ByteFallback" in kinds, "Metaspace" in kinds
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self.adds_bos = bool(tokenizer.bos_token_id is not None and
                             tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id])
        # A BOS the tokenizer inserts itself is no text; one it does not insert (SmolLM2's BOS is
        # <|im_start|>) is an ordinary special token with its content.
        silent = {tokenizer.bos_token_id} if self.adds_bos else set()
        vocab = tokenizer.get_vocab()
        size = max(max(vocab.values(), default=0), max(added, default=0)) + 1
        self.pieces: list[bytes] = [b""] * size
        self.special: set[int] = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items()
                                                                   if t.special}
        for token, i in vocab.items():
            if i in added:
                continue
            if alphabet is not None and all(c in alphabet for c in token):
                self.pieces[i] = bytes(alphabet[c] for c in token)
            elif byte_fallback and (m := _BYTE_FALLBACK.match(token)):
                self.pieces[i] = bytes([int(m.group(1), 16)])
            else:
                self.pieces[i] = (token.replace("▁", " ") if metaspace else token).encode("utf-8")
        for i, content in added.items():
            self.pieces[i] = b"" if i in silent else content.encode("utf-8")
        self.by_bytes: dict[bytes, int] = {}
        """Ordinary (non-special) tokens by their bytes: the exact-token path between vocabularies."""
        for i, piece in enumerate(self.pieces):
            if piece and i not in self.special:
                self.by_bytes.setdefault(piece, i)
        self.prefix = self.join(self.encode("a"))[:-1]
        """What the tokenizer prepends to every input: b"" or, for legacy SentencePiece, b" "."""

    def __len__(self) -> int:
        return len(self.pieces)

    def _continues(self, token: int) -> bool:
        """Whether the token starts inside a character (a continuation byte) or stands for nothing."""
        piece = self.pieces[token]
        return not piece or 0x80 <= piece[0] < 0xC0

    def join(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.pieces[i] for i in ids)

    def text(self, ids: Sequence[int]) -> list[str]:
        """One readable string per token (for alignment; a split character shows as U+FFFD)."""
        return [self.pieces[i].decode("utf-8", errors="replace") for i in ids]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_exact(self, data: bytes, at_start: bool = False) -> list[int] | None:
        """Tokens whose bytes are exactly `data` (valid UTF-8), or None when the tokenizer changes the text.

        Tokenizers that prepend a space to every input (legacy SentencePiece) are handled: at the start
        of a text (`at_start`) the space is kept, as the model saw it in training; elsewhere a separate
        space token is dropped, and a space merged into the first token makes the encoding fail.
        """
        ids = self.encode(data.decode("utf-8"))
        got = self.join(ids)
        if got == data:
            return ids
        if self.prefix and got == self.prefix + data:
            if at_start:
                return ids
            if ids and self.pieces[ids[0]] == self.prefix:
                return ids[1:]
        return None

    def continuation(self, context: Sequence[int], data: bytes, lookbehind: int = 8) -> tuple[list[int], int]:
        """Tokens continuing `context` whose bytes are a prefix of `data`, and how many bytes they cover.

        Re-encodes the last `lookbehind` context tokens together with `data`, so the tokens come out
        as the tokenizer would cut them in context, and keeps those after the context's end. If the
        re-encoding merges across that end (no token boundary there), `data` is encoded on its own.
        Only the longest valid UTF-8 prefix can be encoded; an incomplete character waits.
        """
        start = max(0, len(context) - lookbehind)
        while start < len(context) and self._continues(context[start]):
            start += 1  # the window must start on a character boundary
        head = self.join(context[start:])
        if not head and not any(self.pieces[t] for t in context):  # the start of the text
            alone = valid_utf8_prefix(data)
            ids = self.encode_exact(alone, at_start=True) if alone else None
            return (ids, len(alone)) if ids else ([], 0)
        full = valid_utf8_prefix(head + data)
        if len(full) > len(head):
            ids = self.encode(full.decode("utf-8"))
            got = self.join(ids)
            skip = len(self.prefix) if self.prefix and got == self.prefix + full else 0
            if skip or got == full:
                offset = 0
                for i, token in enumerate(ids):
                    if offset == skip + len(head):
                        return ids[i:], len(full) - len(head)
                    offset += len(self.pieces[token])
        return self._alone(data)

    def _alone(self, data: bytes) -> tuple[list[int], int]:
        """`data` encoded on its own; leading continuation bytes (the end of a character whose start
        is already in the context) become single-byte tokens when the vocabulary has them."""
        lead = 0
        while lead < min(3, len(data)) and 0x80 <= data[lead] < 0xC0:
            lead += 1
        lead_ids = [self.by_bytes.get(data[i : i + 1]) for i in range(lead)]
        if None in lead_ids:
            return [], 0
        alone = valid_utf8_prefix(data[lead:])
        ids = self.encode_exact(alone) if alone else []
        if ids is None:
            ids, alone = [], b""
        return [int(i) for i in lead_ids] + ids, lead + len(alone)

"""Stopper: applies EOS, stop strings and max_new_tokens token by token, so a rule that fires
inside an accepted draft block cuts the block exactly there and the output never overshoots.

Stop strings are matched against the decoded text, which is built incrementally as streaming
detokenizers do (text-generation-inference, vLLM): each token is decoded together with the few
tokens before it (from `_prefix`), and the text it adds is the difference to decoding those alone;
the tokens of an incomplete character (a trailing U+FFFD) are decoded again until it completes.
So each push decodes a bounded tail, not the whole output: O(n) decoding work, not O(n^2).
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from sparrow.config import StoppingConfig
from sparrow.errors import UserError


class Stopper:
    def __init__(self, config: StoppingConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        if config.stop_strings and tokenizer is None:
            raise UserError("stop strings need a tokenizer to decode the generated text")
        self.config = config
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._text = ""  # the decoded text so far (while stop strings are set)
        self._prefix = 0  # tokens[_prefix:_read] decode to the end of _text; they give the next token context
        self._read = 0
        self._checked_chars = 0  # stop strings cannot start before this offset of the decoded text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.tokens)

    def push(self, tokens: Iterable[int]) -> list[int]:
        """Append tokens one at a time until a rule fires. Returns the tokens actually kept."""
        kept: list[int] = []
        for token in tokens:
            if self.done:
                break
            self.tokens.append(int(token))
            kept.append(int(token))
            if int(token) in self.config.eos_token_ids or self._stop_string_index() is not None:
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"
        return kept

    def text(self) -> str:
        """Decoded new text, cut before a stop string that ended the generation."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = self._find_stop(text, 0)
        return text if cut is None else text[:cut]

    def _stop_string_index(self) -> int | None:
        if not self.config.stop_strings:
            return None
        text = self._decoded()
        found = self._find_stop(text, self._checked_chars)
        longest = max(len(s) for s in self.config.stop_strings)
        self._checked_chars = max(0, len(text) - longest)
        return found

    def _decoded(self) -> str:
        """The decoded text of all tokens; `_text` grows by the newest tokens once their characters are complete."""
        before = self.tokenizer.decode(self.tokens[self._prefix:self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.tokens[self._prefix:], skip_special_tokens=True)
        if len(after) <= len(before):  # e.g. a skipped special token
            return self._text
        new = after[len(before):]
        if new.endswith("\ufffd"):  # an incomplete character: decode these tokens again with the next one
            return self._text + new
        self._text += new
        self._prefix, self._read = self._read, len(self.tokens)
        return self._text

    def _find_stop(self, text: str, start: int) -> int | None:
        hits = [i for s in self.config.stop_strings if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

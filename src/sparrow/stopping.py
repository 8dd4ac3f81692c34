"""Stopper: applies EOS, stop strings and max_new_tokens token by token, so a rule that fires
inside an accepted draft block cuts the block exactly there and the output never overshoots."""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from sparrow.config import StoppingConfig


class Stopper:
    def __init__(self, config: StoppingConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        if config.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the generated text")
        self.config = config
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
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
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        found = self._find_stop(text, self._checked_chars)
        longest = max(len(s) for s in self.config.stop_strings)
        self._checked_chars = max(0, len(text) - longest)
        return found

    def _find_stop(self, text: str, start: int) -> int | None:
        hits = [i for s in self.config.stop_strings if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

"""Stopper: applies EOS, stop strings and max_new_tokens token by token, so a rule that fires
inside an accepted draft block cuts the block exactly there and the output never overshoots.

A stop string fires at the first token after which the decoded output (`tokenizer.decode(tokens,
skip_special_tokens=True)`) contains it, as if the whole output were decoded after every token; the work
per token is bounded, not proportional to the output. The text is decoded incrementally, as streaming
detokenizers do (text-generation-inference, vLLM): each token is decoded together with the tokens before
it since the last settled point, and what it adds is the difference to decoding those alone. Text is
*settled* once it can no longer change; a trailing U+FFFD may be an incomplete character that the next
tokens complete, so it stays unsettled (is decoded again) while it could. Three things would otherwise
make the unsettled tail, and with it the work per token, grow with the output:

* special tokens that decoding skips are dropped from the decoded stream (they add no text anywhere);
* an unsettled tail longer than `MAX_UNSETTLED` tokens (a run of broken bytes, or of real U+FFFD
  characters) is settled except its last `KEEP_UNSETTLED` tokens: a UTF-8 character is at most 4 bytes
  and every text token stands for at least one, so nothing before those can still change;
* stop strings are searched only in the new text and the `longest - 1` settled characters before it,
  the only places where a match that was not there before can lie.

Streaming (`on_text`): after each `push` (one round of the engine) the callback gets the text that is final:
settled text, less a trailing part that could still grow into a stop string; when the generation ends, the
rest of `text()`. The pieces concatenated equal `text()`: never a partial character, never (part of) a stop
string. The callback may end the generation by returning a finish reason (a client gone, a timeout).
Each piece is a `Streamed` str that also says which of its characters came from accepted draft tokens
(`push(tokens, drafted=n)`: the first n tokens of the round were drafted; the rest the target produced).
A token's characters are those its decoding settled, so a character split over tokens counts for the last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from transformers import PreTrainedTokenizerBase

from sparrow.config import StoppingConfig
from sparrow.errors import UserError

MAX_UNSETTLED = 8  # tokens decoded again and again while their text may still change
KEEP_UNSETTLED = 4  # tokens kept unsettled when that limit forces a settlement (>= the bytes of one character)
REPLACEMENT = "\ufffd"


class Streamed(str):
    """A piece of streamed text, and its runs by provenance: `spans` are (text, drafted) pairs that concatenate
    to the piece; drafted = the characters came from draft tokens the target accepted."""

    spans: tuple[tuple[str, bool], ...]

    def __new__(cls, text: str, spans: tuple[tuple[str, bool], ...] = ()) -> Streamed:
        piece = super().__new__(cls, text)
        piece.spans = spans if spans or not text else ((text, False),)
        assert "".join(t for t, _ in piece.spans) == text, (text, piece.spans)
        return piece


OnText = Callable[[str], "str | None"]
"""Streaming callback: called once per push with the newly final text (possibly ""); returning a finish reason
(e.g. "length") ends the generation after this push, None goes on."""


class Stopper:
    def __init__(self, config: StoppingConfig, tokenizer: PreTrainedTokenizerBase | None = None,
                 on_text: OnText | None = None) -> None:
        if (config.stop_strings or on_text is not None) and tokenizer is None:
            raise UserError("stop strings and streaming need a tokenizer to decode the generated text")
        self.config = config
        self.tokenizer = tokenizer
        self.on_text = on_text
        self._decoding = bool(config.stop_strings) or on_text is not None
        self._pending = ""  # streaming: settled text not handed to on_text yet (it may start a stop string)
        self._streamed = 0  # streaming: characters handed to on_text so far
        self._marks: list[list] = []  # streaming: [characters, drafted] runs covering _pending
        self._last_drafted = False  # streaming: whether the last pushed token was drafted
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._lookback = max((len(s) for s in config.stop_strings), default=1) - 1
        # Incremental decoding (only while stop strings are set):
        self._ids: list[int] = []  # the tokens that carry text (skipped special tokens left out)
        self._prefix = 0  # _ids[_prefix:_read]: the context the next tokens are decoded with; its text is settled
        self._read = 0  # _ids[_read:]: tokens whose text is not settled yet
        self._context = ""  # decode(_ids[_prefix:_read])
        self._window = ""  # decode(_ids[_prefix:]) as of the last token
        self._tail = ""  # the last `_lookback` settled characters: where a new match can start
        self._skipped: dict[int, bool] = {}  # token id -> whether decoding skips it (a special token)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.tokens)

    def push(self, tokens: Iterable[int], drafted: int = 0) -> list[int]:
        """Append tokens one at a time until a rule fires. Returns the tokens actually kept.

        drafted: how many of `tokens` (the first ones) were accepted draft tokens, for the streamed spans."""
        kept: list[int] = []
        for i, token in enumerate(tokens):
            if self.done:
                break
            token = int(token)
            self.tokens.append(token)
            kept.append(token)
            self._last_drafted = i < drafted
            if token in self.config.eos_token_ids or (self._decoding and self._stop_string_added(token)):
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"
        if self.on_text is not None:
            self._stream()
        return kept

    def _stream(self) -> None:
        """Hand on_text the text that is final now; at the end, the rest of text()."""
        if not self.done:
            cut = len(self._pending) - self._stop_prefix_length(self._pending)
            new, self._pending = self._pending[:cut], self._pending[cut:]
            self._streamed += len(new)
            reason = self.on_text(Streamed(new, self._take_spans(new)))
            if reason is None:
                return
            self.finish_reason = reason
        rest = self.text()[self._streamed:]  # the held and unsettled text (cut before a stop string)
        self._streamed += len(rest)
        self._pending = ""
        unsettled = len(rest) - sum(n for n, _ in self._marks)
        if unsettled > 0:  # text no token settled yet: the last token's
            self._marks.append([unsettled, self._last_drafted])
        self.on_text(Streamed(rest, self._take_spans(rest)))

    def _take_spans(self, text: str) -> tuple[tuple[str, bool], ...]:
        """The (text, drafted) runs of `text`, the start of what the marks cover; those marks are consumed."""
        spans, at = [], 0
        while at < len(text) and self._marks:
            n, drafted = self._marks[0]
            take = min(n, len(text) - at)
            spans.append((text[at:at + take], drafted))
            at += take
            if take == n:
                self._marks.pop(0)
            else:
                self._marks[0][0] -= take
        if at < len(text):
            spans.append((text[at:], self._last_drafted))
        return tuple(spans)

    def _stop_prefix_length(self, text: str) -> int:
        """The length of the longest end of `text` that is the start of a stop string (it may still grow into one)."""
        for n in range(min(len(text), self._lookback), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.config.stop_strings):
                return n
        return 0

    def text(self) -> str:
        """Decoded new text, cut before a stop string that ended the generation."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = self._find_stop(text)
        return text if cut is None else text[:cut]

    def _stop_string_added(self, token: int) -> bool:
        """Whether the output, now ending in `token`, contains a stop string (it did not before). Streaming keeps
        the text this token settled, for on_text."""
        settled, unsettled = self._decode_next(token)
        found = self._find_stop(self._tail + settled + unsettled) is not None
        if settled and self._lookback:
            self._tail = (self._tail + settled)[-self._lookback:]
        if self.on_text is not None and settled:
            self._pending += settled
            if self._marks and self._marks[-1][1] == self._last_drafted:
                self._marks[-1][0] += len(settled)
            else:
                self._marks.append([len(settled), self._last_drafted])
        return found

    def _decode_next(self, token: int) -> tuple[str, str]:
        """Decode one more token: (the text settled by it, the unsettled text after all settled text)."""
        decode = self.tokenizer.decode
        self._ids.append(token)
        window = decode(self._ids[self._prefix:], skip_special_tokens=True)
        if window == self._window and self._is_skipped(token):  # no text here nor anywhere: forget it
            self._ids.pop()
            return "", window[len(self._context):]
        self._window = window
        if window.startswith(self._context) and not window.endswith(REPLACEMENT):
            return self._settle(len(self._ids), window), ""
        if len(self._ids) - self._read > MAX_UNSETTLED:  # nothing before the last few tokens can change now
            end = len(self._ids) - KEEP_UNSETTLED
            head = decode(self._ids[self._prefix:end], skip_special_tokens=True)
            if head.startswith(self._context) and window.startswith(head):
                settled = self._settle(end, head)
                unsettled = window[len(head):]
                self._window = self._context + unsettled  # only compared with the next window, to spot skips
                return settled, unsettled
        return "", window[len(self._context):]

    def _settle(self, end: int, text: str) -> str:
        """_ids[:end] decode to settled text (`text` = decode(_ids[_prefix:end])); returns what it adds."""
        new = text[len(self._context):]
        self._prefix, self._read = self._read, end
        self._context = self._window = self.tokenizer.decode(self._ids[self._prefix:end], skip_special_tokens=True)
        return new

    def _is_skipped(self, token: int) -> bool:
        """A special token that decoding with skip_special_tokens leaves out (it adds text only when kept)."""
        if token not in self._skipped:
            decode = self.tokenizer.decode
            self._skipped[token] = (decode([token], skip_special_tokens=True) == ""
                                    and decode([token], skip_special_tokens=False) != "")
        return self._skipped[token]

    def _find_stop(self, text: str) -> int | None:
        hits = [i for s in self.config.stop_strings if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

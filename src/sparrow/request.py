"""A generation request, validated in one place: the options a caller gives, then the prompt's tokens.

Two steps, both here, each value checked once:

    options = check_options({"max_new_tokens": 64, "temperature": 0.7})   # no model needed
    request = build_request(prompt, options, eos_token_ids=..., context_length=...)  # after tokenizing

`check_options` decides every option's rules (sampling, stopping, seed, grammar, chat, media); `Pipeline.request`
tokenizes the prompt (`token_ids`, `chat_messages` check what it is given) and calls `build_request`, which checks
the prompt against the model's context. The CLI checks the options before it loads a model, and the server before
it queues a request; neither checks an option's value itself, and `Pipeline.generate` runs a `Request` as it is.

Each refusal is a `UserError` whose `field` is sparrow's name of the option (`max_new_tokens`, `prompt`, ...);
its message spells the option as the caller does (`names`: `--max-new-tokens` in the CLI, `max_tokens` in the
server), and the server's HTTP 400 names its own field from `field` (`sparrow.serve.protocol`).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparrow.config import (
    SamplingConfig,
    StoppingConfig,
    check_max_new_tokens,
    check_seed,
    check_temperature,
    check_top_k,
    check_top_p,
)
from sparrow.errors import UserError
from sparrow.grammar import GrammarSpec
from sparrow.text import clean_text
from sparrow.types import Prompt

# The options a request takes (`Pipeline.generate(prompt, **options)`), with their defaults.
DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "stop": (), "chat": False,
    "video": None, "frames": None, "image": None, "json_schema": None, "regex": None,
}
OPTIONS = tuple(DEFAULTS)
DEFAULT_MAX_NEW_TOKENS = 1024  # max_new_tokens=None with a model whose context length is unknown

PromptInput = str | bytes | Sequence[int] | torch.Tensor | Sequence[Mapping[str, str]]
"""text, UTF-8 bytes, token ids, or chat messages ([{"role", "content"}], through the chat template)"""


@dataclass(frozen=True)
class Options:
    """A request's options, checked (`check_options`): everything but the prompt's tokens."""

    sampling: SamplingConfig
    max_new_tokens: int | None  # None: the rest of the model's context
    stop: tuple[str, ...]
    seed: int | None
    grammar: GrammarSpec | None  # structured output (json_schema= / regex=); None: unconstrained
    chat: bool = False  # a text prompt goes through the tokenizer's chat template
    video: Any = None  # media for a vision-language target (`sparrow.vision.prompt.encode_media` checks them)
    frames: int | None = None
    image: Any = None
    names: tuple[tuple[str, str], ...] = ()  # how the caller spells options, for the messages of later checks

    @property
    def media(self) -> bool:
        return self.video is not None or self.image is not None or self.frames is not None

    def name(self, field: str) -> str:
        """`field` as the caller spells it."""
        return dict(self.names).get(field, field)


@dataclass(frozen=True)
class Request:
    """A validated generation request, the prompt tokenized: what `Pipeline.generate` runs."""

    prompt: Prompt
    sampling: SamplingConfig
    stopping: StoppingConfig
    seed: int | None
    grammar: GrammarSpec | None = None  # structured output (json_schema / regex); None: unconstrained


def check_options(options: Mapping[str, object], names: Mapping[str, str] | None = None) -> Options:
    """The one validator of a request's options: an unknown name or a bad value is a UserError whose `field` is the
    option (`names`: how the caller spells each option in messages; default: as sparrow does). max_new_tokens None:
    the rest of the model's context."""
    names = dict(names or {})

    def name(field: str) -> str:
        return names.get(field, field)

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r}; expected one of: {', '.join(OPTIONS)}", field=unknown[0])
    given = {**DEFAULTS, **options}
    sampling = SamplingConfig(temperature=check_temperature(given["temperature"], name("temperature")),
                              top_k=check_top_k(given["top_k"], name("top_k")),
                              top_p=check_top_p(given["top_p"], name("top_p")))
    max_new_tokens = given["max_new_tokens"]
    if max_new_tokens is not None:
        max_new_tokens = check_max_new_tokens(max_new_tokens, name("max_new_tokens"))
    stop = stop_strings(given["stop"], name("stop"))
    seed = check_seed(given["seed"], name("seed"))
    grammar = GrammarSpec.of(given["json_schema"], given["regex"])
    chat = given["chat"]
    if not isinstance(chat, bool):
        raise UserError(f"{name('chat')} must be True or False, got {chat!r}", field="chat")
    return Options(sampling, max_new_tokens, stop, seed, grammar, chat, given["video"], given["frames"],
                   given["image"], tuple(names.items()))


def build_request(prompt: Prompt, options: Options, *, eos_token_ids: frozenset[int],
                  context_length: int | None) -> Request:
    """The request of a tokenized prompt: refused when the prompt, or the prompt and max_new_tokens, do not fit the
    model's context (max_new_tokens None: the rest of it)."""
    n = prompt.input_ids.numel()
    if context_length is not None and n >= context_length:
        raise UserError(f"{options.name('prompt')} is {n} tokens long, but the model's context is {context_length} "
                        "tokens", field="prompt")
    max_new_tokens = options.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = context_length - n if context_length is not None else DEFAULT_MAX_NEW_TOKENS
    elif context_length is not None and n + max_new_tokens > context_length:
        raise UserError(f"{options.name('max_new_tokens')}={max_new_tokens} with a {n}-token prompt exceeds the "
                        f"model's context of {context_length} tokens (at most {context_length - n} new tokens)",
                        field="max_new_tokens")
    stopping = StoppingConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, stop_strings=options.stop)
    return Request(prompt, options.sampling, stopping, options.seed, options.grammar)


# --- the prompt ------------------------------------------------------------------------------------------


def is_chat(prompt: object) -> bool:
    """Whether a prompt is chat messages: a list (or tuple) whose first item is a mapping."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)


def chat_messages(prompt: Sequence[object], argument: str = "prompt") -> list[dict[str, str]]:
    """Chat messages as [{"role", "content"}] with clean text (as a text prompt's), anything else refused."""
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise UserError(f"{argument} as chat messages must be dicts with a str 'role' and 'content', got "
                            f"{message!r} at position {i}", field="prompt")
        content = message.get("content")
        if not isinstance(content, (str, bytes, bytearray)):
            raise UserError(f"{argument} message {i}'s content must be a str, got {type(content).__name__}",
                            field="prompt")
        messages.append({"role": message["role"], "content": clean_text(content, f"{argument} content")})
    return messages


def token_ids(prompt: object, vocab_size: int, argument: str = "prompt") -> list[int]:
    """A token-id prompt as a list of ints in [0, vocab_size); anything else is refused, naming `prompt`."""
    if isinstance(prompt, torch.Tensor):
        if prompt.ndim != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise UserError(f"{argument} as a tensor must be 1-D of integer token ids, got shape "
                            f"{tuple(prompt.shape)} {prompt.dtype}", field="prompt")
        ids = prompt.tolist()
    elif isinstance(prompt, (Mapping, set, frozenset)) or not isinstance(prompt, Iterable):
        raise UserError(f"{argument} must be a str, UTF-8 bytes or a sequence of int token ids, got "
                        f"{type(prompt).__name__}", field="prompt")
    else:
        ids = list(prompt)
    if not ids:
        raise UserError(f"{argument} must not be empty", field="prompt")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise UserError(f"{argument} token ids must be ints, got {t!r} ({type(t).__name__}) at position {i}",
                            field="prompt")
        if not 0 <= t < vocab_size:
            raise UserError(f"{argument} token ids must lie in [0, {vocab_size}), got {t} at position {i}",
                            field="prompt")
    return [int(t) for t in ids]


def stop_strings(stop: object, argument: str = "stop") -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings: None (none), one str, or an iterable of str. Invalid UTF-8
    (lone surrogates) becomes U+FFFD, as in prompts."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, bytearray, Mapping)) or not isinstance(stop, Iterable):
        raise UserError(f"{argument} must be a str or a list of str, got {type(stop).__name__}", field="stop")
    strings = []
    for s in stop:
        if not isinstance(s, str):
            raise UserError(f"{argument} must be a str or a list of str, got an item {s!r} ({type(s).__name__})",
                            field="stop")
        if not s:
            raise UserError(f"{argument} must not be an empty string", field="stop")
        strings.append(clean_text(s, argument))
    return tuple(strings)

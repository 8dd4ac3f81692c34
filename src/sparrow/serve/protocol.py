"""The OpenAI request bodies sparrow serves (pydantic): their shape and types here, their values by sparrow's one
validator of requests (`sparrow.request.check_options`, called by `to_work`), which spells each field as OpenAI does
(`NAMES`: `max_tokens`, `response_format`, `messages`), so its UserError's `field` gives the 400's `param`.

Unknown fields are refused (HTTP 400 naming the field). OpenAI fields sparrow does not implement are accepted
only at their neutral value (`presence_penalty: 0`, `logprobs: null`, ...), so a client that sends them by
default still works. Extensions: `top_k` (0 or -1: off, as in vLLM); `spans` (streamed chunks carry a
`sparrow` object: the chunk's text as (text, drafted) runs and the request's token counts so far).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from sparrow.request import check_options
from sparrow.serve.scheduler import Work

# Accepted only at these values (None always); anything else is "not supported".
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (False,), "top_logprobs": (0,),
    "logit_bias": ({},), "echo": (False,), "suffix": ("",), "best_of": (1,), "parallel_tool_calls": (False, True),
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`: the schema under `schema` (`strict` is accepted; the output always
    keeps to the schema)."""

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_dict(self) -> dict[str, Any] | None:
        """The JSON schema the output keeps to (any object for json_object), None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self.json_schema.schema_


class Sampling(Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # ignored
    spans: bool = False  # sparrow's extension: provenance of streamed text (see the module doc)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        if value is not None:
            value.schema_dict()  # json_schema given where it is needed
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "echo",
                     "suffix", "best_of", "parallel_tool_calls", check_fields=False)
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value not in NEUTRAL[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by sparrow serve (only "
                             f"{' or '.join(map(repr, NEUTRAL[info.field_name]))}), got {value!r}")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def names(self) -> dict[str, str]:
        """sparrow's name of an option -> the field of this body that sets it (where the two differ)."""
        return NAMES

    def work(self, prompt: str | list[int] | list[dict[str, str]], max_tokens: int | None) -> Work:
        """The request's Work, its options checked (a UserError whose message spells the field as the body does)."""
        options = {"max_new_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                   "top_k": 0 if self.top_k == -1 else self.top_k, "seed": self.seed, "stop": self.stop,
                   "json_schema": self.response_format.schema_dict() if self.response_format is not None else None}
        return Work(prompt, check_options(options, self.names()), spans=self.spans)


# sparrow's name of an option -> the body field that sets it (the same name where none is given)
NAMES = {"max_new_tokens": "max_tokens", "json_schema": "response_format"}


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    parallel_tool_calls: bool | None = None

    def names(self) -> dict[str, str]:
        newer = self.max_completion_tokens is not None
        return {**NAMES, "prompt": "messages", "max_new_tokens": "max_completion_tokens" if newer else "max_tokens"}

    def to_work(self) -> Work:
        """The Work of the request (max_tokens null: the rest of the model's context)."""
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        newer = self.max_completion_tokens is not None
        return self.work(messages, self.max_completion_tokens if newer else self.max_tokens)


DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class CompletionRequest(Sampling):
    prompt: str | list[int]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def to_work(self) -> Work:
        """The Work of the request (max_tokens null: DEFAULT_COMPLETION_TOKENS)."""
        max_tokens = DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens
        return self.work(self.prompt, max_tokens)

"""The HTTP layer: OpenAI-compatible endpoints that submit jobs to the Scheduler and turn its events into JSON
or server-sent events. It never touches the pipeline.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad field (`param`
names it), 401 for a missing or wrong API key, 404 for an unknown model or path, 429 when the queue is full,
503 while the model loads, 500 for a bug. A request's failure never stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparrow.serve.metrics import Metrics, num_drafts
from sparrow.serve.protocol import ChatCompletionRequest, CompletionRequest, Sampling
from sparrow.serve.scheduler import Failed, Finished, Job, NotReady, QueueFull, Scheduler, Text

DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting handler checks whether its client is still there
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status)

    def body(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


def create_app(scheduler: Scheduler, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app; its lifespan starts the scheduler (which loads the model) and stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="sparrow", lifespan=lifespan)
    metrics = scheduler.metrics
    app.add_middleware(CountRequests, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code).response()

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")

    def check_model(body: Sampling) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    @app.get("/", include_in_schema=False)
    async def playground() -> HTMLResponse:  # public: the page's own API calls carry the key
        return HTMLResponse(resources.files("sparrow.serve").joinpath("playground.html").read_text("utf-8"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if scheduler.ready:
            return JSONResponse({"status": "ok"})
        if scheduler.load_error is not None:
            return APIError(503, f"the model failed to load: {scheduler.load_error}", "service_unavailable",
                            code="load_failed").response()
        return APIError(503, "the model is loading", "service_unavailable", code="model_loading").response()

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "sparrow"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        return await complete(body, request, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        return await complete(body, request, chat=False)

    async def complete(body: ChatCompletionRequest | CompletionRequest, request: Request, chat: bool):
        job = Job(body.to_work(), asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
        except NotReady as e:
            code = "load_failed" if scheduler.load_error is not None else "model_loading"
            raise APIError(503, str(e), "service_unavailable", code=code) from None
        try:
            first = await next_event(job, request)  # validation passed once the first token is out
        except ClientGone:
            return JSONResponse({}, status_code=499)  # nobody reads it
        except asyncio.CancelledError:  # the handler itself was cancelled (e.g. by Ray Serve's proxy)
            job.cancel()
            raise
        if isinstance(first, Failed):
            raise failure(first)
        shape = Shape(model_name, chat)
        if body.stream:
            return StreamingResponse(stream(job, first, shape, body.include_usage, body.spans),
                                     media_type="text/event-stream")
        event = first
        try:
            while not isinstance(event, Finished):
                event = await next_event(job, request)
                if isinstance(event, Failed):
                    raise failure(event)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        except asyncio.CancelledError:
            job.cancel()
            raise
        return shape.response(event.result.text, event)  # == the Text events concatenated (sparrow.stopping)

    return app


async def next_event(job: Job, request: Request):
    """The job's next event; cancels the job and raises ClientGone when the client disconnects meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone() from None


async def stream(job: Job, first: Text | Finished, shape: Shape, include_usage: bool,
                 spans: bool = False) -> AsyncIterator[str]:
    """Server-sent events: a role chunk (chat), one chunk per non-empty Text, a last chunk with the finish reason,
    a usage chunk (with stream_options.include_usage), then `[DONE]`. A client that goes away cancels the job.
    spans: each text chunk also carries `sparrow`: {"spans": [[text, drafted], ...], "completion_tokens",
    "num_draft_tokens", "num_accepted_tokens"} (the request's totals so far)."""
    try:
        if shape.chat:
            yield shape.sse(shape.chunk({"role": "assistant", "content": ""}, None, include_usage))
        event: Any = first
        while True:
            if isinstance(event, Text) and event.text:
                chunk = shape.chunk(event.text, None, include_usage)
                if spans:
                    chunk["sparrow"] = {"spans": [list(s) for s in event.spans],
                                        "completion_tokens": event.completion_tokens,
                                        "num_draft_tokens": event.num_draft_tokens,
                                        "num_accepted_tokens": event.num_accepted_tokens}
                yield shape.sse(chunk)
            elif isinstance(event, Finished):
                yield shape.sse(shape.chunk("", event.result.finish_reason, include_usage))
                if include_usage:
                    yield shape.sse({**shape.header("chunk"), "choices": [], "usage": usage(event)})
                break
            elif isinstance(event, Failed):
                yield shape.sse({"error": failure(event).body()})
                break
            event = await job.events.get()
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # a no-op once the job finished; ends it at the next round if the client went away


class Shape:
    """OpenAI's response and chunk objects for one request."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def header(self, kind: str) -> dict[str, Any]:
        obj = ("chat.completion" if kind == "full" else "chat.completion.chunk") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str | dict[str, str], finish_reason: str | None, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        content = text if isinstance(text, dict) else {"content": text} if delta else {"role": "assistant",
                                                                                          "content": text}
        if delta and finish_reason is not None:
            content = {}
        return {"index": 0, "delta" if delta else "message": content, "logprobs": None, "finish_reason": finish_reason}

    def chunk(self, text: str | dict[str, str], finish_reason: str | None, include_usage: bool) -> dict[str, Any]:
        chunk = {**self.header("chunk"), "choices": [self.choice(text, finish_reason, delta=True)]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def response(self, text: str, finished: Finished) -> dict[str, Any]:
        return {**self.header("full"), "choices": [self.choice(text, finished.result.finish_reason, delta=False)],
                "usage": usage(finished)}

    @staticmethod
    def sse(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(finished: Finished) -> dict[str, Any]:
    """OpenAI's usage, plus the request's speculative statistics (vLLM's names)."""
    result, stats = finished.result, finished.result.stats
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": result.new_tokens,
        "total_tokens": finished.prompt_tokens + result.new_tokens,
        "speculative": {
            "num_drafts": num_drafts(result),
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "mean_accepted_tokens": stats.mean_accepted_tokens,  # tokens per target forward, bonus included
            "acceptance_rate": stats.acceptance_rate,
        },
    }


def failure(failed: Failed) -> APIError:
    if failed.user_error:  # a request that validation could not see (e.g. a prompt longer than the context)
        message = str(failed.error).replace("max_new_tokens", "max_tokens")  # the pipeline's name -> the field's
        return APIError(400, message, param=param_named(message))
    return APIError(500, f"internal error: {type(failed.error).__name__}: {failed.error} -- this is a bug in sparrow",
                    "internal_error")


PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "prompt", "messages")


def param_named(message: str) -> str | None:
    """The request field a pipeline UserError is about (its message starts with the argument's name)."""
    word = message.split(" ", 1)[0].split("=", 1)[0].rstrip(":")
    if word in ("json_schema", "the"):  # a schema that does not compile, or that allows no output at all
        return "response_format" if "json_schema" in message else None
    return word if word in PARAMS else None


def validation_error(e: RequestValidationError) -> APIError:
    """400 naming the first bad field (its dotted path in the body); a value that fits no member of a union
    (`prompt: 5`) lists what each member expected."""
    errors = e.errors()
    if errors[0].get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {errors[0].get('msg')}", code="invalid_json")
    loc = field_path(errors[0])
    field = ".".join(loc) or None
    messages = [str(error.get("msg", "invalid value")).removeprefix("Value error, ") for error in errors
                if field_path(error)[:len(loc)] == loc]
    message = " or ".join(dict.fromkeys(messages))
    if errors[0].get("type") == "extra_forbidden":
        message = f"unknown field {field!r}"
    elif field and not message.startswith(loc[-1]):
        message = f"{field}: {message}"
    return APIError(400, message, param=field, code="invalid_value")


def field_path(error: dict[str, Any]) -> list[str]:
    """The error's location as field names and list indices: no "body", no union member tags ("str", "list[int]")."""
    return [str(part) for part in error.get("loc", ())
            if part != "body" and not (isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part))]


class CountRequests:
    """ASGI middleware: counts /v1/ requests by endpoint and status code (streams too, unlike BaseHTTPMiddleware
    it never buffers nor wraps the body)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

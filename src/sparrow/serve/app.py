"""The HTTP layer: OpenAI-compatible endpoints that submit jobs to the Scheduler and turn its events into JSON
or server-sent events. It never touches the pipeline.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad field (`param`
names it), 401 for a missing or wrong API key, 404 for an unknown model or path, 429 when the queue is full,
503 while the model loads or the server shuts down, 500 for a bug. A request's failure never stops the server.

Nothing is exposed unasked: FastAPI's /docs, /redoc and /openapi.json are off (the first two would load scripts
from a public CDN); `openapi=True` serves only /openapi.json, behind the API key. /metrics is behind the API key
when one is set, unless `public_metrics=True`. `/` (the playground, one self-contained page whose own calls carry
the key) and `/health` (for load balancers) are public.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparrow.errors import UserError
from sparrow.serve.metrics import Metrics, num_drafts
from sparrow.serve.protocol import ChatCompletionRequest, CompletionRequest, Sampling
from sparrow.serve.scheduler import Failed, Finished, Job, NotReady, QueueFull, Scheduler, ShuttingDown, Text, Work

DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting handler checks whether its client is still there
HANDLER_GRACE_SECONDS = 0.2  # past a shutdown's deadline: the worker's chance to end a job at its round's end
SHUTDOWN = "shutdown"  # `sparrow.ended_by` of a job the server's shutdown ended
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


class DeadlinePassed(Exception):
    """The server is shutting down, its deadline passed and the job still runs (its round overran the deadline)."""


def create_app(scheduler: Scheduler, *, model_name: str, api_key: str | None = None, openapi: bool = False,
               public_metrics: bool = False) -> FastAPI:
    """The app; its lifespan starts the scheduler (which loads the model) and stops it. `openapi`: serve the
    OpenAPI schema at /openapi.json (behind the key); `public_metrics`: /metrics without the key."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="sparrow", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
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
        if scheduler.draining:  # a load balancer sends nothing more here
            return shutting_down(ShuttingDown()).response()
        if scheduler.ready:
            return JSONResponse({"status": "ok"})
        if scheduler.load_error is not None:
            return APIError(503, f"the model failed to load: {scheduler.load_error}", "service_unavailable",
                            code="load_failed").response()
        return APIError(503, "the model is loading", "service_unavailable", code="model_loading").response()

    @app.get("/metrics", dependencies=[] if public_metrics else [Depends(authorized)])
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if openapi:
        @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authorized)])
        async def schema() -> JSONResponse:
            return JSONResponse(app.openapi())

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
        try:
            work = body.to_work()  # the options checked: a bad value is refused before it waits in the queue
        except UserError as e:
            raise bad_request(e, body.names()) from None
        job = Job(work, asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
        except ShuttingDown as e:
            raise shutting_down(e) from None
        except NotReady as e:
            code = "load_failed" if scheduler.load_error is not None else "model_loading"
            raise APIError(503, str(e), "service_unavailable", code=code) from None
        try:
            first = await next_event(job, scheduler, request)  # validation passed once the first token is out
        except ClientGone:
            return JSONResponse({}, status_code=499)  # nobody reads it
        except DeadlinePassed:  # shutting down, and nothing generated yet
            raise shutting_down(ShuttingDown()) from None
        except asyncio.CancelledError:  # the handler itself was cancelled (e.g. by Ray Serve's proxy)
            job.cancel()
            raise
        if isinstance(first, Failed):
            raise failure(first, work)
        shape = Shape(model_name, chat)
        if body.stream:
            return StreamingResponse(stream(job, scheduler, first, shape, body.include_usage, body.spans),
                                     media_type="text/event-stream")
        event, texts, last = first, [], None
        try:
            while not isinstance(event, Finished):
                if isinstance(event, Text):
                    texts.append(event.text)
                    last = event
                event = await next_event(job, scheduler, request)
                if isinstance(event, Failed):
                    raise failure(event, work)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        except DeadlinePassed:  # its round overran the shutdown deadline: the text so far
            return shape.response("".join(texts), "length", cut_usage(last), SHUTDOWN)
        except asyncio.CancelledError:
            job.cancel()
            raise
        # the text == the Text events concatenated (sparrow.stopping)
        return shape.response(event.result.text, event.result.finish_reason, usage(event), event.ended_by)

    return app


async def next_event(job: Job, scheduler: Scheduler, request: Request | None = None):
    """The job's next event. Cancels the job and raises ClientGone when the client of `request` disconnects
    meanwhile, DeadlinePassed when HANDLER_GRACE_SECONDS past a draining scheduler's deadline the job still runs."""
    while True:
        if not job.events.empty():
            return job.events.get_nowait()
        wait = DISCONNECT_POLL_SECONDS
        if scheduler.deadline is not None:
            left = scheduler.deadline + HANDLER_GRACE_SECONDS - time.perf_counter()
            if left <= 0:
                job.cancel()
                raise DeadlinePassed()
            wait = min(wait, left)
        try:
            return await asyncio.wait_for(job.events.get(), wait)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                job.cancel()
                raise ClientGone() from None


async def stream(job: Job, scheduler: Scheduler, first: Text | Finished, shape: Shape, include_usage: bool,
                 spans: bool = False) -> AsyncIterator[str]:
    """Server-sent events: a role chunk (chat), one chunk per non-empty Text, a last chunk with the finish reason,
    a usage chunk (with stream_options.include_usage), then `[DONE]`. A client that goes away cancels the job.
    spans: each text chunk also carries `sparrow`: {"spans": [[text, drafted], ...], "completion_tokens",
    "num_draft_tokens", "num_accepted_tokens"} (the request's totals so far). A job the server ended (its timeout
    or its shutdown deadline) has finish reason "length" and its last chunk `sparrow`: {"ended_by": why}; past the
    deadline (+ HANDLER_GRACE_SECONDS) the stream ends with the text so far without waiting for the job's round."""
    try:
        if shape.chat:
            yield shape.sse(shape.chunk({"role": "assistant", "content": ""}, None, include_usage))
        event: Any = first
        last: Text | None = None
        try:
            while True:
                if isinstance(event, Text):
                    last = event
                if isinstance(event, Text) and event.text:
                    chunk = shape.chunk(event.text, None, include_usage)
                    if spans:
                        chunk["sparrow"] = {"spans": [list(s) for s in event.spans],
                                            "completion_tokens": event.completion_tokens,
                                            "num_draft_tokens": event.num_draft_tokens,
                                            "num_accepted_tokens": event.num_accepted_tokens}
                    yield shape.sse(chunk)
                elif isinstance(event, Finished):
                    for line in shape.last_chunks(event.result.finish_reason, event.ended_by,
                                                  usage(event) if include_usage else None):
                        yield line
                    break
                elif isinstance(event, Failed):
                    yield shape.sse({"error": failure(event, job.work).body()})
                    break
                event = await next_event(job, scheduler)
        except DeadlinePassed:  # its round overran the shutdown deadline: end the stream with the text so far
            for line in shape.last_chunks("length", SHUTDOWN, cut_usage(last) if include_usage else None):
                yield line
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

    def response(self, text: str, finish_reason: str, usage: dict[str, Any], ended_by: str | None
                 ) -> dict[str, Any]:
        response = {**self.header("full"), "choices": [self.choice(text, finish_reason, delta=False)],
                    "usage": usage}
        if ended_by is not None:
            response["sparrow"] = {"ended_by": ended_by}
        return response

    def last_chunks(self, finish_reason: str, ended_by: str | None, usage: dict[str, Any] | None) -> list[str]:
        """The chunk with the finish reason (and `sparrow.ended_by` when the server ended the job), then the usage
        chunk when asked (stream_options.include_usage)."""
        last = self.chunk("", finish_reason, usage is not None)
        if ended_by is not None:
            last["sparrow"] = {"ended_by": ended_by}
        chunks = [self.sse(last)]
        if usage is not None:
            chunks.append(self.sse({**self.header("chunk"), "choices": [], "usage": usage}))
        return chunks

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
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
        "speculative": {
            "num_drafts": num_drafts(result),
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "mean_accepted_tokens": stats.mean_accepted_tokens,  # tokens per target forward, bonus included
            "acceptance_rate": stats.acceptance_rate,
        },
    }


def cut_usage(last: Text | None) -> dict[str, Any]:
    """The usage of a job cut at the shutdown deadline, from its last Text event (the speculative counts known)."""
    prompt, tokens = (last.prompt_tokens, last.completion_tokens) if last is not None else (0, 0)
    drafted, accepted = (last.num_draft_tokens, last.num_accepted_tokens) if last is not None else (0, 0)
    return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens if last is not None else 0},
            "speculative": {"num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                            "acceptance_rate": accepted / drafted if drafted else 0.0}}


def failure(failed: Failed, work: Work) -> APIError:
    if isinstance(failed.error, ShuttingDown):  # it waited in the queue when the server began shutting down
        return shutting_down(failed.error)
    if isinstance(failed.error, UserError):  # a request that only the model could check (e.g. its context length)
        return bad_request(failed.error, dict(work.options.names))
    return APIError(500, f"internal error: {type(failed.error).__name__}: {failed.error} -- this is a bug in sparrow",
                    "internal_error")


def bad_request(error: UserError, names: Mapping[str, str]) -> APIError:
    """400 for a request's UserError: `param` is the body field of the option it concerns (`error.field` as the
    body spells it: `names`, `sparrow.serve.protocol.NAMES`), None where it concerns none."""
    return APIError(400, str(error), param=None if error.field is None else names.get(error.field, error.field))


def shutting_down(error: ShuttingDown) -> APIError:
    return APIError(503, str(error), "service_unavailable", code="shutting_down")


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
    return [
        str(part)
        for part in error.get("loc", ())
        if part != "body" and not (isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part))
    ]


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

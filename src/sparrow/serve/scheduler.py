"""Scheduler: the one owner of the pipeline. Requests wait in a bounded queue; one worker thread loads the model,
then runs them one at a time and reports each request's progress as events.

The HTTP layer (`sparrow.serve.app`) only submits `Job`s and reads their events on its event loop; it never
touches the pipeline. Batched speculative decoding (issue 13, next slice) replaces `_run_one` with a loop that
admits several jobs per step; the queue, `Job` and the events stay as they are.

Streaming: the pipeline's `on_text` hook (`sparrow.stopping`) hands the worker the text that is final after each
round (no partial character, nothing that may still become a stop string); the worker forwards it as `Text`
events. The same hook ends a request early: a job whose client went away finishes at the next round with
finish reason "cancelled" (its result is dropped); a job running longer than `timeout` seconds finishes with
finish reason "length" and the text so far (`Finished.timed_out` is set).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sparrow.errors import UserError
from sparrow.pipeline import Pipeline
from sparrow.serve.metrics import Metrics
from sparrow.text import clean_text
from sparrow.types import GenerationResult

log = logging.getLogger("sparrow.serve")

POLL_SECONDS = 0.1  # how often an idle worker checks whether the server is shutting down
CANCELLED = "cancelled"  # finish reason of a job whose client went away (never sent to anyone)


@dataclass(frozen=True)
class Work:
    """One validated request, as the HTTP layer hands it over (sampling fields already checked)."""

    prompt: str | list[int] | None  # /v1/completions: text or token ids
    messages: list[dict[str, str]] | None  # /v1/chat/completions: [{"role", "content"}], for the chat template
    max_tokens: int | None  # None: the rest of the model's context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    spans: bool = False  # stream which characters came from accepted draft tokens (the playground's colours)


@dataclass(frozen=True)
class Text:
    """New final text of a running job (possibly empty: the first one also says the job has started)."""

    text: str
    spans: tuple[tuple[str, bool], ...] = ()  # (text, drafted) runs that concatenate to `text`
    completion_tokens: int = 0  # the job's totals so far
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class Finished:
    """The job's result (its text equals the `Text` events concatenated)."""

    result: GenerationResult
    prompt_tokens: int
    timed_out: bool  # ended by the server's timeout (finish reason "length")


@dataclass(frozen=True)
class Failed:
    """The job failed: a UserError (the request's fault: HTTP 400) or a bug (HTTP 500)."""

    error: BaseException

    @property
    def user_error(self) -> bool:
        return isinstance(self.error, UserError)


Event = Text | Finished | Failed


class QueueFull(Exception):
    """The queue holds `max_queue` waiting jobs already (HTTP 429)."""


class NotReady(Exception):
    """The model is still loading, or failed to load (HTTP 503)."""


class Job:
    """A request in flight: the worker emits events onto the submitting event loop's queue."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.received = time.perf_counter()
        self._loop = loop
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """The client went away: skip the job if it waits, end it at the next round if it runs."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()


class Scheduler:
    """Loads the pipeline on its worker thread, then runs queued jobs one at a time (see the module doc)."""

    def __init__(self, load: Callable[[], Pipeline], *, max_queue: int = 32, timeout: float | None = None,
                 metrics: Metrics | None = None) -> None:
        if max_queue < 1:
            raise UserError(f"max_queue must be >= 1, got {max_queue}")
        if timeout is not None and not timeout > 0:
            raise UserError(f"timeout must be > 0 seconds, got {timeout}")
        self.metrics = metrics or Metrics()
        self.timeout = timeout
        self.pipeline: Pipeline | None = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None  # e.g. the CLI stops the server
        self._load = load
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="sparrow-scheduler", daemon=True)
        self.metrics.queue_depth.set_function(self._queue.qsize)

    @property
    def ready(self) -> bool:
        return self.pipeline is not None

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stopping.is_set():
            self._thread.start()

    def stop(self, wait: float = 5.0) -> None:
        """End the worker: waiting jobs are dropped, a running one ends at its next round."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(wait)

    def submit(self, job: Job) -> None:
        if not self.ready:
            raise NotReady("the model failed to load" if self.load_error is not None else "the model is loading")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the queue is full ({self._queue.maxsize} requests waiting); retry later") from None

    # --- the worker thread ----------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self.pipeline = self._load()
        except Exception as e:  # reported by /health, and to whoever started the server
            log.error("loading the model failed: %s", e)
            self.load_error = e
            if self.on_load_error is not None:
                self.on_load_error(e)
            return
        while not self._stopping.is_set():
            try:
                job = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if not job.cancelled:
                self.metrics.running.set(1)
                try:
                    self._run_one(job)
                finally:
                    self.metrics.running.set(0)

    def _run_one(self, job: Job) -> None:
        """Generate one job, emitting Text events each round, then Finished or Failed."""
        pipe, work = self.pipeline, job.work
        assert pipe is not None
        started = time.perf_counter()
        first = True
        timed_out = False

        def on_text(text: str) -> str | None:
            nonlocal first, timed_out
            if first:
                self.metrics.time_to_first_token.observe(time.perf_counter() - job.received)
                first = False
            job.emit(Text(text, getattr(text, "spans", ())))
            if job.cancelled or self._stopping.is_set():
                return CANCELLED
            if self.timeout is not None and time.perf_counter() - started > self.timeout:
                timed_out = True
                return "length"
            return None

        try:
            ids = prompt_ids(pipe, work)
            max_tokens = work.max_tokens
            context = pipe.runner.context_length
            if max_tokens is None:  # the rest of the context (Pipeline.request refuses a prompt that fills it)
                max_tokens = max(1, context - len(ids)) if context is not None else DEFAULT_MAX_TOKENS
            result = pipe.generate(ids, max_new_tokens=max_tokens, temperature=work.temperature, top_k=work.top_k,
                                   top_p=work.top_p, seed=work.seed, stop=work.stop, on_text=on_text)
        except Exception as e:
            if not isinstance(e, UserError):
                log.exception("request failed")
            self.metrics.request_failure.labels(reason="bad_request" if isinstance(e, UserError) else "error").inc()
            job.emit(Failed(e))
            return
        if result.finish_reason == CANCELLED:
            self.metrics.request_failure.labels(reason="cancelled").inc()
            return
        self.metrics.finished(result, len(ids), time.perf_counter() - job.received)
        job.emit(Finished(result, len(ids), timed_out))


DEFAULT_MAX_TOKENS = 1024  # max_tokens of a chat request to a model whose context length is unknown


def prompt_ids(pipe: Pipeline, work: Work) -> list[int]:
    """The request's prompt as token ids: completions as the pipeline encodes text; chat through the tokenizer's
    chat template (without one: "role: content" lines, then "assistant:")."""
    if work.messages is None:
        assert work.prompt is not None
        return pipe.encode(work.prompt).input_ids.tolist()
    tokenizer = pipe.tokenizer
    messages = [{**m, "content": clean_text(m["content"], "messages.content")} for m in work.messages]  # as prompts
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return pipe.encode(text).input_ids.tolist()

"""Scheduler: the HTTP side of the engine. Requests wait in a bounded queue; one worker thread loads the pipeline,
hands the jobs to its `sparrow.engine.Engine` as the batch has room, steps the engine, and reports each request's
progress as events.

The HTTP layer (`sparrow.serve.app`) only submits `Job`s and reads their events on its event loop; it never
touches the pipeline. The engine batches (continuous batching: between two steps, waiting requests join, up to
`max_batch`, and finished ones leave; each step drafts for every running request and verifies all drafts in one
target forward, the draft budget shrinking as the batch grows: `BatchPolicy`); models batching does not support
(sliding-window layers, M-RoPE VLMs) run one job at a time.

Streaming: the pipeline's `on_text` hook (`sparrow.stopping`) hands the worker the text that is final after each
round (no partial character, nothing that may still become a stop string); the worker forwards it as `Text`
events. The same hook ends a request early: a job whose client went away finishes at the next round with
finish reason "cancelled" (its result is dropped); a job running longer than `timeout` seconds finishes with
finish reason "length" and the text so far (`Finished.ended_by` is "timeout").

Shutdown (`drain`): the scheduler admits nothing new (`ShuttingDown`: HTTP 503), fails the waiting jobs with
`ShuttingDown` at once, and ends each running job at its last round that ends before the deadline (finish reason
"length", `Finished.ended_by` "shutdown"; a round that overruns the deadline ends it at the round's end, and the
HTTP layer answers without waiting for it: `sparrow.serve.app`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sparrow.decoding.round import Generation
from sparrow.engine import Engine, Submitted, check_max_batch
from sparrow.errors import UserError
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy
from sparrow.request import Options
from sparrow.serve.metrics import Metrics
from sparrow.types import GenerationResult

log = logging.getLogger("sparrow.serve")

POLL_SECONDS = 0.1  # how often an idle worker checks whether the server is shutting down
STOP_GRACE_SECONDS = 0.5  # after a drain's deadline, how long `stop` waits for the worker thread
CANCELLED = "cancelled"  # finish reason of a job whose client went away (never sent to anyone)


@dataclass(frozen=True)
class Work:
    """One request as the HTTP layer hands it over: its options checked (`sparrow.request.check_options`), its
    prompt tokenized and checked against the context by the engine when the worker submits it (`Engine.submit`)."""

    prompt: str | list[int] | list[dict[str, str]]  # /v1/completions: text or token ids; chat: [{"role", "content"}]
    options: Options  # max_new_tokens None: the rest of the model's context
    spans: bool = False  # stream which characters came from accepted draft tokens (the playground's colours)


@dataclass(frozen=True)
class Text:
    """New final text of a running job (possibly empty: the first one also says the job has started)."""

    text: str
    spans: tuple[tuple[str, bool], ...] = ()  # (text, drafted) runs that concatenate to `text`
    completion_tokens: int = 0  # the job's totals so far
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (`serve --prefix-cache`)


@dataclass(frozen=True)
class Finished:
    """The job's result (its text equals the `Text` events concatenated)."""

    result: GenerationResult
    prompt_tokens: int
    ended_by: str | None = None  # "timeout" or "shutdown": the server ended it (finish reason "length")
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache


@dataclass(frozen=True)
class Failed:
    """The job failed: a UserError (the request's fault: HTTP 400) or a bug (HTTP 500)."""

    error: BaseException


Event = Text | Finished | Failed


class QueueFull(Exception):
    """The queue holds `max_queue` waiting jobs already (HTTP 429)."""


class NotReady(Exception):
    """The model is still loading, or failed to load (HTTP 503)."""


class ShuttingDown(Exception):
    """The server is shutting down: it admits no new request, and drops the waiting ones (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down: retry the request on another instance or later")


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
    """Loads the pipeline on its worker thread, then hands queued jobs to its engine (see the module doc)."""

    def __init__(self, load: Callable[[], Pipeline], *, max_queue: int = 32, timeout: float | None = None,
                 metrics: Metrics | None = None, max_batch: int = 8, policy: BatchPolicy | None = None) -> None:
        if max_queue < 1:
            raise UserError(f"max_queue must be >= 1, got {max_queue}")
        self.max_batch = check_max_batch(max_batch)
        self.policy = policy or BatchPolicy()
        if timeout is not None and not timeout > 0:
            raise UserError(f"timeout must be > 0 seconds, got {timeout}")
        self.metrics = metrics or Metrics()
        self.timeout = timeout
        self.pipeline: Pipeline | None = None
        self.engine: Engine | None = None  # the pipeline's, made by the worker once it loaded
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None  # e.g. the CLI stops the server
        self._load = load
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self._deadline: float | None = None  # perf_counter() by which a draining scheduler ends its running jobs
        self._thread = threading.Thread(target=self._work, name="sparrow-scheduler", daemon=True)
        self.metrics.queue_depth.set_function(self._queue.qsize)

    @property
    def ready(self) -> bool:
        return self.pipeline is not None

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stopping.is_set():
            self._thread.start()

    def stop(self, wait: float = 5.0) -> None:
        """End the worker: waiting jobs are dropped, a running one ends at its next round. After `drain`, waits
        for the worker at most until STOP_GRACE_SECONDS past the drain's deadline."""
        self._stopping.set()
        if self._deadline is not None:
            wait = min(wait, max(0.0, self._deadline + STOP_GRACE_SECONDS - time.perf_counter()))
        if self._thread.is_alive():
            self._thread.join(wait)

    def drain(self, seconds: float) -> None:
        """Begin shutting down: admit nothing new (`submit` raises ShuttingDown), fail every waiting job with
        ShuttingDown now, end the running ones within `seconds` (see the module doc). Call it from the thread
        that submits (the event loop's); calling it again changes nothing."""
        if self._deadline is None:
            self._deadline = time.perf_counter() + max(0.0, seconds)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            self._refuse(job)

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    @property
    def deadline(self) -> float | None:
        """The perf_counter() by which a draining scheduler ends its running jobs (None: not draining)."""
        return self._deadline

    def submit(self, job: Job) -> None:
        if self.draining:
            raise ShuttingDown()
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
        engine = self.engine = Engine(self.pipeline, max_batch=self.max_batch, policy=self.policy)
        if engine.unbatched is not None:
            log.warning("requests run one at a time: batching does not support this model (%s)", engine.unbatched)
        engine.prepare()  # the batch policy's costs, before any request waits on them
        self._running: dict[int, Running] = {}  # id(Submitted) -> its job
        while not self._stopping.is_set():
            self._admit(engine)
            if not engine.busy:
                continue
            if engine.unbatched is None:
                self.metrics.batch_size.observe(engine.size)
            for submitted in engine.step():  # a job whose client left finished too ("cancelled", at its round)
                run = self._running.pop(id(submitted))
                if submitted.error is not None:
                    self._fail(run.job, submitted.error)
                else:
                    self._finish(run, submitted.result)
            self.metrics.running.set(engine.size)
        engine.close()

    def _admit(self, engine: Engine) -> None:
        """Hand waiting jobs to the engine while its next step has room (waiting for one when nothing runs); they
        start at its next step, prefilled together (`Engine.step`)."""
        while engine.room and not self._stopping.is_set():
            try:
                job = self._queue.get(timeout=POLL_SECONDS) if not engine.busy else self._queue.get_nowait()
            except queue.Empty:
                break
            if job.cancelled:
                continue
            if self.draining:  # taken from the queue just before `drain` emptied it
                self._refuse(job)
                continue
            self.metrics.running.set(engine.size + 1)
            run = Running(job, self)
            try:
                run.submitted = engine.submit(job.work.prompt, job.work.options, on_text=run.on_text)
                run.prompt_tokens = run.submitted.prompt_tokens
            except Exception as e:
                self._fail(job, e)
                self.metrics.running.set(engine.size)
                continue
            self._running[id(run.submitted)] = run

    def _finish(self, run: Running, result: GenerationResult) -> None:
        if result.finish_reason == CANCELLED:
            self.metrics.request_failure.labels(reason="cancelled").inc()
            return
        self.metrics.finished(result, run.prompt_tokens, time.perf_counter() - run.job.received)
        run.job.emit(Finished(result, run.prompt_tokens, run.ended_by, run.cached_tokens))

    def _fail(self, job: Job, error: BaseException) -> None:
        if not isinstance(error, UserError):
            log.error("request failed", exc_info=error)
        self.metrics.request_failure.labels(reason="bad_request" if isinstance(error, UserError) else "error").inc()
        job.emit(Failed(error))

    def _refuse(self, job: Job) -> None:
        """A waiting job of a draining scheduler: HTTP 503 at once."""
        self.metrics.request_failure.labels(reason="shutdown").inc()
        job.emit(Failed(ShuttingDown()))


class Running:
    """A job being generated: its generation in the batch, and the streaming hook that reports its progress."""

    def __init__(self, job: Job, scheduler: Scheduler) -> None:
        self.job, self.scheduler = job, scheduler
        self.submitted: Submitted | None = None  # once the engine took it
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of them, taken from the prefix cache (known after the prefill)
        self.ended_by: str | None = None  # "timeout" or "shutdown" once the server ends it
        self.started = time.perf_counter()
        self.last = None  # perf_counter of the last round that produced text
        self.tokens = 0  # tokens reported so far
        self.steps = self.drafted = self.accepted = 0  # rounds counted so far, and their draft totals

    @property
    def generation(self) -> Generation | None:
        """Its generation in the batch (None before it joined, or running alone)."""
        return self.submitted.generation if self.submitted is not None else None

    def on_text(self, text: str) -> str | None:
        """After each round: emit the new final text; end the job if its client left, its time is up, or the next
        round would end after a draining scheduler's deadline (a round is taken to last as long as the last one)."""
        metrics, now_ = self.scheduler.metrics, time.perf_counter()
        round_seconds = 0.0 if self.last is None else now_ - self.last
        steps = self.generation.steps[self.steps:] if self.generation is not None else []
        self.steps += len(steps)  # only the new rounds: no pass over the whole history each round
        self.drafted += sum(s.num_draft_tokens for s in steps)
        self.accepted += sum(s.num_accepted for s in steps)
        tokens = len(self.generation.stopper.tokens) if self.generation is not None else 0
        if self.last is None:  # the first round: the prompt is prefilled
            metrics.time_to_first_token.observe(now_ - self.job.received)
            cached = self.submitted.cached_tokens if self.submitted is not None else None
            if cached is not None:
                self.cached_tokens = cached
                metrics.prefix_cache_queries.inc(self.prompt_tokens)
                metrics.prefix_cache_hits.inc(self.cached_tokens)
        elif tokens > self.tokens:
            for _ in range(tokens - self.tokens):  # the round's tokens arrived together: each waited its share
                metrics.inter_token_latency.observe((now_ - self.last) / (tokens - self.tokens))
        self.last, self.tokens = now_, tokens
        self.job.emit(Text(text, getattr(text, "spans", ()), tokens, self.drafted, self.accepted, self.prompt_tokens,
                           self.cached_tokens))
        if self.job.cancelled or self.scheduler._stopping.is_set():
            return CANCELLED
        timeout, deadline = self.scheduler.timeout, self.scheduler.deadline
        if timeout is not None and now_ - self.started > timeout:
            self.ended_by = "timeout"
            return "length"
        if deadline is not None and now_ + round_seconds >= deadline:
            self.ended_by = "shutdown"
            return "length"
        return None

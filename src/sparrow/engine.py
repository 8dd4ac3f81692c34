"""Engine: one pipeline's generations, alone (`generate`) or batched and streaming (`submit`, then `step`).

    engine = Engine(sparrow.load("qwen2.5-coder-1.5b", drafter="draft-model", draft="qwen2.5-coder-0.5b"))
    a = engine.submit("def fib(n):", max_new_tokens=64, on_text=print)   # validated and tokenized now
    b = engine.submit("The quick brown fox", max_new_tokens=32)
    while engine.busy:
        for done in engine.step():                                      # requests join between steps
            print(done.result.text if done.error is None else done.error)

`submit` validates the request at once (a `UserError` names what is wrong) and queues it. Each `step` prefills the
requests submitted since the last one (together where their prompts allow: they join the running batch), then runs
one round of every running request in one shared target forward (continuous batching, `sparrow.decoding.batch`;
the draft budget is `BatchPolicy`'s, its cost tables seeded by `prepare` before the first step), and returns the
requests that finished: each with its `result`, or the `error` that ended it (a failing step fails the requests it
ran; the engine goes on). A request whose `on_text` returns a finish reason ends at that round (a client that went
away, a timeout). Models batching does not support (sliding-window layers, M-RoPE VLMs) run one request a step,
whole, still streaming each round through `on_text`.

One thread drives an engine (the server's worker, `sparrow.serve.scheduler`, which keeps only the HTTP side:
queueing, refusals, events). Every step holds the locks of the models it runs (`sparrow.locks`), so other users of
those models wait between steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sparrow.decoding.batch import Batch, measure_feeds, measure_rows, supports_batching
from sparrow.decoding.round import Generation
from sparrow.drafters.base import draft_runners
from sparrow.errors import UserError
from sparrow.locks import holding
from sparrow.pipeline import Pipeline, PromptInput
from sparrow.policy.batch import BatchPolicy
from sparrow.request import Options, Request
from sparrow.runtime.cached_model import CachedModel
from sparrow.stopping import OnText
from sparrow.types import GenerationResult

log = logging.getLogger("sparrow")


@dataclass(eq=False)
class Submitted:
    """A request in an engine: its generation while it runs batched (None for one that runs alone), then its
    `result`, or the `error` that ended it."""

    prompt_tokens: int
    generation: Generation | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None
    alone: tuple[Request, OnText | None] | None = field(default=None, repr=False)  # to run alone, at a step
    runner: CachedModel | None = field(default=None, repr=False)  # what it runs on alone (the pipeline's)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens its prefill took from the prefix cache, once prefilled (None: no prefix cache)."""
        runner = self.generation.target if self.generation is not None else self.runner
        return runner.reused if runner is not None and runner.prefix_cache is not None else None


class Engine:
    """A pipeline's requests, batched between steps (see the module doc). Not thread-safe: one thread drives it."""

    def __init__(self, pipeline: Pipeline, *, max_batch: int = 8, policy: BatchPolicy | None = None) -> None:
        self.pipeline = pipeline
        self.max_batch = check_max_batch(max_batch)
        self.policy = policy or BatchPolicy()
        self.unbatched: str | None = supports_batching(pipeline.target.model)  # why requests run alone (None: batched)
        self._batch = Batch(pipeline.target.model, self.policy)
        self._joining: list[Submitted] = []  # submitted since the last step: they prefill at the next
        self._running: dict[int, Submitted] = {}  # id(generation) -> its request, while in the batch
        self._alone: list[Submitted] = []  # waiting to run alone (an unbatched model)

    # --- one at a time --------------------------------------------------------------------------------------

    def generate(self, prompt: PromptInput | Request, *, on_text: OnText | None = None,
                 **options) -> GenerationResult:
        """One request (a prompt with its options, or a `Request`), whole, alone: the pipeline's `generate`, which
        the CLI and `sparrow.generate` run."""
        return self.pipeline.generate(prompt, on_text=on_text, **options)

    # --- batched --------------------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Requests submitted and not finished yet."""
        return len(self._joining) + len(self._running) + len(self._alone)

    @property
    def room(self) -> int:
        """How many more requests the next step takes in (`max_batch` at once; 1 for an unbatched model)."""
        return max(0, (1 if self.unbatched else self.max_batch) - self.size)

    @property
    def busy(self) -> bool:
        return self.size > 0

    def prepare(self) -> None:
        """Measure what the batch policy prices steps with, before any request waits on it (once): a plain step's
        seconds for 1, 2, 4, ... <= max_batch rows, and the draft model's (if the drafter runs one batched) per
        draft position and for a catch-up of 16, 64 and 256 tokens."""
        if self.unbatched is not None:
            return
        pipe = self.pipeline
        with holding(pipe.models()):
            known = self.policy.verify.known
            self.policy.seed([] if known else measure_rows(pipe.target.model, self._rows(), vocab=self._vocab),
                             *self._draft_costs())

    def submit(self, prompt: PromptInput | Request, options: Options | None = None, /, *,
               on_text: OnText | None = None, **keywords) -> Submitted:
        """Queue a request: a `Request` built already, or a prompt with its options (`Pipeline.request`'s), checked
        and tokenized now: a bad one raises its `UserError` here and is not queued. It starts at the next `step`,
        whatever `room` says."""
        request = self.pipeline.as_request(prompt, options, **keywords)
        if self.unbatched is not None:
            submitted = Submitted(request.prompt.input_ids.numel(), alone=(request, on_text),
                                  runner=self.pipeline.runner)
            self._alone.append(submitted)
            return submitted
        generation = self.pipeline.sequence(request, on_text=on_text)
        submitted = Submitted(request.prompt.input_ids.numel(), generation)
        self._joining.append(submitted)
        return submitted

    def step(self) -> list[Submitted]:
        """Start the requests submitted since the last step, then one round of every running one; the requests that
        finished (their `result` or `error` set), in no particular order."""
        if self._alone:
            return [self._run_alone(self._alone.pop(0))]
        finished = self._start(self._joining)
        self._joining = []
        if not self._batch.running:
            return finished
        pipe = self.pipeline
        try:
            with holding(pipe.models()):
                done = self._batch.step()
        except Exception as e:  # a bug: every running request fails, the engine goes on
            log.exception("a batch step failed")
            for submitted in self._running.values():
                self._batch.remove(submitted.generation)
                self._end(submitted, error=e)
            finished += self._running.values()
            self._running.clear()
            return finished
        for generation in done:
            finished.append(self._end(self._running.pop(id(generation))))
        return finished

    def close(self) -> None:
        """Drop every request not finished (their caches freed; a shutting-down server's)."""
        for submitted in [*self._joining, *self._running.values()]:
            self._batch.remove(submitted.generation)
            self.pipeline.release(submitted.generation)
        self._joining, self._alone = [], []
        self._running.clear()

    # --- inside ---------------------------------------------------------------------------------------------

    def _start(self, joining: list[Submitted]) -> list[Submitted]:
        """Prefill the joining requests together (`Batch.add`; a first token may already finish one); if that
        fails, the ones not started yet start alone, so only a failing request fails. Returns the finished."""
        if not joining:
            return []
        pipe = self.pipeline
        try:
            with holding(pipe.models()):
                self._batch.add(*(s.generation for s in joining))
        except Exception:
            for submitted in joining:
                if submitted.generation.committed.numel():  # started
                    continue
                try:
                    with holding(pipe.models()):
                        self._batch.add(submitted.generation)
                except Exception as e:
                    self._batch.remove(submitted.generation)
                    self._end(submitted, error=e)
        finished = []
        for submitted in joining:
            if submitted.done:
                finished.append(submitted)
            elif submitted.generation.done:
                finished.append(self._end(submitted))
            else:
                self._running[id(submitted.generation)] = submitted
        return finished

    def _end(self, submitted: Submitted, error: BaseException | None = None) -> Submitted:
        """A batched request's result (or error); its generation goes back to the pipeline, whose prefix cache (if
        any) may keep its cache for a later prompt (only after a clean end between rounds)."""
        generation = submitted.generation
        if error is None:
            submitted.result = self.pipeline.result(generation)
        else:
            submitted.error = error
        self.pipeline.release(generation, keep=error is None)
        return submitted

    def _run_alone(self, submitted: Submitted) -> Submitted:
        request, on_text = submitted.alone
        try:
            submitted.result = self.pipeline.generate(request, on_text=on_text)
        except Exception as e:
            submitted.error = e
        return submitted

    def _rows(self) -> tuple[int, ...]:
        """The batch sizes whose steps `prepare` times: 1, 2, 4, ... <= max_batch."""
        return tuple(2 ** i for i in range(self.max_batch.bit_length()))

    @property
    def _vocab(self) -> int:
        return len(self.pipeline.tokenizer)

    def _draft_costs(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """A draft position's seconds for 1, 2, 4, ... rows (a draft model's batched forward grows with its rows),
        and a catch-up's for one sequence feeding 16, 64 and 256 tokens alone; none without a draft model that
        drafts batched, or once known."""
        draft = next(iter(draft_runners(self.pipeline.drafter)), None)
        if draft is None or self.policy.draft.known or supports_batching(draft.model) is not None:
            return [], []
        return (measure_rows(draft.model, self._rows(), vocab=self._vocab),
                measure_feeds(draft.model, vocab=self._vocab))


def check_max_batch(max_batch: object) -> int:
    """`max_batch` (requests a step runs at most), refused unless an integer >= 1."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise UserError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    return max_batch


__all__ = ["Engine", "Submitted", "check_max_batch"]

"""Pipeline: a loaded target (and drafter) that turns prompts into GenerationResults.

    pipe = sparrow.load("qwen2.5-coder-1.5b", drafter="draft-model", draft="qwen2.5-coder-0.5b")
    result = pipe.generate("def fib(n):", max_new_tokens=64)
    baseline = pipe.generate_plain("def fib(n):", max_new_tokens=64)

Threads: a generation holds the locks of the models and drafter it changes (`sparrow.locks`), so calls
on one pipeline, and on pipelines that share a model, run one after the other.

Pipelines are made by `sparrow.loading`: `load`, and `PipelineCache` (what `sparrow.generate` keeps).
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import PreTrainedTokenizerBase

from sparrow.decoding.baseline import plain_decode
from sparrow.decoding.engine import decode
from sparrow.decoding.round import Generation
from sparrow.drafters.base import Drafter, verify_rows
from sparrow.drafters.draft_model import draft_model_drafters
from sparrow.errors import UserError
from sparrow.grammar import FREE, Constraint, Grammars, guiding
from sparrow.locks import holding, stateful_objects
from sparrow.models import LoadedModel
from sparrow.noise import PositionalNoise
from sparrow.request import (
    OPTIONS,
    Options,
    PromptInput,
    Request,
    build_request,
    chat_messages,
    check_options,
    is_chat,
    token_ids,
)
from sparrow.runtime.batch_invariant import is_exact
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.compiled import StaticCachedModel, traceable
from sparrow.runtime.prefix_cache import PrefixCache
from sparrow.runtime.runner import runner_for
from sparrow.stopping import OnText, Stopper
from sparrow.text import clean_text
from sparrow.types import GenerationResult, Prompt, Ran
from sparrow.verifiers import VERIFIERS, build_verifier
from sparrow.vision.prompt import encode_media


class Pipeline:
    """A target, its runner (and KV cache) and a drafter. Safe to share between threads: see the module doc."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None, verifier: str = "auto",
                 compiled: bool = False, prefix_cache: int = 0, compile_draft: bool | None = None) -> None:
        """compiled: the target runs on a static KV cache with torch.compile'd steps (`sparrow.runtime.compiled`);
        compile_draft (default: as `compiled`): so does the draft model of a draft-model / quantized-self drafter
        (or of auto's draft-model candidate). Either way one generation at a time (no `sequence`).
        prefix_cache: keep the target's KV of up to this many tokens of earlier requests, so that a prompt that
        begins like one of them prefills only the rest (`sparrow.runtime.prefix_cache`; 0: off)."""
        self.target = target
        self.compiled = compiled
        self.draft_compiled = compiled if compile_draft is None else compile_draft
        self.runner = runner_for(target.model, compiled)
        if prefix_cache:
            if type(self.runner) is not CachedModel:
                raise UserError("prefix_cache applies to a text model's dynamic KV cache: not with compile=True "
                                "(--compile) or a vision-language target")
            if drafter is not None and (drafter.hidden_layers or drafter.describe().watches_prefill):
                raise UserError(f"prefix_cache does not combine with the {drafter.name!r} drafter: it reads what the "
                                "target computes over the whole prompt, which a prefix-cached prefill skips")
            self.runner.prefix_cache = PrefixCache(prefix_cache)
            for each in draft_model_drafters(drafter):  # a draft model keeps its own (its prompts are the target's)
                if type(each.draft) is CachedModel:
                    each.draft.prefix_cache = PrefixCache(prefix_cache)
        if self.draft_compiled:
            _compile_draft_runner(drafter)
        self.drafter = drafter
        self.verifier = verifier
        self._forks: list[Drafter] = []  # idle copies of the drafter for batched sequences (`sequence`)
        self._grammars: Grammars | None = None  # structured output: made on the first request that asks for it
        if verifier not in ("auto", *VERIFIERS):
            raise UserError(f"unknown verifier {verifier!r}; expected one of: auto, {', '.join(VERIFIERS)}")

    def warm_up(self, prompt: PromptInput | Prompt, chat: bool = False) -> None:
        """Compile the step sizes the compiled runners run at the cache capacity `prompt` allocates, so that no
        compile falls inside a timed generation (nothing to do where none is): the target's up to the most rows its
        verify scores with this drafter (`verify_rows`: k + 1 for a chain of k, a tree's budget + 1; every size
        where the drafter does not say), with the drafter's hidden layers, and its one-row step without them (plain
        decoding); every size of the draft models' (their catch-up after plain rounds, or auto switching, runs any)."""
        encoded = prompt if isinstance(prompt, Prompt) else self.encode(prompt, chat=chat)
        if self.compiled and isinstance(self.runner, StaticCachedModel):
            layers = self.drafter.hidden_layers if self.drafter is not None else ()
            self.runner.warm_up(encoded, layers, largest=verify_rows(self.drafter))
            if layers:
                self.runner.warm_up(encoded, largest=1)
        if self.draft_compiled:
            for each in draft_model_drafters(self.drafter):
                if isinstance(each.draft, StaticCachedModel):  # a w8a8 draft stays eager
                    each.draft.warm_up(encoded)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.target.tokenizer

    @property
    def exact(self) -> bool:
        """Whether the target verifies batch-invariantly (`sparrow.load(exact=...)`, `--exact`)."""
        return is_exact(self.target.model)

    @property
    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    def eos_token_ids(self) -> frozenset[int]:
        return self.target.eos_token_ids()

    def encode(self, prompt: PromptInput, chat: bool = False, *, video=None, frames: int | None = None,
               image=None) -> Prompt:
        """Tokenize a prompt: text (a str; bytes are UTF-8, invalid UTF-8 becomes U+FFFD), token ids, or chat
        messages ([{"role", "content"}]: the tokenizer's chat template; without one, "role: content" lines, then
        "assistant:"); with video (file, frame dir, array) / image (file(s)), run the VLM's processor."""
        if isinstance(prompt, (str, bytes, bytearray)):
            prompt = clean_text(prompt, "prompt")
        if video is not None or image is not None or frames is not None:
            return encode_media(self.target.processor, prompt, video=video, frames=frames, image=image,
                                model_name=f"target {self.target.name!r}")
        if is_chat(prompt):
            messages = chat_messages(prompt)
            if self.tokenizer.chat_template:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
                return Prompt(input_ids=torch.tensor(ids, dtype=torch.long))
            prompt, chat = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:", False
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UserError("prompt must not be empty", field="prompt")
            if chat and self.tokenizer.chat_template:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                    return_dict=False)
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = token_ids(prompt, self.runner.vocab_size)
        return Prompt(input_ids=torch.tensor(ids, dtype=torch.long))

    def request(self, prompt: PromptInput, options: Options | None = None, /, **keywords) -> Request:
        """The request to generate: its options checked (`sparrow.request.check_options`, each error names its
        option; or `options` checked already), then the prompt tokenized and checked against the model's context.
        Build it once, then hand it to `generate`, `generate_plain` or `sequence` (as often as wanted).

        Options: max_new_tokens (128; None: the rest of the model's context), temperature, top_k, top_p, seed,
        stop, chat, video / frames / image, json_schema (a dict or its JSON text) / regex: structured output
        (`sparrow.grammar`): every output keeps to it, EOS only where it is complete (finish_reason "length" when
        max_new_tokens cuts it short)."""
        if options is None:
            options = check_options(keywords)
        elif keywords:
            raise UserError(f"options are given twice: as checked Options and as {', '.join(sorted(keywords))}",
                            field=min(keywords))
        with holding([self.target.model]):  # the tokenizer is shared with every pipeline on the model
            encoded = self.encode(prompt, options.chat, video=options.video, frames=options.frames,
                                  image=options.image)
        return build_request(encoded, options, eos_token_ids=self.eos_token_ids(),
                             context_length=self.runner.context_length)

    def constraint(self, request: Request) -> Constraint:
        """The request's grammar state (compiled here: a bad schema or regex is a UserError), or FREE."""
        if request.grammar is None:
            return FREE
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.runner.vocab_size)
        return self._grammars.start(request.grammar, request.stopping.eos_token_ids)

    def generate(self, prompt: PromptInput | Request, *, on_text: OnText | None = None,
                 **options) -> GenerationResult:
        """Speculative generation (plain decoding when the pipeline has no drafter) of a prompt with `options`
        (those of `request`), or of a `Request` built already (then no options).

        on_text: streaming; called after each round with the new final text (`sparrow.stopping`); the pieces
        concatenated equal the result's text. Returning a finish reason from it ends the generation."""
        return self._run(self.as_request(prompt, **options), self.drafter, on_text)

    OPTIONS = OPTIONS

    def generate_plain(self, prompt: PromptInput | Request, *, on_text: OnText | None = None,
                       **options) -> GenerationResult:
        """Plain autoregressive decoding of the same target: the oracle and the baseline."""
        return self._run(self.as_request(prompt, **options), None, on_text)

    def as_request(self, prompt: PromptInput | Request, options: Options | None = None, /,
                   **keywords) -> Request:
        """A Request as it is (no options with it), or the request of a prompt and its options (`request`)."""
        if not isinstance(prompt, Request):
            return self.request(prompt, options, **keywords)
        given = [*keywords, *(["options"] if options is not None else [])]
        if given:
            raise UserError(f"a Request takes no options: its own are checked already (got {', '.join(given)})",
                            field=min(given))
        return prompt

    def _run(self, request: Request, drafter: Drafter | None, on_text: OnText | None = None) -> GenerationResult:
        # The locks cover detokenizing too: the tokenizer is shared with every pipeline on the model.
        with holding(stateful_objects(self.target.model, drafter)):
            gen = self._generation(request, self.runner, drafter, on_text)
            start = time.perf_counter()
            try:
                if drafter is not None:
                    with guiding(drafter, gen.grammar):
                        decoded = decode(gen)
                else:
                    decoded = plain_decode(self.runner, gen.prompt, gen.sampling, gen.stopper, gen.generator,
                                           gen.grammar)
            except BaseException:
                # An error (or Ctrl-C) mid-round leaves a half-updated cache. Every generation starts with a
                # prefill that replaces the target's cache and the drafter's state, so the pipeline stays
                # usable; drop the cache now to free its memory.
                self.runner.cache = None
                raise
            seconds = time.perf_counter() - start
            self.runner.hold(gen.prompt.input_ids, decoded.token_ids)
            if drafter is not None:
                drafter.park(gen.committed)
            return GenerationResult(token_ids=decoded.token_ids, text=gen.stopper.text(),
                                    finish_reason=decoded.finish_reason, seconds=seconds, stats=decoded.stats,
                                    ran=self.ran(drafter))

    def sequence(self, prompt: PromptInput | Request, *, on_text: OnText | None = None, plain: bool = False,
                 **options) -> Generation:
        """A generation to run in a `sparrow.decoding.batch.Batch` (a prompt with the options of `generate`, or a
        `Request`): its own cache over the target, and a copy of the drafter that shares its models (None with
        plain=True). Give it back with `release` once it finished; `result` turns it into a GenerationResult."""
        if self.compiled or self.draft_compiled:
            raise UserError("a compiled pipeline (compile=True, --compile) runs one generation at a time; batched "
                            "sequences (sparrow serve) need compile=False")
        request = self.as_request(prompt, **options)
        with holding(stateful_objects(self.target.model, self.drafter)):
            drafter = None
            if self.drafter is not None and not plain:
                drafter = self._forks.pop() if self._forks else self.drafter.fork()
                if drafter.batching is not None:  # in a batch, a draft nobody drafts with is never prefilled
                    drafter.batching.lazy_prefill = True
            runner = runner_for(self.target.model)
            runner.prefix_cache = self.runner.prefix_cache  # one prefix cache for all of them (None: off)
            gen = self._generation(request, runner, drafter, on_text)
            if drafter is not None:
                drafter.grammar = gen.grammar  # drafts only what the grammar allows (until `release`)
        return gen

    def _generation(self, request: Request, runner: CachedModel, drafter: Drafter | None,
                    on_text: OnText | None) -> Generation:
        """The one place a request becomes a Generation (`generate`, `generate_plain` and `sequence`): its grammar
        state, verifier (None for plain decoding), randomness (positional for a seeded request, so it repeats
        however rounds are chunked) and stopping rules, on `runner`."""
        grammar = self.constraint(request)  # compiled here: a bad schema is refused before anything runs
        verifier = None
        if drafter is not None:
            verifier = build_verifier(self.verifier, request.sampling, tokenizer=self.tokenizer)
        generator = PositionalNoise(request.seed, self.runner.device) if request.seed is not None else None
        return Generation(runner, drafter, verifier, request.prompt, request.sampling,
                          Stopper(request.stopping, self.tokenizer, on_text), generator, grammar=grammar)

    def release(self, seq: Generation, keep: bool = False) -> None:
        """Take back a finished (or dropped) sequence's drafter for the next one. keep: hand its cache to the prefix
        cache (with one: `prefix_cache`), for a sequence that ended between rounds (finished or cancelled there);
        otherwise, and after a failure mid-round, the cache is dropped."""
        if keep and seq.target.prefix_cache is not None and seq.committed.numel():
            seq.target.hold(seq.prompt.input_ids, seq.decoded().token_ids)
            seq.target.park()
            if seq.drafter is not None:
                seq.drafter.park(seq.committed)
        seq.target.cache = None
        if seq.drafter is not None:
            seq.drafter.grammar = FREE
            self._forks.append(seq.drafter)
            seq.drafter = None

    def result(self, seq: Generation) -> GenerationResult:
        decoded = seq.decoded()
        with holding([self.target.model]):  # the tokenizer is shared with every pipeline on the model
            text = seq.stopper.text()
        return GenerationResult(token_ids=decoded.token_ids, text=text, finish_reason=decoded.finish_reason,
                                seconds=time.perf_counter() - seq.started, stats=decoded.stats,
                                ran=self.ran(seq.drafter))

    def ran(self, drafter: Drafter | None) -> Ran:
        """What a generation with `drafter` (None: plain decoding) runs: `GenerationResult.ran`."""
        info = drafter.describe() if drafter is not None else None
        target = self.target.model
        quant = getattr(target, "sparrow_quantization", None)
        drafts = [] if drafter is None else [getattr(m, "sparrow_quantization", None) for m in drafter.modules()
                                             if m is not target]
        tree = info.tree if info is not None else None
        return Ran(drafter=drafter.name if drafter is not None else "none",
                   dtype=str(next(target.parameters()).dtype).removeprefix("torch."),
                   quant=quant.format if quant is not None else None,
                   draft_quant=next((q.name for q in drafts if q is not None), None),
                   compiled=self.compiled, draft_compiled=self.draft_compiled and drafter is not None,
                   exact=self.exact, verifier=self.verifier if drafter is not None else "none",
                   tree=(tree.budget, tree.topk, tree.depth) if tree is not None else None,
                   draft_vocab=len(info.vocab) if info is not None and info.vocab is not None else None,
                   rounds_per_option=info.rounds_per_option if info is not None else None)

    def models(self) -> list[torch.nn.Module]:
        """Every module this pipeline runs: the target's and those its drafter declares (`Drafter.modules`)."""
        return [o for o in stateful_objects(self.target.model, self.drafter) if isinstance(o, torch.nn.Module)]


# --- compile --------------------------------------------------------------------------------------------


def _compile_draft_runner(drafter: Drafter | None) -> None:
    """Give each draft-model / quantized-self drafter (auto's too) a compiled runner over its draft (its reduced-head
    view, if any) unless the draft is w8a8; other drafters keep running their forwards eagerly."""
    log = logging.getLogger("sparrow")
    found = draft_model_drafters(drafter)
    for each in found:
        if traceable(each.draft.model):
            each.draft = runner_for(each.draft.model, compiled=True)
        else:  # e.g. `--draft-quant auto` chose w8a8 on this CPU
            log.info("compile: the w8a8 draft runs eagerly (torch.compile cannot trace fbgemm's packed weights)")
    if drafter is not None and not found:
        log.info("compile: drafter %r runs its own forwards eagerly (only draft-model and quantized-self drafts "
                 "are compiled)", drafter.name)


__all__ = ["Options", "Pipeline", "Request"]

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
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from sparrow.config import (
    SamplingConfig,
    StoppingConfig,
    check_max_new_tokens,
    check_seed,
    check_temperature,
    check_top_k,
    check_top_p,
)
from sparrow.decoding.baseline import plain_decode
from sparrow.decoding.engine import decode
from sparrow.decoding.round import Generation
from sparrow.drafters.base import Drafter
from sparrow.drafters.draft_model import draft_model_drafters
from sparrow.errors import UserError
from sparrow.grammar import FREE, Constraint, Grammars, GrammarSpec, guiding
from sparrow.locks import holding, stateful_objects
from sparrow.models import LoadedModel
from sparrow.noise import PositionalNoise
from sparrow.runtime.batch_invariant import is_exact
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.compiled import StaticCachedModel, traceable
from sparrow.runtime.prefix_cache import PrefixCache
from sparrow.runtime.runner import runner_for
from sparrow.stopping import OnText, Stopper
from sparrow.text import clean_text
from sparrow.types import GenerationResult, Prompt
from sparrow.verifiers import VERIFIERS, build_verifier
from sparrow.vision.prompt import encode_media

PromptInput = str | bytes | Sequence[int] | torch.Tensor  # text, UTF-8 bytes, or token ids


@dataclass(frozen=True)
class Request:
    """A validated generation request (the prompt already tokenized)."""

    prompt: Prompt
    sampling: SamplingConfig
    stopping: StoppingConfig
    seed: int | None
    grammar: GrammarSpec | None = None  # structured output (json_schema= / regex=); None: unconstrained


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

    def warm_up(self, prompt: PromptInput, chat: bool = False) -> None:
        """Compile every step size of the compiled runners (the target's, the draft models') at the cache capacity
        `prompt` allocates, so that no compile falls inside a timed generation; nothing to do where none is."""
        encoded = self.encode(prompt, chat=chat)
        runners = [self.runner] if self.compiled else []
        if self.draft_compiled:
            runners += [d.draft for d in draft_model_drafters(self.drafter)]
        for runner in runners:
            if isinstance(runner, StaticCachedModel):  # a w8a8 draft stays eager
                runner.warm_up(encoded)

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
        """Tokenize a prompt: text (a str; bytes are UTF-8, invalid UTF-8 becomes U+FFFD) or token ids; with
        video (file, frame dir, array) / image (file(s)), run the VLM's processor."""
        if isinstance(prompt, (str, bytes, bytearray)):
            prompt = clean_text(prompt, "prompt")
        if video is not None or image is not None or frames is not None:
            return encode_media(self.target.processor, prompt, video=video, frames=frames, image=image,
                                model_name=f"target {self.target.name!r}")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UserError("prompt must not be empty")
            if chat and self.tokenizer.chat_template:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                    return_dict=False)
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = token_ids(prompt, self.runner.vocab_size)
        return Prompt(input_ids=torch.tensor(ids, dtype=torch.long))

    def request(self, prompt: PromptInput, *, max_new_tokens: int = 128, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: str | Iterable[str] | None = (),
                chat: bool = False, video=None, frames: int | None = None, image=None, json_schema: object = None,
                regex: str | None = None) -> Request:
        """Check every option (each error names its argument), then tokenize the prompt.

        json_schema (a dict or its JSON text) / regex: structured output (`sparrow.grammar`): every output keeps
        to it, EOS only where it is complete (finish_reason "length" when max_new_tokens cuts it short)."""
        sampling = SamplingConfig(temperature=check_temperature(temperature), top_k=check_top_k(top_k),
                                  top_p=check_top_p(top_p))
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        stopping = StoppingConfig(max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids(),
                                  stop_strings=stop_strings(stop))
        seed = check_seed(seed)
        grammar = GrammarSpec.of(json_schema, regex)
        if not isinstance(chat, bool):
            raise UserError(f"chat must be True or False, got {chat!r}")
        encoded = self.encode(prompt, chat, video=video, frames=frames, image=image)
        context = self.runner.context_length
        n = encoded.input_ids.numel()
        if context is not None and n >= context:
            raise UserError(f"prompt is {n} tokens long, but the model's context is {context} tokens")
        if context is not None and n + max_new_tokens > context:
            raise UserError(f"max_new_tokens={max_new_tokens} with a {n}-token prompt exceeds the model's "
                             f"context of {context} tokens (at most {context - n} new tokens)")
        return Request(encoded, sampling, stopping, seed, grammar)

    def constraint(self, request: Request) -> Constraint:
        """The request's grammar state (compiled here: a bad schema or regex is a UserError), or FREE."""
        if request.grammar is None:
            return FREE
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.runner.vocab_size)
        return self._grammars.start(request.grammar, request.stopping.eos_token_ids)

    def generate(self, prompt: PromptInput, *, on_text: OnText | None = None, **options) -> GenerationResult:
        """Speculative generation (plain decoding when the pipeline has no drafter).

        on_text: streaming; called after each round with the new final text (`sparrow.stopping`); the pieces
        concatenated equal the result's text. Returning a finish reason from it ends the generation."""
        return self._run(prompt, options, self.drafter, on_text)

    OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "chat", "video", "frames", "image",
               "json_schema", "regex")

    def generate_plain(self, prompt: PromptInput, *, on_text: OnText | None = None, **options) -> GenerationResult:
        """Plain autoregressive decoding of the same target: the oracle and the baseline."""
        return self._run(prompt, options, None, on_text)

    def _run(self, prompt: PromptInput, options: dict[str, Any], drafter: Drafter | None,
             on_text: OnText | None = None) -> GenerationResult:
        self._check_options(options)
        # The locks cover tokenizing and detokenizing too: the tokenizer is shared with every pipeline on the model.
        with holding(stateful_objects(self.target.model, drafter)):
            gen = self._generation(self.request(prompt, **options), self.runner, drafter, on_text)
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
                                    finish_reason=decoded.finish_reason, seconds=seconds, stats=decoded.stats)

    def sequence(self, prompt: PromptInput, *, on_text: OnText | None = None, plain: bool = False,
                 **options) -> Generation:
        """A generation to run in a `sparrow.decoding.batch.Batch` (the same options as `generate`): its own cache over
        the target, and a copy of the drafter that shares its models (None with plain=True). Give it back with
        `release` once it finished; `result` turns it into a GenerationResult."""
        self._check_options(options)
        if self.compiled or self.draft_compiled:
            raise UserError("a compiled pipeline (compile=True, --compile) runs one generation at a time; batched "
                            "sequences (sparrow serve) need compile=False")
        with holding(stateful_objects(self.target.model, self.drafter)):
            request = self.request(prompt, **options)
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

    def _check_options(self, options: Mapping[str, Any]) -> None:
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise UserError(f"unknown option {unknown[0]!r}; expected one of: {', '.join(self.OPTIONS)}")

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
                                seconds=time.perf_counter() - seq.started, stats=decoded.stats)

    def models(self) -> list[torch.nn.Module]:
        """Every module this pipeline runs: the target's and those its drafter declares (`Drafter.modules`)."""
        return [o for o in stateful_objects(self.target.model, self.drafter) if isinstance(o, torch.nn.Module)]


# --- arguments ------------------------------------------------------------------------------------------


def token_ids(prompt: object, vocab_size: int) -> list[int]:
    """A token-id prompt as a list of ints in [0, vocab_size); anything else is refused, naming `prompt`."""
    if isinstance(prompt, torch.Tensor):
        if prompt.ndim != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise UserError(f"prompt as a tensor must be 1-D of integer token ids, got shape {tuple(prompt.shape)} "
                            f"{prompt.dtype}")
        ids = prompt.tolist()
    elif isinstance(prompt, (Mapping, set, frozenset)) or not isinstance(prompt, Iterable):
        raise UserError(f"prompt must be a str, UTF-8 bytes or a sequence of int token ids, got "
                        f"{type(prompt).__name__}")
    else:
        ids = list(prompt)
    if not ids:
        raise UserError("prompt must not be empty")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise UserError(f"prompt token ids must be ints, got {t!r} ({type(t).__name__}) at position {i}")
        if not 0 <= t < vocab_size:
            raise UserError(f"prompt token ids must lie in [0, {vocab_size}), got {t} at position {i}")
    return [int(t) for t in ids]


def stop_strings(stop: object) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings: None (none), one str, or an iterable of str. Invalid UTF-8
    (lone surrogates) becomes U+FFFD, as in prompts."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, bytearray, Mapping)) or not isinstance(stop, Iterable):
        raise UserError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    strings = []
    for s in stop:
        if not isinstance(s, str):
            raise UserError(f"stop must be a str or a list of str, got an item {s!r} ({type(s).__name__})")
        if not s:
            raise UserError("stop strings must not be empty")
        strings.append(clean_text(s, "stop"))
    return tuple(strings)


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


__all__ = ["Pipeline", "Request"]

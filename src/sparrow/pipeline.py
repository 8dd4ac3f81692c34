"""Pipeline: a loaded target (and drafter) that turns prompts into GenerationResults.

    pipe = sparrow.load("qwen2.5-coder-1.5b", drafter="draft-model", draft="qwen2.5-coder-0.5b")
    result = pipe.generate("def fib(n):", max_new_tokens=64)
    baseline = pipe.generate_plain("def fib(n):", max_new_tokens=64)

Threads: a generation holds the locks of the models and drafter it changes (`sparrow.locks`), so calls
on one pipeline, and on pipelines that share a model, run one after the other.

`PipelineCache` is what `sparrow.generate` keeps: a few pipelines, which share their loaded models.
"""

from __future__ import annotations

import gc
import logging
import numbers
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
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
from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.drafters.registry import REGISTRY, build_drafter, check_compile, check_drafter_args, check_quant_args
from sparrow.drafters.requirements import check_models
from sparrow.errors import UserError
from sparrow.grammar import FREE, Constraint, Grammars, GrammarSpec, guiding
from sparrow.locks import holding, stateful_objects
from sparrow.models import LoadedModel, load_model, resolve_device, resolve_dtype
from sparrow.models.quantization import (
    AUTO,
    draft_format,
    parse_quant,
    quantized_copy,
    resolve_draft_quant,
    target_format,
)
from sparrow.noise import PositionalNoise
from sparrow.policy.measure import follow_cost_curve
from sparrow.runtime.batch_invariant import exact_copy, is_exact, source
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.compiled import traceable
from sparrow.runtime.runner import runner_for
from sparrow.speculative_config import given_arguments, merged
from sparrow.stopping import OnText, Stopper
from sparrow.text import clean_text
from sparrow.types import GenerationResult, GenerationStats, Prompt
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
                 compiled: bool = False) -> None:
        """compiled: the target, and a draft-model / quantized-self drafter's draft, run on a static KV cache
        with torch.compile'd steps (`sparrow.runtime.compiled`); one generation at a time (no `sequence`)."""
        self.target = target
        self.compiled = compiled
        self.runner = runner_for(target.model, compiled)
        if compiled:
            _compile_draft_runner(drafter)
        self.drafter = drafter
        self.verifier = verifier
        self._forks: list[Drafter] = []  # idle copies of the drafter for batched sequences (`sequence`)
        self._grammars: Grammars | None = None  # structured output: made on the first request that asks for it
        if verifier not in ("auto", *VERIFIERS):
            raise UserError(f"unknown verifier {verifier!r}; expected one of: auto, {', '.join(VERIFIERS)}")

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
            return GenerationResult(token_ids=decoded.token_ids, text=gen.stopper.text(),
                                    finish_reason=decoded.finish_reason, seconds=seconds, stats=decoded.stats)

    def sequence(self, prompt: PromptInput, *, on_text: OnText | None = None, plain: bool = False,
                 **options) -> Generation:
        """A generation to run in a `sparrow.decoding.batch.Batch` (the same options as `generate`): its own cache over
        the target, and a copy of the drafter that shares its models (None with plain=True). Give it back with
        `release` once it finished; `result` turns it into a GenerationResult."""
        self._check_options(options)
        if self.compiled:
            raise UserError("a compiled pipeline (compile=True, --compile) runs one generation at a time; batched "
                            "sequences (sparrow serve) need compile=False")
        with holding(stateful_objects(self.target.model, self.drafter)):
            request = self.request(prompt, **options)
            drafter = None
            if self.drafter is not None and not plain:
                drafter = self._forks.pop() if self._forks else self.drafter.fork()
                if drafter.lazy_prefill is not None:  # in a batch, a draft nobody drafts with is never prefilled
                    drafter.lazy_prefill = True
            gen = self._generation(request, runner_for(self.target.model), drafter, on_text)
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

    def release(self, seq: Generation) -> None:
        """Take back a finished (or dropped) sequence's drafter for the next one."""
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


# --- loading --------------------------------------------------------------------------------------------


def _draft_spec(drafter: str, draft: str | LoadedModel | None, num_draft_tokens: int | None,
                quant: str | None, draft_quant: str | None, drafter_options: dict[str, Any],
                target: str | LoadedModel, device: str | None,
                dtype: str | torch.dtype) -> tuple[str | LoadedModel | None, str | None]:
    """Check the drafter and quantization arguments (before any model is loaded); returns the draft to load
    ("default" resolved to the drafter's own default; None when the drafter runs no draft model) and its weight
    format (draft_quant "auto": None without a draft model, quantized-self's format for the device the target is,
    or will be, on; it stays "auto" for a draft model until `_quantized` sees the loaded draft)."""
    entry = REGISTRY.get(drafter)  # None: "none"
    needs_draft = entry is not None and entry.takes_draft_model
    copy = entry is not None and entry.quantized_copy  # quantized-self: drafts with a quantized copy of the target
    where = next(target.model.parameters()).device if isinstance(target, LoadedModel) else device
    compute = None  # the copy computes in the target's dtype
    if copy:
        compute = (next(target.model.parameters()).dtype if isinstance(target, LoadedModel)
                   else resolve_dtype(dtype, where))
    draft_quant = resolve_draft_quant(draft_quant, copy, needs_draft, where, compute)
    if copy and draft_quant is not None:
        drafter_options.setdefault("bits", draft_quant)
    check_drafter_args(drafter, num_draft_tokens, drafter_options)
    if isinstance(draft, str) and draft == "default":  # the drafter's own default (none for self-drafters)
        draft = entry.default_draft if entry is not None else None
    check_quant_args(drafter, quant, draft_quant, needs_draft)
    return (draft if needs_draft else None), draft_quant


def load(target: str | LoadedModel = "qwen2.5-coder-1.5b", *, drafter: str = "draft-model",
         draft: str | LoadedModel | None = "default", num_draft_tokens: int | None = None,
         adaptive: bool = True, verifier: str = "auto", dtype: str = "auto", device: str | None = None,
         progress: bool = True, quant: str | None = None, draft_quant: str | None = None, compile: bool = False,
         speculative_config: Mapping[str, Any] | str | None = None, exact: bool | None = None,
         **drafter_options) -> Pipeline:
    """Load a target (and a draft model when the drafter needs or uses one) and build a Pipeline.

    draft: preset, path or hub id, a LoadedModel, None (no draft), or "default" (qwen2.5-coder-0.5b for
    draft-model / cross-vocab / auto; none for visual-prune, which then drafts with the pruned target).

    quant: int8 | int4 weight-only or w8a8 (CPU) target (lossless only relative to the quantized target); "auto":
    the format this machine measured fastest for a verification step (sparrow.runtime.hardware.choose_target_quant;
    dense
    where none pays; lossless then relative to the target in the format chosen); "none": dense.
    draft_quant: int8 | int4 | w8a8 draft model, or the format of the "quantized-self" copy (default int4);
    "auto": the format this machine measured fastest for one draft row (sparrow.runtime.hardware.choose_draft_quant;
    a dense draft where none pays, and for drafters without a draft model).
    compile: static KV cache and torch.compile'd decode / verify steps for the target and the draft of
    draft-model / quantized-self (`sparrow.runtime.compiled`; text LMs without sliding-window layers).
    speculative_config: vLLM's speculative config (a dict or its JSON text: method, model,
    num_speculative_tokens, ...; `sparrow.speculative_config`), applied over drafter / draft / num_draft_tokens.
    exact: batch-invariant verification (`sparrow.runtime.batch_invariant`): each verify row computed as plain decoding
    computes it, so greedy output equals plain decoding token for token in any dtype; None (default): on for a
    quantized target (quant=), off otherwise and with compile (torch.compile traces its own kernels).
    """
    drafter, draft, num_draft_tokens, drafter_options = with_speculative_config(
        speculative_config, drafter, draft, num_draft_tokens, drafter_options)
    if not isinstance(compile, bool):
        raise UserError(f"compile must be True or False, got {compile!r}")
    resolve_exact(exact, compile)  # refuses exact with compile before any model loads
    check_compile(drafter, compile)
    draft, draft_quant = _draft_spec(drafter, draft, num_draft_tokens, quant, draft_quant, drafter_options, target,
                                     device, dtype)
    quant = _target_quant(quant, drafter)
    check_models(drafter, drafter_options, target, draft, device=device, compile=compile, quant=quant,
                 draft_quant=draft_quant)  # what the models' configs say they cannot run, before loading them
    if isinstance(target, str):
        target = load_model(target, dtype=dtype, device=device, progress=progress)
    if isinstance(draft, str):
        draft = load_model(draft, dtype=dtype, device=device, progress=progress)
    quant = target_format(target.model, quant, compile)
    exact = resolve_exact(exact, compile, quant)
    target = _quantized(target, quant)
    draft = _quantized(draft, draft_quant, keep_dense=True) if draft is not None else None
    return _build(target, drafter, draft, num_draft_tokens, adaptive, verifier,
                  _quantized_run(quant, draft_quant, draft), drafter_options, compile, exact)


def resolve_exact(exact: bool | None, compiled: bool = False, quant: str | None = None) -> bool:
    """Whether the target runs batch-invariant forwards: `exact`, or by default (None) for a quantized target
    unless compiled (a dense target opts in: its cost was not measured <= 10 % yet, see docs/lossless.md).
    Refuses exact=True with compile=True before any model loads."""
    if exact is not None and not isinstance(exact, bool):
        raise UserError(f"exact must be True, False or None, got {exact!r}")
    if exact and compiled:
        raise UserError("exact=True (--exact) and compile=True (--compile) do not combine: torch.compile generates "
                         "its own kernels, which are not row-invariant; drop one")
    return (quant is not None and not compiled) if exact is None else exact


def with_speculative_config(config: Mapping[str, Any] | str | None, drafter: str, draft: Any,
                            num_draft_tokens: int | None, options: dict[str, Any]):
    """The Python API's drafter arguments with a speculative config applied (see sparrow.speculative_config)."""
    given = given_arguments(drafter, draft, num_draft_tokens, options)
    return merged(config, drafter=drafter, draft=draft, num_draft_tokens=num_draft_tokens, options=options,
                  given=given, python=True)


def _target_quant(quant: str | None, drafter: str) -> str | None:
    """--quant parsed ('none' -> None); 'auto' stays until `target_format` sees the loaded target, except for
    a drafter drafting with a quantized copy of a dense target (quantized-self)."""
    quant = parse_quant(quant, "quant", auto=True)
    entry = REGISTRY.get(drafter)
    return None if quant == AUTO and entry is not None and entry.quantized_copy else quant


def _quantized(loaded: LoadedModel, quant: str | None, keep_dense: bool = False) -> LoadedModel:
    """`loaded`, or its quantized copy (one per model and bits; keep_dense for drafts: a dense prefill, since
    a draft never changes the output); quant "auto" (drafts): see `draft_format`."""
    quant = draft_format(loaded.model, quant)
    return loaded if quant is None else quantized_copy(loaded, quant, keep_dense=keep_dense)


def _quantized_run(quant: str | None, draft_quant: str | None, draft: LoadedModel | None) -> bool:
    """Whether a quantized kernel runs (the target, the quantized-self copy or the draft model): k then follows
    the measured cost curve."""
    auto_quantized = draft is not None and getattr(draft.model, "sparrow_quantization", None) is not None
    return quant is not None or draft_quant not in (None, AUTO) or auto_quantized


def _build(target: LoadedModel, drafter: str, draft: LoadedModel | None, num_draft_tokens: int | None,
           adaptive: bool, verifier: str, quantized: bool, drafter_options: dict[str, Any],
           compiled: bool = False, exact: bool = False) -> Pipeline:
    """A Pipeline from loaded (and already quantized) models; exact: over the target's batch-invariant copy."""
    if exact:
        target = replace(target, model=exact_copy(target.model))
    built = build_drafter(drafter, target, draft, num_draft_tokens, adaptive, **drafter_options)
    if quantized:  # quantized kernels: k follows the measured cost curve
        follow_cost_curve(built, runner_for(target.model))
    return Pipeline(target, built, verifier, compiled)


def _compile_draft_runner(drafter: Drafter | None) -> None:
    """Give a draft-model / quantized-self drafter a compiled runner over its draft (its reduced-head view,
    if any) unless the draft is w8a8; other drafters keep running their forwards eagerly."""
    if isinstance(drafter, DraftModelDrafter) and traceable(drafter.draft.model):
        drafter.draft = runner_for(drafter.draft.model, compiled=True)
    elif isinstance(drafter, DraftModelDrafter):  # e.g. `--draft-quant auto` chose w8a8 on this CPU
        logging.getLogger("sparrow").info("compile: the w8a8 draft runs eagerly (torch.compile cannot trace "
                                          "fbgemm's packed weights); the target is compiled")
    elif drafter is not None:
        logging.getLogger("sparrow").info("compile: drafter %r runs its own forwards eagerly (only draft-model "
                                          "and quantized-self drafts are compiled)", drafter.name)


class PipelineCache:
    """The pipelines `sparrow.generate` keeps: the `size` most recently used (LRU; building a pipeline from
    loaded models takes milliseconds). Pipelines share their models: one LoadedModel per (model, dtype,
    device, quantization), so calls that differ only in drafter options (k, adaptive, the drafter) never load a model
    twice, and a model no kept pipeline runs is dropped. So at most `size` pipelines and the models they run
    are alive, whatever the calls. Thread-safe; loading happens under the cache's lock."""

    def __init__(self, size: int = 4) -> None:
        if size < 1:
            raise UserError(f"PipelineCache size must be >= 1, got {size}")
        self.size = size
        self._pipelines: OrderedDict[tuple, Pipeline] = OrderedDict()
        self._models: dict[tuple, LoadedModel] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pipelines)

    @property
    def num_models(self) -> int:
        """Loaded models held (each shared by every kept pipeline that runs it)."""
        return len(self._models)

    def clear(self) -> None:
        with self._lock:
            self._pipelines.clear()
            self._models.clear()
        gc.collect()

    def get(
        self,
        target: str | LoadedModel,
        *,
        drafter: str = "draft-model",
        draft: str | LoadedModel | None = "default",
        num_draft_tokens: int | None = None,
        adaptive: bool = True,
        dtype: str = "auto",
        device: str | None = None,
        quant: str | None = None,
        draft_quant: str | None = None,
        speculative_config: Mapping[str, Any] | str | None = None,
        exact: bool | None = None,
    ) -> Pipeline:
        drafter, draft, num_draft_tokens, options = with_speculative_config(speculative_config, drafter, draft,
                                                                            num_draft_tokens, {})
        draft, draft_quant = _draft_spec(drafter, draft, num_draft_tokens, quant, draft_quant, options, target,
                                         device, dtype)  # before loading
        quant = _target_quant(quant, drafter)
        check_models(drafter, options, target, draft, device=device, quant=quant, draft_quant=draft_quant)
        if quant == AUTO:  # the format this machine runs the target fastest in (its dense model loaded once)
            with self._lock:
                quant = target_format(self._model(target, dtype, device, None).model, AUTO)
        exact = resolve_exact(exact, quant=quant)
        key = (_key(target), drafter, _key(draft), num_draft_tokens, adaptive, resolve_dtype(dtype, device),
               resolve_device(device), quant, draft_quant, tuple(sorted((k, repr(v)) for k, v in options.items())),
               exact)
        with self._lock:
            pipe = self._pipelines.get(key)
            if pipe is not None:
                self._pipelines.move_to_end(key)
                return pipe
            try:
                target_model = self._model(target, dtype, device, quant)
                draft_model = (self._model(draft, dtype, device, draft_quant, keep_dense=True)
                               if draft is not None else None)
                pipe = _build(target_model, drafter, draft_model, num_draft_tokens, adaptive, "auto",
                              _quantized_run(quant, draft_quant, draft_model), options, exact=exact)
                self._pipelines[key] = pipe
                evicted = len(self._pipelines) > self.size
                if evicted:
                    self._pipelines.popitem(last=False)
            finally:
                self._drop_unused_models()
        if evicted:
            gc.collect()  # drafters hold reference cycles: free the evicted models now
        return pipe

    def _model(self, spec: str | LoadedModel, dtype: str, device: str | None, quant: str | None,
               keep_dense: bool = False) -> LoadedModel:
        """The model as the pipeline runs it (quantized if asked), loaded once while a kept pipeline runs it."""
        if isinstance(spec, LoadedModel):  # the caller's: not ours to keep (its quantized copy is shared anyway)
            return _quantized(spec, quant, keep_dense)
        dense = (spec, resolve_dtype(dtype, device), resolve_device(device), None, False)
        key = dense if quant is None else (*dense[:3], quant, keep_dense)
        if key not in self._models:  # a dense model only quantized from is dropped with the other unused ones
            if dense not in self._models:
                self._models[dense] = load_model(spec, dtype=dtype, device=device)
            self._models[key] = _quantized(self._models[dense], quant, keep_dense)
        return self._models[key]

    def _drop_unused_models(self) -> None:
        used = {id(n) for pipe in self._pipelines.values() for m in pipe.models() for n in (m, source(m))}
        for key in [k for k, m in self._models.items() if id(m.model) not in used]:
            del self._models[key]


def _key(spec: str | LoadedModel | None) -> object:
    return spec if not isinstance(spec, LoadedModel) else ("loaded", id(spec.model))


__all__ = ["Pipeline", "PipelineCache", "Request", "load", "build_drafter", "GenerationStats"]

"""Loading: model specs and drafter / quantization arguments -> a `sparrow.pipeline.Pipeline`.

    pipe = sparrow.load("qwen2.5-coder-1.5b", drafter="draft-model", draft="qwen2.5-coder-0.5b", quant="int8")

`load` checks every argument (the drafter's options, the weight formats, what the models' config.json say they
cannot run) before any model loads, then loads the target and the draft, quantizes them as asked and builds the
drafter. `PipelineCache` is what `sparrow.generate` keeps: a few pipelines, which share their loaded models.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from sparrow.drafters.registry import REGISTRY, build_drafter, check_compile, check_drafter_args, check_quant_args
from sparrow.drafters.requirements import check_models
from sparrow.errors import UserError
from sparrow.models import LoadedModel, load_model, resolve_device, resolve_dtype
from sparrow.models.gguf_native import load_gguf_model
from sparrow.models.quantization import (
    AUTO,
    GGUF,
    LONG,
    PREFILL,
    W8A8,
    draft_format,
    parse_quant,
    quantized_copy,
    resolve_draft_quant,
    target_format,
)
from sparrow.pipeline import Pipeline
from sparrow.policy.measure import follow_cost_curve
from sparrow.runtime.batch_invariant import exact_copy, source
from sparrow.runtime.compiled import row_invariant
from sparrow.runtime.prefix_cache import PrefixCache
from sparrow.runtime.runner import runner_for
from sparrow.speculative_config import given_arguments, merged


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
         prefix_cache: int = 0, **drafter_options) -> Pipeline:
    """Load a target (and a draft model when the drafter needs or uses one) and build a Pipeline.

    draft: preset, path or hub id, a LoadedModel, None (no draft), or "default" (qwen2.5-coder-0.5b for
    draft-model / cross-vocab / auto; none for visual-prune, which then drafts with the pruned target).

    quant: int8 | int4 weight-only or w8a8 (CPU) target (lossless only relative to the quantized target); "gguf"
    (CPU): the target's linear layers run on its GGUF file's own blocks (Q4_K / Q6_K / Q8_0, 8-bit activations;
    `sparrow.models.gguf_native`), loaded from the file without a float copy; "auto":
    the format this machine measured fastest for a verification step (sparrow.runtime.hardware.choose_target_quant;
    dense
    where none pays; lossless then relative to the target in the format chosen); "none": dense.
    draft_quant: int8 | int4 | w8a8 draft model, or the format of the "quantized-self" copy (default int4);
    "auto": the format this machine measured fastest for one draft row (sparrow.runtime.hardware.choose_draft_quant;
    a dense draft where none pays, and for drafters without a draft model).
    compile: static KV cache and torch.compile'd decode / verify steps for the target and the draft model of
    draft-model / quantized-self / auto (`sparrow.runtime.compiled`; text LMs without sliding-window layers). With
    exact=True and a dense target, or a w8a8 target (which torch.compile cannot trace), only the draft model
    compiles and the target runs eagerly (refused for a drafter without one); an int8 / int4 target compiles and
    stays exact on the CPU (its compiled rows are invariant).
    speculative_config: vLLM's speculative config (a dict or its JSON text: method, model,
    num_speculative_tokens, ...; `sparrow.speculative_config`), applied over drafter / draft / num_draft_tokens.
    exact: batch-invariant verification (`sparrow.runtime.batch_invariant`): each verify row computed as plain decoding
    computes it, so greedy output equals plain decoding token for token in any dtype; None (default): on for a
    quantized target (quant=), eager or compiled on the CPU (int8 / int4: `sparrow.runtime.compiled.row_invariant`),
    off otherwise (a dense compiled target: torch.compile's dense matmuls are not row-invariant).
    prefix_cache: keep the target's KV of up to this many tokens of earlier requests (LRU), so that a prompt that
    begins like one of them prefills only the rest (vLLM's automatic prefix caching; `sparrow.runtime.prefix_cache`);
    0 (default): off. A dynamic-cache text target only, with a drafter that reads no target hidden states.
    """
    drafter, draft, num_draft_tokens, drafter_options = with_speculative_config(
        speculative_config, drafter, draft, num_draft_tokens, drafter_options)
    if not isinstance(compile, bool):
        raise UserError(f"compile must be True or False, got {compile!r}")
    resolve_exact(exact)  # its value, before any model loads
    if prefix_cache:  # its value, before any model loads
        PrefixCache(prefix_cache)
    check_compile(drafter, compile)
    draft, draft_quant = _draft_spec(drafter, draft, num_draft_tokens, quant, draft_quant, drafter_options, target,
                                     device, dtype)
    quant = _target_quant(quant, drafter)
    check_draft_only_compile(drafter, draft, compile and not _target_compiles(compile, exact, quant), exact)
    check_models(drafter, drafter_options, target, draft, device=device, compile=compile, quant=quant,
                 draft_quant=draft_quant)  # what the models' configs say they cannot run, before loading them
    if isinstance(target, str):
        target = load_gguf_model(target, device=device, progress=progress) if quant == GGUF else \
            load_model(target, dtype=dtype, device=device, progress=progress)
    elif quant == GGUF and getattr(target.model, "sparrow_quantization", None) is None:
        raise UserError("quant='gguf' loads the target from its GGUF file: give a preset name or a .gguf path, "
                        "not a loaded model")
    if isinstance(draft, str):
        draft = load_model(draft, dtype=dtype, device=device, progress=progress)
    quant = target_format(target.model, quant, compile)
    target = _quantized(target, quant)
    compiled = _target_compiles(compile, exact, quant, target.model)
    exact = resolve_exact(exact, compiled, quant, target.model)
    check_draft_only_compile(drafter, draft, compile and not compiled, exact)  # again: "auto" may have chosen dense
    draft = _quantized(draft, draft_quant, LONG) if draft is not None else None
    return _build(target, drafter, draft, num_draft_tokens, adaptive, verifier,
                  _quantized_run(quant, draft_quant, draft), drafter_options, compiled, exact, prefix_cache,
                  compile_draft=compile)


def resolve_exact(exact: bool | None, compiled: bool = False, quant: str | None = None,
                  model: nn.Module | None = None) -> bool:
    """Whether the target runs batch-invariant forwards: `exact`, or by default (None) for a quantized target that
    runs eagerly or whose compiled steps keep their rows (`sparrow.runtime.compiled.row_invariant`: int8 / int4 on
    the CPU); a dense target opts in (its cost was not measured <= 10 % yet, see docs/lossless.md) and then runs
    eagerly (torch.compile's dense matmuls are not row-invariant)."""
    if exact is not None and not isinstance(exact, bool):
        raise UserError(f"exact must be True, False or None, got {exact!r}")
    if not compiled:
        return quant is not None if exact is None else exact
    invariant = model is not None and row_invariant(model)
    assert not (exact and not invariant), "an exact target whose compiled rows vary runs eagerly (`_target_compiles`)"
    return invariant if exact is None else exact


def _target_compiles(compile: bool, exact: bool | None, quant: str | None, model: nn.Module | None = None) -> bool:
    """Whether compile=True compiles the target itself: not a w8a8 one (torch.compile cannot trace fbgemm's packed
    weights), nor one that must stay exact (exact=True) unless its compiled rows are invariant (the loaded `model`;
    before loading, a quantized `quant` is taken to be); then only the draft model compiles."""
    if not compile or quant in (W8A8, GGUF):  # GGUF: its custom ops run eagerly (compiling them: not measured yet)
        return False
    return exact is not True or (row_invariant(model) if model is not None else quant is not None)


def check_draft_only_compile(drafter: str, draft: object, draft_only: bool, exact: bool | None) -> None:
    """Refuse, before loading, compile=True where only a draft model would compile and the drafter has none."""
    if draft_only and not (drafter in ("draft-model", "quantized-self") or (drafter == "auto" and draft is not None)):
        why = "exact=True (--exact) keeps a dense target eager" if exact else \
            "a w8a8 target runs eagerly (torch.compile cannot trace fbgemm's packed int8 weights)"
        raise UserError(f"compile=True (--compile) with {why}, so it compiles only a draft model, and drafter "
                        f"{drafter!r} drafts without one: drop --compile")


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


def _quantized(loaded: LoadedModel, quant: str | None, dense: str | None = PREFILL) -> LoadedModel:
    """`loaded`, or its quantized copy (one per model, bits and `dense`: PREFILL for a target, LONG for a draft,
    see `quantize_model`); quant "auto" (drafts): see `draft_format`."""
    quant = draft_format(loaded.model, quant)
    return loaded if quant in (None, GGUF) else quantized_copy(loaded, quant, dense=dense)


def _quantized_run(quant: str | None, draft_quant: str | None, draft: LoadedModel | None) -> bool:
    """Whether a quantized kernel runs (the target, the quantized-self copy or the draft model): k then follows
    the measured cost curve."""
    auto_quantized = draft is not None and getattr(draft.model, "sparrow_quantization", None) is not None
    return quant is not None or draft_quant not in (None, AUTO) or auto_quantized


def _build(target: LoadedModel, drafter: str, draft: LoadedModel | None, num_draft_tokens: int | None,
           adaptive: bool, verifier: str, quantized: bool, drafter_options: dict[str, Any],
           compiled: bool = False, exact: bool = False, prefix_cache: int = 0,
           compile_draft: bool | None = None) -> Pipeline:
    """A Pipeline from loaded (and already quantized) models; exact: over the target's batch-invariant copy."""
    if exact:
        target = replace(target, model=exact_copy(target.model))
    built = build_drafter(drafter, target, draft, num_draft_tokens, adaptive, **drafter_options)
    if quantized:  # quantized kernels: k follows the measured cost curve
        follow_cost_curve(built, runner_for(target.model))
    return Pipeline(target, built, verifier, compiled, prefix_cache, compile_draft)


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
                draft_model = (self._model(draft, dtype, device, draft_quant, LONG)
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
               dense_use: str | None = PREFILL) -> LoadedModel:
        """The model as the pipeline runs it (quantized if asked), loaded once while a kept pipeline runs it."""
        if isinstance(spec, LoadedModel):  # the caller's: not ours to keep (its quantized copy is shared anyway)
            return _quantized(spec, quant, dense_use)
        dense = (spec, resolve_dtype(dtype, device), resolve_device(device), None, False)
        key = dense if quant is None else (*dense[:3], quant, dense_use)
        if key not in self._models and quant == GGUF:  # loaded from the file's blocks, never from a dense model
            self._models[key] = load_gguf_model(spec, device=device, progress=False)
        if key not in self._models:  # a dense model only quantized from is dropped with the other unused ones
            if dense not in self._models:
                self._models[dense] = load_model(spec, dtype=dtype, device=device)
            self._models[key] = _quantized(self._models[dense], quant, dense_use)
        return self._models[key]

    def _drop_unused_models(self) -> None:
        used = {id(n) for pipe in self._pipelines.values() for m in pipe.models() for n in (m, source(m))}
        for key in [k for k, m in self._models.items() if id(m.model) not in used]:
            del self._models[key]


def _key(spec: str | LoadedModel | None) -> object:
    return spec if not isinstance(spec, LoadedModel) else ("loaded", id(spec.model))


__all__ = ["PipelineCache", "load"]

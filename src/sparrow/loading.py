"""Loading: a plan (`sparrow.drafters.plan.SpecPlan`) -> a `sparrow.pipeline.Pipeline`.

    pipe = sparrow.load("qwen2.5-coder-1.5b", drafter="draft-model", draft="qwen2.5-coder-0.5b", quant="int8")
    pipe = sparrow.load(resolve_plan("qwen2.5-coder-1.5b", drafter="prompt-lookup"))

`load` takes a plan, or the arguments `resolve_plan` checks and makes one of before any model loads; it then loads
the target and the draft, settles what needs them (the format "auto" picks, whether a compiled target stays exact),
quantizes them as asked and builds the drafter. `PipelineCache` is what `sparrow.generate` keeps: a few pipelines
of the same plans, which share their loaded models.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any

from sparrow.drafters.plan import SpecPlan, resolve_plan, settle
from sparrow.drafters.registry import build_drafter
from sparrow.errors import UserError
from sparrow.models import LoadedModel, load_model, resolve_device, resolve_dtype
from sparrow.models.gguf_native import load_gguf_model
from sparrow.models.quantization import (
    AUTO,
    GGUF,
    LONG,
    PREFILL,
    draft_format,
    quantized_copy,
    target_format,
)
from sparrow.pipeline import Pipeline
from sparrow.policy.measure import follow_cost_curve
from sparrow.runtime.batch_invariant import exact_copy, source
from sparrow.runtime.runner import runner_for


def load(target: str | LoadedModel | SpecPlan = "qwen2.5-coder-1.5b", *, progress: bool = True,
         **arguments: Any) -> Pipeline:
    """Load the models of a plan (`sparrow.drafters.plan.SpecPlan`, or the arguments `resolve_plan` makes one of)
    and build its Pipeline:

        load(resolve_plan("qwen2.5-coder-1.5b", drafter="prompt-lookup"))
        load("qwen2.5-coder-1.5b", drafter="prompt-lookup")       # the same

    Arguments (every one checked before any model loads), beside the drafter's own options:

    drafter: a registered drafter or "none"; num_draft_tokens: k (None: the drafter's default); adaptive: adapt the
    draft length online (else draft exactly k); verifier: auto | greedy | rejection | loose (LOSSY); dtype, device.

    draft: preset, path or hub id, a LoadedModel, None (no draft), or "default" (qwen2.5-coder-0.5b for
    draft-model / cross-vocab / auto; none for visual-prune, which then drafts with the pruned target).

    quant: int8 | int4 weight-only or w8a8 (CPU) target (lossless only relative to the quantized target); "gguf"
    (CPU): a preset or .gguf target on its file's own blocks; "auto": the format this machine measured fastest for a
    verification step (sparrow.runtime.hardware.choose_target_quant; the file's blocks among them for a target that
    runs on them, sparrow.models.gguf_source; dense where none pays; lossless then relative to the target in the
    format chosen); "none": dense.
    draft_quant: int8 | int4 | w8a8 draft model, or the format of the "quantized-self" copy (default int4); "gguf": a
    draft model (a preset or a .gguf file) on its GGUF file's own blocks (CPU; `sparrow.models.gguf_native`);
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
    plan = as_plan(target, arguments)
    loaded = {}
    for role, spec, fmt in (("target", plan.target, plan.quant), ("draft", plan.draft, plan.draft_quant)):
        if isinstance(spec, str) and fmt == GGUF:  # the file's own blocks, no float copy
            loaded[role] = load_gguf_model(spec, device=plan.device, progress=progress)
        else:
            loaded[role] = (load_model(spec, dtype=plan.dtype, device=plan.device, progress=progress)
                            if isinstance(spec, str) else spec)

    def target_in(quant: str | None) -> LoadedModel:
        return _quantized(loaded["target"], quant)

    def draft_in(quant: str | None) -> LoadedModel:
        return _quantized(loaded["draft"], quant, LONG)

    return _assemble(plan, target_in, draft_in)


def as_plan(target: str | LoadedModel | SpecPlan, arguments: Mapping[str, Any]) -> SpecPlan:
    """`target` if it is a plan (then no other argument is taken), else the plan `resolve_plan` makes of them."""
    if not isinstance(target, SpecPlan):
        return resolve_plan(target, **arguments)
    if arguments:
        raise UserError(f"a SpecPlan carries every argument: drop {', '.join(map(repr, arguments))}")
    return target


def _assemble(plan: SpecPlan, target_in: Callable[[str | None], LoadedModel],
              draft_in: Callable[[str | None], LoadedModel]) -> Pipeline:
    """The Pipeline of `plan` over its models in the formats they run in (`target_in(format)`, `draft_in(format)`:
    the loaded model, quantized as asked; None: dense); quant "auto" settled on the dense target."""
    quant = target_format(target_in(None).model, AUTO, plan.compile) if plan.quant == AUTO else plan.quant
    target = target_in(quant)
    compiled, exact = settle(plan, quant, target.model)
    draft = draft_in(plan.draft_quant) if plan.draft is not None else None
    if exact:
        target = replace(target, model=exact_copy(target.model))
    built = build_drafter(plan.drafter, target, draft, plan.num_draft_tokens, plan.adaptive, **plan.drafter_options)
    if _quantized_run(quant, plan.draft_quant, draft):  # quantized kernels: k follows the measured cost curve
        follow_cost_curve(built, runner_for(target.model))
    return Pipeline(target, built, plan.verifier, compiled, plan.prefix_cache, compile_draft=plan.compile)


def _quantized(loaded: LoadedModel, quant: str | None, dense: str | None = PREFILL) -> LoadedModel:
    """`loaded`, or its quantized copy (one per model, bits and `dense`: PREFILL for a target, LONG for a draft,
    see `quantize_model`); quant "auto" (drafts): see `draft_format`."""
    quant = draft_format(loaded.model, quant)
    if quant == GGUF:
        if getattr(loaded.model, "sparrow_quantization", None) is None or \
                loaded.model.sparrow_quantization.format != GGUF:
            raise UserError(f"gguf weights are loaded from a GGUF file: give {loaded.name!r} as a preset name or a "
                            ".gguf path, not as a loaded model")
        return loaded
    return loaded if quant is None else quantized_copy(loaded, quant, dense=dense)


def _quantized_run(quant: str | None, draft_quant: str | None, draft: LoadedModel | None) -> bool:
    """Whether a quantized kernel runs (the target, the quantized-self copy or the draft model): k then follows
    the measured cost curve."""
    auto_quantized = draft is not None and getattr(draft.model, "sparrow_quantization", None) is not None
    return quant is not None or draft_quant not in (None, AUTO) or auto_quantized


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

    def get(self, target: str | LoadedModel | SpecPlan, **arguments: Any) -> Pipeline:
        """The pipeline of a plan (`sparrow.drafters.plan.SpecPlan`, or `sparrow.load`'s arguments, which
        `resolve_plan` makes one of), built once while kept."""
        plan = as_plan(target, arguments)
        if plan.quant == AUTO:  # the format this machine runs the target fastest in (its dense model loaded once)
            with self._lock:
                plan = replace(plan, quant=target_format(self._dense(plan).model, AUTO, plan.compile))
        key = (_key(plan.target), _key(plan.draft), resolve_dtype(plan.dtype, plan.device),
               resolve_device(plan.device), *(repr(v) if k == "options" else v for k, v in _fields(plan)))
        with self._lock:
            pipe = self._pipelines.get(key)
            if pipe is not None:
                self._pipelines.move_to_end(key)
                return pipe
            try:
                pipe = _assemble(plan, lambda quant: self._model(plan.target, plan.dtype, plan.device, quant),
                                 lambda quant: self._model(plan.draft, plan.dtype, plan.device, quant, LONG))
                self._pipelines[key] = pipe
                evicted = len(self._pipelines) > self.size
                if evicted:
                    self._pipelines.popitem(last=False)
            finally:
                self._drop_unused_models()
        if evicted:
            gc.collect()  # drafters hold reference cycles: free the evicted models now
        return pipe

    def _dense(self, plan: SpecPlan) -> LoadedModel:
        return self._model(plan.target, plan.dtype, plan.device, None)

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


def _fields(plan: SpecPlan) -> list[tuple[str, Any]]:
    """The plan's fields that are neither a model (`_key`) nor the dtype and device (resolved in the key)."""
    skip = ("target", "draft", "dtype", "device")
    return [(f.name, getattr(plan, f.name)) for f in fields(plan) if f.name not in skip]


__all__ = ["PipelineCache", "load"]

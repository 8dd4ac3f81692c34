"""The speculative plan: what a pipeline is built from, resolved once and checked before any model loads.

    plan = resolve_plan("qwen2.5-coder-1.5b", drafter="draft-model", quant="int8")
    pipe = sparrow.load(plan)          # sparrow.load("qwen2.5-coder-1.5b", drafter=..., quant=...) does both

`resolve_plan` is the one resolver: `sparrow.load` and `PipelineCache.get` (what `sparrow.generate` and the Python
API use), `sparrow generate` / `serve` / `bench` (their flags, `flags=True`) and vLLM's speculative config
(`with_speculative_config`, the one translation of it) all come through it. It refuses, in one line, whatever the
registry's facts (`sparrow.drafters.registry`) or the models' config.json (`sparrow.drafters.requirements`) rule
out: an unknown drafter, k, an option the drafter does not take, a weight format the drafter or the device cannot
run, compile for a drafter that cannot run on a compiled target. What needs a loaded model (the format "auto"
picks, whether a compiled target stays exact) is settled by `sparrow.loading` from the plan; "auto" choosing the
target's GGUF file's own blocks, which replace the dense model, is settled here (`sparrow.models.gguf_source`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparrow.drafters.registry import (
    NONE,
    REGISTRY,
    check_applies,
    check_compile,
    check_drafter_args,
    check_quant_args,
    drafter_names,
)
from sparrow.drafters.requirements import check_models
from sparrow.errors import UserError
from sparrow.models import LoadedModel, resolve_dtype
from sparrow.models.gguf_source import gguf_file, settle_gguf, settle_gguf_draft
from sparrow.models.quantization import AUTO, GGUF, W8A8, parse_quant, resolve_draft_quant
from sparrow.runtime.compiled import row_invariant
from sparrow.runtime.prefix_cache import PrefixCache
from sparrow.speculative_config import given_arguments, merged, parse
from sparrow.verifiers import VERIFIERS

ModelSpec = str | LoadedModel  # a preset, path or hub id, or a loaded model
FLAGS = {"head": ("--head", "head"), "draft_device": ("--draft-device", "draft_device"),
         "draft_vocab": ("--draft-vocab", "draft_vocab"), "drop_rate": ("--drop-rate", "drop_rate"),
         **dict.fromkeys(("draft_kv", "draft_kv_budget", "retrieve_every"),
                         ("--draft-kv/--draft-kv-budget/--retrieve-every", "draft_kv"))}
"""Drafter options a command-line flag of its own sets: (the flag, the option whose takers it applies to)."""


@dataclass(frozen=True)
class SpecPlan:
    """Everything a pipeline is built from, as `resolve_plan` resolved and checked it (make plans with it)."""

    target: ModelSpec
    drafter: str  # a registered drafter, or "none" (plain decoding)
    draft: ModelSpec | None  # the draft model the drafter runs ("default" resolved); None: it runs none
    num_draft_tokens: int | None  # None: the drafter's default
    adaptive: bool
    options: tuple[tuple[str, Any], ...]  # the drafter builder's keyword options, by name
    dtype: str
    device: str | None
    quant: str | None  # the target's format: None (dense), int8 | int4 | w8a8 | gguf, or "auto" (settled once loaded)
    draft_quant: str | None  # the draft model's (or quantized-self copy's): as quant; "auto" for a draft model
    compile: bool
    exact: bool | None  # None: on for a quantized target that keeps its rows (settled once loaded)
    verifier: str
    prefix_cache: int  # tokens of earlier requests' KV kept; 0: off

    @property
    def drafter_options(self) -> dict[str, Any]:
        return dict(self.options)


def resolve_plan(target: ModelSpec = "qwen2.5-coder-1.5b", *, drafter: str = "draft-model",
                 draft: ModelSpec | None = "default", num_draft_tokens: int | None = None, adaptive: bool = True,
                 verifier: str = "auto", dtype: str = "auto", device: str | None = None, quant: str | None = None,
                 draft_quant: str | None = None, compile: bool = False, exact: bool | None = None,
                 prefix_cache: int = 0, speculative_config: Mapping[str, Any] | str | None = None,
                 given: Iterable[str] | None = None, flags: bool = False, **options: Any) -> SpecPlan:
    """The plan `sparrow.load`'s arguments (see its docstring) describe, every one checked before any model loads.

    given: which of drafter / draft / num_draft_tokens the caller set explicitly, for the speculative config to
    contradict (None: those that differ from the defaults, as the Python API's). flags: errors name the command
    line's flags (`--drafter`, `--draft-vocab`) rather than the arguments (`drafter=`)."""
    drafter, draft, num_draft_tokens, options = with_speculative_config(
        speculative_config, drafter=drafter, draft=draft, num_draft_tokens=num_draft_tokens, options=options,
        given=given, flags=flags)
    if not isinstance(compile, bool):
        raise UserError(f"compile must be True or False, got {compile!r}")
    if exact is not None and not isinstance(exact, bool):
        raise UserError(f"exact must be True, False or None, got {exact!r}")
    if verifier not in ("auto", *VERIFIERS):
        raise UserError(f"unknown verifier {verifier!r}; expected one of: auto, {', '.join(VERIFIERS)}")
    if prefix_cache:
        PrefixCache(prefix_cache)  # its value
    if flags and drafter in drafter_names():
        for option in options:
            if option in FLAGS:
                check_applies(drafter, *FLAGS[option])
    check_compile(drafter, compile)
    draft, draft_quant = _draft_spec(drafter, draft, num_draft_tokens, quant, draft_quant, options, target,
                                     device, dtype)
    quant = _target_quant(quant, drafter, target, device, dtype)
    check_draft_only_compile(drafter, draft, compile and not target_compiles(compile, exact, quant), exact)
    check_models(drafter, options, target, draft, device=device, compile=compile, quant=quant,
                 draft_quant=draft_quant)  # what the models' configs say they cannot run, before loading them
    return SpecPlan(target, drafter, draft, num_draft_tokens, adaptive, tuple(sorted(options.items())), dtype,
                    device, quant, draft_quant, compile, exact, verifier, prefix_cache)


def with_speculative_config(config: Mapping[str, Any] | str | None, *, drafter: str, draft: Any,
                            num_draft_tokens: int | None, options: Mapping[str, Any],
                            given: Iterable[str] | None = None,
                            flags: bool = False) -> tuple[str, Any, int | None, dict[str, Any]]:
    """(drafter, draft, num_draft_tokens, drafter options) with vLLM's speculative config applied over them
    (`sparrow.speculative_config`); a key that contradicts an argument the caller set (`given`, and every option) is
    refused naming both."""
    if config is None:
        return drafter, draft, num_draft_tokens, dict(options)
    if flags and isinstance(config, str):
        config = parse(config)  # its errors name --speculative-config
    chosen = (given_arguments(drafter, draft, num_draft_tokens, options) if given is None
              else frozenset(given) | set(options))
    return merged(config, drafter=drafter, draft=draft, num_draft_tokens=num_draft_tokens, options=options,
                  given=chosen, python=not flags)


def _draft_spec(drafter: str, draft: ModelSpec | None, num_draft_tokens: int | None, quant: str | None,
                draft_quant: str | None, options: dict[str, Any], target: ModelSpec, device: str | None,
                dtype: str | torch.dtype) -> tuple[ModelSpec | None, str | None]:
    """Check the drafter and quantization arguments; returns the draft to load ("default" resolved to the
    drafter's own default; None when the drafter runs no draft model) and its weight format (draft_quant "auto":
    None without a draft model, quantized-self's format for the device the target is, or will be, on; for a draft
    model "gguf" where the measurement runs its GGUF file's blocks fastest (`settle_gguf_draft`), else it stays
    "auto" until `sparrow.loading` sees the loaded draft)."""
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
        options.setdefault("bits", draft_quant)
    check_drafter_args(drafter, num_draft_tokens, options)
    if isinstance(draft, str) and draft == "default":  # the drafter's own default (none for self-drafters)
        draft = entry.default_draft if entry is not None else None
    check_quant_args(drafter, quant, draft_quant, needs_draft)
    if needs_draft:  # "auto": the draft's GGUF blocks where they ran one row fastest (loaded instead of a dense draft)
        draft_quant = settle_gguf_draft(draft_quant, draft, where, dtype)
    if draft_quant == GGUF and needs_draft and isinstance(draft, str) and not gguf_file(draft):
        raise UserError(f"draft_quant='gguf' runs the draft model on its GGUF file's own blocks: {draft!r} is neither "
                        "a preset nor a .gguf file")
    return (draft if needs_draft else None), draft_quant


def _target_quant(quant: str | None, drafter: str, target: ModelSpec, device: str | None,
                  dtype: str | torch.dtype) -> str | None:
    """--quant parsed ('none' -> None); 'auto' stays until the loaded target settles it, except for a drafter
    drafting with a quantized copy of a dense target (quantized-self: dense), and where the measurement picks the
    target's GGUF file's own blocks, which are loaded instead of the dense model (`settle_gguf`: "gguf")."""
    quant = parse_quant(quant, "quant", auto=True)
    entry = REGISTRY.get(drafter)
    if quant == AUTO and entry is not None and entry.quantized_copy:
        return None
    return settle_gguf(quant, target, device, dtype)


def target_compiles(compile: bool, exact: bool | None, quant: str | None, model: nn.Module | None = None) -> bool:
    """Whether compile=True compiles the target itself: not a w8a8 one (torch.compile cannot trace fbgemm's packed
    weights), nor one that must stay exact (exact=True) unless its compiled rows are invariant (the loaded `model`;
    before loading, a quantized `quant` is taken to be: int8 / int4, and GGUF blocks, whose kernels are
    batch-invariant by construction); then only the draft model compiles."""
    if not compile or quant == W8A8:
        return False
    return exact is not True or (row_invariant(model) if model is not None else quant is not None)


def settle(plan: SpecPlan, quant: str | None, model: nn.Module) -> tuple[bool, bool]:
    """(compiled, exact) for the plan's target loaded in the format `quant` (the plan's, "auto" settled): refusing
    again where only a draft model would compile and the drafter has none ("auto" may have chosen a dense target)."""
    compiled = target_compiles(plan.compile, plan.exact, quant, model)
    exact = resolve_exact(plan.exact, compiled, quant, model)
    check_draft_only_compile(plan.drafter, plan.draft, plan.compile and not compiled, exact)
    return compiled, exact


def resolve_exact(exact: bool | None, compiled: bool = False, quant: str | None = None,
                  model: nn.Module | None = None) -> bool:
    """Whether the target runs batch-invariant forwards: `exact`, or by default (None) for a quantized target that
    runs eagerly or whose compiled steps keep their rows (`sparrow.runtime.compiled.row_invariant`: int8 / int4 on
    the CPU); a dense target opts in (its cost was not measured <= 10 % yet, see docs/lossless.md) and then runs
    eagerly (torch.compile's dense matmuls are not row-invariant)."""
    if not compiled:
        return quant is not None if exact is None else exact
    invariant = model is not None and row_invariant(model)
    assert not (exact and not invariant), "an exact target whose compiled rows vary runs eagerly (`target_compiles`)"
    return invariant if exact is None else exact


def check_draft_only_compile(drafter: str, draft: object, draft_only: bool, exact: bool | None) -> None:
    """Refuse compile=True where only a draft model would compile (`draft_only`) and the drafter compiles none: the
    registry says which drafters compile their own model (`compiles_draft`), a draft model or a quantized copy."""
    entry = REGISTRY.get(drafter) if drafter != NONE else None
    compiles = entry is not None and entry.compiles_draft and (draft is not None or entry.quantized_copy)
    if draft_only and not compiles:
        why = "exact=True (--exact) keeps a dense target eager" if exact else \
            "a w8a8 target runs eagerly (torch.compile cannot trace fbgemm's packed int8 weights)"
        raise UserError(f"compile=True (--compile) with {why}, so it compiles only a draft model, and drafter "
                        f"{drafter!r} drafts without one: drop --compile")


__all__ = ["SpecPlan", "check_draft_only_compile", "resolve_exact", "resolve_plan", "settle", "target_compiles",
           "with_speculative_config"]

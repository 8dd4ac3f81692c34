"""Drafters propose tokens for the target to verify. Registry by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sparrow.cached_model import CachedModel
from sparrow.config import SamplingConfig
from sparrow.drafters import auto, cross_vocab
from sparrow.drafters.base import Drafter
from sparrow.drafters import sparse
from sparrow.drafters import visual_prune
from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.drafters.layer_skip import build_layer_skip
from sparrow.drafters.length import DraftLength
from sparrow.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from sparrow.drafters.quantized_self import build_quantized_self
from sparrow.models import LoadedModel


@dataclass(frozen=True)
class DrafterEntry:
    """How to build a drafter by name; `build(target, draft, num_draft_tokens, adaptive, **options)`."""

    build: Callable[..., Drafter]
    default_num_draft_tokens: int | None  # None: the builder picks (layer-skip: the k its set was tuned for)
    needs_draft_model: bool = False
    uses_draft_model: bool = False  # optional: used when one is given ("auto")
    default_draft: str | None = None  # the draft model `sparrow.load(draft="default")` picks


def _draft_model(target: LoadedModel, draft: LoadedModel, num_draft_tokens: int, adaptive: bool) -> Drafter:
    return DraftModelDrafter(CachedModel(draft.model), CachedModel(target.model).vocab_size,
                             num_draft_tokens=num_draft_tokens, adaptive=adaptive)


def _prompt_lookup(target: LoadedModel, draft: None, num_draft_tokens: int, adaptive: bool) -> Drafter:
    return PromptLookupDrafter(num_draft_tokens=num_draft_tokens, adaptive=adaptive)


REGISTRY: dict[str, DrafterEntry] = {
    "draft-model": DrafterEntry(_draft_model, default_num_draft_tokens=8, needs_draft_model=True, default_draft="qwen2.5-coder-0.5b"),
    "prompt-lookup": DrafterEntry(_prompt_lookup, default_num_draft_tokens=16),
    "quantized-self": DrafterEntry(build_quantized_self, default_num_draft_tokens=8),
    "cross-vocab": DrafterEntry(cross_vocab.build, default_num_draft_tokens=8, needs_draft_model=True, default_draft="qwen2.5-coder-0.5b"),
    "auto": DrafterEntry(auto.build, default_num_draft_tokens=16, uses_draft_model=True, default_draft="qwen2.5-coder-0.5b"),
    "sparse": DrafterEntry(sparse.build, default_num_draft_tokens=8),
    "visual-prune": DrafterEntry(visual_prune.build, default_num_draft_tokens=8, uses_draft_model=True),
    "layer-skip": DrafterEntry(build_layer_skip, default_num_draft_tokens=None),
}
DRAFTERS = (*REGISTRY, "none")  # "none" = plain decoding


def check_drafter_args(name: str, num_draft_tokens: int | None) -> None:
    """Cheap validation, run before any model is loaded."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; expected one of: {', '.join(DRAFTERS)}")
    if num_draft_tokens is not None and (isinstance(num_draft_tokens, bool) or num_draft_tokens < 1):
        raise ValueError(f"k (num_draft_tokens) must be an integer >= 1, got {num_draft_tokens!r}")


def build_drafter(name: str, target: LoadedModel, draft: LoadedModel | None = None,
                  num_draft_tokens: int | None = None, adaptive: bool = False, **options: Any) -> Drafter | None:
    """The drafter registered as `name` (None for "none")."""
    check_drafter_args(name, num_draft_tokens)
    if name == "none":
        return None
    entry = REGISTRY[name]
    if entry.needs_draft_model and draft is None:
        raise ValueError(f"drafter {name!r} needs a draft model (--draft / draft=)")
    k = entry.default_num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    return entry.build(target, draft if entry.needs_draft_model or entry.uses_draft_model else None, k, adaptive,
                       **options)

__all__ = ["Drafter", "DRAFTERS", "REGISTRY", "DrafterEntry", "build_drafter", "check_drafter_args", "DraftModelDrafter", "PromptLookupDrafter", "DraftLength", "find_continuation"]

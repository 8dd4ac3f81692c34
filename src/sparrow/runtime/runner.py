"""`runner_for(model)`: the CachedModel that runs `model` with its real prefill and position scheme.

A text LM gets a plain `CachedModel`; a VLM gets the subclass from `sparrow.runtime.vision` that moves its
visual inputs at prefill (and, for M-RoPE models such as Qwen2.5-VL, passes the model's 3-D positions).
Everything that runs a user's model (pipeline, drafters, tuning) builds its wrapper here.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.compiled import StaticCachedModel
from sparrow.runtime.vision import cached_model_class


def runner_for(model: PreTrainedModel, compiled: bool = False) -> CachedModel:
    """A fresh CachedModel (or VLM subclass) around `model`, with an empty cache. compiled: a
    `sparrow.runtime.compiled.StaticCachedModel` instead (static KV cache, torch.compile'd steps; text LMs without
    sliding-window layers only, else a UserError)."""
    if compiled:
        return StaticCachedModel(model)
    return cached_model_class(model)(model)

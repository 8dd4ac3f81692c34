"""Record the post-RoPE queries a model's prefill computes, without changing its numerics.

A running `QueryCapture` routes the attention of its model's decoder layers from transformers' "sdpa" (or
sparrow's "sparrow_sdpa", `sparrow.runtime.attention.decode`, or "sparrow_rowwise", `sparrow.runtime.attention.rowwise`,
which
w8a8 copies and exact verification use) to "sparrow_capture" (registered with
`transformers.AttentionInterface`, and its mask with the sdpa mask function): it calls the very function the
layer's config named before, with the very same arguments, so outputs are bit-identical. Every forward that
starts from an empty cache (query length == key length: a prefill) also stores, per layer, a copy of the
queries of its last `window` positions and the attention scale. Scores are then computed from these queries
against the keys in the cache (see drafters/kv_selection.py); nothing is re-run through the model.

A capture runs only inside `with capture:` (or between `start()` and `stop()`). Starting switches the
attention config(s) of the decoder layers, and nothing else (a VLM's vision tower keeps its own
implementation); the last capture to stop on a config restores exactly the implementation it had.
No hooks are installed. Drafters that read the target's prefill queries (sparse, visual-prune) hand
the engine their capture as `watch_prefill(target)` (drafters/base.py), and the engine runs the
target's prefill inside it: the user's model is switched for the duration of that one forward only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from sparrow.errors import UserError
from sparrow.runtime.attention import rowwise as rowwise_attention
from sparrow.runtime.attention.decode import SDPA
from sparrow.runtime.attention.layers import attention_configs, decoder_layers
from sparrow.runtime.cached_model import prefill_module

IMPLEMENTATION = "sparrow_capture"
CAPTURABLE = (*SDPA, rowwise_attention.NAME)  # implementations with sdpa's mask format, called as they are
_ACTIVE: set[QueryCapture] = set()  # started, not yet stopped
_SWITCHED: dict[int, tuple[Any, Any, int]] = {}  # id(config) -> (config, implementation before, captures on it)


@dataclass(frozen=True)
class CapturedQueries:
    """One layer's prefill queries."""

    queries: Tensor  # [heads, w, d] post-RoPE queries of the last w positions
    scaling: float
    length: int  # number of positions the prefill forward covered (n)


def _capture_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
    """sdpa, plus the active captures' `observe` side effect (query [1, heads, q, d], key/value the layer's
    cached [1, kv_heads, n, d], which an observer may rewrite in place before attention reads them)."""
    if _ACTIVE:
        for capture in list(_ACTIVE):
            if id(module) in capture.module_ids:
                capture.observe(module, query, key, value, kwargs.get("scaling"))
    switched = _SWITCHED.get(id(getattr(module, "config", None)))
    replaced = switched[1] if switched is not None and switched[1] in CAPTURABLE else "sdpa"  # what it replaced
    return ALL_ATTENTION_FUNCTIONS[replaced](module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Make "sparrow_capture" known to transformers (idempotent: registering again changes nothing)."""
    AttentionInterface.register(IMPLEMENTATION, _capture_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


def check_capturable(model: torch.nn.Module) -> None:
    """UserError unless the decoder's attention runs through sdpa or one of sparrow's sdpa-based implementations
    (`CAPTURABLE`), or already through the capture wrapper."""
    for config in attention_configs(model):
        implementation = config._attn_implementation
        if implementation not in (*CAPTURABLE, IMPLEMENTATION):
            raise UserError(f"query capture needs a model with attn_implementation='sdpa', got {implementation!r} "
                             "(load it with attn_implementation='sdpa')")


class QueryCapture:
    """Per-layer queries of the last `window` positions of the most recent prefill of `model` while started.

    `with QueryCapture(model, window) as capture: ...` (or `start()` / `stop()`); the model is switched back to
    exactly what it was when the last capture on it stops.
    """

    def __init__(self, model: torch.nn.Module, window: int) -> None:
        check_capturable(model)
        self.model = model
        self.window = window
        # a quantized target prefills with its dense source model (`prefill_module`): its layers are watched too
        watched = list({id(m): m for m in (model, prefill_module(model))}.values())
        self.module_ids = {id(layer) for m in watched for layer in decoder_layers(m)}
        self.configs = list({id(c): c for m in watched for c in attention_configs(m)}.values())
        self.layers: dict[int, CapturedQueries] = {}

    def observe(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                scaling: float | None) -> None:
        """Called by the attention of every decoder layer of `model` while started: records prefills (a forward
        from an empty cache, query length == key length). Subclasses may act on other forwards too."""
        if query.shape[2] == key.shape[2]:
            self.record(module, query, scaling)

    def record(self, module: torch.nn.Module, query: Tensor, scaling: float | None) -> None:
        assert query.ndim == 4 and query.shape[0] == 1, f"batch size 1 expected, got {tuple(query.shape)}"
        n = query.shape[2]
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        self.layers[module.layer_idx] = CapturedQueries(query[0, :, -self.window:].detach().clone(), scale, n)

    def start(self) -> QueryCapture:
        """Route the decoder's attention through the capture wrapper and record its prefills (from now on)."""
        if self.active:
            return self
        check_capturable(self.model)
        register()
        self.layers = {}
        for config in self.configs:
            _, before, users = _SWITCHED.get(id(config), (config, config._attn_implementation_internal, 0))
            _SWITCHED[id(config)] = (config, before, users + 1)
            config._attn_implementation_internal = IMPLEMENTATION  # this config only, not its sub-configs
        _ACTIVE.add(self)
        return self

    def stop(self) -> None:
        """Stop recording (what was recorded stays for `take`); the last capture on a config restores it."""
        if not self.active:
            return
        _ACTIVE.discard(self)
        for config in self.configs:
            _, before, users = _SWITCHED.pop(id(config))
            if users > 1:
                _SWITCHED[id(config)] = (config, before, users - 1)
            else:
                config._attn_implementation_internal = before

    @property
    def active(self) -> bool:
        return self in _ACTIVE

    def __enter__(self) -> QueryCapture:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def take(self, length: int, num_layers: int) -> list[CapturedQueries]:
        """The recorded layers of a prefill over `length` positions (then forgotten); ValueError if absent."""
        layers, self.layers = self.layers, {}
        missing = [i for i in range(num_layers) if i not in layers or layers[i].length != length]
        if missing:
            raise UserError(f"no captured prefill queries of length {length} for layers {missing[:5]}: the target "
                             "must be prefilled inside the drafter's `watch_prefill(target)` context (the engine "
                             "does this; the drafter must be built on this target)")
        return [layers[i] for i in range(num_layers)]

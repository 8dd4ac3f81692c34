"""Record the post-RoPE queries a model's prefill computes, without changing its numerics.

`install(model)` switches a model whose attention runs through transformers' "sdpa" function to
"sparrow_capture", registered with `transformers.AttentionInterface` (and its mask with the sdpa
mask function): it calls the very same sdpa function with the very same arguments, so outputs are
bit-identical. While a `QueryCapture` is active on that model, every forward that starts from an
empty cache (query length == key length: a prefill) also stores, per layer, a copy of the queries of
its last `window` positions and the attention scale. Scores are then computed from these queries
against the keys in the cache (see drafters/kv_selection.py); nothing is re-run through the model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

IMPLEMENTATION = "sparrow_capture"
_ACTIVE: weakref.WeakSet[QueryCapture] = weakref.WeakSet()  # a capture stops when its owner drops it


@dataclass(frozen=True)
class CapturedQueries:
    """One layer's prefill queries."""

    queries: Tensor  # [heads, w, d] post-RoPE queries of the last w positions
    scaling: float
    length: int  # number of positions the prefill forward covered (n)


def _capture_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
    """sdpa, plus a recording side effect while a capture is active (query [1, heads, q, d])."""
    if _ACTIVE and query.shape[2] == key.shape[2]:
        for capture in list(_ACTIVE):
            if id(module) in capture.module_ids:
                capture.record(module, query, kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(IMPLEMENTATION, _capture_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


def install(model: torch.nn.Module) -> None:
    """Route the model's attention through the capture wrapper (idempotent; bit-identical outputs)."""
    implementation = model.config._attn_implementation
    if implementation == IMPLEMENTATION:
        return
    if implementation != "sdpa":
        raise ValueError(f"query capture needs a model with attn_implementation='sdpa', got {implementation!r} "
                         "(load it with attn_implementation='sdpa')")
    model.set_attn_implementation(IMPLEMENTATION)


class QueryCapture:
    """Per-layer queries of the last `window` positions of the most recent prefill of `model`."""

    def __init__(self, model: torch.nn.Module, window: int) -> None:
        install(model)
        self.window = window
        try:  # the language model only: a VLM's vision tower runs through the wrapper too, but is not recorded
            decoder = model.get_decoder()
        except (AttributeError, ValueError, NotImplementedError):
            decoder = model
        self.module_ids = {id(m) for m in decoder.modules() if isinstance(getattr(m, "layer_idx", None), int)}
        self.layers: dict[int, CapturedQueries] = {}

    def record(self, module: torch.nn.Module, query: Tensor, scaling: float | None) -> None:
        assert query.ndim == 4 and query.shape[0] == 1, f"batch size 1 expected, got {tuple(query.shape)}"
        n = query.shape[2]
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        self.layers[module.layer_idx] = CapturedQueries(query[0, :, -self.window:].detach().clone(), scale, n)

    def start(self) -> QueryCapture:
        _ACTIVE.add(self)
        return self

    def stop(self) -> None:
        _ACTIVE.discard(self)

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
            raise ValueError(f"no captured prefill queries of length {length} for layers {missing[:5]}: the target "
                             "must be prefilled while the capture is active (sparse drafter built on this target?)")
        return [layers[i] for i in range(num_layers)]

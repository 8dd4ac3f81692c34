"""Record the post-RoPE queries a model's prefill computes, without changing its numerics.

A running `QueryCapture` switches its model's attention from transformers' "sdpa" to "sparrow_capture"
(registered with `transformers.AttentionInterface`, and its mask with the sdpa mask function, when the
first capture starts): it calls the very same sdpa function with the very same arguments, so outputs
are bit-identical. Every forward that starts from an empty cache (query length == key length: a
prefill) also stores, per layer, a copy of the queries of its last `window` positions and the
attention scale. Stopping the capture (the last one on that model) switches the model back to "sdpa".
Scores are then computed from these queries against the keys in the cache (see
drafters/kv_selection.py); nothing is re-run through the model.

Drafters that read the target's prefill queries (sparse, visual-prune) cannot wrap that prefill (the
engine runs it before `Drafter.prefill`), so they use `capture_prefills()`: forward hooks that run the
capture around each forward of the model that starts from an empty cache, and leave the model on
"sdpa" everywhere else. The hooks live until the drafter's `close()`, or until it is garbage-collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from sparrow.errors import UserError

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


def register() -> None:
    """Make "sparrow_capture" known to transformers (idempotent: registering again changes nothing)."""
    AttentionInterface.register(IMPLEMENTATION, _capture_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


def check_capturable(model: torch.nn.Module) -> None:
    """ValueError unless the model's attention runs through sdpa (or already through the capture wrapper)."""
    implementation = model.config._attn_implementation
    if implementation not in ("sdpa", IMPLEMENTATION):
        raise UserError(f"query capture needs a model with attn_implementation='sdpa', got {implementation!r} "
                         "(load it with attn_implementation='sdpa')")


class QueryCapture:
    """Per-layer queries of the last `window` positions of the most recent prefill of `model`.

    Records while started: `start()`/`stop()`, or `with QueryCapture(model, window) as capture: ...`.
    """

    def __init__(self, model: torch.nn.Module, window: int) -> None:
        check_capturable(model)
        self.model = model
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
        """Route the model's attention through the capture wrapper and record its prefills."""
        check_capturable(self.model)
        register()
        if self.model.config._attn_implementation != IMPLEMENTATION:
            self.model.set_attn_implementation(IMPLEMENTATION)
        _ACTIVE.add(self)
        return self

    def stop(self) -> None:
        """Stop recording; the last capture running on the model switches it back to sdpa."""
        _ACTIVE.discard(self)
        others = any(capture.model is self.model for capture in _ACTIVE)
        if not others and self.model.config._attn_implementation == IMPLEMENTATION:
            self.model.set_attn_implementation("sdpa")

    @property
    def active(self) -> bool:
        return self in _ACTIVE

    def __enter__(self) -> QueryCapture:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def capture_prefills(self) -> Callable[[], None]:
        """Run this capture around every forward of the model that starts from an empty cache (a prefill);
        returns the function that removes these hooks."""
        started = []  # whether the running forward started the capture (it was not running already)

        def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            cache = kwargs.get("past_key_values")
            if not self.active and (cache is None or cache.get_seq_length() == 0):
                self.start()
                started.append(True)

        def after(module: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
            if started:
                started.clear()
                self.stop()

        hooks = (self.model.register_forward_pre_hook(before, with_kwargs=True),
                 self.model.register_forward_hook(after, with_kwargs=True, always_call=True))

        def remove() -> None:
            for hook in hooks:
                hook.remove()

        return remove

    def take(self, length: int, num_layers: int) -> list[CapturedQueries]:
        """The recorded layers of a prefill over `length` positions (then forgotten); ValueError if absent."""
        layers, self.layers = self.layers, {}
        missing = [i for i in range(num_layers) if i not in layers or layers[i].length != length]
        if missing:
            raise UserError(f"no captured prefill queries of length {length} for layers {missing[:5]}: the target "
                             "must be prefilled while the capture is active (sparse drafter built on this target?)")
        return [layers[i] for i in range(num_layers)]

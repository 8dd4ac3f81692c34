"""CachedModel subclasses for vision-language models: visual prefill and the model's real positions.

`sparrow.runtime.runner.runner_for(model)` picks the class (see `cached_model_class`), so the engine, the baseline
and model-backed drafters need no change:

* `VisionCachedModel` (LLaVA-OneVision and other 1-D-position VLMs): moves the prompt's pixel inputs to
  the model's device and dtype at prefill; positions are the cache index (the model's default).
* `MRopeCachedModel` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: models with `model.model.get_rope_index`): computes
  the 3-D M-RoPE positions of the prompt once with the model's own `get_rope_index`, keeps the rope delta
  *per sequence* on this object, and passes explicit `position_ids` to every forward:
  prefill -> `pos3d` [3, 1, n]; token at cache index i >= n -> `i + rope_delta` on all three axes,
  which is exactly what transformers' `generate` uses. The model's own mutable `model.model.rope_deltas`
  is never read, so a draft of the same class (or the same object) prefilled in between cannot corrupt it.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Prompt, TargetOutput

VISUAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes",
                 "image_sizes_videos", "second_per_grid_ts", "mm_token_type_ids", "batch_num_images")


def is_vlm(model: torch.nn.Module) -> bool:
    """True for models with a vision tower (config.vision_config), e.g. Qwen2.5-VL, LLaVA-OneVision."""
    return getattr(model.config, "vision_config", None) is not None


def has_mrope(model: torch.nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return is_vlm(model) and callable(getattr(inner, "get_rope_index", None))


def cached_model_class(model: torch.nn.Module) -> type[CachedModel]:
    """The CachedModel class that runs `model` with its real position scheme."""
    if has_mrope(model):
        return MRopeCachedModel
    if is_vlm(model):
        return VisionCachedModel
    return CachedModel


def token_type_ids(input_ids: Tensor, config) -> Tensor:
    """[n] int: 0 text, 1 image placeholder, 2 video placeholder (Qwen-VL's `mm_token_type_ids`)."""
    image = getattr(config, "image_token_id", None)
    video = getattr(config, "video_token_id", None)
    types = torch.zeros_like(input_ids, dtype=torch.int)
    if image is not None:
        types[input_ids == image] = 1
    if video is not None:
        types[input_ids == video] = 2
    return types


def mrope_positions(model: torch.nn.Module, prompt: Prompt) -> tuple[Tensor, int]:
    """(position_ids [3, 1, n], rope_delta) of `prompt` for an M-RoPE model, from its own `get_rope_index`.

    Text-only prompts get plain positions and delta 0. Tokens after the prompt sit at
    `cache index + rope_delta` (delta < 0 when visual tokens share temporal/spatial positions).
    """
    inner = model.model
    ids = prompt.input_ids.to(model.device)[None]
    inputs = prompt.model_inputs
    if inputs.get("image_grid_thw") is None and inputs.get("video_grid_thw") is None:
        n = ids.shape[1]
        return torch.arange(n, device=ids.device).view(1, 1, n).expand(3, 1, n), 0
    types = inputs.get("mm_token_type_ids")
    types = token_type_ids(ids, model.config) if types is None else types.to(ids.device)
    accepted = inspect.signature(inner.get_rope_index).parameters
    extra = {k: _to(inputs[k], ids.device) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
             if inputs.get(k) is not None and (k in accepted or "kwargs" in accepted)}
    positions, deltas = inner.get_rope_index(ids, mm_token_type_ids=types, **extra)
    assert positions.shape == (3, 1, ids.shape[1]), tuple(positions.shape)
    return positions, int(deltas.reshape(-1)[0])


def _to(value: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    if not isinstance(value, Tensor):
        return value
    if dtype is not None and value.is_floating_point():
        return value.to(device=device, dtype=dtype)
    return value.to(device)


class VisionCachedModel(CachedModel):
    """A VLM with 1-D positions: prefill carries the visual inputs, decoding is plain text."""

    def model_inputs(self, prompt: Prompt) -> dict[str, Any]:
        """Prefill keyword arguments on this model's device; pixels in its dtype."""
        dtype = next(self.model.parameters()).dtype
        return {k: _to(v, self.device, dtype if k.startswith("pixel_values") else None)
                for k, v in prompt.model_inputs.items()}

    def prefill(self, prompt: Prompt, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        return super().prefill(replace(prompt, model_inputs=self.model_inputs(prompt)), hidden_layers)


class MRopeCachedModel(VisionCachedModel):
    """Qwen-VL family: explicit 3-D M-RoPE positions, rope delta kept per sequence on this object."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.rope_delta = 0
        """Decode position = cache index + rope_delta. A pruned-prefill drafter that drops m visual tokens
        from the cache but keeps full-sequence positions sets rope_delta = delta + m."""
        self.prompt_positions: Tensor | None = None  # [3, 1, n] positions of the last prefilled prompt

    def position_ids(self, positions: Tensor) -> Tensor:
        ids = positions.to(self.device) + self.rope_delta + self.position_offset
        return ids.view(1, 1, -1).expand(3, 1, ids.numel())

    def prefill(self, prompt: Prompt, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        inputs = self.model_inputs(prompt)
        positions, self.rope_delta = mrope_positions(self.model, replace(prompt, model_inputs=inputs))
        self.prompt_positions = positions
        return CachedModel.prefill(self, replace(prompt, model_inputs={**inputs, "position_ids": positions}),
                                   hidden_layers)

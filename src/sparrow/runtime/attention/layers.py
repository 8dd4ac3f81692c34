"""Which modules of a model are its decoder's attention layers, and the configs they dispatch on."""

from __future__ import annotations

from typing import Any

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model's modules with a `layer_idx` (decoder layers and their attention modules)."""
    try:  # the language model only: a VLM's vision tower is neither switched nor recorded
        decoder = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        decoder = model
    return [m for m in decoder.modules() if isinstance(getattr(m, "layer_idx", None), int)]



def attention_configs(model: torch.nn.Module) -> list[Any]:
    """The distinct configs the decoder's attention layers dispatch on (`config._attn_implementation`)."""
    configs = {id(m.config): m.config for m in decoder_layers(model) if getattr(m, "config", None) is not None}
    return list(configs.values()) or [model.config]


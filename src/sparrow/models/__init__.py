"""Preset models and loading of target/draft models (presets, GGUF files, local dirs, hub ids).

The on-disk cache of dequantized presets and quantized copies: ``sparrow.models.cache``.
"""

from sparrow.models.loading import LoadedModel, list_presets, load_model, resolve_dtype
from sparrow.models.presets import PRESETS, install, is_installed
from sparrow.runtime.devices import resolve_device

__all__ = ["PRESETS", "LoadedModel", "install", "is_installed", "list_presets", "load_model", "resolve_device",
           "resolve_dtype"]

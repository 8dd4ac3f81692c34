"""Preset models and loading of target/draft models (presets, GGUF files, local dirs, hub ids)."""

from sparrow.models.loading import LoadedModel, list_presets, load_model, resolve_device, resolve_dtype
from sparrow.models.presets import PRESETS

__all__ = ["PRESETS", "LoadedModel", "list_presets", "load_model", "resolve_device", "resolve_dtype"]

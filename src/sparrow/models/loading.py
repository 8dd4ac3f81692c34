"""Load a target or draft model: a preset name, a ``.gguf`` file, a local directory or a hub id.

Presets are dequantized from GGUF once and then cached as safetensors under
``<cache_dir>/models/<preset>-<dtype>/``, so later loads take about a second. The cache entry is
written, verified and rebuilt by :mod:`sparrow.models.cache`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)
from transformers.utils import logging as hf_logging

from sparrow.errors import UserError
from sparrow.models import cache
from sparrow.models.presets import PRESETS, Preset, is_installed, open_gguf
from sparrow.paths import default_cache_dir
from sparrow.runtime.attention import decode as decode_attention
from sparrow.runtime.devices import resolve_device
from sparrow.runtime.hardware import choose_dtype, choose_onednn
from sparrow.runtime.onednn import route_linears

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for decoding, with its tokenizer."""

    model: PreTrainedModel  # eval mode, on device, requested dtype
    tokenizer: PreTrainedTokenizerBase
    name: str  # preset name, path or hub id as the user gave it
    processor: ProcessorMixin | None = None  # a VLM's processor (images/videos -> model inputs); None for text LMs

    @property
    def is_vlm(self) -> bool:
        return self.processor is not None

    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a generation: the generation config's EOS id(s) and the tokenizer's."""
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(ids)


AUTO_DTYPE = "auto"


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype:
    """Map a dtype name (or a supported ``torch.dtype``) to a ``torch.dtype``.

    ``"auto"``: the fastest exact-enough dtype for ``device`` (resolved as ``resolve_device`` does) on this
    machine, from its features and a short cached micro-benchmark: see ``sparrow.runtime.hardware.choose_dtype``."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower() == AUTO_DTYPE:
        return choose_dtype(resolve_device(device))[0]
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise UserError(f"invalid dtype {dtype!r}: expected one of {AUTO_DTYPE}, {', '.join(_DTYPES)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _cache_dir_for(preset: Preset, dtype: torch.dtype, cache_dir: Path) -> Path:
    return cache_dir / "models" / f"{preset.name}-{_dtype_name(dtype)}"


def _cache_meta(preset: Preset, dtype: torch.dtype) -> dict[str, str]:
    """What a preset's cache entry was built from: a new GGUF (another pinned version) rebuilds it."""
    return {"kind": "preset", "preset": preset.name, "dtype": _dtype_name(dtype), "gguf_sha256": preset.sha256}


def list_presets(cache_dir: Path | str | None = None) -> list[dict]:
    """One dict per preset: name, description, installed, cached (a complete entry in some dtype),
    cached_dtypes and damaged_dtypes (entries a load would rebuild). Cheap: sizes, no checksums."""
    root = Path(cache_dir or default_cache_dir()).expanduser()
    rows = []
    for preset in PRESETS.values():
        states = {_dtype_name(d): cache.status(_cache_dir_for(preset, d, root)).state for d in _CACHE_DTYPES}
        cached = [d for d, state in states.items() if state == "complete"]
        rows.append(
            {
                "name": preset.name,
                "description": preset.description,
                "installed": is_installed(preset),
                "cached": bool(cached),
                "cached_dtypes": cached,
                "damaged_dtypes": [d for d, state in states.items() if state == "damaged"],
            }
        )
    return rows


class _Progress:
    """Rich spinner plus one line per step on stderr; a no-op when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.console = None
        if enabled:  # rich lazily: the GPU head recipe loads models where only torch and transformers are installed
            from rich.console import Console

            self.console = Console(stderr=True)
        self._status = None

    def __enter__(self) -> _Progress:
        if self.console is not None:
            self._status = self.console.status("loading …")
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()

    def __call__(self, message: str) -> None:
        if self.console is not None and self._status is not None:
            from rich.markup import escape  # lazily, as Console above

            self.console.print(f"[dim]sparrow:[/dim] {escape(message)}", highlight=False, soft_wrap=True)
            self._status.update(message)


@contextlib.contextmanager
def _quiet_transformers(silence_warnings: bool) -> Iterator[None]:
    """Hide transformers' progress bars (our spinner replaces them), optionally its warnings too.

    The GGUF dequantizer uses a plain ``tqdm`` that ignores transformers' switch,
    so it is swapped for a disabled one for the duration.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if silence_warnings:
        hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


def _placement(device: torch.device) -> dict[str, object]:
    """from_pretrained keywords that put the weights straight onto ``device`` as they are loaded, so a big
    model is never materialised on the CPU first (none for the CPU, where transformers loads anyway)."""
    return {} if device.type == "cpu" else {"device_map": device}


def _from_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize a GGUF file into a dense model (never kept packed)."""
    d, f = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, dtype=dtype, quantization_config=GgufConfig(dequantize=True), **_placement(device)
    )
    return model, tokenizer


def _from_dir(path: str, dtype: torch.dtype, device: torch.device,
              **kwargs: object) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A text LM with its tokenizer, or a VLM (config with a vision_config) with its processor in that slot."""
    config = AutoConfig.from_pretrained(path, **kwargs)
    if getattr(config, "vision_config", None) is not None:
        processor = AutoProcessor.from_pretrained(path, **kwargs)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **_placement(device), **kwargs)
        return model, processor
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **_placement(device), **kwargs)
    return model, tokenizer


def _save_cache(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Write the model (safetensors) and its tokenizer into ``directory``."""
    model.hf_quantizer = None  # a GGUF-quantized model refuses save_pretrained
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _dequantize(preset: Preset, dtype: torch.dtype, device: torch.device, cache_dir: Path,
                say: _Progress) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize the preset's verified GGUF (assembled in the cache, or where the cache cannot be
    written in a temporary directory removed once the model is in memory: see ``open_gguf``)."""
    with open_gguf(preset, cache_dir, report=say) as path:
        say(f"dequantizing {preset.name} to {_dtype_name(dtype)} (first time only, ~15-90 s) …")
        return _from_gguf(path, dtype, device)


def _load_preset(
    preset: Preset, dtype: torch.dtype, device: torch.device, cache_dir: Path, say: _Progress
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """From the verified cache entry; else dequantize the GGUF, cache it (when the cache can be
    written) and load the entry, or keep the model built in memory (when it cannot)."""
    entry = _cache_dir_for(preset, dtype, cache_dir)
    with cache.open_entry(entry, _cache_meta(preset, dtype), say) as slot:
        if not slot.ready:
            model, tokenizer = _dequantize(preset, dtype, device, cache_dir, say)
            if slot.writable:
                say(f"saving safetensors cache to {entry} …")
            if not slot.commit(functools.partial(_save_cache, model, tokenizer)):
                return model, tokenizer  # the cache is an optimisation: keep the model built in memory
            del model, tokenizer
            gc.collect()
    say(f"loading cached {preset.name} ({_dtype_name(dtype)}) …")
    return _from_dir(str(entry), dtype, device)


def _looks_like_path(spec: str) -> bool:
    """True for things a hub id can't be: ./x, /x, ~/x, a/b/c, x.gguf, or a Windows path."""
    if spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1:
        return True
    return os.sep != "/" and os.sep in spec


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message squeezed onto one line, shortened to ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _offline() -> bool:
    flags = (os.environ.get(k, "").upper() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(f in {"1", "ON", "YES", "TRUE"} for f in flags)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Quick TCP check of the hub endpoint, so a typo doesn't sit through ~45 s of retries."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # can't probe through a proxy; let the hub client try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _from_hub(spec: str, dtype: torch.dtype, device: torch.device,
              say: _Progress) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a hub id: from the local Hugging Face cache if there, else from the network."""
    def not_found(reason: str) -> UserError:
        return UserError(
            f"model spec {spec!r} is not a preset ({', '.join(PRESETS)}), not a local path, "
            f"and could not be fetched from the Hugging Face hub: {reason}"
        )

    try:
        return _from_dir(spec, dtype, device, local_files_only=True)
    except OSError:
        pass  # not in the local cache
    except Exception as exc:  # invalid repo id, unsupported architecture, ...
        raise not_found(_one_line(exc)) from None
    if _offline():
        raise not_found("offline mode (HF_HUB_OFFLINE) and not in the local Hugging Face cache")
    if not _hub_reachable():
        raise not_found("the hub is not reachable (no network?)")
    say(f"fetching {spec} from the Hugging Face hub …")
    try:
        return _from_dir(spec, dtype, device)
    except Exception as exc:  # hub errors come in many types; report one clean line
        raise not_found(_one_line(exc)) from None


def _load_local(
    spec: str, path: Path, dtype: torch.dtype, device: torch.device, say: _Progress, quiet: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load an existing local path: a ``.gguf`` file or a Hugging Face model directory."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model spec {spec!r} is a directory without a config.json, not a Hugging Face model")
        say(f"loading {path} …")
        kind, load = "local directory", functools.partial(_from_dir, str(path), dtype, device)
    elif path.suffix == ".gguf":
        say(f"dequantizing {path.name} to {_dtype_name(dtype)} …")
        kind, load, quiet = "GGUF file", functools.partial(_from_gguf, path, dtype, device), True
    else:
        raise UserError(f"model spec {spec!r} is a file but not a .gguf file")
    with _quiet_transformers(quiet):
        try:
            return load()
        except Exception as exc:  # a broken or unsupported file: one clear line, cause chained
            raise UserError(f"model spec {spec!r}: could not load the {kind}: {_one_line(exc)}") from exc


def _load_any(
    spec: str, dtype: torch.dtype, device: torch.device, cache_dir: Path, say: _Progress, quiet: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dispatch on what ``spec`` is: preset, local path or hub id."""
    preset = PRESETS.get(spec.strip().lower())
    path = Path(spec).expanduser()
    if preset is not None:
        with _quiet_transformers(True):
            return _load_preset(preset, dtype, device, cache_dir, say)
    if path.exists():
        return _load_local(spec, path, dtype, device, say, quiet)
    if _looks_like_path(spec):
        raise UserError(
            f"model spec {spec!r} is not a preset ({', '.join(PRESETS)}) and no such file or directory exists"
        )
    with _quiet_transformers(quiet):
        return _from_hub(spec, dtype, device, say)


def read_config(spec: str | LoadedModel, cache_dir: Path | str | None = None) -> PretrainedConfig | None:
    """A model's transformers config, read from its config.json without loading a weight (a LoadedModel's own), so
    `sparrow.load` can refuse what a model's family cannot run before loading it. None where that would take more
    than reading a file (a GGUF file, a preset not yet in the cache, a hub id not in the local Hugging Face cache)
    or the file is not a config transformers reads: the loader then loads it, or reports what is wrong with it."""
    if isinstance(spec, LoadedModel):
        return spec.model.config
    if not isinstance(spec, str) or not spec.strip():
        return None
    preset, path = PRESETS.get(spec.strip().lower()), Path(spec).expanduser()
    source, kwargs = None, {}
    if preset is not None:  # any cached dtype: the config is the same
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        entries = (_cache_dir_for(preset, dtype, root) for dtype in _CACHE_DTYPES)
        source = next((str(e) for e in entries if cache.status(e).state == "complete"), None)
    elif path.is_dir():
        source = str(path)
    elif not path.exists() and not _looks_like_path(spec):  # a hub id
        source, kwargs = spec, {"local_files_only": True}
    if source is None:
        return None
    try:
        with _quiet_transformers(True):
            return AutoConfig.from_pretrained(source, **kwargs)
    except Exception:  # not readable as a config (or not cached): the loader reports it with its own message
        return None


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    cache_dir: Path | str | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode, on ``device``, in ``dtype`` (a name, or ``"auto"``:
    what this machine runs fastest, see ``resolve_dtype``).

    ``spec`` is a preset name (see ``PRESETS``), a path to a ``.gguf`` file, a local
    directory holding a Hugging Face model, or a Hugging Face hub id.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"invalid model spec {spec!r}: expected a preset name, a path or a hub id")
    torch_dtype = resolve_dtype(dtype, device)
    dev = resolve_device(device)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    start = time.perf_counter()
    with _Progress(progress) as say:
        model, tokenizer = _load_any(spec, torch_dtype, dev, root, say, quiet=not progress)
        model = model.to(dev).eval()  # already there when loaded in place (see _placement): a no-op
        processor = tokenizer if isinstance(tokenizer, ProcessorMixin) else None  # a VLM (see _from_dir)
        tokenizer = processor.tokenizer if processor is not None else tokenizer

        decode_attention.use(model)  # one-row decoding steps without torch's slow single-row CPU kernel
        kernel = ""
        if torch_dtype == torch.float32 and choose_onednn(dev)[0]:  # a CPU that measured oneDNN faster
            kernel = f", {route_linears(model)} linears through oneDNN"
        say(f"loaded {spec} ({_dtype_name(torch_dtype)}, {dev}{kernel}) in {time.perf_counter() - start:.1f} s")
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, processor=processor)

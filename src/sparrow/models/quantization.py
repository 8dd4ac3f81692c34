"""Quantized copies of a model: weight-only int8 per output channel or int4 in groups, or w8a8.

A thin wrapper over torch's own packed kernels (no hand-written kernels):

* int8: ``aten._weight_int8pack_mm`` (CPU and CUDA): symmetric, one scale per output channel.
* int4: ``aten._weight_int4pack_mm_for_cpu`` on the CPU, ``aten._weight_int4pack_mm`` (tinygemm)
  on CUDA: asymmetric, one (scale, zero) pair per group of ``group_size`` input channels,
  ``w ~= (q - 8) * scale + zero`` with ``q`` in 0..15 (torchao's ``int4_weight_only`` layout).
* w8a8 (CPU only): int8 weights per output channel *and* int8 activations quantized per token at run
  time, multiplied in integers by fbgemm (``quantized.linear_dynamic``, the x86 VNNI kernels behind
  ``torch.ao``'s dynamic quantization). See ``DynamicInt8Linear`` for why it stays batch-invariant.

``quantize_model`` returns a *copy*: every ``nn.Linear`` whose shape the kernel takes becomes a
``QuantizedLinear``; everything else (embeddings, norms, layers the kernel can't take) is shared
with the source model, read-only. The source model's weights are never modified. Activations
stay in the model's dtype (the layer casts to the kernel's dtype and back where needed).

Decoding a quantized copy is *not* the source model: used as a draft (quantized self-draft,
quantized draft model) the output stays exactly the target's; used as the target (``--quant``),
speculation is lossless relative to the quantized target only. A quantized target prefills a prompt with
the dense model it was quantized from (``dense=PREFILL``: torch's packed CPU kernels cost ~linear in the rows)
and runs every decoding and verify step quantized: plain and speculative decoding alike.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import struct
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.models import PRESETS, LoadedModel, cache
from sparrow.paths import default_cache_dir
from sparrow.runtime.attention.rowwise import use_rowwise
from sparrow.runtime.cached_model import PREFILL_MODULE
from sparrow.runtime.hardware import choose_draft_quant, choose_target_quant
from sparrow.runtime.quant import (
    CPU_INT8_K_MULTIPLE,
    W8A8,
    DynamicInt8Linear,
    QuantizedLinear,
    _vnni,
    check_device,
    group_siblings,
    kernel_takes,
)

QUANT_BITS: dict[str, int] = {"int8": 8, "int4": 4, "w8a8": 8}  # format -> bits per weight
# a model on its GGUF file's own blocks (Q4_K / Q6_K / Q8_0 as the file has them; sparrow.models.gguf_native): loaded
# from the file rather than quantized from a dense model: a target's (--quant) or a draft model's (--draft-quant)
# format, never the quantized-self copy's
GGUF = "gguf"
# --draft-quant auto: the draft format this machine runs fastest (sparrow.runtime.hardware.choose_draft_quant)
AUTO = "auto"
INT4_GROUP_SIZES = (32, 64, 128, 256)
# Where a quantized copy runs long forwards on its source's dense weights (shared, never copied):
PREFILL = "prefill"  # a target's: a prompt's prefill runs the dense source model (`prefill_module`)
LONG = "long"  # a draft's (its output never changes the result): every forward of >= DENSE_FROM_TOKENS tokens
DENSE_USES = (PREFILL, LONG)
DEFAULT_GROUP_SIZE = 128
FORMAT_VERSION = 2  # bump when the on-disk layout changes (2: a cache entry directory with a manifest)
WEIGHTS_FILE = "weights.safetensors"  # the packed weights inside a quantized cache entry


def parse_quant(quant: str | int | None, argument: str = "quant", auto: bool = False) -> str | None:
    """'int8' / 'int4' / 'w8a8' / 'gguf' / 8 / 4 -> the format's name; None -> None; where `auto` is allowed, also
    'auto' -> 'auto' (chosen by sparrow.runtime.hardware) and 'none' -> None (dense). Raises UserError naming
    `argument`."""
    if quant is None:
        return None
    if isinstance(quant, int) and not isinstance(quant, bool) and quant in (4, 8):
        return f"int{quant}"
    if isinstance(quant, str) and quant.lower() in QUANT_BITS:
        return quant.lower()
    if isinstance(quant, str) and quant.lower() == GGUF:
        return GGUF
    if auto and isinstance(quant, str) and quant.lower() in (AUTO, "none"):
        return AUTO if quant.lower() == AUTO else None
    names = (AUTO, "none", *QUANT_BITS, GGUF) if auto else (*QUANT_BITS, GGUF)
    raise UserError(f"invalid {argument} {quant!r}: expected one of {', '.join(names)}")


def resolve_draft_quant(draft_quant: str | int | None, quantized_copy: bool, has_draft_model: bool,
                        device: str | torch.device | None, dtype: torch.dtype | None = None) -> str | None:
    """--draft-quant checked before any model is loaded. 'auto' becomes None for a drafter without a draft model,
    the format sparrow.runtime.hardware measured fastest for one row on `device` in `dtype` (the target's) for a
    drafter drafting with a quantized copy of the target (`quantized_copy`: quantized-self; None: its int4 default),
    and stays 'auto' for a draft model (`draft_format` settles it once the draft is loaded)."""
    fmt = parse_quant(draft_quant, "draft_quant", auto=True)
    if fmt != AUTO:
        return fmt
    if quantized_copy:
        return choose_draft_quant(device, dtype=dtype)[0]
    return AUTO if has_draft_model else None


def draft_format(model: nn.Module | None, draft_quant: str | None) -> str | None:
    """The format a loaded draft model runs in: `draft_quant`, or for 'auto' the format sparrow.runtime.hardware
    measured fastest for one row on the model's device in its dtype, where that kernel takes at least one of the model's
    linear layers (None, a dense draft, otherwise and where there is no draft)."""
    if draft_quant != AUTO:
        return draft_quant
    if model is None:
        return None

    weight = next(model.parameters())
    device = weight.device
    fmt = choose_draft_quant(device, dtype=weight.dtype)[0]
    if fmt is None:
        return None
    kind = W8A8 if fmt == W8A8 else QUANT_BITS[fmt]
    takes = any(kernel_takes(kind, m.out_features, m.in_features, DEFAULT_GROUP_SIZE, device)
                for m in model.modules() if type(m) is nn.Linear)
    return fmt if takes else None


def target_format(model: nn.Module, quant: str | None, compile: bool = False) -> str | None:
    """The format a loaded target runs in: `quant`, or for 'auto' the format sparrow.runtime.hardware measured
    fastest over a decoding step and a verify (1 and 8 rows) on the model's device in its dtype
    (`choose_target_quant`; not w8a8 with `compile`, which cannot trace it), where that kernel takes at least one of
    the model's linear layers; None (dense) otherwise."""
    if quant != AUTO:
        return quant

    weight = next(model.parameters())
    fmt = choose_target_quant(weight.device, dtype=weight.dtype, exclude=(W8A8,) if compile else ())[0]
    if fmt is None:
        return None
    kind = W8A8 if fmt == W8A8 else QUANT_BITS[fmt]
    takes = any(kernel_takes(kind, m.out_features, m.in_features, DEFAULT_GROUP_SIZE, weight.device)
                for m in model.modules() if type(m) is nn.Linear)
    return fmt if takes else None


"""Children of one module that read the same input in the architectures sparrow runs (an attention's
projections, a gated MLP's two halves)."""


def _layer_tensors(layer: nn.Module) -> dict[str, Tensor]:
    """What the disk cache keeps of a quantized layer."""
    return layer.tensors() if isinstance(layer, DynamicInt8Linear) else dict(layer.named_buffers())


@dataclass(frozen=True)
class QuantizationInfo:
    """Set as `model.sparrow_quantization` on every quantized copy."""

    format: str  # "int8", "int4", "w8a8" or "gguf"
    group_size: int
    quantized: tuple[str, ...]  # names of the layers replaced by QuantizedLinear / DynamicInt8Linear
    skipped: tuple[str, ...]  # nn.Linear layers the kernel can't take (kept dense, shared)
    from_disk: bool  # loaded from the disk cache rather than quantized now

    @property
    def bits(self) -> int:
        return QUANT_BITS.get(self.format, 0)  # gguf: the file's own mix (4-8 bits)

    @property
    def name(self) -> str:
        return self.format


def _shared_copy(model: nn.Module) -> nn.Module:
    """A structural copy of `model` whose parameters and buffers are the source's own tensors."""
    memo: dict[int, object] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _stderr(message: str) -> None:
    print(f"sparrow: {message}", file=sys.stderr, flush=True)


def _cache_meta(layers: dict[str, nn.Linear], fmt: str, group_size: int, device: torch.device) -> dict[str, str]:
    """What a cache entry must have been built for: anything else (another torch: another packed
    layout; another model's layers) rebuilds it."""
    shapes = hashlib.sha256(repr(sorted((n, m.out_features, m.in_features) for n, m in layers.items())).encode())
    dtype = next(iter(layers.values())).weight.dtype
    meta = {"kind": "quantized", "format": str(FORMAT_VERSION), "bits": str(QUANT_BITS[fmt]),
            "group_size": str(group_size), "device_type": device.type, "dtype": str(dtype), "torch": torch.__version__,
            "layers_sha256": shapes.hexdigest()}
    return meta if fmt != W8A8 else {**meta, "quant_format": fmt}


_SAFETENSORS_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "BF16": torch.bfloat16,
                       "F16": torch.float16, "F32": torch.float32}


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors file read into fresh CPU memory (torch's allocator: 64-byte aligned).

    Not memory-mapped: tensors in a mapped file are only 8-byte aligned (the CPU int8 kernel then
    crashes, see kernel_takes) and a process would fault (SIGBUS) if the file were truncated under
    it. One read per tensor costs ~0.2 s for 820 MB, less than copying out of a mapping (~0.4-0.9 s)."""
    tensors = {}
    with open(path, "rb", buffering=0) as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_bytes))
        for key, spec in header.items():
            if key == "__metadata__":
                continue
            tensor = torch.empty(spec["shape"], dtype=_SAFETENSORS_DTYPES[spec["dtype"]])
            start, end = spec["data_offsets"]
            size = tensor.numel() * tensor.element_size()
            if end - start != size:
                raise ValueError(f"{path}: {key} has {end - start} bytes, expected {size}")
            f.seek(8 + header_bytes + start)
            if size and f.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != size:
                raise ValueError(f"{path}: {key} is cut short")
            tensors[key] = tensor
    return tensors


def _load_cached(path: Path, device: torch.device) -> dict[str, Tensor] | None:
    """The packed weights of a verified cache entry, on `device`; None if unreadable (then rebuilt)."""
    try:
        tensors = _read_safetensors(path)
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return {k: t.to(device) for k, t in tensors.items()}


def _save_cached(directory: Path, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS_FILE))


def _quantize_layers(model: nn.Module, take: dict[str, nn.Linear], fmt: str, group_size: int, dense: str | None,
                     cached: dict[str, Tensor] | None) -> nn.Module:
    """A shared copy of `model` with the `take` layers replaced by QuantizedLinear or DynamicInt8Linear
    (from `cached` if given); `dense`: see quantize_model."""
    clone = _shared_copy(model)
    bits = QUANT_BITS[fmt]
    reduce_range = fmt == W8A8 and not _vnni()
    for name, linear in take.items():
        if fmt == W8A8 and cached is not None:
            layer = DynamicInt8Linear(linear.in_features, linear.out_features, cached[f"{name}.packed"],
                                      cached[f"{name}.scales"], linear.bias, reduce_range)
        elif fmt == W8A8:
            layer = DynamicInt8Linear.from_linear(linear, reduce_range)
        elif cached is not None:
            layer = QuantizedLinear(linear.in_features, linear.out_features, bits, group_size,
                                    cached[f"{name}.packed"], cached[f"{name}.scales"], linear.bias,
                                    linear.weight if dense == LONG else None)
        else:
            layer = QuantizedLinear.from_linear(linear, bits, group_size, dense == LONG)
        _set_module(clone, name, layer)
    return clone


def _buffers(clone: nn.Module, take: dict[str, nn.Linear]) -> dict[str, Tensor]:
    return {f"{n}.{b}": t for n in take for b, t in _layer_tensors(clone.get_submodule(n)).items()}


def quantize_model(model: nn.Module, quant: int | str, group_size: int = DEFAULT_GROUP_SIZE,
                   cache_entry: Path | str | None = None, dense: str | None = PREFILL,
                   report: Callable[[str], None] | None = None) -> nn.Module:
    """A quantized copy of `model` (int8, int4 or w8a8); `model` itself is left untouched.

    Every nn.Linear the kernel can take (lm_head included) is quantized; the rest is shared.
    With `cache_entry` (a directory, see sparrow.models.cache), the packed weights are read from it
    when it is intact and matches (bits, group size, dtype, device type, torch version, layer shapes),
    and written to it otherwise; `report` gets the cache's problems (damaged entry rebuilt, cache not
    writable; default: stderr).

    `dense`: which long forwards run on the source's dense weights (kept alive, shared, memory-mapped where the
    loader maps the checkpoint; torch's packed CPU kernels cost ~linear in the rows, a 264-token prefill of the
    int4 1.5B about twice the dense bfloat16 one). PREFILL (the default, a target's): a prompt's prefill runs a
    structural copy of the source model (`prefill_module`), and every decoding and verify step the quantized
    layers, so speculative decoding's output stays the quantized target's own. LONG (a draft's, whose output
    never changes the result): an int8 / int4 layer runs every forward of >= DENSE_FROM_TOKENS tokens dense.
    None: neither. w8a8 copies keep none: fbgemm's int8 kernel scales with the rows (264 rows of a 1536 x 8960
    weight: 5.7 ms, against 9.3 ms dense in bfloat16 and 39 ms in float32; AMD EPYC Zen 5).
    """
    fmt = parse_quant(quant, "quant")
    if fmt is None or fmt == GGUF:
        raise UserError(f"quant must be one of {', '.join(QUANT_BITS)} (gguf weights are loaded from a GGUF file)")
    if dense is not None and dense not in DENSE_USES:
        raise UserError(f"dense must be one of {', '.join(DENSE_USES)} or None, got {dense!r}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        raise UserError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    first = next(model.parameters())
    check_device(fmt, first.device, first.dtype)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    kind = W8A8 if fmt == W8A8 else QUANT_BITS[fmt]
    take = {n: m for n, m in linears.items() if kernel_takes(kind, m.out_features, m.in_features, group_size,
                                                              m.weight.device)}
    if not take:
        raise UserError(f"{fmt} (group size {group_size}): the kernel takes none of the model's linear layers "
                         f"(int4 needs in_features divisible by the group size and out_features by 8; "
                         f"int8 on the CPU in_features divisible by {CPU_INT8_K_MULTIPLE})")
    cached = None
    if cache_entry is None:
        clone = _quantize_layers(model, take, fmt, group_size, dense, None)
    else:
        entry = Path(cache_entry).expanduser()
        with cache.open_entry(entry, _cache_meta(take, fmt, group_size, first.device), report or _stderr) as slot:
            cached = _load_cached(entry / WEIGHTS_FILE, first.device) if slot.ready else None
            if cached is not None and any(f"{n}.{b}" not in cached for n in take for b in ("packed", "scales")):
                cached = None
            clone = _quantize_layers(model, take, fmt, group_size, dense, cached)
            if cached is None:
                slot.commit(lambda directory: _save_cached(directory, _buffers(clone, take)))
    if fmt == W8A8:  # its int8 activations would amplify the last-bit differences of batched attention

        use_rowwise(clone)
        group_siblings(clone)
    clone.sparrow_quantization = QuantizationInfo(fmt, group_size, tuple(take), tuple(sorted(set(linears) - set(take))),
                                                  from_disk=cached is not None)
    if dense == PREFILL and fmt != W8A8:  # in __dict__: not a submodule (not in .parameters(), .to(), state_dict)
        clone.__dict__[PREFILL_MODULE] = _shared_copy(model).eval()
    return clone.eval()


_COPIES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int, str | None], nn.Module]] = \
    weakref.WeakKeyDictionary()


def quantized_cache_entry(loaded: LoadedModel, quant: int | str, group_size: int,
                          cache_dir: Path | str | None = None) -> Path | None:
    """Disk cache entry (a directory) of a preset's quantized copy, under <sparrow cache>/quantized/;
    None for other models (nothing names their weights reliably)."""
    if loaded.name.strip().lower() not in PRESETS:
        return None
    first = next(loaded.model.parameters())
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dtype = str(first.dtype).removeprefix("torch.")
    fmt = parse_quant(quant)
    return root / "quantized" / f"{loaded.name.strip().lower()}-{dtype}-{fmt}-g{group_size}-{first.device.type}"


def quantized_copy(loaded: LoadedModel, quant: str | int, group_size: int = DEFAULT_GROUP_SIZE,
                   cache_dir: Path | str | None = None, dense: str | None = PREFILL,
                   report: Callable[[str], None] | None = None) -> LoadedModel:
    """The quantized copy of `loaded`, built once per (model, bits, group size, dense) in this process, and
    for presets read from / written to the disk cache. `dense` (PREFILL for a target, LONG for a draft) and
    `report`: see quantize_model."""
    fmt = parse_quant(quant)
    if fmt is None or fmt == GGUF:
        raise UserError(f"quant must be one of {', '.join(QUANT_BITS)} (gguf weights are loaded from a GGUF file)")
    if getattr(loaded.model, "sparrow_quantization", None) is not None:
        raise UserError(f"{loaded.name!r} is already quantized ({loaded.model.sparrow_quantization.name})")
    copies = _COPIES.setdefault(loaded.model, {})
    key = (fmt, group_size, dense)
    if key not in copies:
        entry = quantized_cache_entry(loaded, fmt, group_size, cache_dir)
        copies[key] = quantize_model(loaded.model, fmt, group_size, cache_entry=entry, dense=dense, report=report)
        if entry is not None and cache.status(entry).state == "complete":
            with contextlib.suppress(OSError):  # sparrow's first cache format: a bare file beside the entry
                entry.with_name(entry.name + ".safetensors").unlink(missing_ok=True)
    return LoadedModel(model=copies[key], tokenizer=loaded.tokenizer, name=f"{loaded.name} ({fmt})",
                       processor=loaded.processor)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers a decoding step reads (tied / shared tensors counted once; the dense
    weights a draft's quantized layers keep for long forwards are not)."""
    dense = {id(m.dense) for m in model.modules() if isinstance(m, QuantizedLinear) and m.dense is not None}
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in dense:
            continue
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def describe(model: nn.Module) -> str:
    """'int4 (g128, 197 layers)' for a quantized copy, 'bfloat16' otherwise."""
    info = getattr(model, "sparrow_quantization", None)
    if info is None:
        return str(next(model.parameters()).dtype).removeprefix("torch.")
    group = f"g{info.group_size}, " if info.format == "int4" else ""
    return f"{info.name} ({group}{len(info.quantized)} layers)"


def summary(model: nn.Module) -> dict[str, object]:
    """JSON-ready description of a model's quantization."""
    info = getattr(model, "sparrow_quantization", None)
    if info is None:
        return {"quant": None}
    return {"quant": info.name, "group_size": info.group_size, "quantized_layers": len(info.quantized),
            "skipped_layers": list(info.skipped)}


__all__ = [
    "QUANT_BITS",
    "GGUF",
    "W8A8",
    "QuantizedLinear",
    "DynamicInt8Linear",
    "QuantizationInfo",
    "quantize_model",
    "quantized_copy",
    "quantized_cache_entry",
    "parse_quant",
    "weight_bytes",
    "describe",
    "summary",
]

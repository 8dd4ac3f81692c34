"""Weight-only quantized copies of a model: int8 per output channel, or int4 in groups.

A thin wrapper over torch's own packed kernels (no hand-written kernels):

* int8: ``aten._weight_int8pack_mm`` (CPU and CUDA): symmetric, one scale per output channel.
* int4: ``aten._weight_int4pack_mm_for_cpu`` on the CPU, ``aten._weight_int4pack_mm`` (tinygemm)
  on CUDA: asymmetric, one (scale, zero) pair per group of ``group_size`` input channels,
  ``w ~= (q - 8) * scale + zero`` with ``q`` in 0..15 (torchao's ``int4_weight_only`` layout).

``quantize_model`` returns a *copy*: every ``nn.Linear`` whose shape the kernel takes becomes a
``QuantizedLinear``; everything else (embeddings, norms, layers the kernel can't take) is shared
with the source model, read-only. The source model's weights are never modified. Activations
stay in the model's dtype (the layer casts to the kernel's dtype and back where needed).

Decoding a quantized copy is *not* the source model: used as a draft (quantized self-draft,
quantized draft model) the output stays exactly the target's; used as the target (``--quant``),
speculation is lossless relative to the quantized target only.
"""

from __future__ import annotations

import copy
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from sparrow.models import LoadedModel, PRESETS
from sparrow.models.presets import default_cache_dir
from sparrow.errors import UserError

QUANT_BITS: dict[str, int] = {"int8": 8, "int4": 4}
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 128
CUDA_INT4_INNER_K_TILES = 8  # tinygemm tiling: K must be a multiple of 16 * inner_k_tiles
FORMAT_VERSION = 1  # bump when the on-disk layout changes
DENSE_FROM_TOKENS = 16  # with a dense fallback, forwards of >= this many tokens (prefill) use it


def parse_quant(quant: str | int | None, argument: str = "quant") -> int | None:
    """'int8' / 'int4' / 8 / 4 -> bits; None -> None. Raises ValueError naming `argument`."""
    if quant is None:
        return None
    if isinstance(quant, int) and not isinstance(quant, bool) and quant in QUANT_BITS.values():
        return quant
    if isinstance(quant, str) and quant.lower() in QUANT_BITS:
        return QUANT_BITS[quant.lower()]
    raise UserError(f"invalid {argument} {quant!r}: expected one of {', '.join(QUANT_BITS)}")


def check_quant_args(drafter: str, quant: str | None, draft_quant: str | None, has_draft_model: bool) -> None:
    """Cheap validation of --quant / --draft-quant, run before any model is loaded."""
    parse_quant(quant, "quant")
    parse_quant(draft_quant, "draft_quant")
    if quant is not None and drafter == "quantized-self":
        raise UserError("drafter 'quantized-self' drafts with a quantized copy of an unquantized target; "
                         "drop --quant (or use --drafter draft-model with --draft-quant)")
    if draft_quant is not None and not has_draft_model and drafter != "quantized-self":
        raise UserError(f"draft_quant needs a draft model, and drafter {drafter!r} has none")


def check_device(bits: int, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, with a clear message, devices and dtypes torch has no packed kernel for."""
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"int{bits} weight-only quantization runs on cpu or cuda, not {device.type}")
    if device.type == "cuda" and bits == 4 and torch.cuda.get_device_capability(device) < (8, 0):
        raise UserError("int4 weight-only quantization on CUDA needs compute capability >= 8.0 (tinygemm, bfloat16)")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UserError(f"weight-only quantization needs a floating-point model, got {dtype}")


def kernel_takes(bits: int, out_features: int, in_features: int, group_size: int, device: torch.device) -> bool:
    """Whether the packed kernel accepts a [out_features, in_features] weight."""
    if bits == 8:
        return True
    k_multiple = 16 * CUDA_INT4_INNER_K_TILES if device.type == "cuda" else group_size
    return in_features % group_size == 0 and in_features % k_multiple == 0 and out_features % 8 == 0


def _kernel_dtype(bits: int, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Activation dtype the kernel computes in (tinygemm on CUDA takes bfloat16 only)."""
    return torch.bfloat16 if bits == 4 and device.type == "cuda" else dtype


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N] float32), symmetric per output channel."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (q int32 [N, K] in 0..15, scales_and_zeros float32 [K / group_size, N, 2]).

    Asymmetric per group: w ~= (q - 8) * scale + zero, the layout torch's int4 kernels read.
    """
    n, k = weight.shape
    assert k % group_size == 0, (tuple(weight.shape), group_size)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-10)  # [N, K / group]
    zeros = low + 8 * scales
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def pack_int4(q: Tensor, device: torch.device) -> Tensor:
    """int32 [N, K] in 0..15 -> the device's packed int4 layout (CPU and CUDA layouts differ)."""
    if device.type == "cuda":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)  # [N, K / 2]
        return torch.ops.aten._convert_weight_to_int4pack(pairs, CUDA_INT4_INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device), 1)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W stored packed (int8 or int4); a drop-in for nn.Linear at inference."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, packed: Tensor,
                 scales: Tensor, bias: Tensor | None, dense: Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.register_buffer("packed", packed)  # int8 [N, K] or the device's packed int4 layout
        self.register_buffer("scales", scales)  # int8: [N]; int4: [K / group_size, N, 2], kernel dtype
        self.bias = bias  # shared with the source layer (read-only), or None
        # The packed kernels cost ~linear in the number of tokens (a 300-token prefill runs 2.5-3.5x
        # slower than bf16), so a draft may keep the source's dense weight (shared, no copy) for
        # long forwards. It is the source's own nn.Parameter (so it counts in .parameters()), never
        # a buffer: it is not part of the quantized state and is not written to the disk cache.
        self.dense = dense  # [N, K] or None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int, keep_dense: bool = False) -> QuantizedLinear:
        weight = linear.weight
        dtype = _kernel_dtype(bits, weight.device, weight.dtype)
        if bits == 8:
            q, scales = quantize_int8(weight)
            packed = q
        else:
            q, scales = quantize_int4(weight, group_size)
            packed = pack_int4(q, weight.device)
        return cls(linear.in_features, linear.out_features, bits, group_size, packed,
                   scales.to(device=weight.device, dtype=dtype), linear.bias, weight if keep_dense else None)

    @property
    def weight(self) -> Tensor:
        """A data-less [out_features, in_features] stand-in, for code that reads `.weight.shape`
        (e.g. the width of an LM head); the real weight is `packed` + `scales`."""
        return torch.empty(self.out_features, self.in_features, dtype=self.scales.dtype, device="meta")

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape  # [..., in_features]
        if self.dense is not None and x.numel() >= DENSE_FROM_TOKENS * self.in_features:
            return nn.functional.linear(x, self.dense, self.bias)
        x2 = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.packed, self.scales)
        elif x2.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}{group}"


@dataclass(frozen=True)
class QuantizationInfo:
    """Set as `model.sparrow_quantization` on every quantized copy."""

    bits: int
    group_size: int
    quantized: tuple[str, ...]  # names of the layers replaced by QuantizedLinear
    skipped: tuple[str, ...]  # nn.Linear layers the kernel can't take (kept dense, shared)
    from_disk: bool  # loaded from the disk cache rather than quantized now

    @property
    def name(self) -> str:
        return f"int{self.bits}"


def _shared_copy(model: nn.Module) -> nn.Module:
    """A structural copy of `model` whose parameters and buffers are the source's own tensors."""
    memo: dict[int, object] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _cache_metadata(model: nn.Module, bits: int, group_size: int, device: torch.device) -> dict[str, str]:
    dtype = next(model.parameters()).dtype
    return {"format": str(FORMAT_VERSION), "bits": str(bits), "group_size": str(group_size),
            "device_type": device.type, "dtype": str(dtype), "torch": torch.__version__}


def _load_cached(path: Path, metadata: dict[str, str], device: torch.device) -> dict[str, Tensor] | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            if f.metadata() is None or {k: f.metadata().get(k) for k in metadata} != metadata:
                return None  # another torch (packed layout), dtype or device type: rebuild
            return {key: f.get_tensor(key) for key in f.keys()}
    except (OSError, ValueError, RuntimeError):
        return None  # missing or unreadable: rebuild


def _save_cached(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the complete new one
    finally:
        tmp.unlink(missing_ok=True)


def quantize_model(model: nn.Module, bits: int | str, group_size: int = DEFAULT_GROUP_SIZE,
                   cache_file: Path | str | None = None, keep_dense: bool = False) -> nn.Module:
    """A weight-only quantized copy of `model` (int8 or int4); `model` itself is left untouched.

    Every nn.Linear the kernel can take (lm_head included) is quantized; the rest is shared.
    With `cache_file`, the packed weights are read from it when it matches (bits, group size,
    dtype, device type, torch version) and written to it otherwise. With `keep_dense`, forwards
    of >= DENSE_FROM_TOKENS tokens (prefill) use the source's dense weights: for drafts only (the
    output of a draft never changes the result), since it keeps the source weights alive and makes
    the copy's numerics depend on the forward's length.
    """
    bits = parse_quant(bits, "bits")
    if bits is None:
        raise UserError("bits must be int8 or int4")
    if bits == 4 and group_size not in INT4_GROUP_SIZES:
        raise UserError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    first = next(model.parameters())
    check_device(bits, first.device, first.dtype)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    take = {n: m for n, m in linears.items() if kernel_takes(bits, m.out_features, m.in_features, group_size,
                                                              m.weight.device)}
    if not take:
        raise UserError(f"int{bits} (group size {group_size}): the kernel takes none of the model's linear layers "
                         f"(int4 needs in_features divisible by the group size and out_features by 8)")
    metadata = _cache_metadata(model, bits, group_size, first.device)
    path = Path(cache_file).expanduser() if cache_file is not None else None
    cached = _load_cached(path, metadata, first.device) if path is not None else None
    if cached is not None and any(f"{n}.packed" not in cached for n in take):
        cached = None
    clone = _shared_copy(model)
    for name, linear in take.items():
        if cached is not None:
            layer = QuantizedLinear(linear.in_features, linear.out_features, bits, group_size,
                                    cached[f"{name}.packed"], cached[f"{name}.scales"], linear.bias,
                                    linear.weight if keep_dense else None)
        else:
            layer = QuantizedLinear.from_linear(linear, bits, group_size, keep_dense)
        _set_module(clone, name, layer)
    if path is not None and cached is None:
        try:
            _save_cached(path, {f"{n}.{b}": t for n in take for b, t in clone.get_submodule(n).named_buffers()},
                         metadata)
        except OSError:
            pass  # the cache is an optimisation only
    clone.sparrow_quantization = QuantizationInfo(bits, group_size, tuple(take), tuple(sorted(set(linears) - set(take))),
                                                  from_disk=cached is not None)
    return clone.eval()


_COPIES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int, bool], nn.Module]] = weakref.WeakKeyDictionary()


def quantized_cache_file(loaded: LoadedModel, bits: int, group_size: int,
                         cache_dir: Path | str | None = None) -> Path | None:
    """Disk cache of a preset's quantized copy, under <sparrow cache>/quantized/; None for other models."""
    if loaded.name.strip().lower() not in PRESETS:
        return None
    first = next(loaded.model.parameters())
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dtype = str(first.dtype).removeprefix("torch.")
    return root / "quantized" / f"{loaded.name.strip().lower()}-{dtype}-int{bits}-g{group_size}-{first.device.type}.safetensors"


def quantized_copy(loaded: LoadedModel, quant: str | int, group_size: int = DEFAULT_GROUP_SIZE,
                   cache_dir: Path | str | None = None, keep_dense: bool = False) -> LoadedModel:
    """The quantized copy of `loaded`, built once per (model, bits, group size, keep_dense) in this
    process, and for presets read from / written to the disk cache. keep_dense: for drafts only."""
    bits = parse_quant(quant)
    if bits is None:
        raise UserError("quant must be int8 or int4")
    if getattr(loaded.model, "sparrow_quantization", None) is not None:
        raise UserError(f"{loaded.name!r} is already quantized ({loaded.model.sparrow_quantization.name})")
    copies = _COPIES.setdefault(loaded.model, {})
    key = (bits, group_size, keep_dense)
    if key not in copies:
        path = quantized_cache_file(loaded, bits, group_size, cache_dir)
        copies[key] = quantize_model(loaded.model, bits, group_size, cache_file=path, keep_dense=keep_dense)
    return LoadedModel(model=copies[key], tokenizer=loaded.tokenizer, name=f"{loaded.name} (int{bits})",
                       processor=loaded.processor)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers a forward reads (tied / shared tensors counted once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def describe(model: nn.Module) -> str:
    """'int4 (g128, 197 layers)' for a quantized copy, 'bfloat16' otherwise."""
    info = getattr(model, "sparrow_quantization", None)
    if info is None:
        return str(next(model.parameters()).dtype).removeprefix("torch.")
    group = f"g{info.group_size}, " if info.bits == 4 else ""
    return f"{info.name} ({group}{len(info.quantized)} layers)"


def summary(model: nn.Module) -> dict[str, object]:
    """JSON-ready description of a model's quantization."""
    info = getattr(model, "sparrow_quantization", None)
    if info is None:
        return {"quant": None}
    return {"quant": info.name, "group_size": info.group_size, "quantized_layers": len(info.quantized),
            "skipped_layers": list(info.skipped)}


__all__ = ["QUANT_BITS", "check_quant_args", "QuantizedLinear", "QuantizationInfo", "quantize_model", "quantized_copy",
           "quantized_cache_file", "parse_quant", "weight_bytes", "describe", "summary"]

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
speculation is lossless relative to the quantized target only.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import struct
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from sparrow.models import LoadedModel, PRESETS, cache
from sparrow.models.presets import default_cache_dir
from sparrow.errors import UserError

QUANT_BITS: dict[str, int] = {"int8": 8, "int4": 4, "w8a8": 8}  # format -> bits per weight
W8A8 = "w8a8"
AUTO = "auto"  # --draft-quant auto: the draft format this machine runs fastest (sparrow.hardware.choose_draft_quant)
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 128
CUDA_INT4_INNER_K_TILES = 8  # tinygemm tiling: K must be a multiple of 16 * inner_k_tiles
CPU_INT8_K_MULTIPLE = 16  # the CPU int8 kernel reads each weight row with 16-byte-aligned loads
CPU_INT4_N_MULTIPLE = 16  # the CPU int4 packing takes output rows in blocks of 16
FORMAT_VERSION = 2  # bump when the on-disk layout changes (2: a cache entry directory with a manifest)
WEIGHTS_FILE = "weights.safetensors"  # the packed weights inside a quantized cache entry
DENSE_FROM_TOKENS = 16  # with a dense fallback, forwards of >= this many tokens (prefill) use it


def parse_quant(quant: str | int | None, argument: str = "quant", auto: bool = False) -> str | None:
    """'int8' / 'int4' / 'w8a8' / 8 / 4 -> the format's name; None -> None; where `auto` is allowed (a draft's
    format), also 'auto' -> 'auto' (chosen by sparrow.hardware) and 'none' -> None (dense). Raises UserError
    naming `argument`."""
    if quant is None:
        return None
    if isinstance(quant, int) and not isinstance(quant, bool) and quant in (4, 8):
        return f"int{quant}"
    if isinstance(quant, str) and quant.lower() in QUANT_BITS:
        return quant.lower()
    if auto and isinstance(quant, str) and quant.lower() in (AUTO, "none"):
        return AUTO if quant.lower() == AUTO else None
    names = (AUTO, "none", *QUANT_BITS) if auto else tuple(QUANT_BITS)
    raise UserError(f"invalid {argument} {quant!r}: expected one of {', '.join(names)}")


def resolve_draft_quant(draft_quant: str | int | None, drafter: str, has_draft_model: bool,
                        device: str | torch.device | None, dtype: torch.dtype | None = None) -> str | None:
    """--draft-quant checked before any model is loaded. 'auto' becomes None for a drafter without a draft model,
    the format sparrow.hardware measured fastest for one row on `device` in `dtype` (the target's) for
    quantized-self (None: its int4 default), and stays 'auto' for a draft model (`draft_format` settles it once the
    draft is loaded)."""
    fmt = parse_quant(draft_quant, "draft_quant", auto=True)
    if fmt != AUTO:
        return fmt
    if drafter == "quantized-self":
        from sparrow.hardware import choose_draft_quant

        return choose_draft_quant(device, dtype=dtype)[0]
    return AUTO if has_draft_model else None


def draft_format(model: nn.Module | None, draft_quant: str | None) -> str | None:
    """The format a loaded draft model runs in: `draft_quant`, or for 'auto' the format sparrow.hardware measured
    fastest for one row on the model's device in its dtype, where that kernel takes at least one of the model's
    linear layers (None, a dense draft, otherwise and where there is no draft)."""
    if draft_quant != AUTO:
        return draft_quant
    if model is None:
        return None
    from sparrow.hardware import choose_draft_quant

    weight = next(model.parameters())
    device = weight.device
    fmt = choose_draft_quant(device, dtype=weight.dtype)[0]
    if fmt is None:
        return None
    kind = W8A8 if fmt == W8A8 else QUANT_BITS[fmt]
    takes = any(kernel_takes(kind, m.out_features, m.in_features, DEFAULT_GROUP_SIZE, device)
                for m in model.modules() if type(m) is nn.Linear)
    return fmt if takes else None


def check_quant_args(drafter: str, quant: str | None, draft_quant: str | None, has_draft_model: bool) -> None:
    """Cheap validation of --quant / --draft-quant, run before any model is loaded."""
    parse_quant(quant, "quant")
    parse_quant(draft_quant, "draft_quant", auto=True)
    if quant is not None and drafter == "quantized-self":
        raise UserError("drafter 'quantized-self' drafts with a quantized copy of an unquantized target; "
                         "drop --quant (or use --drafter draft-model with --draft-quant)")
    if quant is not None and drafter == "layer-skip":
        raise UserError("drafter 'layer-skip' needs an unquantized target (its skip sets are tuned on the dense "
                         "model); drop --quant")
    if draft_quant is not None and not has_draft_model and drafter != "quantized-self":
        raise UserError(f"draft_quant needs a draft model, and drafter {drafter!r} has none")


def check_device(fmt: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, with a clear message, devices and dtypes torch has no packed kernel for."""
    if fmt == W8A8 and device.type != "cpu":
        raise UserError(f"w8a8 runs on the CPU only (fbgemm's int8 kernels), not {device.type}; "
                        "use int8 or int4 (weight-only) there")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"{fmt} weight-only quantization runs on cpu or cuda, not {device.type}")
    if device.type == "cuda" and fmt == "int4" and torch.cuda.get_device_capability(device) < (8, 0):
        raise UserError("int4 weight-only quantization on CUDA needs compute capability >= 8.0 (tinygemm, bfloat16)")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UserError(f"quantization needs a floating-point model, got {dtype}")


def kernel_takes(bits: int | str, out_features: int, in_features: int, group_size: int, device: torch.device) -> bool:
    """Whether the packed kernel accepts a [out_features, in_features] weight.

    int8 on the CPU needs K % 16 == 0 (and 16-byte-aligned weights, see _load_cached): in bfloat16
    the kernel crashes (SIGSEGV) on forwards of 4+ tokens otherwise (torch 2.14, avx512). int4 on the CPU
    packs N in blocks of 16 output rows (`_convert_weight_to_int4pack_for_cpu` refuses other N).
    w8a8 (fbgemm) takes any shape."""
    if bits == W8A8:
        return True
    if bits in (8, "int8"):
        return device.type != "cpu" or in_features % CPU_INT8_K_MULTIPLE == 0
    k_multiple = 16 * CUDA_INT4_INNER_K_TILES if device.type == "cuda" else group_size
    n_multiple = 8 if device.type == "cuda" else CPU_INT4_N_MULTIPLE
    return in_features % group_size == 0 and in_features % k_multiple == 0 and out_features % n_multiple == 0


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


def _vnni() -> bool:
    """Whether the CPU multiplies u8 x s8 without int16 saturation (VNNI): then w8a8 uses all 8 activation bits."""
    from sparrow.hardware import cpu_info

    return any(flag in cpu_info().flags for flag in ("avx512_vnni", "avx_vnni"))


def _prepack(qweight: Tensor, scales: Tensor) -> object:
    """fbgemm's packing of an int8 [N, K] weight with one scale per output channel."""
    with warnings.catch_warnings():  # torch marks its quantized tensor types deprecated; fbgemm is the x86 kernel
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(qweight, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None)


def _int8_matmul(x: Tensor, params: object, pads: Tensor, reduce_range: bool) -> Tensor:
    """x [..., K] times a prepacked int8 weight [N, K + pad] -> [..., N] in x's dtype, each row quantized on its own
    (see DynamicInt8Linear)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    peak = x2.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)  # [T, 1]
    rows = torch.cat([x2 / peak, pads.expand(x2.shape[0], -1)], dim=-1)  # [T, K + pad], range exactly [-1, 1]
    y = (torch.ops.quantized.linear_dynamic(rows, params, reduce_range) * peak).to(x.dtype)  # [T, N]
    return y.reshape(*x.shape[:-1], y.shape[-1])


class DynamicInt8Linear(nn.Module):
    """y = x W^T + b in integers: int8 W (one scale per output channel), int8 x quantized per token at run time.

    fbgemm's dynamic linear picks ONE activation range per call (the whole [tokens, K] input), which would
    make a token's output depend on the other tokens of the forward, so a multi-token verify would not
    equal one-token decoding. Each row is therefore divided by its own max |x| and given extra input
    columns, +1, -1 and zeros up to a multiple of 16 (fbgemm runs ~2x slower on ragged K), whose weights are
    zero: every call then sees exactly the range [-1, 1], each row is
    quantized on its own, the int32 accumulation is exact in any blocking, and the row is scaled back
    after. A token's output is bit-identical whatever else the forward holds (tests/test_quantization.py).
    A w8a8 copy also attends row by row in short forwards (`sparrow.rowwise_attention`), so a verify forward
    equals one-token decoding of the copy bit for bit and speculation is lossless relative to it. Activations
    lose what 8 bits per token lose (7 bits without VNNI, where fbgemm's u8 x s8 pairs would saturate)."""

    def __init__(self, in_features: int, out_features: int, qweight: Tensor, scales: Tensor, bias: Tensor | None,
                 reduce_range: bool) -> None:
        super().__init__()
        assert qweight.shape == (out_features, in_features) and qweight.dtype == torch.int8, qweight.shape
        self.in_features, self.out_features, self.reduce_range = in_features, out_features, reduce_range
        self.bias = bias  # shared with the source layer (read-only), or None
        pad = 2 + (-(in_features + 2)) % 16
        padded = torch.cat([qweight, qweight.new_zeros(out_features, pad)], dim=1)  # [N, K + pad]
        self.params = _prepack(padded, scales)
        self.group: SiblingGroup | None = None  # set by SiblingGroup, which then holds the weights
        self.slot = 0
        self.register_buffer("scales", scales.float())  # [N]
        self.register_buffer("pads", torch.tensor([[1.0, -1.0] + [0.0] * (pad - 2)]), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, reduce_range: bool | None = None) -> DynamicInt8Linear:
        """reduce_range: 7-bit activations (default: where the CPU has no VNNI)."""
        q, scales = quantize_int8(linear.weight)
        reduce_range = not _vnni() if reduce_range is None else reduce_range
        return cls(linear.in_features, linear.out_features, q, scales, linear.bias, reduce_range)

    def int8_weight(self) -> Tensor:
        """The int8 [N, K] weight (read back from fbgemm's packing, or from its group's)."""
        if self.group is not None:
            return self.group.int8_weight(self.slot)
        qw, _ = torch.ops.quantized.linear_unpack(self.params)
        return qw.int_repr()[:, : self.in_features].contiguous()

    def tensors(self) -> dict[str, Tensor]:
        return {"packed": self.int8_weight(), "scales": self.scales}

    @property
    def weight(self) -> Tensor:
        """A data-less [out_features, in_features] stand-in (see QuantizedLinear.weight)."""
        return torch.empty(self.out_features, self.in_features, dtype=torch.float32, device="meta")

    def forward(self, x: Tensor) -> Tensor:
        y = self.group.output(self.slot, x) if self.group is not None else _int8_matmul(x, self.params, self.pads,
                                                                                         self.reduce_range)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Children of one module that read the same input in the architectures sparrow runs (an attention's
projections, a gated MLP's two halves)."""


class SiblingGroup:
    """w8a8 layers that read the same input (an attention's q / k / v, an MLP's gate / up) as ONE fbgemm call.

    The first member called multiplies the input by all the members' int8 weights at once (concatenated:
    the weights are packed only here, once) and keeps the others' columns until each member takes its own;
    a member called with another input, or the same one again, computes afresh. Every output column is the
    member's own: the same int8 row, the same int32 sum, the same scale, so the results equal separate calls
    bit for bit (tests/test_quantization.py), one call instead of three cuts what each call costs besides the
    matmul (a 1.5B decoding step: 197 -> 113 calls)."""

    def __init__(self, members: list[DynamicInt8Linear]) -> None:
        first = members[0]
        assert len(members) > 1 and all(m.group is None and m.in_features == first.in_features
                                        and m.reduce_range == first.reduce_range for m in members)
        weights = [m.int8_weight() for m in members]
        self.sizes = [w.shape[0] for w in weights]
        padded = torch.cat([torch.cat(weights), torch.zeros(sum(self.sizes), first.pads.shape[1], dtype=torch.int8)], 1)
        self.params = _prepack(padded, torch.cat([m.scales for m in members]))  # [sum N, K + pad]
        self.pads, self.reduce_range = first.pads, first.reduce_range
        self._input: Tensor | None = None
        self._version = -2
        self._outputs: list[Tensor | None] = []
        for slot, member in enumerate(members):
            member.group, member.slot, member.params = self, slot, None

    def output(self, slot: int, x: Tensor) -> Tensor:
        """Member `slot`'s x W^T (no bias) [..., N_slot]."""
        version = _version(x)
        if self._input is not x or self._version != version or self._outputs[slot] is None:
            y = _int8_matmul(x, self.params, self.pads, self.reduce_range)
            self._outputs = list(y.split(self.sizes, dim=-1))
            self._input, self._version = x, version
        out, self._outputs[slot] = self._outputs[slot], None
        if all(o is None for o in self._outputs):
            self._input = None  # hold nothing between forwards
        return out.contiguous()

    def int8_weight(self, slot: int) -> Tensor:
        qw, _ = torch.ops.quantized.linear_unpack(self.params)
        start = sum(self.sizes[:slot])
        return qw.int_repr()[start: start + self.sizes[slot], : qw.shape[1] - self.pads.shape[1]].contiguous()


def _version(x: Tensor) -> int:
    """x's in-place modification counter; -1 for inference tensors, which have none (then the object alone
    identifies the input: the architectures of SIBLINGS never modify it between the siblings' calls)."""
    return -1 if x.is_inference() else x._version


def group_siblings(model: nn.Module) -> None:
    """Group `model`'s w8a8 siblings (SIBLINGS) into SiblingGroups."""
    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if all(type(m) is DynamicInt8Linear and m.group is None for m in members) and \
                    len({(m.in_features, m.reduce_range) for m in members}) == 1:
                SiblingGroup(members)


def _layer_tensors(layer: nn.Module) -> dict[str, Tensor]:
    """What the disk cache keeps of a quantized layer."""
    return layer.tensors() if isinstance(layer, DynamicInt8Linear) else dict(layer.named_buffers())


@dataclass(frozen=True)
class QuantizationInfo:
    """Set as `model.sparrow_quantization` on every quantized copy."""

    format: str  # "int8", "int4" or "w8a8"
    group_size: int
    quantized: tuple[str, ...]  # names of the layers replaced by QuantizedLinear / DynamicInt8Linear
    skipped: tuple[str, ...]  # nn.Linear layers the kernel can't take (kept dense, shared)
    from_disk: bool  # loaded from the disk cache rather than quantized now

    @property
    def bits(self) -> int:
        return QUANT_BITS[self.format]

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


def _quantize_layers(model: nn.Module, take: dict[str, nn.Linear], fmt: str, group_size: int, keep_dense: bool,
                     cached: dict[str, Tensor] | None) -> nn.Module:
    """A shared copy of `model` with the `take` layers replaced by QuantizedLinear or DynamicInt8Linear
    (from `cached` if given)."""
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
                                    linear.weight if keep_dense else None)
        else:
            layer = QuantizedLinear.from_linear(linear, bits, group_size, keep_dense)
        _set_module(clone, name, layer)
    return clone


def _buffers(clone: nn.Module, take: dict[str, nn.Linear]) -> dict[str, Tensor]:
    return {f"{n}.{b}": t for n in take for b, t in _layer_tensors(clone.get_submodule(n)).items()}


def quantize_model(model: nn.Module, quant: int | str, group_size: int = DEFAULT_GROUP_SIZE,
                   cache_entry: Path | str | None = None, keep_dense: bool = False,
                   report: Callable[[str], None] | None = None) -> nn.Module:
    """A quantized copy of `model` (int8, int4 or w8a8); `model` itself is left untouched.

    Every nn.Linear the kernel can take (lm_head included) is quantized; the rest is shared.
    With `cache_entry` (a directory, see sparrow.models.cache), the packed weights are read from it
    when it is intact and matches (bits, group size, dtype, device type, torch version, layer shapes),
    and written to it otherwise; `report` gets the cache's problems (damaged entry rebuilt, cache not
    writable; default: stderr). With `keep_dense`, forwards of >= DENSE_FROM_TOKENS tokens (prefill)
    use the source's dense weights: for drafts only (the output of a draft never changes the result),
    since it keeps the source weights alive and makes the copy's numerics depend on the forward's length.
    """
    fmt = parse_quant(quant, "quant")
    if fmt is None:
        raise UserError(f"quant must be one of {', '.join(QUANT_BITS)}")
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
        clone = _quantize_layers(model, take, fmt, group_size, keep_dense, None)
    else:
        entry = Path(cache_entry).expanduser()
        with cache.open_entry(entry, _cache_meta(take, fmt, group_size, first.device), report or _stderr) as slot:
            cached = _load_cached(entry / WEIGHTS_FILE, first.device) if slot.ready else None
            if cached is not None and any(f"{n}.{b}" not in cached for n in take for b in ("packed", "scales")):
                cached = None
            clone = _quantize_layers(model, take, fmt, group_size, keep_dense, cached)
            if cached is None:
                slot.commit(lambda directory: _save_cached(directory, _buffers(clone, take)))
    if fmt == W8A8:  # its int8 activations would amplify the last-bit differences of batched attention
        from sparrow.rowwise_attention import use_rowwise

        use_rowwise(clone)
        group_siblings(clone)
    clone.sparrow_quantization = QuantizationInfo(fmt, group_size, tuple(take), tuple(sorted(set(linears) - set(take))),
                                                  from_disk=cached is not None)
    return clone.eval()


_COPIES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int, bool], nn.Module]] = weakref.WeakKeyDictionary()


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
                   cache_dir: Path | str | None = None, keep_dense: bool = False,
                   report: Callable[[str], None] | None = None) -> LoadedModel:
    """The quantized copy of `loaded`, built once per (model, bits, group size, keep_dense) in this
    process, and for presets read from / written to the disk cache. keep_dense: for drafts only.
    `report`: see quantize_model."""
    fmt = parse_quant(quant)
    if fmt is None:
        raise UserError(f"quant must be one of {', '.join(QUANT_BITS)}")
    if getattr(loaded.model, "sparrow_quantization", None) is not None:
        raise UserError(f"{loaded.name!r} is already quantized ({loaded.model.sparrow_quantization.name})")
    copies = _COPIES.setdefault(loaded.model, {})
    key = (fmt, group_size, keep_dense)
    if key not in copies:
        entry = quantized_cache_entry(loaded, fmt, group_size, cache_dir)
        copies[key] = quantize_model(loaded.model, fmt, group_size, cache_entry=entry, keep_dense=keep_dense,
                                     report=report)
        if entry is not None and cache.status(entry).state == "complete":
            with contextlib.suppress(OSError):  # sparrow's first cache format: a bare file beside the entry
                entry.with_name(entry.name + ".safetensors").unlink(missing_ok=True)
    return LoadedModel(model=copies[key], tokenizer=loaded.tokenizer, name=f"{loaded.name} ({fmt})",
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
    group = f"g{info.group_size}, " if info.format == "int4" else ""
    return f"{info.name} ({group}{len(info.quantized)} layers)"


def summary(model: nn.Module) -> dict[str, object]:
    """JSON-ready description of a model's quantization."""
    info = getattr(model, "sparrow_quantization", None)
    if info is None:
        return {"quant": None}
    return {"quant": info.name, "group_size": info.group_size, "quantized_layers": len(info.quantized),
            "skipped_layers": list(info.skipped)}


__all__ = ["QUANT_BITS", "W8A8", "check_quant_args", "QuantizedLinear", "DynamicInt8Linear", "QuantizationInfo", "quantize_model", "quantized_copy",
           "quantized_cache_entry", "parse_quant", "weight_bytes", "describe", "summary"]

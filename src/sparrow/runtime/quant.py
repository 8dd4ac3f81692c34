"""Quantized linear kernels: weight-only int8 per output channel or int4 in groups, and w8a8.

A thin wrapper over torch's own packed kernels (no hand-written kernels):

* int8: ``aten._weight_int8pack_mm`` (CPU and CUDA): symmetric, one scale per output channel.
* int4: ``aten._weight_int4pack_mm_for_cpu`` on the CPU, ``aten._weight_int4pack_mm`` (tinygemm)
  on CUDA: asymmetric, one (scale, zero) pair per group of ``group_size`` input channels,
  ``w ~= (q - 8) * scale + zero`` with ``q`` in 0..15 (torchao's ``int4_weight_only`` layout).
* w8a8 (CPU only): int8 weights per output channel *and* int8 activations quantized per token at run
  time, multiplied in integers by fbgemm (``quantized.linear_dynamic``, the x86 VNNI kernels behind
  ``torch.ao``'s dynamic quantization). See ``DynamicInt8Linear`` for why it stays batch-invariant.

Model copies built from these layers, and their disk cache: ``sparrow.models.quantization``.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.runtime.cpu import cpu_info

W8A8 = "w8a8"



CUDA_INT4_INNER_K_TILES = 8  # tinygemm tiling: K must be a multiple of 16 * inner_k_tiles



CPU_INT8_K_MULTIPLE = 16  # the CPU int8 kernel reads each weight row with 16-byte-aligned loads



CPU_INT4_N_MULTIPLE = 16  # the CPU int4 packing takes output rows in blocks of 16



DENSE_FROM_TOKENS = 16  # with a dense fallback, forwards of >= this many tokens (prefill) use it



def check_device(fmt: str, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Refuse, with a clear message, devices and dtypes torch has no packed kernel for (dtype None: the device
    only, as `sparrow.load` checks before loading)."""
    if fmt == "gguf" and device.type != "cpu":
        raise UserError(f"gguf (the GGUF file's own blocks) runs on the CPU only, not {device.type}")
    if fmt == W8A8 and device.type != "cpu":
        raise UserError(f"w8a8 runs on the CPU only (fbgemm's int8 kernels), not {device.type}; "
                        "use int8 or int4 (weight-only) there")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"{fmt} weight-only quantization runs on cpu or cuda, not {device.type}")
    if device.type == "cuda" and fmt == "int4" and torch.cuda.get_device_capability(device) < (8, 0):
        raise UserError("int4 weight-only quantization on CUDA needs compute capability >= 8.0 (tinygemm, bfloat16)")
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
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
    return any(flag in cpu_info().flags for flag in ("avx512_vnni", "avx_vnni"))



def _prepack(qweight: Tensor, scales: Tensor) -> object:
    """fbgemm's packing of an int8 [N, K] weight with one scale per output channel."""
    with warnings.catch_warnings():  # torch marks its quantized tensor types deprecated; fbgemm is the x86 kernel
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            qweight, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0
        )
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
    after. A token's output is bit-identical whatever else the forward holds (tests/models/test_quantization.py).
    A w8a8 copy also attends row by row in short forwards (`sparrow.runtime.attention.rowwise`), so a verify forward
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



class SiblingGroup:
    """w8a8 layers that read the same input (an attention's q / k / v, an MLP's gate / up) as ONE fbgemm call.

    The first member called multiplies the input by all the members' int8 weights at once (concatenated:
    the weights are packed only here, once) and keeps the others' columns until each member takes its own;
    a member called with another input, or the same one again, computes afresh. Every output column is the
    member's own: the same int8 row, the same int32 sum, the same scale, so the results equal separate calls
    bit for bit (tests/models/test_quantization.py), one call instead of three cuts what each call costs besides the
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


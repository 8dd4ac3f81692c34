"""float32 linear layers through oneDNN, on CPUs where torch's default float32 matmul is slow for a few rows.

torch runs a float32 ``nn.Linear`` on a CPU through its BLAS (Intel MKL in the PyPI wheels). On an AVX2-only
AMD EPYC (Zen 3; torch 2.14.1, MKL 2024.2, 2 threads) a 8960x1536 float32 matmul took 3.8 ms for one row and
11.6 ms for eight: a verify forward of 8 tokens cost ~3x a decoding step, where reading the weight once bounds
both. The same matmul through oneDNN (``torch.ops.mkldnn._linear_pointwise``, the kernel torch's inductor
uses for CPU linears), with the same dense weight and no copy, took 2.8 / 4.9 ms. ``route_linears`` sends a
model's float32 CPU linear layers there; ``sparrow.runtime.hardware`` measures both paths once per machine and
``load_model`` routes a float32 model only where oneDNN measured faster. Results agree with torch's to
float32 rounding (~3e-7 relative), so it is the same float32 model; plain decoding and verification both run
it, which keeps speculative decoding exactly lossless against it.

Only eager float32 inference on the CPU takes the path: a layer moved to another device or dtype, run with
autograd recording (a weight or an input that requires grad under ``torch.enable_grad``) or traced by
``torch.compile`` (``--compile``: inductor generates its own code for the linear) runs torch's own linear.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn


def available() -> bool:
    """Whether this torch build has oneDNN's linear kernel for CPU tensors."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN: x [..., in], weight [out, in] (float32, CPU) -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _forward(module: nn.Linear, x: Tensor) -> Tensor:
    weight = module.weight
    fast = x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
    if (not fast or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            or torch.compiler.is_compiling()):  # inductor lowers this op only for frozen (constant) weights
        return nn.Linear.forward(module, x)  # moved, cast, training or compiled since it was routed
    return linear(x, weight, module.bias)


def routed(module: nn.Module) -> bool:
    return isinstance(getattr(module, "forward", None), functools.partial) and module.forward.func is _forward


def route_linears(model: nn.Module) -> int:
    """Run every float32 CPU ``nn.Linear`` of ``model`` through oneDNN (in place; the weights stay as they are,
    so anything reading ``.weight`` is unaffected). Returns how many layers were routed."""
    count = 0
    for module in model.modules():
        if (type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"
                and not routed(module)):
            module.forward = functools.partial(_forward, module)
            count += 1
    return count


def unroute_linears(model: nn.Module) -> int:
    """Undo ``route_linears``; returns how many layers went back to torch's linear."""
    count = 0
    for module in model.modules():
        if routed(module):
            del module.forward
            count += 1
    return count

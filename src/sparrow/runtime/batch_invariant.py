"""Batch-invariant target forwards: each row of a short multi-token forward is computed exactly as a one-token
forward computes it, so a verify forward's logits equal plain decoding's bit for bit, in any dtype.

A verify forward of k tokens and k one-token decoding steps compute the same math with other reduction orders:

* attention: torch's kernels block a multi-row query differently from a single row. `sparrow.runtime.attention.rowwise`
  attends a short forward one row at a time, each through the one-token call.
* dense linear layers: on the CPU torch runs a one-row bfloat16 (and oneDNN float32) matmul through a
  matrix-vector kernel and two or more rows through a blocked matrix kernel; measured on an AMD EPYC Zen 5
  (avx512_bf16, torch 2.14.1), each row of a 2..64-row product is bit-identical to the same row in any other
  row count >= 2, but not to the one-row product. `exact_linear` therefore runs a one-row forward as two rows
  (the row twice) and keeps the first. torch's MKL float32 matmul is not row-invariant at any row count, so
  float32 layers go through oneDNN (`sparrow.runtime.onednn`, the same float32 model). Whether the kernel keeps its
  rows invariant is probed on each layer's own weight when the model is made exact (`probe`); a layer whose
  kernel fails the probe computes every row of a short forward on its own (exact, but k weight reads).
* quantized layers: torch's int8 / int4 weight-only kernels and sparrow's w8a8 layers are row-invariant as
  they are (tests/test_quantization.py); they are left alone.

Everything else a decoder runs (norms, RoPE, activations, residuals) is row by row already. Forwards of more
than `MAX_ROWS` rows (a prompt's prefill, the same in plain and speculative decoding) take the batched path.

Without this, greedy speculative decoding in bfloat16 flips near-ties now and then (output == plain decoding
on 10 of 15 questions in the issue's measurement); with it the output is plain decoding's, token for token.
`make_exact(model)` switches a model in place; `exact_copy(model)` gives a copy that shares the weights.
"""

from __future__ import annotations

import copy
import functools
import logging
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparrow.runtime import onednn
from sparrow.runtime.attention.rowwise import MAX_ROWS, use_rowwise

PROBE_ROWS = (2, 3, 4, 5, 7, 8, 9, 16, 17, 33, MAX_ROWS)  # row counts compared against the MAX_ROWS product
PAIR = "pair"  # one row runs as two; 2..MAX_ROWS rows as they are
EACH_ROW = "each-row"  # every row of a short forward on its own (as a pair): for kernels that fail the probe


def _kernel(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The matmul a layer runs: oneDNN for float32 on the CPU where torch has it, else torch's linear."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and onednn.available():
        return onednn.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _pair(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [1, K] -> [1, N], computed as the first row of a two-row product."""
    return _kernel(x.expand(2, -1).contiguous(), weight, bias)[:1]


def exact_linear(x: Tensor, weight: Tensor, bias: Tensor | None, mode: str = PAIR) -> Tensor:
    """F.linear(x, weight, bias), x [..., K] -> [..., N], with each row of a forward of <= MAX_ROWS rows computed
    as in a one-row forward (see the module doc)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > MAX_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1 or mode == EACH_ROW:
        y = torch.cat([_pair(flat[i : i + 1], weight, bias) for i in range(rows)])
    else:
        y = _kernel(flat.contiguous(), weight, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def probe(weight: Tensor, bias: Tensor | None, seed: int = 0) -> str:
    """PAIR if the kernel keeps each row of a product the same at every row count in PROBE_ROWS and as a pair,
    for this weight (random inputs from `seed`); EACH_ROW otherwise."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(MAX_ROWS, weight.shape[1], generator=generator).to(device=weight.device, dtype=weight.dtype)
    with torch.inference_mode():
        full = _kernel(x, weight, bias)
        same = all(torch.equal(_kernel(x[:m].contiguous(), weight, bias), full[:m]) for m in PROBE_ROWS[:-1])
        same = same and all(torch.equal(_pair(x[i : i + 1], weight, bias), full[i : i + 1]) for i in (0, MAX_ROWS - 1))
    return PAIR if same else EACH_ROW


def _forward(module: nn.Linear, x: Tensor) -> Tensor:
    weight = module.weight
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) \
            or x.dtype != weight.dtype or x.device != weight.device:
        return nn.Linear.forward(module, x)
    return exact_linear(x, weight, module.bias, module.sparrow_exact_mode)


def make_exact(model: nn.Module) -> dict[str, int]:
    """Switch `model` (a transformers model) in place to batch-invariant forwards: row-wise decoder attention and
    every floating nn.Linear through `exact_linear` (quantized layers are row-invariant already). Returns how
    many layers took each mode ({"pair": n, "each-row": m}); idempotent."""
    use_rowwise(model)
    counts = {PAIR: 0, EACH_ROW: 0}
    modes: dict[tuple, str] = {}
    for module in model.modules():
        if type(module) is not nn.Linear or not module.weight.dtype.is_floating_point:
            continue
        if getattr(module, "sparrow_exact_mode", None) is None:
            weight = module.weight
            key = (weight.data_ptr(), tuple(weight.shape), weight.dtype)
            if key not in modes:
                modes[key] = probe(weight.detach(), None if module.bias is None else module.bias.detach())
            module.sparrow_exact_mode = modes[key]
            module.forward = functools.partial(_forward, module)
        counts[module.sparrow_exact_mode] += 1
    if counts[EACH_ROW]:
        logging.getLogger("sparrow").info("exact: %d linear layers compute verify rows one by one (their kernel "
                                          "is not row-invariant on this machine)", counts[EACH_ROW])
    return counts


def is_exact(model: nn.Module) -> bool:
    return bool(getattr(model, "sparrow_exact", False))


def source(model: nn.Module) -> nn.Module:
    """The model an exact copy was made from, while it lives (the model itself otherwise)."""
    ref = model.__dict__.get("sparrow_exact_source")
    made_from = ref() if ref is not None else None
    return model if made_from is None else made_from


_COPIES: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def exact_copy(source: torch.nn.Module) -> torch.nn.Module:
    """`source` made batch-invariant: a structural copy sharing every weight (built once per model in this
    process), or `source` itself when it is exact already. The user's model is left as it was; a quantized
    copy (sparrow's own, `sparrow.models.quantization`) is switched in place."""
    if is_exact(source):
        return source
    if getattr(source, "sparrow_quantization", None) is not None:
        make_exact(source)
        source.sparrow_exact = True
        return source
    model = _COPIES.get(source)
    if model is None:
        memo: dict[int, object] = {id(t): t for t in [*source.parameters(), *source.buffers()]}
        model = copy.deepcopy(source, memo)
        make_exact(model)
        model.sparrow_exact = True
        model.__dict__["sparrow_exact_source"] = weakref.ref(source)  # weak: _COPIES' key must stay freeable
        _COPIES[source] = model
    return model

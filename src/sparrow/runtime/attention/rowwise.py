"""Batch-invariant attention for short forwards: each query row attends exactly as a one-token step would.

A k-token verify forward and k one-token decoding steps compute the same math, but torch's attention kernels
block a multi-row query differently from a single row, so the results differ in the last bits. In float
models that only flips exact near-ties; a model that quantizes its activations (w8a8) turns a last-bit
difference into a different int8 value now and then, which moves the logits visibly (measured on
qwen2.5-coder-1.5b: ~1 logit after a few tokens). `rowwise_sdpa` therefore runs a forward of at most
`MAX_ROWS` query rows one row at a time, each row through `sparrow.runtime.attention.decode.attend` (transformers'
sdpa, a single row packed by KV head) with exactly the keys it may see and no mask: the same call, with the same
tensors, as the one-token step at that position.
Longer forwards (the prompt's prefill, the same in plain and speculative decoding) take the batched path.

Registered as the attention implementation "sparrow_rowwise" (transformers' AttentionInterface, with sdpa's
mask format), set on w8a8 copies by `sparrow.models.quantization`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from sparrow.runtime.attention.decode import SDPA, attend
from sparrow.runtime.attention.layers import attention_configs

NAME = "sparrow_rowwise"
MAX_ROWS = 64  # verify chains and trees; a longer forward is a prefill


def _visible(mask: Tensor, row: int) -> Tensor:
    """Indices of the keys query `row` may attend to, from sdpa's [1, 1 | heads, q, kv] mask (bool: True =
    attend; float: 0 = attend)."""
    allowed = mask[0, 0, row]
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    return allowed.nonzero().flatten()


def rowwise_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 **kwargs) -> tuple[Tensor, None]:
    """query [b, heads, q, d], key / value [b, kv_heads, kv, d] -> ([b, q, heads, d], None), as sdpa."""
    q, kv = query.shape[2], key.shape[2]
    # a prefill, several sequences (not claimed invariant), or a compiled graph: torch.compile's own kernels, whose
    # rows the static path keeps invariant (`sparrow.runtime.compiled`)
    if q > MAX_ROWS or query.shape[0] != 1 or torch.compiler.is_compiling():
        return attend(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    rows = []
    for row in range(q):
        if attention_mask is None:  # sdpa's is_causal (q > 1): row i sees keys 0..i; one row sees them all
            seen = row + 1 if q > 1 else kv  # (a dynamic cache's causal rows are its only ones; a static cache's
            keys, values = key[:, :, :seen], value[:, :, :seen]  # unmasked prefill is its first slots)
        else:
            seen = _visible(attention_mask, row)
            prefix = seen.numel() > 0 and int(seen[-1]) == seen.numel() - 1  # keys 0..n-1: a view, as a step
            keys = key[:, :, : seen.numel()] if prefix else key.index_select(2, seen)
            values = value[:, :, : seen.numel()] if prefix else value.index_select(2, seen)
        out, _ = attend(module, query[:, :, row : row + 1], keys, values, None, is_causal=False, **kwargs)
        rows.append(out)  # [b, 1, heads, d]
    return torch.cat(rows, dim=1), None


AttentionInterface.register(NAME, rowwise_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_rowwise(model: nn.Module) -> bool:
    """Switch the decoder attention of `model` (a transformers model) from sdpa to row-wise attention, in place;
    False if it is not sdpa. A VLM's vision tower is left alone (as `sparrow.runtime.attention.decode.use` does)."""
    configs = [c for c in attention_configs(model) if getattr(c, "_attn_implementation", None) in (*SDPA, NAME)]
    for config in configs:
        config._attn_implementation_internal = NAME  # this config only, not its sub-configs
    return bool(configs)

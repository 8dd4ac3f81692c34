"""Attention for a decoding step: one query row per head, without torch's slow single-row CPU kernel.

A decoding step (plain decoding, a draft model's step) attends one query row per head over the whole cache.
For a grouped-query model transformers asks torch's sdpa for that with ``enable_gqa`` (query [b, heads, 1, d],
keys [b, kv_heads, n, d]), and torch's CPU kernel runs a single query row far slower than several: on an
AVX2-only AMD EPYC (torch 2.14.1, 2 threads; Qwen2.5-1.5B's 12 query and 2 KV heads of 128) 0.21 / 0.67 /
8.6 ms a layer at 512 / 2k / 8k cached tokens in float32, and 1.1 / 4.4 / 19.3 ms in bfloat16. ``attend``
computes the same thing the way transformers itself does when a mask is present (``pack_gqa``): the query heads
that share a KV head become rows of that head, [b, heads, 1, d] -> [b, kv_heads, heads / kv_heads, d], each
attending to every cached key (a decoding step's query may see the whole cache: no mask). There: 0.11 / 0.31 /
2.3 ms in float32 and 0.15 / 0.44 / 1.7 ms in bfloat16, outputs equal to the unpacked call's bit for bit (at
other shapes, a tiny test model's, they can differ in the last bits: the same sums, blocked differently).

Anything else (several query rows, a mask, no grouped heads, dropout, position biases, paged caches,
torch.compile, devices other than the CPU) goes to transformers' sdpa unchanged. Registered as the attention
implementation "sparrow_sdpa" (with sdpa's masks); ``use(model)`` switches a model's decoder from "sdpa" to it
(``load_model`` does for every model it loads). Row-wise attention (``sparrow.rowwise_attention``) attends
through ``attend`` as well, so its one-token steps and verify rows stay the same call; query capture
(``sparrow.attention_capture``) calls whichever of the two the model had.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "sparrow_sdpa"
SDPA = ("sdpa", NAME)  # implementations that compute transformers' sdpa attention


def _packable(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None, kwargs: dict) -> bool:
    groups = getattr(module, "num_key_value_groups", 1)
    return (query.shape[2] == 1 and attention_mask is None and isinstance(groups, int) and groups > 1
            and key.shape[1] * groups == query.shape[1] and query.device.type == "cpu"
            and not kwargs.get("dropout") and kwargs.get("position_bias") is None and kwargs.get("cache") is None
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and not kwargs.get("output_attentions", False) and not torch.compiler.is_compiling())


def attend(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
           **kwargs) -> tuple[Tensor, None]:
    """query [b, heads, q, d], key / value [b, kv_heads, n, d] -> ([b, q, heads, d], None), as transformers' sdpa."""
    if not _packable(module, query, key, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)  # query head h = kv head h // groups
    out = F.scaled_dot_product_attention(packed, key, value, scale=kwargs.get("scaling"))  # [b, kv_heads, groups, d]
    return out.reshape(batch, 1, heads, dim), None


def use(model: nn.Module) -> int:
    """Switch the decoder attention of `model` (a transformers model) from "sdpa" to ``attend``, in place; returns
    how many configs were switched (0: not sdpa, or already switched). A VLM's vision tower is left alone."""
    from sparrow.attention_capture import attention_configs

    count = 0
    for config in attention_configs(model):
        if getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation_internal = NAME  # this config only, not its sub-configs
            count += 1
    return count


AttentionInterface.register(NAME, attend)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)

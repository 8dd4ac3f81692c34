"""Attention for decoding steps and verify forwards: query heads packed as rows of their KV head.

A decoding step (plain decoding, a draft model's step) attends one query row per head over the whole cache.
For a grouped-query model transformers asks torch's sdpa for that with ``enable_gqa`` (query [b, heads, 1, d],
keys [b, kv_heads, n, d]), and torch's CPU kernel runs a single query row far slower than several: on an
AVX2-only AMD EPYC (torch 2.14.1, 2 threads; Qwen2.5-1.5B's 12 query and 2 KV heads of 128) 0.21 / 0.67 /
8.6 ms a layer at 512 / 2k / 8k cached tokens in float32, and 1.1 / 4.4 / 19.3 ms in bfloat16. ``attend``
computes the same thing the way transformers itself does when a mask is present (``pack_gqa``): the query heads
that share a KV head become rows of that head, [b, heads, 1, d] -> [b, kv_heads, heads / kv_heads, d], each
attending to every cached key (a decoding step's query may see the whole cache: no mask). There: 0.11 / 0.31 /
2.3 ms in float32 and 0.15 / 0.44 / 1.7 ms in bfloat16.

A verify forward (q drafted rows after the cache) comes with a mask, causal over the cache or a draft tree's,
one for every head; transformers then copies the keys and values once per query head (``repeat_kv``) before
calling sdpa. ``attend`` packs those rows too, [b, heads, q, d] -> [b, kv_heads, groups * q, d], each packed row
keeping its query row's mask, and reads the cache as it is (measured in the README's CPU section).

Outputs equal sdpa's up to rounding: bit for bit at the 1.5B's shapes above, but at other shapes (a tiny test
model's) the last bits can differ (the same sums, blocked differently). Batch-invariant by construction: torch's
CPU kernel takes the query rows in blocks of 32, and a block of a few rows (1-2 at head dim 64, 1-5 at 128,
measured on this machine by `short_blocks`) goes through another BLAS kernel that rounds otherwise; the packed
rows are padded (`padding`: copies of the last row, dropped after) so that no block is a short one, and every
row is then computed as inside a full block, whatever the number of rows (a compiled verify attends as its
one-row steps; the 1.5B's 6 packed rows of dim 128 need no padding). The static cache's steps
(`sparrow.runtime.compiled`, compiled or not) pass a mask over every slot even for a single row; those rows are
packed the same way (under torch.compile transformers would copy the keys once per query head: a 1.5B's one-row
step over 512 slots took 0.55 ms a layer, packed 0.08 ms). Anything else (a prefill, a mask per head, no grouped
heads, dropout, position biases, paged caches, devices other than the CPU) goes to
transformers' sdpa unchanged. Registered as the attention implementation "sparrow_sdpa" (with sdpa's masks);
``use(model)`` switches a model's decoder from "sdpa" to it (``load_model`` does for every model it loads).
Row-wise attention (``sparrow.runtime.attention.rowwise``) attends through ``attend`` as well, so its one-token steps
and verify rows stay the same call; query capture (``sparrow.runtime.attention.capture``) calls whichever of the two the
model had.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from sparrow.runtime.attention.layers import attention_configs

NAME = "sparrow_sdpa"
QUERY_BLOCK = 32  # query rows torch's CPU flash attention takes at a time (below 192 rows)
SDPA = ("sdpa", NAME)  # implementations that compute transformers' sdpa attention


def _packable(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None, kwargs: dict) -> bool:
    """Grouped heads, on the CPU, in inference, and either one row without a mask (a decoding step) or several
    rows with one mask for all heads (a verify: causal over the cache, or a draft tree's)."""
    groups = getattr(module, "num_key_value_groups", 1)
    rows = query.shape[2]
    if attention_mask is None:
        masked = rows == 1  # several rows without a mask: a prefill, causal by `is_causal`
    else:  # one mask for all heads (the static cache's steps mask even a single row)
        masked = (attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                  and attention_mask.shape[2] in (1, rows) and attention_mask.shape[0] in (1, query.shape[0]))
    return (masked and isinstance(groups, int) and groups > 1 and key.shape[1] * groups == query.shape[1]
            and query.device.type == "cpu"
            and not kwargs.get("dropout") and kwargs.get("position_bias") is None and kwargs.get("cache") is None
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and not kwargs.get("output_attentions", False))


def attend(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
           **kwargs) -> tuple[Tensor, None]:
    """query [b, heads, q, d], key / value [b, kv_heads, n, d], attention_mask None or [b | 1, 1, q | 1, n] (bool:
    True = attend, or additive) -> ([b, q, heads, d], None), as transformers' sdpa."""
    if not _packable(module, query, key, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    packed = query.reshape(batch, kv_heads, groups * rows, dim)  # row g * q + i: query head kv * groups + g, row i
    mask = None
    if attention_mask is not None:  # each packed row keeps its query row's mask
        mask = attention_mask.expand(-1, 1, rows, -1).repeat(1, 1, groups, 1)  # [b | 1, 1, groups * q, n]
    extra = padding(groups * rows, dim, query.dtype)
    if extra:  # copies of the last packed row (and its mask row), dropped after
        packed = torch.cat([packed, packed[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
        if mask is not None:
            mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=kwargs.get("scaling"))
    if extra:
        out = out[:, :, : groups * rows]
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


@functools.cache
def short_blocks(dim: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The query block sizes (1 .. QUERY_BLOCK - 1) at which torch's CPU attention computes a row otherwise than it
    does inside a full block of QUERY_BLOCK rows (measured here, on random data, with and without a mask).

    torch's CPU flash attention takes query rows in blocks of QUERY_BLOCK (32 below 192 rows) and multiplies each
    block by the keys with a BLAS call whose kernel changes for a block of few rows: on an Intel Xeon (AVX-512,
    torch 2.14.1, float32) rows of blocks of 1-2 rows (head dim 64), 1-5 (128), 1-10 (256) differed in the last
    bits from the same rows in a full block, and a block of 33 rows is 32 + 1."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 1, n, dim, generator=generator).to(dtype) for n in (QUERY_BLOCK, 48, 48))
    mask = torch.rand(1, 1, QUERY_BLOCK, 48, generator=generator) > 0.2
    short = []
    with torch.inference_mode():
        full = [F.scaled_dot_product_attention(query, key, value, attn_mask=m) for m in (None, mask)]
        for size in range(1, QUERY_BLOCK):
            for whole, m in zip(full, (None, mask)):
                part = F.scaled_dot_product_attention(query[:, :, :size], key, value,
                                                      attn_mask=None if m is None else m[:, :, :size])
                if not torch.equal(part, whole[:, :, :size]):
                    short.append(size)
                    break
    return tuple(short)


@torch._dynamo.assume_constant_result  # a compiled step calls it while tracing and keeps the number
def padding(rows: int, dim: int, dtype: torch.dtype) -> int:
    """Rows to add to `rows` packed query rows so that no query block is a short one (`short_blocks`): then every
    row is computed as inside a full block, the same bits whatever the number of rows, so a k-row verify attends as
    k one-row steps do (batch-invariant by construction; the 1.5B's one-row step, 6 packed rows of dim 128, needs
    none)."""
    tail = rows % QUERY_BLOCK
    short = short_blocks(dim, dtype)
    if tail not in short:
        return 0
    return next((size for size in range(tail, QUERY_BLOCK) if size not in short), QUERY_BLOCK) - tail


def use(model: nn.Module) -> int:
    """Switch the decoder attention of `model` (a transformers model) from "sdpa" to ``attend``, in place; returns
    how many configs were switched (0: not sdpa, or already switched). A VLM's vision tower is left alone."""
    count = 0
    for config in attention_configs(model):
        if getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation_internal = NAME  # this config only, not its sub-configs
            count += 1
    return count


AttentionInterface.register(NAME, attend)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)

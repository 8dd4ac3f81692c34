"""EAGLE-3's training-time test over a padded batch at once: the GPU recipe's training and evaluation step.

`sparrow.training.heads.ttt_loss` runs one sequence at a time (rows [n]); on a GPU that is launch-bound. Here the
same computation runs on a right-padded batch: tokens [B, T], the target's fused features [B, T, 3D] and its
top-k labels [B, T, k], with each sequence's length. It reuses the head's own modules (fc, the decoder layers'
norms, projections and MLP, norm, lm_head), so the weights trained are the head's; only attention and rotary get
a batch dimension. Step j: row t (of every sequence) reads token x[t + 1 + j] and, as hidden input, the target
features (j = 0) or its own output of step j - 1, at position t + j; it attends to the step-0 rows <= t and to
its own rows of steps 1 .. j (`sparrow.training.heads.ttt_mask`); padding rows come after every real row, so no real
row sees them, and rows whose label lies beyond the sequence are left out of the loss. The loss of step j is the
mean soft cross-entropy over the batch's kept rows (top label inside the draft vocabulary), weighted decay ** j.

EAGLE-3 heads with concatenation fusion only (what SpecForge / SGLang serve).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sparrow.heads.eagle import EagleHead
from sparrow.heads.layers import Attention, DecoderLayer, _rotate
from sparrow.training.heads import soft_cross_entropy, target_to_draft, ttt_mask


@dataclass(frozen=True)
class BatchLoss:
    """The loss of a batch and, per draft depth 1 .. ttt_steps, the top-1 agreement counts over its valid rows."""

    loss: Tensor  # scalar; a constant zero (no graph) when no row of the batch had a label in the draft vocabulary
    agreed: tuple[int, ...]  # rows whose draft argmax is the target's argmax, per depth
    rows: tuple[int, ...]  # valid rows per depth
    positions: int  # training positions of the batch (valid step-0 rows)


def _attention(attn: Attention, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
               past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, n, width], cos/sin [n, hd], mask [n, past + n] bool, past keys/values [B, kv_heads, past, hd]."""
    b, n, _ = x.shape
    q = _rotate(attn.q_proj(x).view(b, n, attn.heads, attn.head_dim).transpose(1, 2), cos, sin)
    k = _rotate(attn.k_proj(x).view(b, n, attn.kv_heads, attn.head_dim).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(b, n, attn.kv_heads, attn.head_dim).transpose(1, 2)
    keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
    groups = attn.heads // attn.kv_heads
    out = nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1), attn_mask=mask[None, None])
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, -1)), k, v


def _layer(layer: DecoderLayer, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
           past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
    """DecoderLayer.forward over [B, n, d] rows."""
    if layer.mode == "fused":
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
    else:
        x = layer.input_layernorm(hidden) if layer.mode == "inner" else hidden
    attended, k, v = _attention(layer.self_attn, x, cos, sin, mask, past)
    hidden = hidden + attended
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), k, v


def batched_step(head: EagleHead, tokens: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor,
                 past: list[tuple[Tensor, Tensor]] | None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """EagleHead.step over a batch: tokens [B, n], hidden [B, n, d], positions [n], mask [n, past + n]; past and
    the returned keys/values: one (keys, values) [B, kv_heads, rows, hd] per decoder layer (the new rows only)."""
    embeds = head.embed(tokens)
    cos, sin = head.rotary(positions)
    new = []
    x = hidden
    for i, layer in enumerate(head.decoder_layers()):
        x, k, v = _layer(layer, embeds, x, cos, sin, mask, None if past is None else past[i])
        new.append((k, v))
    return x, new


def batched_ttt_loss(head: EagleHead, tokens: Tensor, lengths: Tensor, features: Tensor, label_ids: Tensor,
                     label_logprobs: Tensor, ttt_steps: int, decay: float = 0.8) -> BatchLoss:
    """The training-time-test loss of a right-padded batch (see the module docstring). tokens [B, T] int64,
    lengths [B] (>= 2), features [B, T, fused_width], label_ids / label_logprobs [B, T, k] (row t: the target's
    top-k for token t + 1)."""
    c = head.config
    assert c.arch == "eagle3" and c.fusion == "concat", (c.arch, c.fusion)
    t = tokens.shape[1]
    m = t - 1
    device = head.fc.weight.device
    tokens, lengths = tokens.to(device), lengths.to(device)
    label_ids, label_logprobs = label_ids.to(device), label_logprobs.to(device)
    rows = torch.arange(m, device=device)
    draft_ids, to_draft = head.draft_to_target, target_to_draft(head)
    hidden = head.fc(features[:, :m].to(device, head.fc.weight.dtype))
    past: list[tuple[Tensor, Tensor]] | None = None
    total: Tensor = hidden.new_zeros((), dtype=torch.float32)
    agreed, counted = [], []
    positions = int((lengths - 1).clamp(min=0).sum())
    for j in range(ttt_steps):
        label_rows = rows + 1 + j
        valid = label_rows[None] <= lengths[:, None] - 1  # [B, m]
        if not bool(valid.any()):
            break
        label_rows = label_rows.clamp(max=t - 1)
        out, new = batched_step(head, tokens[:, label_rows], hidden, rows + j, ttt_mask(m, j, device), past)
        past = new if past is None else [(torch.cat([p[0], n[0]], 2), torch.cat([p[1], n[1]], 2))
                                         for p, n in zip(past, new)]
        logits = head.draft_logits(out).float()  # [B, m, draft_vocab]
        ids, logprobs = label_ids[:, label_rows], label_logprobs[:, label_rows]
        cross, inside = soft_cross_entropy(logits.log_softmax(-1).flatten(0, 1), ids.flatten(0, 1),
                                           logprobs.flatten(0, 1), to_draft)
        keep = valid.flatten() & inside
        if bool(keep.any()):
            total = total + decay**j * cross[keep].mean()
        agreed.append(int(((draft_ids[logits.argmax(-1)] == ids[..., 0]) & valid).sum()))
        counted.append(int(valid.sum()))
        hidden = out
    return BatchLoss(total, tuple(agreed), tuple(counted), positions)


__all__ = ["BatchLoss", "batched_step", "batched_ttt_loss"]

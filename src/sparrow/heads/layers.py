"""The building blocks of a head's decoder layer: Llama's RMSNorm, gated MLP, rotary attention over a KV past,
and EAGLE-3's layer whose attention reads cat(embedding, hidden) (2d wide)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sparrow.heads.config import HeadConfig


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Llama's rotary embedding (rotate-half convention); x [heads, n, hd], cos/sin [n, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: HeadConfig, input_width: int) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(input_width, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(input_width, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(input_width, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: tuple[Tensor, Tensor] | None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """x [n, input_width], cos/sin [n, hd], mask [n, past + n] bool (True = may attend), past: keys and
        values [kv_heads, past, hd]. Returns ([n, d] output, [kv_heads, n, hd] new keys, new values)."""
        n = x.shape[0]
        q = _rotate(self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1), cos, sin)
        k = _rotate(self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        assert mask.shape == (n, keys.shape[1]), (tuple(mask.shape), n, keys.shape[1])
        groups = self.heads // self.kv_heads
        out = nn.functional.scaled_dot_product_attention(
            q[None], keys.repeat_interleave(groups, 0)[None], values.repeat_interleave(groups, 0)[None],
            attn_mask=mask[None, None])[0]  # [heads, n, hd]
        return self.o_proj(out.transpose(0, 1).reshape(n, -1)), k, v


class DecoderLayer(nn.Module):
    """A Llama decoder layer in one of three input modes:
    "fused": EAGLE-3's first layer, reading cat(input_layernorm(embedding), hidden_norm(h)) (2d wide);
    "first": EAGLE-1's (and gated heads') first layer, reading the fused input directly (no input norm);
    "inner": a deeper layer (Dovetail), a standard pre-norm layer over the previous layer's output."""

    def __init__(self, config: HeadConfig, mode: str | None = None) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.mode = mode or ("fused" if config.arch == "eagle3" and config.fusion == "concat" else "first")
        assert self.mode in ("fused", "first", "inner"), self.mode
        if self.mode == "fused":
            self.input_layernorm, self.hidden_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        elif self.mode == "inner":
            self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(config, 2 * d if self.mode == "fused" else d)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(config)

    def forward(self, embeds: Tensor | None, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [n, d] on the residual; embeds [n, d] ("fused" only; None otherwise, already in `hidden`)."""
        if self.mode == "fused":
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        else:
            x = self.input_layernorm(hidden) if self.mode == "inner" else hidden
        attended, k, v = self.self_attn(x, cos, sin, mask, past)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), k, v


def causal_mask(n: int, past: int, device: torch.device | str) -> Tensor:
    """[n, past + n] bool: row i sees the past and rows <= i."""
    rows = torch.arange(n, device=device)[:, None]
    return torch.arange(past + n, device=device)[None] <= past + rows


@torch.no_grad()
def init_parameters(module: nn.Module, generator: torch.Generator | None, std: float = 0.02) -> None:
    """A head's random initial weights: normal(0, std) linear weights, zero biases, unit RMSNorm weights."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            device = generator.device if generator is not None else None
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator, device=device) * std)
            if layer.bias is not None:
                layer.bias.zero_()
        elif isinstance(layer, RMSNorm):
            layer.weight.fill_(1.0)

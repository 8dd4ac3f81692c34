"""EAGLE draft heads: one decoder layer that reads the target's hidden states (Li et al. 2024, 2025).

EAGLE-3 (`arch="eagle3"`): the target's hidden states of three layers (low, mid, high; transformers'
`hidden_states` indexing, by default 2, L // 2 and L - 3 as SpecForge and vLLM pick them) are concatenated
and fused by `fc` [3D -> d]. The decoder layer `midlayer` reads cat(input_layernorm(embedding), hidden_norm(h))
(so its attention input is 2d wide), keeps h on the residual, and its output goes through `norm` and an
`lm_head` over a draft vocabulary: draft id i is target id i + d2t[i]; `t2d` marks the target ids it covers.

EAGLE-1 (`arch="eagle1"`): the target's last hidden state (after its final norm) and the embedding,
fc(cat(embedding, h)) [2d -> d], a standard decoder layer without an input norm, and the target's own LM head.

Dovetail (`fusion="gated"`, `num_layers` > 1; both arches): the feature and the embedding are mixed by a learned
gate (`sparrow.heads.fusion`) instead of concatenation, and more decoder layers follow the first (standard
pre-norm layers: EAGLE-1's `layers.1..`, EAGLE-3's `layers.1..` after `midlayer`). The head can live on another
device than its target (`device`): it then holds frozen copies of the target's embedding (and EAGLE-1's LM head),
so only token ids and hidden states cross devices.

Alignment (both): head row t reads the token x[t + 1] and the feature of position t, and predicts x[t + 2].
While drafting, a draft row's feature is the head's own output at its parent's row (EAGLE's autoregression
over features). The embedding (and EAGLE-1's LM head) are the target's, frozen, never stored with the head.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from sparrow.heads.config import ARCHS, FUSIONS, HeadConfig, default_layers
from sparrow.heads.fusion import GatedFusion
from sparrow.heads.layers import DecoderLayer, RMSNorm, causal_mask, init_parameters


@dataclass(frozen=True)
class TargetParts:
    """The target's modules a head borrows (frozen; never saved with the head)."""

    embed: nn.Module  # token ids -> [.., D] embeddings
    lm_head: nn.Module  # [.., D] -> [.., vocab] logits (EAGLE-1 drafts through it)

    @staticmethod
    def of(model: nn.Module) -> TargetParts:
        return TargetParts(model.get_input_embeddings(), model.get_output_embeddings())

    @property
    def device(self) -> torch.device:
        return next(self.embed.parameters()).device

    def on(self, device: torch.device | str, with_lm_head: bool) -> TargetParts:
        """The parts as a head on `device` uses them: these, or (on another device) frozen copies of the embedding
        and, `with_lm_head`, the LM head (Dovetail's split: the head never reaches into the target's device)."""
        if torch.device(device) == self.device:
            return self

        def moved(module: nn.Module) -> nn.Module:
            return copy.deepcopy(module).to(device).requires_grad_(False)

        return TargetParts(moved(self.embed), moved(self.lm_head) if with_lm_head else self.lm_head)


def _grown(t: Tensor, dim: int, capacity: int) -> Tensor:
    """`t` with dimension `dim` extended (zeros) to `capacity`."""
    shape = list(t.shape)
    shape[dim] = capacity - shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


@dataclass
class HeadCache:
    """The head's KV for its rows, and each row's output hidden state (the feature its children read).

    Buffers grow by doubling, so appending a draft row copies nothing (amortised); rows >= `rows` are stale."""

    keys: Tensor  # [kv_heads, capacity, hd]
    values: Tensor  # [kv_heads, capacity, hd]
    outputs: Tensor  # [capacity, d]
    rows: int = 0

    @property
    def past(self) -> tuple[Tensor, Tensor] | None:
        """Keys and values [kv_heads, rows, hd] of the cached rows (None when empty)."""
        return (self.keys[:, : self.rows], self.values[:, : self.rows]) if self.rows else None

    @property
    def hidden(self) -> Tensor:
        """[rows, d] output hidden state of each cached row."""
        return self.outputs[: self.rows]

    def append(self, keys: Tensor, values: Tensor, outputs: Tensor) -> None:
        """keys/values [kv_heads, n, hd], outputs [n, d] of the next n rows."""
        end = self.rows + outputs.shape[0]
        if end > self.outputs.shape[0]:
            capacity = max(end, 2 * self.outputs.shape[0], 16)
            self.keys, self.values = _grown(self.keys, 1, capacity), _grown(self.values, 1, capacity)
            self.outputs = _grown(self.outputs, 0, capacity)
        self.keys[:, self.rows : end] = keys
        self.values[:, self.rows : end] = values
        self.outputs[self.rows : end] = outputs
        self.rows = end

    def crop(self, rows: int) -> None:
        assert 0 <= rows <= self.rows, (rows, self.rows)
        self.rows = rows


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head bound to its target's embedding (and LM head); see the module docstring.

    Parameters are created without initial values: `reset_parameters(generator)` or loading fills them."""

    def __init__(self, config: HeadConfig, target: TargetParts, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        c = self.config = config
        with torch.device("meta"):
            inner = [DecoderLayer(c, "inner") for _ in range(c.num_layers - 1)]
            if c.arch == "eagle3":
                self.fc = nn.Linear(c.fused_width, c.hidden_size, bias=c.fc_bias)
                self.midlayer = DecoderLayer(c)
                if inner:  # named layers.1.. (sparrow-only: serving engines read one midlayer)
                    self.layers = nn.ModuleDict({str(i + 1): layer for i, layer in enumerate(inner)})
                self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
                self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            else:  # gated: fc projects the feature alone (h1); concat: fc(cat(e, f))
                width = c.target_hidden_size if c.fusion == "gated" else 2 * c.hidden_size
                self.fc = nn.Linear(width, c.hidden_size, bias=c.fc_bias)
                self.layers = nn.ModuleList([DecoderLayer(c), *inner])
            if c.fusion == "gated":
                self.gate = GatedFusion(c.hidden_size, c.rms_norm_eps)
        device = torch.device(device) if device is not None else target.device
        target = target.on(device, with_lm_head=c.arch == "eagle1")
        self.to_empty(device=device)
        if dtype is not None:
            self.to(dtype)
        if c.arch == "eagle3":
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long, device=device))
            self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool, device=device))
        self.target = target
        rope = LlamaRotaryEmbedding(self._llama_config())
        self._inv_freq, self._rope_scale = rope.inv_freq.float().clone(), float(rope.attention_scaling)

    def _llama_config(self) -> LlamaConfig:
        c = self.config
        return LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                           rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                           max_position_embeddings=c.max_position_embeddings)

    # --- parameters -----------------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None, std: float = 0.02) -> None:
        """Random initial weights (normal(0, std) linears, unit norms, zero biases); the identity draft vocab map."""
        init_parameters(self, generator, std)
        if self.config.arch == "eagle3":
            self.set_draft_vocab(torch.arange(self.config.draft_vocab_size))

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """The draft vocabulary: `target_ids` ([draft_vocab_size] distinct target ids; stored sorted, as d2t/t2d)."""
        ids = target_ids.to(self.d2t.device).long().unique()  # sorted
        assert ids.shape == (self.config.draft_vocab_size,), (tuple(ids.shape), self.config.draft_vocab_size)
        assert int(ids.max()) < self.config.vocab_size, (int(ids.max()), self.config.vocab_size)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> Tensor:
        """[draft_vocab_size] int64: the target id of each draft id (arange for EAGLE-1)."""
        if self.config.arch == "eagle1":
            return torch.arange(self.config.vocab_size, device=self.fc.weight.device)
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # --- running --------------------------------------------------------------------------------------

    def embed(self, tokens: Tensor) -> Tensor:
        """[n] target ids -> [n, d] the target's embeddings (frozen: no gradient reaches the target), in the
        head's dtype."""
        with torch.no_grad():
            return self.target.embed(tokens.to(self.fc.weight.device)).to(self.fc.weight.dtype)

    def fuse(self, features: Tensor) -> Tensor:
        """[n, fused_width] target features -> [n, d] the hidden input of a row (EAGLE-3: fc; EAGLE-1: as is)."""
        assert features.ndim == 2 and features.shape[1] == self.config.fused_width, (
            tuple(features.shape), self.config.fused_width)
        features = features.to(self.fc.weight.dtype)
        return self.fc(features) if self.config.arch == "eagle3" else features

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """[n] positions -> cos, sin [n, head_dim] in the head's dtype."""
        freqs = positions.to(self._inv_freq.device).float()[:, None] * self._inv_freq[None]
        angles = torch.cat([freqs, freqs], -1)
        dtype, device = self.fc.weight.dtype, self.fc.weight.device
        cos, sin = angles.cos() * self._rope_scale, angles.sin() * self._rope_scale
        return cos.to(device, dtype), sin.to(device, dtype)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers in order (EAGLE-3: midlayer first)."""
        if self.config.arch == "eagle3":
            return [self.midlayer, *(self.layers.values() if self.config.num_layers > 1 else ())]
        return list(self.layers)

    def step(self, tokens: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor,
             past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """One pass of the layers over n rows. tokens [n] (x[t + 1] of row t), hidden [n, d] (fused target
        features or parents' outputs), positions [n], mask [n, past + n] bool, past: keys and values
        [num_layers * kv_heads, past, hd] (layer i's heads at rows i * kv_heads ..). Returns ([n, d] output hidden
        (pre-norm), [num_layers * kv_heads, n, hd] keys, values)."""
        c, n = self.config, tokens.numel()
        assert hidden.shape == (n, c.hidden_size) and positions.shape == (n,), (
            tuple(hidden.shape), tuple(positions.shape), n)
        embeds = self.embed(tokens)
        cos, sin = self.rotary(positions)
        if c.arch == "eagle3":
            x = hidden  # fc already applied (fuse) or a parent's output
        else:
            x = self.fc(hidden) if c.fusion == "gated" else self.fc(torch.cat([embeds, hidden], -1))
        if c.fusion == "gated":
            x = self.gate(embeds, x)
        kv, keys, values = c.num_key_value_heads, [], []
        for i, layer in enumerate(self.decoder_layers()):
            layer_past = None if past is None else (past[0][i * kv : (i + 1) * kv], past[1][i * kv : (i + 1) * kv])
            x, k, v = layer(embeds if layer.mode == "fused" else None, x, cos, sin, mask, layer_past)
            keys.append(k)
            values.append(v)
        return x, torch.cat(keys), torch.cat(values)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """[n, d] output hidden -> [n, draft_vocab_size] logits over the draft vocabulary."""
        if self.config.arch == "eagle3":
            return self.lm_head(self.norm(hidden))
        head = self.target.lm_head  # frozen: gradients flow to `hidden` only
        bias = None if head.bias is None else head.bias.detach()
        return nn.functional.linear(hidden.to(head.weight.dtype), head.weight.detach(), bias)

    def logits(self, hidden: Tensor) -> Tensor:
        """[n, d] output hidden -> [n, vocab_size] logits in the target vocabulary (-inf outside the draft
        vocabulary, as vLLM maps a reduced head back with d2t)."""
        draft = self.draft_logits(hidden)
        if self.config.arch == "eagle1" or (self.config.draft_vocab_size == self.config.vocab_size
                                            and not bool(self.d2t.any())):
            return draft  # the identity map
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_to_target, draft)

    def run(self, tokens: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor, cache: HeadCache) -> Tensor:
        """`step` on top of `cache` (appending the rows to it); returns [n, d] output hidden."""
        out, k, v = self.step(tokens, hidden, positions, mask, cache.past)
        cache.append(k, v, out)
        return out

    def empty_cache(self) -> HeadCache:
        c, w = self.config, self.fc.weight
        kv = w.new_zeros(c.num_layers * c.num_key_value_heads, 0, c.head_dim)
        return HeadCache(kv, kv.clone(), w.new_zeros(0, c.hidden_size))  # grows on the first append


def parameter_count(head: EagleHead) -> int:
    return sum(p.numel() for p in head.parameters())


__all__ = ["ARCHS", "FUSIONS", "EagleHead", "HeadCache", "HeadConfig", "TargetParts", "causal_mask", "default_layers",
           "new_eagle_head", "parameter_count"]


def new_eagle_head(model: nn.Module, arch: str = "eagle3", generator: torch.Generator | None = None,
                   draft_vocab: Tensor | None = None, fusion: str = "concat", layers: int = 1,
                   device: torch.device | str | None = None, **overrides: Any) -> EagleHead:
    """A randomly initialised EAGLE-1/3 head for `model` (see `sparrow.heads.factory.new_head`)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    size = None if draft_vocab is None else int(draft_vocab.unique().numel())
    config = replace(HeadConfig.for_target(text, arch, draft_vocab_size=size, vocab_size=vocab), fusion=fusion,
                     num_layers=layers, **overrides)
    parameter = next(model.parameters())
    head = EagleHead(config, TargetParts.of(model), device=device if device is not None else parameter.device,
                     dtype=parameter.dtype)
    head.reset_parameters(generator)
    if draft_vocab is not None and arch == "eagle3":
        head.set_draft_vocab(draft_vocab)
    return head

"""LongSpec's draft head (Yang et al. 2025, arXiv 2502.17421): constant memory however long the context.

One decoder layer over the token embeddings (the target's, frozen), in three sublayers:
1. sliding-window self-attention over the head's own recent rows: row t (token x[t], position t) sees its rows
   at positions t - window + 1 .. t, so the head's own KV never holds more than `window` committed rows;
2. cross-attention over the target's KV cache of one decoder layer (`kv_layer`), read in place (no copy): row t
   sees the target's keys and values of positions < t - lag, where lag = the row's draft depth (while drafting,
   the target has cached committed[:-1] only); the target's keys are already rotated, so the query is rotated
   at the row's position with the same rotary embedding; a zero "null" key lets a row with no target key
   attend to nothing;
3. the MLP, then `norm` and the target's own LM head (shared, frozen), predicting x[t + 1].

Training (`train_longspec`) runs the target and the head at anchor-offset positions (sparrow.heads.train:
`anchor_offset_positions`): a few sink positions stay, the rest shift by a random large offset, so short text
teaches the positions of long contexts. Rows are trained at random lags 0 .. max_lag - 1 (the draft depths).

Checkpoint: `config.json` with `"architectures": ["SparrowLongSpecHead"]` and the tensors of this module (sparrow
only; no serving engine reads them).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from sparrow.errors import UserError
from sparrow.heads.eagle import TargetParts
from sparrow.heads.layers import MLP, Attention, RMSNorm, _rotate, init_parameters
from sparrow.heads.train import (Evaluation, StepResult, TrainReport, anchor_offset_positions, draw_batch,
                                 new_optimiser)

ARCHITECTURE = "SparrowLongSpecHead"


@dataclass(frozen=True)
class LongSpecConfig:
    hidden_size: int  # d = the target's
    intermediate_size: int
    num_attention_heads: int  # = the target's (the cross-attention reads its KV heads)
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    kv_layer: int  # the target decoder layer whose KV cache the cross-attention reads (0-based)
    window: int = 64  # committed rows the self-attention keeps
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    arch: str = "longspec"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise UserError(f"a LongSpec head's window must be >= 1, got {self.window}")
        if self.kv_layer < 0:
            raise UserError(f"kv_layer must be a target decoder layer index >= 0, got {self.kv_layer}")

    @staticmethod
    def for_target(text: Any, vocab_size: int, window: int = 64, kv_layer: int | None = None) -> LongSpecConfig:
        heads = text.num_attention_heads
        parameters = getattr(text, "rope_parameters", None) or {}
        return LongSpecConfig(
            hidden_size=text.hidden_size, intermediate_size=text.intermediate_size, num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab_size=vocab_size,
            kv_layer=text.num_hidden_layers - 1 if kv_layer is None else kv_layer, window=window,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=float(parameters.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096))


class CrossAttention(nn.Module):
    """Queries from the head's rows over the target's cached keys and values (grouped heads, a null key)."""

    def __init__(self, config: LongSpecConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """x [n, d], cos/sin [n, hd], keys/values [kv_heads, L, hd] (the target's, any dtype), mask [n, L] bool."""
        n, length = x.shape[0], keys.shape[1]
        assert mask.shape == (n, length) and keys.shape == values.shape, (tuple(mask.shape), n, tuple(keys.shape))
        groups = self.heads // self.kv_heads
        q = _rotate(self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1), cos, sin)  # [h, n, hd]
        q = q.reshape(self.kv_heads, groups * n, self.head_dim)  # head i reads KV head i // groups
        k, v = keys.to(q.dtype), values.to(q.dtype)  # the cache's own tensors when the dtypes agree: no copy
        scores = (q @ k.transpose(1, 2)).view(self.heads, n, length) / math.sqrt(self.head_dim)  # [h, n, L]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        scores = torch.cat([scores, scores.new_zeros(self.heads, n, 1)], -1)  # the null key (value 0)
        probs = scores.softmax(-1)[..., :length].reshape(self.kv_heads, groups * n, length)
        out = (probs @ v).view(self.heads, n, self.head_dim)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class LongSpecHead(nn.Module):
    """See the module docstring. Parameters: `reset_parameters(generator)` or loading fills them."""

    def __init__(self, config: LongSpecConfig, target: TargetParts, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        c = self.config = config
        with torch.device("meta"):
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.self_attn = Attention(c, c.hidden_size)  # type: ignore[arg-type]  (duck-typed config)
            self.cross_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.cross_attn = CrossAttention(c)
            self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.mlp = MLP(c)  # type: ignore[arg-type]
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        device = torch.device(device) if device is not None else target.device
        self.to_empty(device=device)
        if dtype is not None:
            self.to(dtype)
        self.target = target.on(device, with_lm_head=True)
        rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                                head_dim=c.head_dim, rope_theta=c.rope_theta,
                                                max_position_embeddings=c.max_position_embeddings))
        self._inv_freq, self._rope_scale = rope.inv_freq.float().clone(), float(rope.attention_scaling)

    @property
    def weight(self) -> Tensor:
        """A parameter: the head's device and dtype."""
        return self.norm.weight

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None, std: float = 0.02) -> None:
        init_parameters(self, generator, std)

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """[n] positions -> cos, sin [n, head_dim] (the target's rotary embedding) in the head's dtype."""
        freqs = positions.to(self._inv_freq.device).float()[:, None] * self._inv_freq[None]
        angles = torch.cat([freqs, freqs], -1)
        cos, sin = angles.cos() * self._rope_scale, angles.sin() * self._rope_scale
        return cos.to(self.weight.device, self.weight.dtype), sin.to(self.weight.device, self.weight.dtype)

    def step(self, tokens: Tensor, positions: Tensor, self_mask: Tensor, past: tuple[Tensor, Tensor] | None,
             target_kv: tuple[Tensor, Tensor], cross_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """n rows. tokens [n], positions [n], self_mask [n, past + n] bool over the head's own rows, past: its
        keys/values [kv_heads, past, hd]; target_kv: the target layer's keys/values [kv_heads, L, hd]; cross_mask
        [n, L] bool. Returns ([n, d] output hidden, [kv_heads, n, hd] keys, values)."""
        n = tokens.numel()
        assert positions.shape == (n,), (tuple(positions.shape), n)
        with torch.no_grad():
            x = self.target.embed(tokens.to(self.weight.device)).to(self.weight.dtype)
        cos, sin = self.rotary(positions)
        attended, k, v = self.self_attn(self.input_layernorm(x), cos, sin, self_mask, past)
        h = x + attended
        h = h + self.cross_attn(self.cross_layernorm(h), cos, sin, *target_kv, cross_mask)
        return h + self.mlp(self.post_attention_layernorm(h)), k, v

    def logits(self, hidden: Tensor) -> Tensor:
        """[n, d] -> [n, vocab] through `norm` and the target's LM head (frozen)."""
        head = self.target.lm_head
        bias = None if head.bias is None else head.bias.detach()
        return nn.functional.linear(self.norm(hidden).to(head.weight.dtype), head.weight.detach(), bias)


def window_mask(query_positions: Tensor, key_positions: Tensor, window: int) -> Tensor:
    """[n, m] bool: a query sees the keys at positions p - window < key <= p."""
    q, k = query_positions[:, None], key_positions[None, :]
    return (k <= q) & (k > q - window)


def target_layer_kv(cache: Any, layer: int) -> tuple[Tensor, Tensor]:
    """The keys and values [kv_heads, L, hd] a transformers cache holds for decoder `layer` (views, batch row 0)."""
    entry = cache.layers[layer]
    return entry.keys[0], entry.values[0]


def new_longspec_head(model: nn.Module, generator: torch.Generator | None = None, window: int = 64,
                      kv_layer: int | None = None, device: torch.device | str | None = None,
                      **overrides: Any) -> LongSpecHead:
    """A randomly initialised LongSpec head for the transformers causal LM `model` (its dtype; its device or
    `device`)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    config = replace(LongSpecConfig.for_target(text, vocab, window, kv_layer), **overrides)
    if config.kv_layer >= text.num_hidden_layers:
        raise UserError(f"kv_layer {config.kv_layer} is not a layer of the target ({text.num_hidden_layers} layers)")
    parameter = next(model.parameters())
    head = LongSpecHead(config, TargetParts.of(model), device=device if device is not None else parameter.device,
                        dtype=parameter.dtype)
    head.reset_parameters(generator)
    return head


def longspec_loss(head: LongSpecHead, tokens: Tensor, positions: Tensor, target_kv: tuple[Tensor, Tensor],
                  target_logits: Tensor, lags: Tensor) -> tuple[Tensor, float]:
    """Soft cross-entropy of every row t (token x[t] at `positions[t]`) against the target's distribution of
    x[t + 1], with row t's cross-attention limited to target positions < t - lags[t]. tokens/positions/lags [n],
    target_kv [kv_heads, n, hd] each, target_logits [n, vocab]. Rows that would see no target key are skipped.
    Returns the loss and the top-1 agreement."""
    n = tokens.numel()
    index = torch.arange(n, device=tokens.device)
    keep = index - lags > 0
    self_mask = window_mask(index, index, head.config.window)
    cross_mask = index[None, :] < (index - lags)[:, None]
    out, _, _ = head.step(tokens, positions, self_mask, None, target_kv, cross_mask)
    logits = head.logits(out[keep]).float()
    target = target_logits[keep].float()
    loss = -(target.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    agreement = float((logits.argmax(-1) == target.argmax(-1)).float().mean())
    return loss, agreement


def train_longspec(head: LongSpecHead, model: nn.Module, sequences: Sequence[Tensor], steps: int, lr: float = 1e-3,
                   generator: torch.Generator | None = None, anchor_offset: int = 0, max_sink: int = 4,
                   max_lag: int = 4, clip: float = 0.5) -> TrainReport:
    """Train `head` in place for `steps` AdamW steps on `sequences` ([n] target ids each) of the transformers
    causal LM `model`. Each step draws a sequence, anchor-offset positions (anchor_offset > 0: the first
    0 .. max_sink tokens keep theirs, the rest shift by up to anchor_offset) and per-row lags 0 .. max_lag - 1,
    runs the target at those positions for its KV and distributions, and the head over them."""
    start = time.perf_counter()
    optimiser = new_optimiser(head, lr)  # type: ignore[arg-type]  (any module with parameters)
    losses, agreements, seen = [], [], 0
    for _ in range(steps):
        tokens = sequences[draw_batch(len(sequences), 1, generator)[0]]
        result = longspec_step(head, model, optimiser, [tokens], generator, anchor_offset, max_lag, clip, max_sink)
        losses.append(result.loss)
        agreements.append(result.agreement)
        seen += tokens.numel()
    head.eval().requires_grad_(False)
    return TrainReport(tuple(losses), tuple(agreements), seen, time.perf_counter() - start)


@torch.no_grad()
def _target_pass(model: nn.Module, tokens: Tensor, positions: Tensor) -> tuple[Any, Tensor]:
    """The target over `tokens` at `positions`: its cache (kept alive by the caller) and logits [n, vocab]."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    result = model(input_ids=tokens.to(device)[None], position_ids=positions.to(device)[None], cache=cache,
                   use_cache=True)
    return cache, result.logits[0]


def longspec_step(head: LongSpecHead, model: nn.Module, optimiser: torch.optim.Optimizer, batch: Sequence[Tensor],
                  generator: torch.Generator | None, anchor_offset: int = 0, max_lag: int = 4, clip: float = 0.5,
                  max_sink: int = 4) -> StepResult:
    """One AdamW step on the mean LongSpec loss of `batch` ([n] ids each): per sequence, anchor-offset positions
    and per-row lags 0 .. max_lag - 1 drawn with `generator` (in that order), the target run at those positions
    for its KV and distributions, the head over them. Gradients clipped to norm `clip`."""
    head.train()
    device = generator.device if generator is not None else None
    optimiser.zero_grad(set_to_none=True)
    step_loss = step_agreement = 0.0
    tokens_seen = 0
    on = head.weight.device
    for tokens in batch:
        n = tokens.numel()
        positions = anchor_offset_positions(n, anchor_offset, generator, max_sink)
        lags = torch.randint(max_lag, (n,), generator=generator, device=device)
        cache, logits = _target_pass(model, tokens, positions)
        kv = target_layer_kv(cache, head.config.kv_layer)
        loss, agreement = longspec_loss(head, tokens.to(on), positions.to(on), kv, logits, lags.to(on))
        (loss / len(batch)).backward()
        step_loss += float(loss.detach()) / len(batch)
        step_agreement += agreement / len(batch)
        tokens_seen += n
    nn.utils.clip_grad_norm_([p for group in optimiser.param_groups for p in group["params"]], clip)
    optimiser.step()
    return StepResult(step_loss, step_agreement, tokens_seen)


@torch.no_grad()
def evaluate_longspec(head: LongSpecHead, model: nn.Module, sequences: Sequence[Tensor], depths: int = 3
                      ) -> Evaluation:
    """Loss (at draft depth 1) and top-1 agreement at draft depth 1 .. depths of `head` on held-out `sequences`,
    at their own positions: depth j is every row at lag j - 1 (the target's KV ends j - 1 tokens before it)."""
    head.eval()
    losses, agreements = [], []
    on = head.weight.device
    for tokens in sequences:
        n = tokens.numel()
        positions = torch.arange(n)
        cache, logits = _target_pass(model, tokens, positions)
        kv = target_layer_kv(cache, head.config.kv_layer)
        per_depth = []
        for lag in range(depths):
            if n - lag <= 1:  # no row sees a target key
                break
            lags = torch.full((n,), lag, device=on)
            loss, agreement = longspec_loss(head, tokens.to(on), positions.to(on), kv, logits, lags)
            if lag == 0:
                losses.append(float(loss))
            per_depth.append(agreement)
        if per_depth:
            agreements.append(per_depth)
    return Evaluation.mean_of(losses, agreements)


def save_longspec(head: LongSpecHead, directory: str | Path) -> Path:
    """Write `head` (config.json with `architectures: ["SparrowLongSpecHead"]`, model.safetensors)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"architectures": [ARCHITECTURE], **asdict(head.config),
              "torch_dtype": str(head.weight.dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    save_file({k: t.detach().contiguous().cpu() for k, t in head.state_dict().items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def load_longspec(raw: dict[str, Any], tensors: dict[str, Tensor], model: nn.Module,
                  device: torch.device | str | None, where: str) -> LongSpecHead:
    """The LongSpec head of a config.json (`raw`) and its tensors, bound to `model`; refuses one that does not fit."""
    names = {f.name for f in fields(LongSpecConfig)}
    try:
        config = LongSpecConfig(**{k: v for k, v in raw.items() if k in names})
    except TypeError as error:
        raise UserError(f"{where}: config.json is not a LongSpec head's ({error})") from None
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    fits = (config.hidden_size, config.vocab_size) == (text.hidden_size, vocab)
    if not fits or config.kv_layer >= text.num_hidden_layers:
        raise UserError(f"{where} has hidden size {config.hidden_size}, vocabulary {config.vocab_size} and reads "
                        f"layer {config.kv_layer}, but the target's are {text.hidden_size}, {vocab} and "
                        f"{text.num_hidden_layers} layers; a head must be trained for this target")
    parameter = next(model.parameters())
    head = LongSpecHead(config, TargetParts.of(model), device=device if device is not None else parameter.device,
                        dtype=parameter.dtype)
    missing = sorted(set(head.state_dict()) ^ set(tensors))
    if missing:
        raise UserError(f"{where} tensors do not match a LongSpec head: {missing}")
    head.load_state_dict(tensors, strict=True)
    return head.eval().requires_grad_(False)

"""Training the LongSpec head: its loss at anchor-offset positions against the target's KV, steps and evaluation."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from sparrow.heads.longspec import LongSpecHead, target_layer_kv, window_mask
from sparrow.training.loop import (
    Evaluation,
    StepResult,
    TrainReport,
    anchor_offset_positions,
    draw_batch,
    new_optimiser,
)


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


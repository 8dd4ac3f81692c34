"""Sparrow's draft head for Video-LLMs (Zhang et al., ACL 2026, arXiv 2602.15318): no visual KV in the draft.

The head is an EAGLE-3 head (`sparrow.heads.eagle`; same tensors, so it saves in the SpecForge layout, with a
`"sparrow"` entry in config.json that sparrow reads) drafted and trained in Sparrow's way:

* Text-anchored window attention with hidden-state reuse (VATA): the head has rows only for *text* positions
  (row t reads the token x[t + 1] and the target's hidden states at t, as in EAGLE), and each row attends to the
  last `text_window` text rows only. Visual placeholder positions get no row and no KV: the target's deep text
  states already carry what the draft needs from the video, so the draft's cost does not depend on the number
  of frames.
* Intermediate-layer visual state bridging (IVSB), training only: rows at visual positions are trained too,
  fed the target's intermediate-layer state (`bridge_layer`, in every fused slot) instead of its low/mid/high
  mix, with the target's distribution as the label (weight `bridge_weight`). No text row attends to them (as at
  inference, where they do not exist); they teach `fc` and the layer to read semantic-rich visual states.
* Multi-token prediction (MTP): the text rows are trained for `ttt_steps` draft depths on the head's own outputs
  (EAGLE-3's training-time test), the exposure bias Sparrow's MTP addresses.

From Python: `train_sparrow` on `video_features`; from the command line, `sparrow train head --arch sparrow` (the
target's answers about videos: `sparrow.heads.video_data`; steps: `sparrow_step` in `sparrow.heads.trainer`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from sparrow.errors import UserError
from sparrow.heads.eagle import EagleHead, new_head
from sparrow.heads.longspec import window_mask
from sparrow.heads.train import Evaluation, StepResult, TrainReport


@dataclass(frozen=True)
class SparrowSpec:
    """What makes an EAGLE-3 head a Sparrow head (saved as config.json's "sparrow" entry)."""

    text_window: int = 32  # text rows a row attends to (its own included)
    bridge_layer: int = 1  # transformers' hidden_states index of the intermediate layer IVSB feeds visual rows

    def __post_init__(self) -> None:
        if self.text_window < 1:
            raise UserError(f"a Sparrow head's text_window must be >= 1, got {self.text_window}")


def new_sparrow_head(model: nn.Module, generator: torch.Generator | None = None, text_window: int = 32,
                     bridge_layer: int | None = None, **options: Any) -> EagleHead:
    """An EAGLE-3 head for the Video-LLM `model` (its language model's sizes) with a SparrowSpec attached."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer = text.num_hidden_layers // 2 if bridge_layer is None else bridge_layer
    if not 0 <= layer <= text.num_hidden_layers:
        raise UserError(f"bridge_layer {layer} is not a hidden state of the target (0..{text.num_hidden_layers})")
    head = new_head(model, "eagle3", generator, **options)
    head.sparrow = SparrowSpec(text_window, layer)
    return head


def spec_of(head: nn.Module) -> SparrowSpec | None:
    return getattr(head, "sparrow", None)


def text_anchored_mask(text: Tensor, window: int) -> Tensor:
    """[m, m] bool over rows in sequence order, `text` [m] bool: a text row sees the text rows among the last
    `window` text rows up to itself; a visual row (IVSB, training only) sees the last `window` text rows before it
    and itself. No row sees another visual row."""
    m = text.numel()
    rank = text.long().cumsum(0) - 1  # a text row's rank among the text rows; a visual row: the rank before it
    seen = window_mask(rank, rank, window) & text[None, :]
    order = torch.arange(m, device=text.device)
    causal = order[None, :] <= order[:, None]
    return (seen & causal) | torch.eye(m, dtype=torch.bool, device=text.device)


@dataclass(frozen=True)
class VideoFeatures:
    """One Video-LLM sequence as a Sparrow head trains on it."""

    tokens: Tensor  # [n] int64
    visual: Tensor  # [n] bool: visual placeholder positions
    hidden: Tensor  # [n, fused_width] the target's hidden states of the head's layers, concatenated
    bridged: Tensor  # [n, fused_width] the bridge layer's state, repeated in every slot
    logits: Tensor  # [n, vocab]: row t scores token t + 1


@torch.no_grad()
def video_features(model: nn.Module, head: EagleHead, input_ids: Tensor, model_inputs: dict[str, Any],
                   continuation: Tensor, visual_ids: Sequence[int]) -> VideoFeatures:
    """Run the Video-LLM over a prompt (with its pixels: `model_inputs` as the processor gave them) and then
    `continuation` ([c] ids) on its cache, collecting the head's features and the target's logits."""
    device = next(model.parameters()).device
    layers, bridge = head.config.target_layers, spec_of(head).bridge_layer
    cache = DynamicCache(config=model.config)
    parts = [model(input_ids=input_ids.to(device)[None], cache=cache, use_cache=True,
                   output_hidden_states=True, **model_inputs)]
    if continuation.numel():
        parts.append(model(input_ids=continuation.to(device)[None], cache=cache, use_cache=True,
                           output_hidden_states=True))
    states = [torch.cat([p.hidden_states[i][0] for p in parts]) for i in range(len(parts[0].hidden_states))]
    tokens = torch.cat([input_ids.to(device), continuation.to(device)])
    visual = torch.isin(tokens, torch.tensor(list(visual_ids), device=device, dtype=tokens.dtype))
    return VideoFeatures(tokens, visual, torch.cat([states[i] for i in layers], -1),
                         torch.cat([states[bridge]] * len(layers), -1), torch.cat([p.logits[0] for p in parts]))


def sparrow_loss(head: EagleHead, f: VideoFeatures, ttt_steps: int, decay: float = 0.8,
                 bridge_weight: float = 0.5) -> tuple[Tensor, float]:
    """Step 0 over every row (text rows on their features, visual rows bridged; text-anchored mask), steps
    1 .. ttt_steps - 1 over the text rows on their own outputs. Soft cross-entropy against the target at the
    label position, weighted decay^j (visual rows: bridge_weight). Returns the loss and the depth-1 agreement."""
    total, agreements = sparrow_depth_loss(head, f, ttt_steps, decay, bridge_weight)
    return total, agreements[0]


def sparrow_depth_loss(head: EagleHead, f: VideoFeatures, ttt_steps: int, decay: float = 0.8,
                       bridge_weight: float = 0.5) -> tuple[Tensor, tuple[float, ...]]:
    """`sparrow_loss` with the top-1 agreement of the text rows at each draft depth 1 .. ttt_steps (of the rows
    that have a label at that depth)."""
    spec, n = spec_of(head), f.tokens.numel()
    device = head.fc.weight.device
    m = n - 1
    rows = torch.arange(m, device=device)
    text = ~f.visual[:m]
    draft_ids = head.draft_to_target

    def cross(out: Tensor, label_rows: Tensor) -> Tensor:
        soft = f.logits[label_rows][:, draft_ids].float().softmax(-1)
        return -(soft * head.draft_logits(out).float().log_softmax(-1)).sum(-1)

    hidden = head.fuse(torch.where(text[:, None], f.hidden[:m], f.bridged[:m]))
    out, k, v = head.step(f.tokens[rows + 1], hidden, rows, text_anchored_mask(text, spec.text_window), None)
    ce = cross(out, rows + 1)
    total = ce[text].mean() + (bridge_weight * ce[~text].mean() if bool((~text).any()) else 0.0)
    best = f.logits[rows + 1].argmax(-1)
    agreements = [float((draft_ids[head.draft_logits(out[text]).argmax(-1)] == best[text]).float().mean())]
    at = text.nonzero().flatten()  # the text rows, in order
    r = at.numel()
    keys, values, hidden = [k[:, at]], [v[:, at]], out[at]
    base = window_mask(torch.arange(r, device=device), torch.arange(r, device=device), spec.text_window)
    eye = torch.eye(r, dtype=torch.bool, device=device)
    for j in range(1, ttt_steps):
        label_rows = at + 1 + j
        valid = label_rows <= n - 1
        if not bool(valid.any()):
            break
        label_rows = label_rows.clamp(max=n - 1)
        mask = torch.cat([base, *[eye] * j], 1)
        out, k, v = head.step(f.tokens[label_rows], hidden, at + j, mask, (torch.cat(keys, 1), torch.cat(values, 1)))
        keys.append(k)
        values.append(v)
        total = total + decay**j * cross(out, label_rows)[valid].mean()
        drafted = draft_ids[head.draft_logits(out[valid]).argmax(-1)]
        agreements.append(float((drafted == f.logits[label_rows[valid]].argmax(-1)).float().mean()))
        hidden = out
    return total, tuple(agreements)


def train_sparrow(head: EagleHead, features: Sequence[VideoFeatures], steps: int, lr: float = 1e-3,
                  generator: torch.Generator | None = None, ttt_steps: int = 3, clip: float = 0.5,
                  bridge_weight: float = 0.5) -> TrainReport:
    """Train the Sparrow head in place for `steps` AdamW steps, one sequence (drawn with `generator`) a step."""
    assert features and spec_of(head) is not None, "train_sparrow needs video features and a Sparrow head"
    start = time.perf_counter()
    head.train().requires_grad_(True)
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    device = generator.device if generator is not None else None
    losses, agreements, seen = [], [], 0
    for _ in range(steps):
        f = features[int(torch.randint(len(features), (1,), generator=generator, device=device))]
        optimiser.zero_grad(set_to_none=True)
        loss, agreement = sparrow_loss(head, f, ttt_steps, bridge_weight=bridge_weight)
        loss.backward()
        nn.utils.clip_grad_norm_(parameters, clip)
        optimiser.step()
        losses.append(float(loss.detach()))
        agreements.append(agreement)
        seen += f.tokens.numel() - 1
    head.eval().requires_grad_(False)
    return TrainReport(tuple(losses), tuple(agreements), seen, time.perf_counter() - start)


def _on_device(f: VideoFeatures, device: torch.device) -> VideoFeatures:
    """`f` on `device` (features kept on the CPU between steps; hidden states in their own dtype)."""
    if f.tokens.device == device:
        return f
    return VideoFeatures(f.tokens.to(device), f.visual.to(device), f.hidden.to(device), f.bridged.to(device),
                         f.logits.to(device))


def sparrow_step(head: EagleHead, optimiser: torch.optim.Optimizer, batch: Sequence[VideoFeatures], ttt_steps: int,
                 decay: float = 0.8, clip: float = 0.5, bridge_weight: float = 0.5) -> StepResult:
    """One AdamW step on the mean Sparrow loss of `batch` (gradients clipped to norm `clip`): the step of
    `sparrow.heads.trainer.run_training` for a Sparrow head."""
    head.train()
    optimiser.zero_grad(set_to_none=True)
    device = head.fc.weight.device
    step_loss = step_agreement = 0.0
    tokens = 0
    for f in batch:
        loss, agreements = sparrow_depth_loss(head, _on_device(f, device), ttt_steps, decay, bridge_weight)
        (loss / len(batch)).backward()
        step_loss += float(loss.detach()) / len(batch)
        step_agreement += agreements[0] / len(batch)
        tokens += f.tokens.numel() - 1
    parameters = [p for group in optimiser.param_groups for p in group["params"]]
    nn.utils.clip_grad_norm_(parameters, clip)
    optimiser.step()
    return StepResult(step_loss, step_agreement, tokens)


@torch.no_grad()
def evaluate_sparrow(head: EagleHead, features: Sequence[VideoFeatures], ttt_steps: int = 3,
                     bridge_weight: float = 0.5) -> Evaluation:
    """Loss and per-depth top-1 agreement of a Sparrow head on held-out video features (left in eval mode)."""
    head.eval()
    device = head.fc.weight.device
    losses, agreements = [], []
    for f in features:
        loss, depths = sparrow_depth_loss(head, _on_device(f, device), ttt_steps, bridge_weight=bridge_weight)
        losses.append(float(loss))
        agreements.append(list(depths))
    return Evaluation.mean_of(losses, agreements)

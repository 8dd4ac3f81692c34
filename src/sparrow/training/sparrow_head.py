"""Training the Sparrow head for Video-LLMs: its loss over video features, steps and held-out evaluation."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from sparrow.heads.eagle import EagleHead
from sparrow.heads.longspec import window_mask
from sparrow.heads.sparrow_head import VideoFeatures, spec_of, text_anchored_mask
from sparrow.training.loop import Evaluation, StepResult, TrainReport, mean_loss_step


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
    `sparrow.training.trainer.run_training` for a Sparrow head."""
    device = head.fc.weight.device
    return mean_loss_step(head, optimiser, batch,
                          lambda f: sparrow_depth_loss(head, _on_device(f, device), ttt_steps, decay, bridge_weight),
                          clip)



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


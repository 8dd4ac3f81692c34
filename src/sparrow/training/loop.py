"""What every head's training loop shares: the optimiser, the data order, step and evaluation records, the report,
and LongSpec's anchor-offset positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sparrow.heads.eagle import EagleHead


@dataclass(frozen=True)
class TrainReport:
    """What `train_head` did: per optimiser step, the loss and the top-1 agreement of the first draft position."""

    losses: tuple[float, ...]
    agreement: tuple[float, ...]  # share of rows whose depth-1 draft argmax equals the target's argmax
    tokens: int  # training positions seen (rows of step 0, summed over steps)
    seconds: float



def anchor_offset_positions(n: int, max_offset: int, generator: torch.Generator | None, max_sink: int = 4) -> Tensor:
    """LongSpec's anchor-offset position indices for a training sequence of n tokens ([n] int64): the first
    `sink` tokens (uniform in 0 .. max_sink) keep their positions (attention sinks), the rest shift by one random
    offset in 0 .. max_offset, so short text trains the large positions of long contexts. max_offset 0: arange."""
    device = generator.device if generator is not None else None
    positions = torch.arange(n, device=device)
    if max_offset <= 0:
        return positions
    sink = int(torch.randint(max_sink + 1, (1,), generator=generator, device=device))
    offset = int(torch.randint(max_offset + 1, (1,), generator=generator, device=device))
    positions[sink:] += offset
    return positions



@dataclass(frozen=True)
class StepResult:
    """One optimiser step: the batch's mean loss, depth-1 agreement and the training positions it had."""

    loss: float
    agreement: float
    tokens: int


def mean_loss_step(head: EagleHead, optimiser: torch.optim.Optimizer, batch: Sequence[Any],
                   loss_of: Callable[[Any], tuple[Tensor, Sequence[float]]], clip: float) -> StepResult:
    """One optimiser step on the mean of `loss_of(item)` (a loss and its per-depth agreements) over `batch` (items
    with `tokens`), gradients clipped to norm `clip`. A loss without a gradient (a constant zero: no row's target
    argmax lies in the draft vocabulary) counts in the mean and adds none."""
    head.train()
    optimiser.zero_grad(set_to_none=True)
    step_loss = step_agreement = 0.0
    tokens = 0
    for item in batch:
        loss, agreements = loss_of(item)
        if loss.requires_grad:
            (loss / len(batch)).backward()
        step_loss += float(loss.detach()) / len(batch)
        step_agreement += agreements[0] / len(batch)
        tokens += item.tokens.numel() - 1
    parameters = [p for group in optimiser.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(parameters, clip)
    optimiser.step()
    return StepResult(step_loss, step_agreement, tokens)


def new_optimiser(head: EagleHead, lr: float, frozen: Sequence[str] = ()) -> torch.optim.AdamW:
    """EAGLE-3's AdamW (betas 0.9, 0.95, no weight decay) over the head's trainable parameters: all but those of
    the submodules named in `frozen` (e.g. "lm_head"), which are left without gradients."""
    head.requires_grad_(True)
    for name in frozen:
        head.get_submodule(name).requires_grad_(False)
    return torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                             weight_decay=0.0)



def draw_batch(count: int, batch_size: int, generator: torch.Generator | None) -> list[int]:
    """`batch_size` indices into `count` sequences, drawn with `generator` (the data order of a run)."""
    device = generator.device if generator is not None else None
    return torch.randint(count, (batch_size,), generator=generator, device=device).tolist()



@dataclass(frozen=True)
class Evaluation:
    """A head against its target on held-out features."""

    loss: float  # mean TTT loss per sequence
    agreement: tuple[float, ...]  # top-1 agreement at draft depth 1 .. ttt_steps (target-fed context)
    sequences: int

    @staticmethod
    def mean_of(losses: list[float], agreements: list[list[float]]) -> Evaluation:
        """The mean loss and per-depth agreement over sequences (depths: as many as every sequence reached)."""
        if not losses:
            return Evaluation(0.0, (), 0)
        depth = min(len(a) for a in agreements)
        mean = tuple(sum(a[j] for a in agreements) / len(agreements) for j in range(depth))
        return Evaluation(sum(losses) / len(losses), mean, len(losses))

    def record(self) -> dict[str, Any]:
        """What eval.json's "held_out" holds."""
        return {"sequences": self.sequences, "loss": self.loss, "agreement_per_depth": list(self.agreement),
                "expected_tokens_per_round": self.expected_accepted}

    @property
    def expected_accepted(self) -> float:
        """Tokens per round a chain of ttt_steps drafts would commit if depth j were accepted with the agreement
        at j given its parents were: 1 + a1 + a1 a2 + ... (a proxy for EAGLE's acceptance length tau)."""
        total, product = 1.0, 1.0
        for a in self.agreement:
            product *= a
            total += product
        return total


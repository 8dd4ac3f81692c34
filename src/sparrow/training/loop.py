"""What every head's training loop shares: the optimiser, the data order, step and evaluation records, the report,
and LongSpec's anchor-offset positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sparrow.errors import UserError
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


OPTIMISERS = ("adamw", "muon")
"""`new_optimiser`'s kinds: EAGLE-3's AdamW, or Muon on the 2-D weight matrices with AdamW on the rest."""


class MuonAdamW:
    """Muon (torch.optim.Muon: orthogonalised momentum, 2-D matrices only) over a head's weight matrices and AdamW
    over the rest (norms, biases, the LM head: Muon is meant for hidden matrices, not the output layer), as one
    optimiser: `param_groups` lists both (a schedule sets one learning rate on all), `step`, `zero_grad`,
    `state_dict` / `load_state_dict`. Muon's updates are scaled to AdamW's RMS (`match_rms_adamw`), so one
    learning rate fits both."""

    def __init__(self, matrices: list[Tensor], others: list[Tensor], lr: float) -> None:
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(others, lr=lr, betas=(0.9, 0.95), weight_decay=0.0) if others else None
        self.parts = [self.muon] + ([self.adamw] if self.adamw is not None else [])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, saved in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(saved)


def new_optimiser(head: nn.Module, lr: float, frozen: Sequence[str] = (), kind: str = "adamw"
                  ) -> torch.optim.Optimizer:
    """The optimiser over the head's trainable parameters: all but those of the submodules named in `frozen` (e.g.
    "lm_head"), which are left without gradients. kind "adamw": EAGLE-3's AdamW (betas 0.9, 0.95, no weight
    decay); "muon": `MuonAdamW` (Muon on the 2-D weights but the LM head's, AdamW on the rest; no weight decay)."""
    if kind not in OPTIMISERS:
        raise UserError(f"optimizer must be one of {', '.join(OPTIMISERS)}, got {kind!r}")
    head.requires_grad_(True)
    for name in frozen:
        head.get_submodule(name).requires_grad_(False)
    named = [(name, p) for name, p in head.named_parameters() if p.requires_grad]
    if kind == "muon":
        matrices = [p for name, p in named if p.ndim == 2 and not name.startswith("lm_head.")]
        others = [p for name, p in named if not (p.ndim == 2 and not name.startswith("lm_head."))]
        return MuonAdamW(matrices, others, lr)  # type: ignore[return-value]  (an optimiser in all but its base)
    return torch.optim.AdamW([p for _, p in named], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)



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


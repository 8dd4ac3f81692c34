"""A resumable training run of a head: AdamW steps on cached features, held-out evaluations, checkpoints, a log.

A run directory holds the head in its serving layout (`sparrow.heads.layout`: config.json, model.safetensors,
float32 while training), `trainer_state.pt` (step, optimiser state, the data-order generator's state, the
head's config, weights and the settings) and `train_log.jsonl` (one row per step; held-out rows carry
`held_out_loss`). Resuming restores all of it, so the steps after a checkpoint are the ones an uninterrupted
run takes (same batches, same optimiser moments, bit for bit on the same device).

A checkpoint is written to a temporary file, flushed to disk and renamed over `trainer_state.pt`; the one it
replaces is kept as `trainer_state.prev.pt`. `read_state` refuses a damaged state file (truncated, unreadable)
with a one-line message and falls back to the previous one (its own copy of the weights: the head's layout
files may be the newer checkpoint's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from sparrow.errors import UserError
from sparrow.heads.config import HeadConfig
from sparrow.heads.eagle import EagleHead, TargetParts
from sparrow.heads.layout import WEIGHTS, save_head
from sparrow.heads.longspec import LongSpecConfig, LongSpecHead
from sparrow.heads.sparrow_head import SparrowSpec
from sparrow.training import orchestrator
from sparrow.training.heads import INITS, evaluate_head, train_step
from sparrow.training.longspec import evaluate_longspec, longspec_step
from sparrow.training.loop import OPTIMISERS, Evaluation, StepResult, draw_batch, new_optimiser
from sparrow.training.orchestrator import Outcome, Schedule, append_row
from sparrow.training.sparrow_head import evaluate_sparrow, sparrow_step

STATE = "trainer_state.pt"
PREVIOUS = "trainer_state.prev.pt"  # the checkpoint before the last one
LOG = "train_log.jsonl"


@dataclass(frozen=True)
class TrainSettings:
    """The recipe of a run (EAGLE-3's optimiser; a short linear warmup; TTT over `ttt_steps` draft depths)."""

    steps: int
    lr: float = 1e-3
    batch_size: int = 4  # sequences per optimiser step
    ttt_steps: int = 3
    decay: float = 0.8  # weight of depth j's loss: decay ** j
    clip: float = 0.5
    warmup: int = 20  # steps of linear learning-rate warmup
    checkpoint_every: int = 100
    eval_every: int = 50
    seed: int = 0  # of the data order
    anchor_offset: int = 0  # LongSpec heads: anchor-offset positions shifted by up to this (0: none)
    init_from_target: str = "lm_head"  # what a fresh head takes from its target (sparrow.training.heads.INITS)
    optimizer: str = "adamw"  # or muon (sparrow.training.loop.OPTIMISERS)

    def __post_init__(self) -> None:
        for name, value in (("--steps", self.steps), ("--batch-size", self.batch_size),
                            ("--ttt-steps", self.ttt_steps), ("--warmup", self.warmup),
                            ("--checkpoint-every", self.checkpoint_every), ("--eval-every", self.eval_every)):
            if value < 1:
                raise UserError(f"{name} must be an integer >= 1, got {value}")
        if not self.lr > 0:
            raise UserError(f"--lr must be > 0, got {self.lr}")
        if self.anchor_offset < 0:
            raise UserError(f"--anchor-offset must be an integer >= 0, got {self.anchor_offset}")
        if self.init_from_target not in INITS:
            raise UserError(f"--init-from-target must be one of {', '.join(INITS)}, got {self.init_from_target!r}")
        if self.optimizer not in OPTIMISERS:
            raise UserError(f"--optimizer must be one of {', '.join(OPTIMISERS)}, got {self.optimizer!r}")


def save_checkpoint(directory: Path, head: EagleHead | LongSpecHead, optimiser: torch.optim.Optimizer,
                    generator: torch.Generator, step: int, settings: TrainSettings) -> None:
    """The head (its layout) and the trainer state, the state written last (it marks a whole checkpoint). The state
    holds the head's whole config (HeadConfig or LongSpecConfig), its weights and a Sparrow head's SparrowSpec;
    it is written whole or not at all, and the one it replaces becomes PREVIOUS."""
    save_head(head, directory)
    spec = getattr(head, "sparrow", None)
    state = {"step": step, "optimiser": optimiser.state_dict(), "generator": generator.get_state(),
             "head_config": asdict(head.config), "settings": asdict(settings),
             "sparrow": None if spec is None else asdict(spec),
             "weights": {name: t.detach().cpu() for name, t in head.state_dict().items()}}
    partial = directory / (STATE + ".partial")
    with partial.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    if (directory / STATE).is_file():
        os.replace(directory / STATE, directory / PREVIOUS)
    os.replace(partial, directory / STATE)


def read_state(directory: Path, warn: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The trainer state of `directory` (None when it has none): trainer_state.pt, or when that is damaged (or
    missing after a crash between the two renames of `save_checkpoint`) the previous one, with a one-line
    `warn`ing. UserError when every state file there is damaged."""
    damaged: list[str] = []
    for name in (STATE, PREVIOUS):
        path = directory / name
        if not path.is_file():
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not {"step", "optimiser", "generator", "head_config"} <= state.keys():
                raise ValueError("not a trainer state")
        except Exception as e:  # noqa: BLE001 -- truncated, garbage, another file: every loader error counts
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
            damaged.append(f"{path} is damaged ({type(e).__name__}: {detail})")
            continue
        if damaged and warn is not None:
            warn(f"{damaged[0]}: using the previous checkpoint {path.name} (step {state['step']}) instead")
        return state
    if damaged:
        raise UserError(f"{'; '.join(damaged)}; no readable checkpoint is left: delete {directory / STATE} (and "
                        f"{PREVIOUS}) to train again from step 0 with the corpus and features already there")
    return None


def resumed_head(directory: Path, state: dict[str, Any], model: nn.Module,
                 device: torch.device) -> EagleHead | LongSpecHead:
    """The float32 head of a checkpoint, bound to `model` (the target it was trained for): every variant (EAGLE-1/3
    with their fusion and layers, a Sparrow head's spec, a LongSpec head's window and layer) as it was saved."""
    fields = dict(state["head_config"])
    if fields.get("arch") == "longspec":
        head: EagleHead | LongSpecHead = LongSpecHead(LongSpecConfig(**fields), TargetParts.of(model), device=device,
                                                      dtype=torch.float32)
    else:
        fields["target_layers"] = tuple(fields["target_layers"])
        head = EagleHead(HeadConfig(**fields), TargetParts.of(model), device=device, dtype=torch.float32)
        if state.get("sparrow") is not None:
            head.sparrow = SparrowSpec(**state["sparrow"])
    weights = state.get("weights")  # older checkpoints: the layout's weights only
    head.load_state_dict({k: t.to(device) for k, t in weights.items()} if weights is not None
                         else load_file(str(directory / WEIGHTS), device=str(device)), strict=True)
    return head


def run_training(head: EagleHead | LongSpecHead, train: Sequence[Any], held_out: Sequence[Any],
                 settings: TrainSettings, directory: Path, state: dict[str, Any] | None = None,
                 deadline: float | None = None, on_step: Callable[[dict[str, Any]], None] | None = None,
                 model: nn.Module | None = None) -> Outcome:
    """Train `head` (in place) to settings.steps steps, from `state` (a checkpoint's `read_state`) or from step 0,
    with sparrow.training.orchestrator: it stops early, with a checkpoint, once time.monotonic() passes `deadline`.
    `on_step(row)` sees each log row. EAGLE heads train on `Features`, a Sparrow head on `sparrow_head.VideoFeatures`;
    a LongSpec head on token sequences ([n] ids) with its target `model` (it reads the target's KV at anchor-offset
    positions drawn each step, so no feature cache applies)."""
    if not train:
        raise UserError("no training sequences: give more --data or --tokens")
    steps = _CachedSteps(head, train, held_out, settings, directory, state, on_step, model)
    schedule = Schedule(settings.lr, settings.warmup, steps=settings.steps, until=deadline,
                        checkpoint_steps=settings.checkpoint_every)
    outcome = orchestrator.train(steps, schedule, state, steps.start)
    head.eval().requires_grad_(False)
    return outcome


class _CachedSteps:
    """`sparrow train head`'s side of the orchestrator: batches drawn from features already computed, a row of
    train_log.jsonl a step (held-out rows every settings.eval_every steps and at the last), trainer_state.pt."""

    def __init__(self, head: EagleHead | LongSpecHead, train: Sequence[Any], held_out: Sequence[Any],
                 settings: TrainSettings, directory: Path, state: dict[str, Any] | None,
                 on_step: Callable[[dict[str, Any]], None] | None, model: nn.Module | None) -> None:
        self.head, self.train, self.held_out, self.settings, self.directory = head, train, held_out, settings, directory
        self.on_step = on_step
        self.step_of, self.evaluate_on = _trainer_of(head, settings, model)
        directory.mkdir(parents=True, exist_ok=True)
        self.order = torch.Generator().manual_seed(settings.seed)
        self.optimiser = new_optimiser(head, settings.lr, kind=settings.optimizer)
        self.start = 0 if state is None else int(state["step"])
        _cut_log(directory / LOG, self.start)
        self.evaluated: tuple[int, Evaluation] | None = None

    def step(self, step: int) -> None:
        batch = [self.train[i] for i in draw_batch(len(self.train), self.settings.batch_size, self.order)]
        result = self.step_of(self.optimiser, batch, self.order)
        step += 1
        row: dict[str, Any] = {"step": step, "loss": result.loss, "agreement": result.agreement,
                               "tokens": result.tokens, "lr": self.optimiser.param_groups[0]["lr"]}
        if self.held_out and (step % self.settings.eval_every == 0 or step == self.settings.steps):
            evaluation = self.evaluate(step)
            assert evaluation is not None
            row.update(held_out_loss=evaluation.loss, held_out_agreement=list(evaluation.agreement),
                       expected_accepted=evaluation.expected_accepted)
        append_row(self.directory / LOG, row)
        if self.on_step is not None:
            self.on_step(row)

    def checkpoint(self, step: int) -> None:
        save_checkpoint(self.directory, self.head, self.optimiser, self.order, step, self.settings)

    def evaluate(self, step: int) -> Evaluation | None:
        if not self.held_out:
            return None
        if self.evaluated is None or self.evaluated[0] != step:
            self.evaluated = step, self.evaluate_on(self.held_out)
        return self.evaluated[1]


def _trainer_of(head: EagleHead | LongSpecHead, settings: TrainSettings, model: nn.Module | None
                ) -> tuple[Callable[[torch.optim.Optimizer, list[Any], torch.Generator], StepResult],
                           Callable[[Sequence[Any]], Evaluation]]:
    """The optimiser step and the held-out evaluation of `head`'s arch (the generator: the run's data order)."""
    if head.config.arch == "longspec":
        if model is None:
            raise ValueError("a LongSpec head trains with its target: pass model=")
        return (lambda optimiser, batch, generator: longspec_step(
                    head, model, optimiser, batch, generator, settings.anchor_offset, settings.ttt_steps + 1,
                    settings.clip),
                lambda held_out: evaluate_longspec(head, model, held_out, settings.ttt_steps))
    if settings.anchor_offset:
        raise UserError("--anchor-offset applies to --arch longspec only")
    if getattr(head, "sparrow", None) is not None:  # a Sparrow head trains on VideoFeatures (sparrow_head)

        return (lambda optimiser, batch, generator: sparrow_step(head, optimiser, batch, settings.ttt_steps,
                                                                 settings.decay, settings.clip),
                lambda held_out: evaluate_sparrow(head, held_out, settings.ttt_steps))
    return (lambda optimiser, batch, generator: train_step(head, optimiser, batch, settings.ttt_steps, settings.decay,
                                                           clip=settings.clip),
            lambda held_out: evaluate_head(head, held_out, settings.ttt_steps))


def _cut_log(path: Path, keep_through: int) -> None:
    """train_log.jsonl cut back to the rows of steps <= keep_through (those of the checkpoint resumed)."""
    rows = read_log(path) if path.is_file() else []
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= keep_through))


def read_log(path: Path) -> list[dict[str, Any]]:
    """The rows of a train_log.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["LOG", "PREVIOUS", "STATE", "TrainSettings", "read_log", "read_state", "resumed_head",
           "run_training", "save_checkpoint"]

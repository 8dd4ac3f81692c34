"""The training plot of a head: loss per step, held-out agreement per draft depth and the acceptance proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_training(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """A PNG of a run's log rows (`sparrow.training.trainer.read_log`): left, the training and held-out loss;
    right, held-out top-1 agreement at each draft depth and the expected tokens per round (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    held = [r for r in rows if "held_out_loss" in r]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [r["loss"] for r in rows], lw=0.8, alpha=0.6, label="train (batch)")
    if held:
        left.plot([r["step"] for r in held], [r["held_out_loss"] for r in held], "o-", label="held-out")
        depths = len(held[-1]["held_out_agreement"])
        for j in range(depths):
            right.plot([r["step"] for r in held], [r["held_out_agreement"][j] for r in held], "o-",
                       label=f"agreement, depth {j + 1}")
        tau = right.twinx()
        tau.plot(
            [r["step"] for r in held], [r["expected_accepted"] for r in held], "k--", label="expected tokens/round"
        )
        tau.set_ylabel("expected tokens per round (chain)")
        tau.legend(loc="lower right")
    left.set(xlabel="step", ylabel="TTT loss", title="loss")
    right.set(xlabel="step", ylabel="top-1 agreement with the target", title="held-out agreement", ylim=(0, 1))
    left.legend()
    if held:
        right.legend(loc="upper left")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path

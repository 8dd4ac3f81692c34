"""The one training orchestrator (sparrow.training.orchestrator) with a fake `Steps`: checkpoint cadence, the last
checkpoint never twice for one step, resume of the optimiser and data order, stops, and the refusals."""

from __future__ import annotations

import pytest
import torch

from sparrow.errors import UserError
from sparrow.training.loop import Evaluation
from sparrow.training.orchestrator import Schedule, check_out, train


class FakeSteps:
    def __init__(self, fail_at: int | None = None) -> None:
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.optimiser = torch.optim.AdamW([self.weight], lr=1.0)
        self.order = torch.Generator().manual_seed(0)
        self.fail_at, self.lrs, self.draws, self.saved = fail_at, [], [], []

    def step(self, step: int) -> None:
        if step == self.fail_at:
            raise RuntimeError("boom")
        self.lrs.append(self.optimiser.param_groups[0]["lr"])
        self.draws.append(int(torch.randint(1000, (1,), generator=self.order)))

    def checkpoint(self, step: int) -> None:
        self.saved.append(step)

    def evaluate(self, step: int) -> Evaluation:
        return Evaluation(float(step), (0.5,), 1)


def test_checkpoints_every_n_steps_and_once_at_the_end_with_a_warmed_up_learning_rate():
    steps = FakeSteps()
    outcome = train(steps, Schedule(lr=1.0, warmup=4, steps=10, checkpoint_steps=5))
    assert (outcome.step, outcome.stopped, outcome.error) == (10, "done", None)
    assert steps.saved == [5, 10] and outcome.evaluation.loss == 10.0  # not twice at step 10
    assert steps.lrs[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    steps = FakeSteps()
    assert train(steps, Schedule(lr=1.0, warmup=1, steps=7, checkpoint_steps=5)).step == 7 and steps.saved == [5, 7]


def test_a_resumed_run_draws_the_batches_an_uninterrupted_one_does():
    whole = FakeSteps()
    train(whole, Schedule(lr=1.0, warmup=1, steps=6))
    first = FakeSteps()
    train(first, Schedule(lr=1.0, warmup=1, steps=3))
    state = {"optimiser": first.optimiser.state_dict(), "generator": first.order.get_state()}
    second = FakeSteps()
    assert train(second, Schedule(lr=1.0, warmup=1, steps=6), state, start_step=3).step == 6
    assert first.draws + second.draws == whole.draws


def test_an_error_ends_training_only_with_always_finish_and_a_spent_budget_stops_at_once():
    steps = FakeSteps(fail_at=2)
    outcome = train(steps, Schedule(lr=1.0, warmup=1, steps=9, always_finish=True, steps_reached="max steps"))
    assert (outcome.step, outcome.stopped, outcome.error) == (2, "error", "RuntimeError: boom") and steps.saved == [2]
    with pytest.raises(RuntimeError, match="boom"):
        train(FakeSteps(fail_at=2), Schedule(lr=1.0, warmup=1, steps=9))
    spent = train(FakeSteps(), Schedule(lr=1.0, warmup=1, until=0.0))
    assert (spent.step, spent.stopped) == (0, "time budget")


def test_resume_and_out_refusals_are_one_line(tmp_path):
    with pytest.raises(UserError, match="holds no checkpoint \\(x\\) to continue"):
        check_out(tmp_path, True, None, " (x)")
    with pytest.raises(UserError, match="already holds a run: pass --resume to continue it"):
        check_out(tmp_path, False, tmp_path / "state.pt")
    check_out(tmp_path, True, tmp_path / "state.pt")
    check_out(tmp_path, False, None)

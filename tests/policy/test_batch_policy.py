"""The batch draft budget (sparrow.policy.batch) on fake costs: as the batch grows and verification becomes
compute-bound, the draft cap shrinks; where no draft pays, steps are plain with a probe now and then."""

from __future__ import annotations

from conftest import tiny_model

from sparrow.policy.batch import BatchPolicy, CostTable
from sparrow.policy.measure import measure_batch_cost


class Seq:
    """What BatchPolicy reads of a generation: its acceptance."""

    def __init__(self, acceptance: float) -> None:
        self.acceptance = type("A", (), {"value": acceptance})()


def cpu_like_policy() -> BatchPolicy:
    """Verification memory-bound up to ~16 tokens then compute-bound; a draft position costs 40 ms for one
    sequence and 60 ms for 32 together (a CPU-like curve)."""
    policy = BatchPolicy()
    policy.seed([(1, 0.100), (16, 0.120), (64, 0.600), (256, 2.600)])
    policy.draft.add(1, 0.040)
    policy.draft.add(32, 0.060)
    return policy


def test_the_draft_cap_shrinks_as_the_batch_grows():
    policy = cpu_like_policy()
    caps = [policy.cap([Seq(0.7)] * b, [8] * b) for b in (1, 2, 4, 8, 16, 32)]
    assert caps[0] == 8  # alone: the drafter's own policy decides
    assert all(a >= b for a, b in zip(caps[1:], caps[2:])), caps
    assert caps[1] > caps[-1], caps


def test_a_batch_that_stops_drafting_probes_now_and_then():
    """Nothing accepted: plain steps, but a probe every few steps (the interval doubling while it loses)."""
    policy = cpu_like_policy()
    caps = [policy.cap([Seq(0.0)] * 4, [8] * 4) for _ in range(40)]
    probes = [i for i, k in enumerate(caps) if k]
    assert caps.count(0) >= 34 and 2 <= len(probes) <= 5, caps
    assert all(b - a >= 4 for a, b in zip(probes, probes[1:]))
    assert probes[2] - probes[1] > probes[1] - probes[0]


def test_cost_table_interpolates_decayed_bin_means():
    table = CostTable(decay=0.5)
    table.add(1, 0.2)
    assert table(8) == 0.2 * 8  # one bin: proportional beyond it
    table.add(1, 0.1)  # the same bin: a decayed mean, the newer observation weighing twice the older
    table.add(16, 0.4)
    assert table(1) == table(0.5) == (0.5 * 0.2 + 0.1) / 1.5  # flat below the first bin
    assert table(16) == 0.4 and table(32) > 0.4  # the last segment's slope beyond the last bin


def test_measure_batch_cost_times_the_lengths_that_fit():
    """The seed of a served batch's verify table: one timed forward per length that fits the context."""
    model = tiny_model("llama", seed=0)  # a 1024-token context
    points = measure_batch_cost(model, tokens=(1, 16, 1000), context=32)
    assert [n for n, _ in points] == [1, 16] and all(seconds > 0 for _, seconds in points)
    policy = BatchPolicy()
    policy.seed(points)
    assert policy.verify.known

"""The batch draft budget (sparrow.policy.batch) on fake costs: as the batch grows and verification becomes
compute-bound, the draft cap shrinks; where no draft pays, steps are plain with a probe now and then."""

from __future__ import annotations

from conftest import tiny_model

from sparrow.decoding.batch import measure_feeds, measure_rows
from sparrow.policy.batch import BatchPolicy, CostTable
from sparrow.policy.estimates import AcceptanceEstimate


class Seq:
    """What BatchPolicy reads of a generation: its acceptance (here the prior alone: geometric)."""

    def __init__(self, acceptance: float) -> None:
        self.acceptance = AcceptanceEstimate(prior=acceptance)


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
    caps, probing = [], []
    for _ in range(40):
        caps.append(policy.cap([Seq(0.0)] * 4, [8] * 4))
        probing.append(policy.probing)  # what the batch reads to probe only with drafts in step
    probes = [i for i, k in enumerate(caps) if k]
    assert probing == [bool(k) for k in caps]
    assert caps.count(0) >= 34 and 2 <= len(probes) <= 5, caps
    assert all(b - a >= 4 for a, b in zip(probes, probes[1:]))
    assert probes[2] - probes[1] > probes[1] - probes[0]


def compute_bound_verify() -> list[tuple[int, float]]:
    """A bfloat16 target on 2 CPU cores: verification is compute-bound early (0.25 s for 1 token, 0.8 s for 16)."""
    return [(1, 0.25), (16, 0.80), (64, 2.5)]


INT4_DRAFT = [(1, 0.02), (8, 0.06)]  # a draft position: 20 ms for one row, 60 ms for 8 (it grows with rows)


def test_the_cap_weighs_drafting_against_a_plain_step_with_measured_batched_costs():
    """Two sequences: drafting pays; eight: a plain step of 8 tokens beats drafting one token each (k = 1: 16
    tokens verified, 8 rows drafting), so the cap is 0 (a plain step) from the first decision on."""
    policy = BatchPolicy()
    policy.seed(compute_bound_verify(), INT4_DRAFT)
    assert policy.draft.known
    assert policy.cap([Seq(0.8)] * 2, [8] * 2) > 0
    eight = [Seq(0.6)] * 8
    assert policy.rate(eight, [8] * 8, 0) > max(policy.rate(eight, [8] * 8, k) for k in range(1, 9))
    fresh = BatchPolicy()
    fresh.seed(compute_bound_verify(), INT4_DRAFT)
    assert [fresh.cap(eight, [8] * 8) for _ in range(3)] == [0, 0, 0]  # no blind first step; probes come later


def test_an_unseeded_draft_cost_would_draft_blindly():
    """Negative control: with the draft's cost unknown (counted as 0) a batch of eight drafts where the measured
    draft cost keeps it plain (acceptance 0.8: drafting one token each 14 % faster than plain at no draft cost,
    6 % at the measured cost, under the 10 % margin)."""
    eight = [Seq(0.8)] * 8
    policy = BatchPolicy()
    policy.seed(compute_bound_verify())
    assert not policy.draft.known and policy.cap(eight, [8] * 8) > 0
    seeded = BatchPolicy()
    seeded.seed(compute_bound_verify(), INT4_DRAFT)
    assert seeded.cap(eight, [8] * 8) == 0


def test_drafting_must_beat_a_plain_step_by_the_margin():
    """Four sequences whose best cap is 6 % faster than plain by the estimates stay plain (the cost tables are
    that far off); with no margin they draft."""
    seqs = [Seq(0.6)] * 4
    policy = BatchPolicy()
    policy.seed(compute_bound_verify(), INT4_DRAFT)
    rates = [policy.rate(seqs, [8] * 4, k) for k in range(9)]
    assert rates[0] < max(rates[1:]) < rates[0] * 1.1, rates
    assert policy.cap(seqs, [8] * 4) == 0
    eager = BatchPolicy(margin=0.0)
    eager.seed(compute_bound_verify(), INT4_DRAFT)
    assert eager.cap(seqs, [8] * 4) > 0


def test_the_cap_uses_observed_accepted_lengths():
    """Allowed 8, the drafters stop after 3 tokens (their confidence exit), all accepted: the per-token rate is ~1,
    so the geometric model expects ~9 tokens of a cap of 8; observed, a cap of 8 yields ~4, and the cap is 3."""
    policy = BatchPolicy()
    policy.seed([(1, 0.100), (16, 0.110), (64, 0.400)], [(1, 0.004), (4, 0.005)])
    observed = Seq(0.8)
    for _ in range(50):
        observed.acceptance.observe(3, 3, reach=8)
    geometric = Seq(observed.acceptance.value)
    assert observed.acceptance.tokens(8) < 5 < 8.5 < geometric.acceptance.tokens(8)
    assert policy.cap([observed] * 4, [8] * 4) == 3 < policy.cap([geometric] * 4, [8] * 4)


INT4_FEED = [(16, 0.015), (64, 0.05), (256, 0.2)]  # one sequence's draft feeding n tokens alone (dense prefill)


def test_a_catch_up_is_priced_by_the_tokens_each_draft_has_left():
    """Twelve sequences whose drafts sat out 150 tokens each (a lazy prompt prefill and the steps since): with
    20 tokens left each, their catch-ups (0.12 s each, alone) cost more than drafting then saves, so the step is
    plain; with 200 left, each step carries a tenth of that share and drafting pays. Drafts in step pay nothing,
    and without a measured feed table the lag is not priced (the earlier policy, which drafted here)."""
    seqs, verify, draft = [Seq(0.8)] * 12, [(1, 0.10), (32, 0.12), (64, 0.2), (256, 0.8)], [(1, 0.01), (16, 0.02)]
    policy = BatchPolicy()
    policy.seed(verify, draft, INT4_FEED)
    assert policy.feed.known
    far = [150] * 12
    assert policy.cap(seqs, [20] * 12, far) == 0
    assert policy.cap(seqs, [200] * 12, far) > 0
    assert policy.cap(seqs, [20] * 12, [0] * 12) > 0  # in step: nothing to catch up
    unmeasured = BatchPolicy()
    unmeasured.seed(verify, draft)
    assert unmeasured.cap(seqs, [20] * 12, far) > 0  # negative control


def test_a_served_batch_seeds_its_feed_table_with_single_sequence_forwards():
    """The catch-up table's seed (`Scheduler._draft_costs`): one sequence's forward of 16, 64 tokens, more costing
    no less."""
    points = measure_feeds(tiny_model("llama", seed=0), (16, 64))
    assert [n for n, _ in points] == [16, 64] and all(seconds > 0 for _, seconds in points)
    policy = BatchPolicy()
    policy.seed([(1, 0.1)], feed=points)
    assert policy.feed.known and policy.feed(64) >= policy.feed(16)


def test_cost_table_interpolates_decayed_bin_means():
    table = CostTable(decay=0.5)
    table.add(1, 0.2)
    assert table(8) == 0.2 * 8  # one bin: proportional beyond it
    table.add(1, 0.1)  # the same bin: a decayed mean, the newer observation weighing twice the older
    table.add(16, 0.4)
    assert table(1) == table(0.5) == (0.5 * 0.2 + 0.1) / 1.5  # flat below the first bin
    assert table(16) == 0.4 and table(32) > 0.4  # the last segment's slope beyond the last bin


def test_a_served_batch_seeds_its_verify_table_with_batched_steps():
    """The seed of a served batch's verify table (`Scheduler._verify_costs`): one-token forwards of 1, 2, 4 rows."""
    model = tiny_model("llama", seed=0)
    points = measure_rows(model, (1, 2, 4), context=32)
    assert [n for n, _ in points] == [1, 2, 4] and all(seconds > 0 for _, seconds in points)
    policy = BatchPolicy()
    policy.seed(points)
    assert policy.verify.known


def test_no_probe_where_even_whole_drafts_would_not_pay():
    """32 sequences on a compute-bound target: verifying 2 tokens each costs more than twice a plain step, so no
    acceptance could make drafting pay, and the policy never probes (a probe costs a drafting step and the drafts'
    catch-up); with four sequences whole drafts would pay, and a batch accepting nothing still probes."""
    policy = BatchPolicy()
    policy.seed([(1, 0.25), (32, 1.0), (64, 2.2), (256, 9.0)], [(1, 0.02), (32, 0.2)])
    many = [Seq(0.0)] * 32
    assert not policy.could_pay(many, [8] * 32, policy.rate(many, [8] * 32, 0))
    assert [policy.cap(many, [8] * 32) for _ in range(40)] == [0] * 40
    few = [Seq(0.0)] * 4
    assert policy.could_pay(few, [8] * 4, policy.rate(few, [8] * 4, 0))
    assert any(policy.cap(few, [8] * 4) for _ in range(40))


def test_cost_table_never_prices_more_tokens_lower():
    """A noisy bin above the next one (16 tokens timed at 0.35 s, 32 at 0.28 s) left the slope beyond the last bin
    flat: 64 or 96 tokens cost what 32 did. Costs are non-decreasing and the extrapolation is never flatter than
    the whole table's slope."""
    table = CostTable()
    for tokens, seconds in [(1, 0.16), (8, 0.17), (16, 0.35), (32, 0.28)]:
        table.add(tokens, seconds)
    costs = [table(t) for t in (1, 8, 16, 24, 32, 64, 96)]
    assert costs == sorted(costs), costs
    assert table(64) - table(32) >= (0.35 - 0.16) / 31 * 32 - 1e-9
    assert table(96) > table(64) > table(32)

"""The speculation policy (sparrow.policy) on deterministic fake timings: no wall clock is read.

A fake round drafts what the policy allows, costs `draft` seconds per draft token plus
verify(n) = 1 + 0.02 (n - 1) seconds, and accepts the draft's leading tokens from a fixed
success pattern with the wanted acceptance rate.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sparrow.config import SamplingConfig
from sparrow.drafters.draft_loop import autoregressive_draft
from sparrow.policy.estimates import AcceptanceEstimate, BackOff, Decayed, DecayedLine, best_length, expected_tokens
from sparrow.policy.length import LengthPolicy
from sparrow.types import StepStats


def verify(n: int) -> float:
    return 1.0 + 0.02 * (n - 1)


class FakeText:
    """Draft tokens are accepted following a fixed pattern: `hits` successes in every `period` tokens."""

    def __init__(self, hits: int, period: int) -> None:
        self.pattern = itertools.cycle([True] * hits + [False] * (period - hits))

    def accepted(self, drafted: int) -> int:
        n = 0
        while n < drafted and next(self.pattern):
            n += 1
        return n


def simulate(policy: LengthPolicy, text: FakeText, draft: float, rounds: int) -> tuple[list[int], float, float]:
    """(caps, tokens, seconds) of `rounds` fake rounds with `draft` seconds per draft token."""
    caps, tokens, seconds = [], 0.0, 0.0
    for _ in range(rounds):
        k = policy.cap(8)
        accepted = text.accepted(k) if k else 0
        step = StepStats(k, accepted, draft * k, verify(k + 1))
        policy.observe(step)
        caps.append(k)
        tokens += accepted + 1
        seconds += step.draft_seconds + step.verify_seconds
    return caps, tokens, seconds


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.9, 8) == pytest.approx((1 - 0.9 ** 9) / 0.1)


def test_expected_tokens_follow_the_observed_accepted_lengths_where_geometric_overestimates():
    """Drafts of 8 on a mix of easy and hard text: every other round accepts all 8, the others none. Observed:
    5 tokens a round (9 or 1); the geometric model (a = 8 / 9 per token) predicts ~5.9."""
    estimate = AcceptanceEstimate(decay=0.99)
    for i in range(400):
        estimate.observe(8, 8 if i % 2 else 0)
    geometric = expected_tokens(estimate.value, 8)
    assert geometric > 5.8
    assert estimate.tokens(8) == expected_tokens(estimate, 8) == pytest.approx(5.0, abs=0.1)
    assert estimate.tokens(2) == pytest.approx(2.0, abs=0.05)  # 1 + 1/2 + 1/2
    assert estimate.tokens(0) == 1.0


def test_a_draft_that_stops_short_of_its_cap_counts_as_failed_there():
    """Allowed 8, the drafter stops after 3 (all accepted): a cap of 8 yields 4 tokens, not more."""
    estimate = AcceptanceEstimate(decay=0.99)
    for _ in range(400):
        estimate.observe(3, 3, reach=8)
    assert estimate.tokens(8) == pytest.approx(4.0, abs=0.15)  # the prior weighs 2 rounds at position 4
    assert estimate.tokens(3) == pytest.approx(4.0, abs=0.05)


def test_without_observations_the_estimate_is_the_geometric_prior():
    estimate = AcceptanceEstimate(prior=0.7)
    assert all(estimate.tokens(k) == pytest.approx(expected_tokens(0.7, k)) for k in range(10))
    estimate.observe(2, 2)  # beyond the positions observed: the (updated) geometric rate
    a = estimate.value
    assert estimate.rate(5) == a and estimate.rate(1) > a


def test_best_length_follows_acceptance_and_costs():
    flat = lambda n: 1.0  # noqa: E731  (dense bf16: verifying 9 tokens costs one)
    steep = lambda n: 0.25 + 0.2 * n  # noqa: E731  (quantized kernels: verify cost grows with n)
    cheap = lambda k: 0.1 * k  # noqa: E731
    assert best_length(0.9, cheap, flat, 8) == 8
    assert best_length(0.9, cheap, steep, 8) < 8
    assert best_length(0.3, cheap, flat, 8) < best_length(0.95, cheap, flat, 8)
    assert best_length(0.1, lambda k: 0.5 * k, verify, 8, minimum=0) == 0  # drafting does not pay: plain decoding
    assert best_length(0.9, lambda k: 0.5 * k, verify, 8, minimum=0) > 0


def test_decayed_line_fits_intercept_and_slope():
    line = DecayedLine(decay=0.97)
    for n in (1, 9, 1, 5, 17):
        line.add(n, 0.5 + 0.01 * n)
    a, b = line.line()
    assert a == pytest.approx(0.5) and b == pytest.approx(0.01)
    flat, origin = DecayedLine(), DecayedLine(origin=True)
    for line in (flat, origin):
        line.add(4, 2.0)
    assert flat(1) == 2.0 and origin(1) == 0.5  # no spread yet: a flat verify cost, a per-token draft cost


def test_decayed_means_follow_the_latest_observations():
    seconds = Decayed(decay=0.5)
    assert not seconds.known
    for y in (4.0, 4.0, 1.0):
        seconds.add(1.0, y)
    mean = (0.25 * 4 + 0.5 * 4 + 1) / (0.25 + 0.5 + 1)
    assert seconds.mean() == pytest.approx(mean)
    seconds.scale(0.1)  # less weight to what is known so far: the same mean
    assert seconds.mean() == pytest.approx(mean)
    seconds.add(1.0, 2.0, weight=0.1)  # ... so the next observation counts most
    assert seconds.mean() == pytest.approx((0.005 * mean * 1.75 + 2.0) / (0.005 * 1.75 + 1))
    with pytest.raises(ValueError):
        seconds.add(1.0)  # every quantity, every time


def test_back_off_probes_at_doubling_intervals_and_restarts_once_it_pays():
    backoff = BackOff(start=4, limit=16)
    backoff.restart(first=4)
    used = [r for r in range(1, 60) if backoff.decide(False, r)]
    assert used == [4, 12, 28, 44]  # intervals 8, 16, then capped at 16
    assert backoff.decide(True, 60) and not backoff.probing  # it pays: used, and the schedule restarts
    assert backoff.interval == 4 and backoff.next == 64
    assert [r for r in range(61, 90) if backoff.decide(False, r)] == [64, 72, 88]


def test_backoff_drafts_nothing_when_drafting_cannot_pay_and_returns_after_a_probe():
    policy = LengthPolicy(8, adaptive=True, backoff=True)
    caps, tokens, seconds = simulate(policy, FakeText(1, 10), draft=0.5, rounds=500)  # draft 0.5 x verify, a = 0.1
    assert caps[:1] == [8]  # nothing measured yet: draft, and measure
    backed_off = caps.index(0)
    assert backed_off <= 4  # a few rounds to learn that it does not pay
    assert caps[backed_off:].count(0) >= 0.95 * len(caps[backed_off:])
    probes = [i for i in range(backed_off, len(caps)) if caps[i]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [8, 16, 32, 64] == [policy.max_probe_interval // 2 ** i for i in (3, 2, 1, 0)]  # doubling
    assert caps[probes[0]] == 1  # a probe is as short as the estimates make best
    assert tokens / seconds >= 0.95 / verify(1)  # at least 0.95x plain decoding's speed
    # The text turns easy (every token accepted): the next probe pays and drafting resumes.
    next_probe = policy.probes.next
    caps, _, _ = simulate(policy, FakeText(1, 1), draft=0.5, rounds=next_probe - policy._round + 30)
    resumed = caps.index(1)
    assert sum(caps[:resumed]) == 0 and all(k > 0 for k in caps[resumed:])
    assert caps[-1] == 8  # and grows back to the full length


def test_backoff_keeps_drafting_when_it_pays():
    policy = LengthPolicy(8, adaptive=True, backoff=True)
    caps, tokens, seconds = simulate(policy, FakeText(9, 10), draft=0.05, rounds=200)  # cheap draft, a = 0.9
    assert all(k > 0 for k in caps) and tokens / seconds > 2.0 / verify(1)


def test_fixed_mode_never_changes_k():
    policy = LengthPolicy(5, adaptive=False)
    caps, _, _ = simulate(policy, FakeText(0, 10), draft=2.0, rounds=50)  # nothing accepted, draft twice a verify
    assert caps == [5] * 50
    assert policy.cap(3) == 3 and policy.keep_drafting(0.0)  # only the round's budget bounds it


def test_cost_aware_mode_follows_the_curve_and_backs_off():
    from sparrow.policy.estimates import CostCurve

    policy = LengthPolicy(8, adaptive=True, backoff=True)
    policy.follow(CostCurve(verify_seconds=tuple(0.25 + 0.2 * n for n in range(1, 10)), draft_seconds=0.05))
    assert 1 <= policy.cap(8) < 8 and policy.confidence_threshold == 0.0  # a steep verify curve: short drafts
    caps, _, _ = simulate(policy, FakeText(0, 10), draft=0.05, rounds=40)  # nothing accepted: not even k = 1 pays
    assert caps[-10:].count(0) >= 8


def test_adaptive_cap_rule_and_confidence_threshold():
    policy = LengthPolicy(8, adaptive=True)
    assert policy.cap(8) == 8 and policy.confidence_threshold == pytest.approx(0.4)
    policy.observe(StepStats(8, 2, 0.0, 0.0))
    assert policy.cap(8) == 7 and policy.confidence_threshold > 0.4  # low acceptance: stop earlier
    policy.observe(StepStats(7, 7, 0.0, 0.0))
    assert policy.cap(8) == 8 and policy.cap(3) == 3
    assert not policy.keep_drafting(0.1) and policy.keep_drafting(0.9)


@pytest.mark.parametrize("defer", [False, True])
def test_draft_loop_greedy_sampled_and_confidence_exit(defer):
    """step(token, i) -> logits; the exit cuts after the first token under the threshold, deferred or not."""
    vocab = 5
    peaks = [10.0, 10.0, 0.0, 10.0]  # position 2 is flat: confidence 1/5 < 0.4

    def step(token, i):
        logits = torch.zeros(vocab)
        logits[(int(token) + 1) % vocab] = peaks[i]
        return logits

    adaptive, fixed = LengthPolicy(4, adaptive=True), LengthPolicy(4)
    first = torch.tensor([0])
    greedy = SamplingConfig()
    draft = autoregressive_draft(step, first, 4, greedy, None, fixed, defer=defer)
    assert draft.tokens.tolist() == [1, 2, 0, 1] and draft.probs is None  # argmax ties: the first index
    cut = autoregressive_draft(step, first, 4, greedy, None, adaptive, defer=defer)
    assert cut.tokens.tolist() == [1, 2, 0]  # the flat position is drafted, then drafting stops
    sampled = autoregressive_draft(step, first, 4, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0),
                                   adaptive, defer=defer)
    assert sampled.probs is not None and sampled.probs.shape == (len(sampled), vocab)
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(len(sampled)))
    assert len(autoregressive_draft(step, first, 0, greedy, None, fixed)) == 0


def test_auto_tree_shape_follows_the_cost_curve():
    from sparrow.drafters.tree_draft import MAX_AUTO_BUDGET, auto_shape

    flat = tuple(0.1 for _ in range(MAX_AUTO_BUDGET + 1))  # verification nearly free (bf16 units, GPUs)
    assert auto_shape(flat, topk=4, depth=6).budget == MAX_AUTO_BUDGET
    linear = tuple(0.1 * n for n in range(1, MAX_AUTO_BUDGET + 2))  # every verified token costs
    assert auto_shape(linear, topk=4, depth=6).budget == 7  # n + 1 <= 1.25 * 7 tokens
    assert auto_shape(linear, topk=10, depth=2).budget == 10  # never fewer nodes than one level of children


def _step(drafted: int, accepted: int, draft: float, verify: float) -> StepStats:
    return StepStats(drafted, accepted, draft, verify, tree=drafted > 0)


def test_measured_backoff_leaves_trees_that_do_not_pay_and_probes_them():
    from sparrow.policy.tree import TreePolicy

    policy = TreePolicy()
    decisions = []
    for _ in range(200):
        drafting = policy.draft_now()
        decisions.append(drafting)
        # a tree costs 3 plain steps and commits 1.5 tokens: half of plain decoding's speed
        policy.observe(_step(12, 1, 0.2, 0.1) if drafting else _step(0, 0, 0.0, 0.1))
    assert decisions[:3] == [True] * 3 and decisions[3] is False  # warm-up, then one plain round to measure
    assert sum(decisions[-100:]) <= 4  # backed off, probing on a doubling schedule
    gaps = [i for i, d in enumerate(decisions) if d][4:]
    assert all(b - a >= 4 for a, b in zip(gaps, gaps[1:]))


def test_measured_backoff_keeps_trees_that_pay():
    from sparrow.policy.tree import TreePolicy

    policy = TreePolicy()
    drafted = 0
    for _ in range(100):
        drafting = policy.draft_now()
        drafted += drafting
        policy.observe(_step(12, 4, 0.05, 0.12) if drafting else _step(0, 0, 0.0, 0.1))  # 5 tokens / 0.17 s
    assert drafted >= 98


def test_adaptive_cap_never_exceeds_the_best_length_on_the_measured_costs():
    """A drafter without back-off (prompt lookup: drafting is free) still drafts less where verification is
    expensive: the cap rule may grow the length, the measured verify line bounds it."""
    steep = LengthPolicy(8, adaptive=True)  # verify(n) = n seconds: each draft token costs a whole forward
    flat = LengthPolicy(8, adaptive=True)  # verify(n) = 1 + 0.02 (n - 1): the module's memory-bound CPU
    text_steep, text_flat = FakeText(4, 5), FakeText(4, 5)  # a = 0.8
    steep_caps, flat_caps = [], []
    for _ in range(40):
        for policy, text, cost, caps in ((steep, text_steep, lambda n: float(n), steep_caps),
                                         (flat, text_flat, verify, flat_caps)):
            k = policy.cap(8)
            policy.observe(StepStats(k, text.accepted(k), 0.0, cost(k + 1)))
            caps.append(k)
    assert steep_caps[0] == flat_caps[0] == 8  # nothing measured yet
    # (a round at the cap rule's length now and then: a verify line fitted on one length has no slope)
    assert sum(steep_caps[-20:]) / 20 <= 2.0 < 4.0 <= sum(flat_caps[-20:]) / 20
    assert min(steep_caps) >= 1  # no back-off: it never stops drafting

"""Verifier branch tests on hand-built logits: accept none / all (+ bonus) / some, empty drafts."""

from __future__ import annotations

import pytest
import torch

from sparrow.config import GREEDY, SamplingConfig
from sparrow.types import Draft
from sparrow.verifiers import GreedyVerifier, RejectionVerifier, build_verifier

V = 10


def logits_for(choices: list[int]) -> torch.Tensor:
    """[len(choices), V] logits whose argmax row i is choices[i] (+10 / -10 as HF's tests do)."""
    out = torch.full((len(choices), V), -10.0)
    out[torch.arange(len(choices)), torch.tensor(choices)] = 10.0
    return out


@pytest.mark.parametrize("verifier", [GreedyVerifier(), RejectionVerifier()])
@pytest.mark.parametrize(
    ("draft", "target", "expected", "accepted"),
    [
        ([3, 4, 5], [3, 4, 5, 6], [3, 4, 5, 6], 3),  # all accepted + bonus 6
        ([1, 4, 5], [3, 4, 5, 6], [3], 0),  # first rejected: correction 3 only
        ([3, 4, 9], [3, 4, 5, 6], [3, 4, 5], 2),  # last rejected: not 9, not 6
        ([3, 7, 5], [3, 4, 5, 6], [3, 4], 1),  # later agreement (5) does not count after a rejection
        ([], [8], [8], 0),  # empty draft: bonus only
    ],
)
def test_greedy_verdicts(verifier, draft, target, expected, accepted):
    verdict = verifier.verify(Draft(tokens=torch.tensor(draft, dtype=torch.long)), logits_for(target), GREEDY,
                              torch.Generator().manual_seed(0))
    assert verdict.tokens.tolist() == expected
    assert verdict.num_accepted == accepted


def test_rejection_with_sampled_probs_at_temperature_zero_equals_greedy():
    q = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)), -1)
    verdict = RejectionVerifier().verify(Draft(tokens=torch.tensor([3, 4, 9]), probs=q), logits_for([3, 4, 5, 6]),
                                         GREEDY, None)
    assert verdict.tokens.tolist() == [3, 4, 5]


def test_rejection_never_accepts_a_token_the_target_gives_zero_probability():
    sampling = SamplingConfig(temperature=1.0, top_k=2)  # token 0 falls outside the target's top 2
    target = torch.tensor([[0.0, 5.0, 5.0, -1.0] + [-9.0] * (V - 4)] * 2)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        verdict = RejectionVerifier().verify(Draft(tokens=torch.tensor([0])), target, sampling, g)
        assert verdict.num_accepted == 0 and verdict.tokens.tolist()[0] in (1, 2)


def test_rejection_is_reproducible_with_a_seeded_generator():
    sampling = SamplingConfig(temperature=1.0)
    target = torch.randn(5, V, generator=torch.Generator().manual_seed(2))
    draft = Draft(tokens=torch.tensor([1, 2, 3, 4]))
    runs = [RejectionVerifier().verify(draft, target, sampling, torch.Generator().manual_seed(7)).tokens.tolist()
            for _ in range(20)]
    assert all(r == runs[0] for r in runs)


def test_shape_mismatch_is_caught():
    with pytest.raises(AssertionError):
        GreedyVerifier().verify(Draft(tokens=torch.tensor([1, 2])), logits_for([1, 2]), GREEDY, None)


def test_build_verifier_names():
    assert build_verifier("auto", GREEDY).name == "greedy"
    assert build_verifier("auto", SamplingConfig(temperature=0.5)).name == "rejection"
    with pytest.raises(ValueError, match="verifier"):
        build_verifier("typical", GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        build_verifier("greedy", SamplingConfig(temperature=0.5))

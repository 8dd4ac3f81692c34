"""Verifier branch tests on hand-built logits: accept none / all (+ bonus) / some, empty drafts."""

from __future__ import annotations

import pytest
import torch

from sparrow import sampling as S
from sparrow.config import GREEDY, SamplingConfig
from sparrow.types import Draft, Verdict
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


def reference_chain_verify(draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
                           generator: torch.Generator | None) -> Verdict:
    """Slow reference: Leviathan et al. Alg. 1 one position at a time (the pre-vectorisation loop)."""
    k = len(draft)
    p = S.probs(target_logits, sampling)  # [k + 1, vocab]
    tokens = draft.tokens.tolist()
    u = S.uniform(k, p.device, generator).tolist()
    for i, x in enumerate(tokens):
        q = torch.nn.functional.one_hot(torch.tensor(x), V).float() if draft.probs is None else draft.probs[i].float()
        p_x, q_x = float(p[i, x]), float(q[x])
        if q_x > 0 and u[i] < min(1.0, p_x / q_x):
            continue
        r = (p[i] - q).clamp_min(0)
        recovered = S.sample(r / r.sum() if r.sum() > 0 else p[i], generator)
        return Verdict(tokens=torch.tensor([*tokens[:i], int(recovered)]), num_accepted=i)
    return Verdict(tokens=torch.tensor([*tokens, int(S.sample(p[k], generator))]), num_accepted=k)


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4, top_p=0.9), GREEDY])
def test_vectorised_chain_equals_the_reference_loop_seed_for_seed(sampling, with_probs):
    g = torch.Generator().manual_seed(11)
    accepted = set()
    for _ in range(200):
        k = int(torch.randint(0, 6, (1,), generator=g))
        target = torch.randn(k + 1, V, generator=g) * 2
        q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1) if with_probs else None
        # Tokens often equal the target's argmax, so long accepted prefixes occur as well as early rejections.
        guess = torch.randint(0, V, (k,), generator=g)
        tokens = torch.where(torch.rand(k, generator=g) < 0.6, target[:k].argmax(-1), guess)
        seed = int(torch.randint(0, 2**31, (1,), generator=g))
        fast = RejectionVerifier().verify(Draft(tokens, q), target, sampling, torch.Generator().manual_seed(seed))
        slow = reference_chain_verify(Draft(tokens, q), target, sampling, torch.Generator().manual_seed(seed))
        assert fast.tokens.tolist() == slow.tokens.tolist() and fast.num_accepted == slow.num_accepted
        accepted.add(fast.num_accepted)
    assert len(accepted) >= 4  # the cases covered rejections at several positions


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

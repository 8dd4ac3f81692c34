"""Lossless sampling: the emitted tokens follow the target's distribution exactly.

Toy Markov models with known next-token tables play target (P) and draft (Q). Speculative
rounds run until two tokens are emitted; the empirical joint distribution of those two
tokens must match P(a | s) P(b | a). Each bin's count must lie within 6 standard deviations
(+ 5) of its expectation, the bound TileOPs uses. Negative controls, each a known-wrong rule,
must fail the same check, so the test can tell right from wrong at this sample size.
"""

from __future__ import annotations

import pytest
import torch

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.types import Draft, Verdict
from sparrow.verifiers import RejectionVerifier

V, START, LENGTH, N = 6, 0, 2, 3_000
g0 = torch.Generator().manual_seed(1234)
P_LOGITS = torch.randn(V, V, generator=g0) * 1.5  # target: row s = logits of the token after s
Q_LOGITS = torch.randn(V, V, generator=g0) * 1.5  # draft: an unrelated, confident Markov model


def expected_joint(sampling: SamplingConfig) -> torch.Tensor:
    p = S.probs(P_LOGITS, sampling)  # [V, V]
    return p[START][:, None] * p  # [V, V]: P(a | START) P(b | a)


class AlwaysAccept:
    """Negative control: accepts every draft token, so the output follows the draft."""

    def verify(self, draft: Draft, target_logits, sampling, generator) -> Verdict:
        bonus = S.sample(S.probs(target_logits[-1], sampling), generator)
        return Verdict(tokens=torch.cat([draft.tokens, bonus.reshape(1)]), num_accepted=len(draft))


def draft_round(last: int, k: int, mode: str, sampling: SamplingConfig, g: torch.Generator) -> Draft:
    tokens, rows = [], []
    for _ in range(k):
        q = S.probs(Q_LOGITS[last], sampling)
        last = int(S.sample(q, g)) if mode == "sampled" else int(Q_LOGITS[last].argmax())
        tokens.append(last)
        rows.append(q)
    probs = torch.stack(rows) if mode in ("sampled", "argmax-with-q") else None
    return Draft(tokens=torch.tensor(tokens), probs=probs)


def emitted_counts(verifier, mode: str, k: int, sampling: SamplingConfig, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(N):
        out: list[int] = []
        while len(out) < LENGTH:
            last = out[-1] if out else START
            draft = draft_round(last, k, mode, sampling, g)
            rows = torch.tensor([last, *draft.tokens.tolist()])
            out += verifier.verify(draft, P_LOGITS[rows], sampling, g).tokens.tolist()
        counts[out[0], out[1]] += 1
    return counts


def matches(counts: torch.Tensor, expected: torch.Tensor) -> bool:
    mean = N * expected
    bound = 6 * (N * expected * (1 - expected)).sqrt() + 5
    return bool(((counts - mean).abs() <= bound).all())


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-topk4-topp0.9"])
@pytest.mark.parametrize("mode", ["sampled", "argmax"])
def test_speculative_sampling_preserves_the_target_distribution(mode, sampling):
    counts = emitted_counts(RejectionVerifier(), mode, k=3, sampling=sampling)
    assert matches(counts, expected_joint(sampling))


def test_negative_control_p_over_q_on_argmax_drafts_fails():
    """LongSpec / Draft & Verify's flaw: min(1, p/q) with q = draft softmax for argmax drafts."""
    sampling = SAMPLINGS[0]
    assert not matches(emitted_counts(RejectionVerifier(), "argmax-with-q", k=3, sampling=sampling),
                       expected_joint(sampling))


def test_negative_control_accepting_everything_fails():
    sampling = SAMPLINGS[0]
    assert not matches(emitted_counts(AlwaysAccept(), "sampled", k=3, sampling=sampling), expected_joint(sampling))

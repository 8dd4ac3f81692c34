"""Lossless sampling: the emitted tokens follow the target's distribution exactly (chains and trees).

Toy Markov models with known next-token tables play target (P) and draft (Q). Speculative
rounds run until two tokens are emitted; the empirical joint distribution of those two
tokens must match P(a | s) P(b | a). Each bin's count must lie within 6 standard deviations
(+ 5) of its expectation, the bound TileOPs uses. Negative controls, each a known-wrong rule,
must fail the same check, so the test can tell right from wrong at this sample size.
Trees are depth 2: deterministic top-k siblings (the q = 1 rule), top-k with a duplicate
sibling, or siblings sampled i.i.d. from q (probs given).
"""

from __future__ import annotations

import pytest
import torch

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.types import Draft, Verdict
from sparrow.verifiers import RejectionVerifier, rejection

pytestmark = pytest.mark.usefixtures("one_thread")  # thousands of tiny ops: threads only add spin waits

V, START, LENGTH, N = 6, 0, 2, 3_000
g0 = torch.Generator().manual_seed(1234)
P_LOGITS = torch.randn(V, V, generator=g0) * 1.5  # target: row s = logits of the token after s
Q_LOGITS = torch.randn(V, V, generator=g0) * 1.5  # draft: an unrelated, confident Markov model
# Tree draft: close to the target, so siblings carry target mass and a wrong sibling rule shows.
Q_TREE_LOGITS = P_LOGITS + torch.randn(V, V, generator=g0)


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


def tree_round(last: int, mode: str, sampling: SamplingConfig, g: torch.Generator) -> Draft:
    """Depth-2 tree: siblings under the root, then under each of them (node i's q row = q at its parent)."""
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[torch.Tensor] = []

    def add_children(token: int, parent: int, width: int) -> None:
        q = S.probs(Q_TREE_LOGITS[token], sampling)
        top = Q_TREE_LOGITS[token].topk(width).indices.tolist()
        picks = {"tree-sampled": lambda: [int(S.sample(q, g)) for _ in range(width)],
                 "tree-topk": lambda: top, "tree-topk-with-q": lambda: top,
                 "tree-topk-duplicate": lambda: [top[0], *top]}[mode]()
        for x in picks:
            tokens.append(x)
            parents.append(parent)
            rows.append(q)

    add_children(last, -1, 3)
    for i in range(len(tokens)):  # the root's children
        add_children(tokens[i], i, 2)
    probs = torch.stack(rows) if mode in ("tree-sampled", "tree-topk-with-q") else None
    return Draft(tokens=torch.tensor(tokens), probs=probs, parents=torch.tensor(parents))


def emitted_counts(verifier, mode: str, k: int, sampling: SamplingConfig, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(N):
        out: list[int] = []
        while len(out) < LENGTH:
            last = out[-1] if out else START
            if mode.startswith("tree"):
                draft = tree_round(last, mode, sampling, g)
            else:
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


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-topk4-topp0.9"])
@pytest.mark.parametrize("mode", ["tree-topk", "tree-topk-duplicate", "tree-sampled"])
def test_tree_speculative_sampling_preserves_the_target_distribution(mode, sampling):
    counts = emitted_counts(RejectionVerifier(), mode, k=0, sampling=sampling)
    assert matches(counts, expected_joint(sampling))


def test_negative_control_p_over_q_on_top_k_siblings_fails():
    """LongSpec's tree flaw: min(1, p/q) with q = draft softmax for deterministically chosen (top-k) children."""
    sampling = SAMPLINGS[0]
    assert not matches(emitted_counts(RejectionVerifier(), "tree-topk-with-q", k=0, sampling=sampling),
                       expected_joint(sampling))


def stale_try_children(children, tokens, q, target, u):
    """Broken: every sibling is tested against the parent's p, not the residual left by the rejected ones."""
    left = target
    for child in children:
        x = tokens[child : child + 1]
        q_row = rejection.point_mass(x, target) if q is None else q[child]
        if bool(rejection.accepts(u[child], target.gather(0, x), q_row.gather(0, x))):
            return child, target
        left = rejection.residual(left, q_row)
    return None, left


@pytest.mark.parametrize("mode", ["tree-topk", "tree-sampled"])
def test_negative_control_not_updating_the_residual_between_siblings_fails(mode, monkeypatch):
    sampling = SAMPLINGS[0]
    monkeypatch.setattr(rejection, "try_children", stale_try_children)
    assert not matches(emitted_counts(RejectionVerifier(), mode, k=0, sampling=sampling), expected_joint(sampling))

"""Tree verification on hand-built logits: greedy paths (deepest, non-first branch, empty, leaf bonus, ties),
chains as trees, and rejection sampling at temperature 0 reducing to greedy on trees."""

from __future__ import annotations

import pytest
import torch

from sparrow.config import GREEDY, SamplingConfig
from sparrow.tree import chain_parents, on_first_branch
from sparrow.types import Draft
from sparrow.verifiers import GreedyVerifier, RejectionVerifier

pytestmark = pytest.mark.usefixtures("one_thread")

V = 10


def logits_for(choices: list[int]) -> torch.Tensor:
    """[len(choices), V] logits whose argmax row i is choices[i]."""
    out = torch.full((len(choices), V), -10.0)
    out[torch.arange(len(choices)), torch.tensor(choices)] = 10.0
    return out


def tree(tokens: list[int], parents: list[int], probs: torch.Tensor | None = None) -> Draft:
    return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=probs,
                 parents=torch.tensor(parents, dtype=torch.long))


#        root -> 0 (3), 1 (5);  0 -> 2 (4);  1 -> 3 (6);  3 -> 4 (7)
TOKENS, PARENTS = [3, 5, 4, 6, 7], [-1, -1, 0, 1, 3]


@pytest.mark.parametrize("verifier", [GreedyVerifier(), RejectionVerifier()])
@pytest.mark.parametrize(
    ("rows", "expected", "path"),
    [  # rows: the target's argmax at [root, node 0, ..., node 4]
        ([5, 0, 6, 0, 7, 9], [5, 6, 7, 9], [1, 3, 4]),  # non-first branch accepted to the leaf: bonus from node 4's row
        ([3, 4, 0, 0, 0, 0], [3, 4, 0], [0, 2]),  # first branch to its leaf: bonus from node 2's row
        ([3, 8, 0, 0, 0, 0], [3, 8], [0]),  # node 2 rejected: correction from node 0's row
        ([5, 0, 6, 0, 2, 0], [5, 6, 2], [1, 3]),  # node 4 rejected: correction 2
        ([9, 0, 0, 0, 0, 0], [9], []),  # nothing accepted: correction from row 0
    ],
)
def test_greedy_tree_verdicts(verifier, rows, expected, path):
    verdict = verifier.verify(tree(TOKENS, PARENTS), logits_for(rows), GREEDY, torch.Generator().manual_seed(0))
    assert verdict.tokens.tolist() == expected
    assert verdict.num_accepted == len(path) and verdict.path.tolist() == path
    first = [[0, 2], [0], []]  # the first-child spine's prefixes in this tree
    assert on_first_branch(torch.tensor(PARENTS), verdict.path) == (path in first)


def test_greedy_tree_picks_the_deepest_accepted_path_not_the_first():
    # Duplicate root children (token 3): node 0's subtree fails at depth 2, node 1's does not.
    verdict = GreedyVerifier().verify(tree([3, 3, 4, 4], [-1, -1, 0, 1]), logits_for([3, 8, 4, 0, 9]), GREEDY, None)
    assert verdict.path.tolist() == [1, 3] and verdict.tokens.tolist() == [3, 4, 9]


def test_greedy_tree_ties_go_to_the_lowest_index():
    # Both subtrees accepted to depth 2: node 2 (index 2) beats node 3; the bonus comes from node 2's row.
    verdict = GreedyVerifier().verify(tree([3, 3, 4, 4], [-1, -1, 0, 1]), logits_for([3, 4, 4, 7, 9]), GREEDY, None)
    assert verdict.path.tolist() == [0, 2] and verdict.tokens.tolist() == [3, 4, 7]


@pytest.mark.parametrize("verifier", [GreedyVerifier(), RejectionVerifier()])
def test_empty_tree_gives_the_bonus_only(verifier):
    draft = Draft(tokens=torch.empty(0, dtype=torch.long), parents=torch.empty(0, dtype=torch.long))
    verdict = verifier.verify(draft, logits_for([6]), GREEDY, None)
    assert verdict.tokens.tolist() == [6] and verdict.num_accepted == 0 and verdict.path.tolist() == []


@pytest.mark.parametrize(
    ("draft", "target"),
    [([3, 4, 5], [3, 4, 5, 6]), ([1, 4, 5], [3, 4, 5, 6]), ([3, 4, 9], [3, 4, 5, 6]), ([3, 7, 5], [3, 4, 5, 6])],
)
def test_greedy_chain_as_a_tree_equals_the_chain_verifier(draft, target):
    tokens = torch.tensor(draft)
    chain = GreedyVerifier().verify(Draft(tokens=tokens), logits_for(target), GREEDY, None)
    as_tree = GreedyVerifier().verify(Draft(tokens=tokens, parents=chain_parents(len(draft))), logits_for(target),
                                      GREEDY, None)
    assert as_tree.tokens.tolist() == chain.tokens.tolist() and as_tree.num_accepted == chain.num_accepted
    assert as_tree.accepted_nodes.tolist() == chain.accepted_nodes.tolist()


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=3)])
def test_rejection_chain_as_a_tree_equals_the_chain_path_seed_for_seed(sampling, with_probs):
    """The tree walk draws the same uniforms in the same order, so a chain-shaped tree gives the same verdicts."""
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        k = int(torch.randint(0, 6, (1,), generator=g))
        target = torch.randn(k + 1, V, generator=g) * 2
        q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1) if with_probs else None
        tokens = torch.multinomial(q, 1, generator=g)[:, 0] if with_probs else torch.randint(0, V, (k,), generator=g)
        seed = int(torch.randint(0, 2**31, (1,), generator=g))
        chain = RejectionVerifier().verify(Draft(tokens, q), target, sampling, torch.Generator().manual_seed(seed))
        as_tree = RejectionVerifier().verify(Draft(tokens, q, chain_parents(k)), target, sampling,
                                             torch.Generator().manual_seed(seed))
        assert as_tree.tokens.tolist() == chain.tokens.tolist()
        assert as_tree.accepted_nodes.tolist() == chain.accepted_nodes.tolist()


def random_tree(g: torch.Generator, n: int, rows: list[int]) -> tuple[list[int], list[int]]:
    """n nodes with distinct sibling tokens; a node often copies the target's choice at its parent's row."""
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=g))
        taken = {t for t, par in zip(tokens, parents) if par == parent}
        choice = rows[parent + 1]
        candidates = [choice] if choice not in taken and float(torch.rand(1, generator=g)) < 0.6 else []
        candidates += [t for t in torch.randperm(V, generator=g).tolist() if t not in taken]
        tokens.append(candidates[0])
        parents.append(parent)
    return tokens, parents


@pytest.mark.parametrize("with_probs", [False, True])
def test_rejection_at_temperature_zero_equals_greedy_on_trees(with_probs):
    g = torch.Generator().manual_seed(5)
    for _ in range(100):
        n = int(torch.randint(1, 9, (1,), generator=g))
        rows = torch.randint(0, V, (n + 1,), generator=g).tolist()
        tokens, parents = random_tree(g, n, rows)
        probs = torch.softmax(torch.randn(n, V, generator=g), -1) if with_probs else None
        draft = tree(tokens, parents, probs)
        greedy = GreedyVerifier().verify(draft, logits_for(rows), GREEDY, None)
        sampled = RejectionVerifier().verify(draft, logits_for(rows), GREEDY, torch.Generator().manual_seed(0))
        assert sampled.tokens.tolist() == greedy.tokens.tolist(), (tokens, parents, rows)
        assert sampled.path.tolist() == greedy.path.tolist()


def test_q1_rule_never_recovers_a_rejected_sibling():
    """Target mass on {1, 2, 3} only; siblings 1 and 2 rejected -> the recovered token must be 3."""
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    target = torch.tensor([[-9.0, 1.0, 1.0, 1.0] + [-9.0] * (V - 4)] * 3)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        verdict = RejectionVerifier().verify(tree([1, 2], [-1, -1]), target, sampling, g)
        seen.add(verdict.tokens.tolist()[0])
        if verdict.num_accepted == 0:
            assert verdict.tokens.tolist() == [3]
        else:
            assert verdict.path.tolist() in ([0], [1]) and verdict.tokens.tolist()[1] in (1, 2, 3)
    assert seen == {1, 2, 3}

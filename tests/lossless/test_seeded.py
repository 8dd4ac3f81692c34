"""Seeded runs repeat exactly however the tokens were chunked into rounds (sparrow.noise), and stay lossless.

a) Pipelines: a seeded sampled request gives the same tokens with k = 1, 2, 4, 8 (fixed) and with the
   adaptive length policy (timing-driven), for a sampled draft-model chain, prompt lookup and an EAGLE-2
   tree; it equals seeded plain decoding; a different seed gives a different output (negative control).
b) Toy Markov models (as in test_distribution): coupled verification with random draft lengths emits the
   same tokens as plain sampling with the same noise, and follows the target's joint distribution; reusing
   one position's noise for every token (a known-wrong rule) fails the same check.
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.noise import PositionalNoise
from sparrow.pipeline import Pipeline
from sparrow.types import Draft
from sparrow.verifiers import RejectionVerifier

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Paris is the capital of France. Paris is"
OPTIONS = dict(max_new_tokens=40, temperature=0.8, seed=1)
DRAFTERS = {  # name -> (registry name, uses the close draft model, options)
    "draft-model": ("draft-model", True, {}),
    "prompt-lookup": ("prompt-lookup", False, {}),
    "draft-model-tree": ("draft-model", True, dict(tree_budget=8, tree_topk=2, tree_depth=4)),
}


@pytest.fixture(scope="module")
def close_draft(target_model, tokenizer) -> LoadedModel:
    return LoadedModel(perturbed(target_model, 0.05, seed=1), tokenizer, "close")


@pytest.mark.parametrize("name", DRAFTERS)
def test_seeded_output_does_not_depend_on_the_draft_length(loaded_target, close_draft, name):
    registry_name, needs_draft, options = DRAFTERS[name]
    draft = close_draft if needs_draft else None
    expected = Pipeline(loaded_target, None).generate_plain(PROMPT, **OPTIONS).token_ids
    drafted = 0
    for k, adaptive in [(1, False), (2, False), (4, False), (8, False), (4, True), (4, True)]:
        pipe = Pipeline(loaded_target, build_drafter(registry_name, loaded_target, draft, k, adaptive, **options))
        result = pipe.generate(PROMPT, **OPTIONS)
        assert result.token_ids == expected, (k, adaptive)
        drafted += result.stats.num_draft_tokens
    assert drafted > 0
    other = pipe.generate(PROMPT, **{**OPTIONS, "seed": 2}).token_ids
    assert other != expected  # negative control: the seed matters


def test_an_unseeded_request_uses_fresh_randomness(loaded_target):
    pipe = Pipeline(loaded_target, build_drafter("prompt-lookup", loaded_target, None, 4))
    runs = {tuple(pipe.generate(PROMPT, max_new_tokens=40, temperature=1.0).token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_positional_noise_is_keyed_by_seed_and_position_only():
    noise = PositionalNoise(7, torch.device("cpu"))
    like = torch.empty(0)
    a = noise.exponentials([3, 5], 10, like)
    assert torch.equal(a, noise.at(3).exponentials([0, 2], 10, like))
    assert torch.equal(a[1], PositionalNoise(7, torch.device("cpu"), 5).exponentials([0], 10, like)[0])  # no cache
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a, PositionalNoise(8, torch.device("cpu")).exponentials([3, 5], 10, like))
    noise.exponentials(list(range(6, 100)), 10, like)  # drops the earliest kept positions; redraws are equal
    assert torch.equal(a, noise.exponentials([3, 5], 10, like))


# b) Toy Markov models: target P, draft Q (row s = logits of the token after s).
V, START, LENGTH, N = 6, 0, 2, 3_000
g0 = torch.Generator().manual_seed(1234)
P_LOGITS = torch.randn(V, V, generator=g0) * 1.5
Q_LOGITS = P_LOGITS + torch.randn(V, V, generator=g0)
SAMPLING = SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)


def toy_draft(last: int, k: int, mode: str, noise: PositionalNoise) -> Draft:
    """k chain tokens after `last` (sampled with the noise of their positions, or argmax), or a depth-2 top-2 tree."""
    if mode == "tree":
        top = Q_LOGITS[last].topk(2).indices.tolist()
        kids = [Q_LOGITS[x].topk(2).indices.tolist() for x in top]
        return Draft(tokens=torch.tensor([*top, *kids[0], *kids[1]]), parents=torch.tensor([-1, -1, 0, 0, 1, 1]))
    tokens, rows = [], []
    for i in range(k):
        q = S.probs(Q_LOGITS[last], SAMPLING)
        last = int(S.sample(q, noise.at(i))) if mode == "sampled" else int(Q_LOGITS[last].argmax())
        tokens.append(last)
        rows.append(q)
    return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=torch.stack(rows) if rows else None)


def speculative(seed: int, mode: str, lengths: torch.Generator) -> list[int]:
    """LENGTH tokens after START by rounds of 0-3 draft tokens (a tree: its own shape), as the engine runs them."""
    noise, out = PositionalNoise(seed, torch.device("cpu")), []
    while len(out) < LENGTH:
        last = out[-1] if out else START
        draft = toy_draft(last, int(torch.randint(0, 4, (1,), generator=lengths)), mode, noise.at(len(out)))
        rows = torch.tensor([last, *draft.tokens.tolist()])  # a Markov target: a node's row is its token's
        out += RejectionVerifier().verify(draft, P_LOGITS[rows], SAMPLING, noise.at(len(out))).tokens.tolist()
    return out[:LENGTH]


def plain(seed: int, reuse: bool = False) -> list[int]:
    """Plain sampling with positional noise; reuse: the broken rule, position 0's noise for every token."""
    noise, out = PositionalNoise(seed, torch.device("cpu")), []
    for t in range(LENGTH):
        out.append(int(S.sample(S.probs(P_LOGITS[out[-1] if out else START], SAMPLING), noise.at(0 if reuse else t))))
    return out


@pytest.mark.parametrize("mode", ["sampled", "argmax", "tree"])
def test_coupled_verification_equals_plain_sampling_and_follows_the_target(mode):
    lengths = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V)
    for seed in range(N):
        out = speculative(seed, mode, lengths)
        assert out == plain(seed), seed
        counts[out[0], out[1]] += 1
    assert matches(counts, expected_joint())


def test_negative_control_reusing_one_positions_noise_fails():
    counts = torch.zeros(V, V)
    for seed in range(N):
        out = plain(seed, reuse=True)
        counts[out[0], out[1]] += 1
    assert not matches(counts, expected_joint())


def expected_joint() -> torch.Tensor:
    p = S.probs(P_LOGITS, SAMPLING)  # [V, V]
    return p[START][:, None] * p  # P(a | START) P(b | a)


def matches(counts: torch.Tensor, expected: torch.Tensor) -> bool:
    """Each bin within 6 standard deviations (+ 5) of its expectation, as in test_distribution."""
    mean = N * expected
    return bool(((counts - mean).abs() <= 6 * (mean * (1 - expected)).sqrt() + 5).all())

"""Prompt lookup's draft length on measured costs: where a wider target forward costs real time, spurious
matches that the target rejects stop being drafted (back-off with probes); where it is nearly free, or the
matches are right, drafting goes on. Timings are fed to the policy, never measured, so these cannot flake."""

from __future__ import annotations

import torch

from sparrow.config import SamplingConfig
from sparrow.drafters import build_drafter
from sparrow.drafters.prompt_lookup import PromptLookupDrafter
from sparrow.types import StepStats, Verdict

CONTEXT = torch.tensor([5, 1, 2, 3, 1, 2, 4, 1, 2, 6, 1, 2])  # the suffix [1, 2] matches three times


def expensive(n: int) -> float:
    """A target forward of n tokens where each extra row costs half a one-token step (float32 on an AVX2 CPU
    measured ~2.1x a step for ~7 tokens, ~2x for 2 tokens in one matmul)."""
    return 0.4 + 0.2 * (n - 1)


def cheap(n: int) -> float:
    """Where extra rows are nearly free (bf16 with bf16 instructions: 8 tokens ~1.1x one)."""
    return 0.4 + 0.005 * (n - 1)


def drafted_per_round(drafter: PromptLookupDrafter, rounds: int, accepted_share: float,
                      verify_seconds) -> list[int]:
    """Run `rounds` rounds on CONTEXT: each accepts `accepted_share` of its draft (rounded down) and its target
    forward of n tokens takes verify_seconds(n)."""
    sampling, randomness = SamplingConfig(), torch.Generator().manual_seed(0)
    lengths = []
    for _ in range(rounds):
        draft = drafter.propose(CONTEXT, 16, sampling, randomness)
        n = len(draft)
        accepted = int(accepted_share * n)
        verdict = Verdict(tokens=torch.zeros(accepted + 1, dtype=torch.long), num_accepted=accepted)
        drafter.observe(draft, verdict, None, StepStats(n, accepted, 1e-5, verify_seconds(n + 1)))
        lengths.append(n)
    return lengths


def test_rejected_matches_back_off_where_each_drafted_token_widens_an_expensive_forward():
    lengths = drafted_per_round(PromptLookupDrafter(8, adaptive=True), 80, 0.0, expensive)
    assert lengths[0] > 0  # it tries first
    plain = lengths.count(0)
    assert plain > 60  # then mostly plain steps...
    assert 0 < sum(1 for n in lengths[40:] if n) <= 3  # ...with rare probes (the interval doubles)


def test_matches_that_pay_keep_being_drafted():
    assert all(drafted_per_round(PromptLookupDrafter(8, adaptive=True), 40, 0.75, cheap))  # mostly right, cheap
    assert all(drafted_per_round(PromptLookupDrafter(8, adaptive=True), 40, 1.0, expensive))  # a copy pays anyway


def test_fixed_length_and_explicit_backoff_off_always_draft():
    for drafter in (PromptLookupDrafter(4, adaptive=False), PromptLookupDrafter(4, adaptive=True, backoff=False)):
        assert all(drafted_per_round(drafter, 30, 0.0, expensive))


def test_the_registry_builder_passes_backoff(loaded_target):
    assert build_drafter("prompt-lookup", loaded_target, None, 4, adaptive=True).length.backoff
    assert not build_drafter("prompt-lookup", loaded_target, None, 4, adaptive=True, backoff=False).length.backoff
    assert not build_drafter("prompt-lookup", loaded_target, None, 4).length.backoff  # --fixed: exactly k

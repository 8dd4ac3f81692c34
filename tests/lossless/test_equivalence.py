"""Lossless is a test: for every drafter x verifier, greedy speculative output equals the
target's own greedy output token for token (float32, tiny random Llama and Qwen2 models),
and drafts were really accepted."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_gemma3, tiny_model

from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]


@pytest.fixture(scope="module")
def drafts(target_model, tokenizer, arch) -> dict[str, LoadedModel]:
    return {
        "same": LoadedModel(target_model, tokenizer, "same"),  # everything accepted
        "close": LoadedModel(perturbed(target_model, 0.05, seed=1), tokenizer, "close"),  # partial acceptance
        "random": LoadedModel(tiny_model(arch, seed=99), tokenizer, "random"),  # almost nothing accepted
    }


@pytest.fixture(scope="module")
def baselines(loaded_target) -> dict[tuple[str, int], list[int]]:
    pipe = Pipeline(loaded_target, None)
    return {(p, n): pipe.generate_plain(p, max_new_tokens=n).token_ids for p in PROMPTS for n in (1, 5, 40)}


def run(pipe: Pipeline, max_new_tokens: int, baselines) -> tuple[int, int]:
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=max_new_tokens)
        assert result.token_ids == baselines[(prompt, max_new_tokens)], (prompt, result.stats)
        assert result.stats.num_accepted_tokens <= result.stats.num_draft_tokens
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    return drafted, accepted


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("draft", ["same", "close", "random"])
def test_draft_model_greedy_equals_plain(loaded_target, drafts, baselines, draft, k, verifier):
    pipe = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, drafts[draft], k), verifier)
    for n in (1, 5, 40):
        drafted, accepted = run(pipe, n, baselines)
    if draft == "same":
        assert accepted == drafted > 0  # draft == target: every draft token accepted
    elif draft == "close":
        assert 0 < accepted < drafted


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_prompt_lookup_greedy_equals_plain(loaded_target, baselines, k, verifier):
    pipe = Pipeline(loaded_target, build_drafter("prompt-lookup", loaded_target, None, k), verifier)
    for n in (1, 5, 40):
        drafted, accepted = run(pipe, n, baselines)
    assert accepted > 0


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_adaptive_draft_length_greedy_equals_plain(loaded_target, drafts, baselines, drafter):
    draft = drafts["close"] if drafter == "draft-model" else None
    pipe = Pipeline(loaded_target, build_drafter(drafter, loaded_target, draft, 16, adaptive=True))
    pipe.drafter.length.backoff = False  # back-off decides from wall-clock timings; acceptance is checked without it
    drafted, accepted = run(pipe, 40, baselines)
    assert 0 < accepted < drafted


def test_long_generation_equals_plain(loaded_target, drafts):
    plain = Pipeline(loaded_target, None).generate_plain(PROMPTS[1], max_new_tokens=300).token_ids
    for name in ("draft-model", "prompt-lookup"):
        pipe = Pipeline(loaded_target, build_drafter(name, loaded_target, drafts["close"], 4))
        result = pipe.generate(PROMPTS[1], max_new_tokens=300)
        assert result.token_ids == plain and len(plain) == 300
        assert result.stats.num_accepted_tokens > 0


def test_plain_decoding_equals_transformers_generate(loaded_target):
    """The oracle itself agrees with transformers' greedy generate."""
    pipe = Pipeline(loaded_target, None)
    ids = pipe.encode(PROMPTS[0]).input_ids
    with torch.no_grad():
        hf = loaded_target.model.generate(ids[None], max_new_tokens=40, do_sample=False)[0, ids.numel():]
    assert pipe.generate_plain(PROMPTS[0], max_new_tokens=40).token_ids == hf.tolist()


def test_sampling_is_reproducible_with_a_seed(loaded_target, drafts):
    pipe = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, drafts["close"], 4))
    runs = [pipe.generate(PROMPTS[0], max_new_tokens=30, temperature=0.8, top_p=0.9, seed=5).token_ids
            for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_sliding_window_model_rolls_back_exactly(tokenizer):
    """Gemma-3 mixes sliding-window layers (window 8 here) with global ones; rollback must stay exact."""
    model = tiny_gemma3(num_layers=4)
    target = LoadedModel(model, tokenizer, "tiny-gemma3")
    draft = LoadedModel(perturbed(model, 0.05, seed=2), tokenizer, "close")
    plain = Pipeline(target, None).generate_plain(PROMPTS[0], max_new_tokens=60).token_ids
    for k in (2, 8):
        result = Pipeline(target, build_drafter("draft-model", target, draft, k)).generate(
            PROMPTS[0], max_new_tokens=60
        )
        assert result.token_ids == plain and result.stats.num_accepted_tokens > 0
    # Rejections once the window is full: the target must crop sliding layers past their window.
    far = LoadedModel(tiny_gemma3(num_layers=4, seed=1, sharpen=False), tokenizer, "unrelated")
    long_prompt = " ".join(PROMPTS)
    plain = Pipeline(target, None).generate_plain(long_prompt, max_new_tokens=40).token_ids
    result = Pipeline(target, build_drafter("draft-model", target, far, 4)).generate(long_prompt, max_new_tokens=40)
    stats = result.stats
    assert result.token_ids == plain and stats.num_accepted_tokens < stats.num_draft_tokens  # rejected: rewound

"""Integration: the real smollm2-135m preset in float32, speculative output == plain output."""

from __future__ import annotations

import pytest

from sparrow.drafters import build_drafter
from sparrow.models import load_model
from sparrow.pipeline import Pipeline

pytestmark = pytest.mark.real_model

PROMPTS = [
    ("Write a Python function that returns the square of a number.", True),
    ("Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.", True),
    ("The capital of France is", False),
]


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m", dtype="float32", progress=False)


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_smollm2_speculative_equals_plain(smollm, drafter):
    pipe = Pipeline(smollm, build_drafter(drafter, smollm, smollm if drafter == "draft-model" else None, 4))
    accepted = 0
    for prompt, chat in PROMPTS:
        plain = pipe.generate_plain(prompt, max_new_tokens=48, chat=chat)
        spec = pipe.generate(prompt, max_new_tokens=48, chat=chat)
        assert spec.token_ids == plain.token_ids, (prompt, spec.text, plain.text)
        assert spec.text == plain.text
        accepted += spec.stats.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_smollm2_batched_speculative_equals_plain(smollm, drafter):
    """The three prompts in one batch (sparrow.decoding.batch), the last one joining after a step: each == plain."""
    from sparrow.decoding.batch import Batch
    from sparrow.policy.batch import BatchPolicy

    pipe = Pipeline(smollm, build_drafter(drafter, smollm, smollm if drafter == "draft-model" else None, 4))
    batch = Batch(smollm.model, BatchPolicy(adaptive=False))
    gens = []
    for i, (prompt, chat) in enumerate(PROMPTS):
        gens.append(pipe.sequence(prompt, max_new_tokens=48, chat=chat))
        batch.add(gens[-1])
        if i == 1:
            batch.step()
    while len(batch):
        batch.step()
    accepted = 0
    for gen, (prompt, chat) in zip(gens, PROMPTS):
        result = pipe.result(gen)
        assert result.token_ids == pipe.generate_plain(prompt, max_new_tokens=48, chat=chat).token_ids, prompt
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_smollm2_chat_template_and_eos(smollm):
    pipe = Pipeline(smollm, None)
    result = pipe.generate_plain("Say hello.", max_new_tokens=64, chat=True)
    assert result.text.strip()
    assert pipe.encode("Say hello.", chat=True).input_ids.numel() > pipe.encode("Say hello.").input_ids.numel()
    if result.finish_reason == "stop":
        assert result.token_ids[-1] in pipe.eos_token_ids()

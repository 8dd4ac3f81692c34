"""A batch of five requests, two joining late: the run that the batch and draft-vocabulary tests share."""

from __future__ import annotations

from collections import Counter

import torch

from sparrow.decoding.batch import Batch
from sparrow.decoding.round import Generation
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is", "a",
           "def add(a, b):\n    return a + b\n\ndef"]



BUDGETS = [30, 7, 41, 19, 25]



def run_batch(pipe: Pipeline, policy: BatchPolicy | None = None, join_after: int = 2, plain: bool = False,
              **options) -> list:
    """The PROMPTS in one batch (the last two join after `join_after` steps); the results in PROMPTS order. The
    requests that join together prefill together (`Batch.add`: one shared target forward for each group)."""
    batch = Batch(pipe.target.model, policy or BatchPolicy(adaptive=False))
    gens: list[Generation] = []

    def start(indices: range) -> None:
        joining = [pipe.sequence(PROMPTS[i], max_new_tokens=BUDGETS[i], plain=plain, **options) for i in indices]
        batch.add(*joining)
        gens.extend(joining)

    start(range(3))
    steps = 0
    while len(batch) or len(gens) < len(PROMPTS):
        batch.step()
        steps += 1
        if steps == join_after:
            start(range(3, len(PROMPTS)))
    results = [pipe.result(gen) for gen in gens]
    for gen in gens:
        pipe.release(gen)
    return results


def count_forwards(model: torch.nn.Module) -> Counter:
    """Counts the model's forwards (until `del model.forward`)."""
    calls = Counter()
    forward = model.forward

    def counted(*args, **kwargs):
        calls["forwards"] += 1
        return forward(*args, **kwargs)

    model.forward = counted
    return calls

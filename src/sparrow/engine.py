"""The speculative decoding loop: prefill, then rounds of draft -> score -> verify -> commit."""

from __future__ import annotations

import time

import torch

from sparrow import sampling as S
from sparrow.cached_model import CachedModel
from sparrow.config import SamplingConfig
from sparrow.drafters import Drafter
from sparrow.stopping import Stopper
from sparrow.types import GenerationStats, Prompt, StepStats
from sparrow.verifiers import Verifier


def clock(device: torch.device) -> float:
    """perf_counter after the device has finished queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def speculative_decode(target: CachedModel, drafter: Drafter, verifier: Verifier, prompt: Prompt,
                       sampling: SamplingConfig, stopper: Stopper,
                       generator: torch.Generator | None) -> GenerationStats:
    """Generate into `stopper.tokens`; the target's output distribution is unchanged (lossless)."""
    device = target.device
    start = clock(device)
    first_logits = target.prefill(prompt)  # cache: prompt; invariant from here on: cache == committed[:-1]
    drafter.prefill(prompt, target)
    committed = prompt.input_ids.to(device)
    committed = torch.cat([committed, S.choose(first_logits, sampling, generator).reshape(1)])
    stopper.push(committed[-1:].tolist())
    prefill_seconds = clock(device) - start
    steps: list[StepStats] = []
    while not stopper.done:
        t0 = clock(device)
        # 1. Draft: never more than the budget allows, since each round also yields one target token.
        draft = drafter.propose(committed, stopper.remaining - 1, sampling, generator)
        t1 = clock(device)
        # 2. Score: one target forward over [last committed token, *draft] -> [k + 1, vocab].
        target_logits = target.forward(torch.cat([committed[-1:], draft.tokens.to(device)]))
        # 3. Verify: the accepted prefix plus one bonus or recovered token.
        verdict = verifier.verify(draft, target_logits, sampling, generator)
        # 4. Commit: the target drops KV of rejected drafts; the drafter hears the verdict.
        committed = torch.cat([committed, verdict.tokens.to(device)])
        target.rewind(committed.numel() - 1)
        drafter.observe(draft, verdict)
        stopper.push(verdict.tokens.tolist())  # EOS / stop string / length cut inside the block
        steps.append(StepStats(len(draft), verdict.num_accepted, t1 - t0, clock(device) - t1))
    return GenerationStats.from_steps(steps, prefill_seconds)

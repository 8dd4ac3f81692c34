"""Plain autoregressive decoding: the oracle of the tests and the baseline of the benchmarks.

It shares CachedModel, sampling and Stopper with the speculative engine, so the only
difference between the two is the loop itself.
"""

from __future__ import annotations

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.grammar import FREE, Constraint, masked
from sparrow.noise import Randomness, at
from sparrow.runtime.cached_model import CachedModel
from sparrow.stopping import Stopper
from sparrow.timing import now as clock
from sparrow.types import Decoded, GenerationStats, Prompt, StepStats


def plain_decode(target: CachedModel, prompt: Prompt, sampling: SamplingConfig, stopper: Stopper,
                 generator: Randomness, grammar: Constraint = FREE) -> Decoded:
    """Positional noise (seeded requests) samples position t with the noise of t, as the engine does.
    grammar: constrained decoding: each token from the target's logits masked by the grammar's state."""
    device = target.device
    start = clock(device)
    logits = target.prefill(prompt).logits[-1]
    position = prompt.input_ids.numel()  # of the token sampled next
    token = S.choose(masked(logits, grammar.allowed()), sampling, at(generator, position))
    chosen = [int(token)]  # the step's one read
    grammar.commit(chosen)
    stopper.push(chosen)
    prefill_seconds = clock(device) - start
    steps: list[StepStats] = []
    while not stopper.done:
        t0 = clock(device)
        logits = target.forward(token.reshape(1)).logits[-1]
        position += 1
        token = S.choose(masked(logits, grammar.allowed()), sampling, at(generator, position))
        chosen = [int(token)]
        grammar.commit(chosen)
        stopper.push(chosen)
        steps.append(StepStats(0, 0, 0.0, clock(device) - t0))
    return Decoded(list(stopper.tokens), stopper.finish_reason or "length",
                   GenerationStats.from_steps(steps, prefill_seconds))

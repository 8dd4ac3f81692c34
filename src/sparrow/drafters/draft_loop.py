"""The autoregressive draft loop every model-based chain drafter shares (gpt-fast's decode_n_tokens).

Drafters differ only in their step function: a draft model with its own cache, the target skipping
layers on its own cache, the target on a sparse cache. At temperature > 0 each token is sampled from
q (after the target's temperature / top-k / top-p) and q is returned, so the verifier applies
min(1, p/q); at temperature 0 it is the argmax (Draft.probs None: the q = 1 rule).

Confidence exit (adaptive policies): drafting stops after the first token whose draft top probability
is under the policy's threshold. On a CPU the check is free and stops at once; on an accelerator the
confidences stay on the device and one host sync after the loop cuts the draft there (the tokens are
the same, at the cost of the forwards after the cut).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.grammar import FREE, Constraint, masked
from sparrow.noise import Randomness, at
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Draft

Step = Callable[[Tensor, int], Tensor]
"""step(token [1] int64, i) -> [vocab] logits of draft position i (the token is the one before it)."""


@dataclass(frozen=True)
class Forward:
    """A draft forward a drafter asks for: `tokens` ([n] int64) appended to `runner`'s cache. Whoever runs it
    answers with the [vocab] logits of its last row: alone (`run`), or batched with other sequences' forwards
    of the same model (`sparrow.decoding.batch`)."""

    runner: CachedModel
    tokens: Tensor

    def run(self) -> Tensor:
        return self.runner.forward(self.tokens).logits[-1]


DraftSteps = Generator[object, Tensor, Draft]
"""A draft in the making: yields a request per draft position, is sent that position's [vocab] logits, and
returns the Draft."""


def drive(steps: DraftSteps, answer: Callable[[object], Tensor]) -> Draft:
    """Run a DraftSteps generator to its Draft, answering each request with `answer(request)`."""
    try:
        request = next(steps)
        while True:
            request = steps.send(answer(request))
    except StopIteration as done:
        return done.value


def autoregressive_draft(step: Step, first_token: Tensor, steps: int, sampling: SamplingConfig,
                         generator: Randomness, policy: LengthPolicy, defer: bool | None = None,
                         grammar: Constraint = FREE) -> Draft:
    """Up to `steps` draft tokens after `first_token` ([1], the last committed token), `step` giving each
    position's logits; see `draft_chain`."""
    chain = draft_chain(lambda token, i: (token, i), first_token, steps, sampling, generator, policy, defer, grammar)
    return drive(chain, lambda request: step(*request))


def draft_chain(request: Callable[[Tensor, int], object], first_token: Tensor, steps: int,
                sampling: SamplingConfig, generator: Randomness, policy: LengthPolicy,
                defer: bool | None = None, grammar: Constraint = FREE) -> DraftSteps:
    """Up to `steps` draft tokens after `first_token` ([1], the last committed token): yields `request(token,
    i)` for draft position i (the token is the one before it) and is sent its [vocab] logits. Positional noise
    (seeded requests): offset i is draft token i's position, so a sampled draft shares the target's noise there.

    defer: check the confidence exit once after the loop (default: on accelerators, not on CPUs).
    grammar: structured output: each position's logits masked by the grammar after the tokens drafted so far
    (the state is rolled back at the end); a stop token ends the draft."""
    if steps < 1:
        return Draft.empty(first_token.device)
    threshold = policy.confidence_threshold
    defer = first_token.device.type != "cpu" if defer is None else defer
    token, tokens, rows, tops = first_token, [], [], []
    pushed = 0
    try:
        for i in range(steps):
            logits = masked((yield request(token, i)), grammar.allowed())
            token = _choose(logits, sampling, generator, i, rows)
            tokens.append(token)
            if not grammar.push(token):  # a stop token: nothing follows it
                break
            pushed += 1
            if threshold > 0:
                top = logits.float().softmax(-1).max()
                if defer:
                    tops.append(top)
                elif not policy.keep_drafting(float(top)):
                    break
    finally:
        grammar.pop(pushed)
    n = len(tokens)
    if tops:  # one host sync: keep up to the first token under the threshold
        below = torch.stack(tops) < threshold
        n = min(n, int(torch.cat([below, below.new_ones(1)]).int().argmax()) + 1)
    return Draft(tokens=torch.cat(tokens[:n]), probs=torch.stack(rows[:n]) if rows else None)


def _choose(logits: Tensor, sampling: SamplingConfig, generator: Randomness, i: int, rows: list[Tensor]) -> Tensor:
    """Draft token i ([1]): the argmax, or a sample of q (appended to `rows`)."""
    if sampling.greedy:
        return S.greedy(logits).reshape(1)
    rows.append(S.probs(logits, sampling))
    return S.sample(rows[-1], at(generator, i)).reshape(1)


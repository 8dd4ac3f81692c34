"""The speculative decoding loop: prefill, then rounds of draft -> score -> verify -> commit."""

from __future__ import annotations

import torch

from sparrow.config import SamplingConfig
from sparrow.decoding.round import Generation, finish, start
from sparrow.drafters.base import Drafter
from sparrow.grammar import FREE, Constraint
from sparrow.noise import Randomness, at
from sparrow.runtime.cached_model import CachedModel
from sparrow.stopping import Stopper
from sparrow.timing import now
from sparrow.tree import TreeLayout
from sparrow.types import Decoded, Draft, Prompt, TargetOutput
from sparrow.verifiers import Verifier


def score(target: CachedModel, last: torch.Tensor, draft: Draft, hidden_layers: tuple[int, ...]) -> TargetOutput:
    """One target forward over [last committed token, *draft nodes] -> [len(draft) + 1] rows.

    A chain runs with the model's own causal mask; a tree with its ancestor mask and depth positions.
    """
    tokens = torch.cat([last, draft.tokens.to(last.device)])
    if not draft.is_tree:
        return target.forward(tokens, hidden_layers=hidden_layers)
    layout = TreeLayout.of(draft.parents.to(target.device), target.length)
    return target.forward(tokens, layout.positions, layout.mask, hidden_layers)


def speculative_decode(target: CachedModel, drafter: Drafter, verifier: Verifier, prompt: Prompt,
                       sampling: SamplingConfig, stopper: Stopper, generator: Randomness,
                       sync_timing: bool = True, grammar: Constraint = FREE) -> Decoded:
    """Generate with `stopper`'s rules (a fresh Stopper: EOS, stop strings, max_new_tokens); the target's
    output distribution is unchanged (lossless).

    generator: positional noise (seeded requests) makes the output independent of the draft lengths, so equal
    to seeded plain decoding (`sparrow.noise`); a sequential generator (or None) gives rejection sampling.
    sync_timing: on CUDA, synchronise before each clock read so draft and verify seconds are exact
    (the adaptive policies compare them); False measures only what the host waited for.
    grammar: structured output (`sparrow.grammar`): lossless relative to plain decoding of the masked target.
    """
    return decode(Generation(target, drafter, verifier, prompt, sampling, stopper, generator, grammar=grammar),
                  sync_timing)


def decode(gen: Generation, sync_timing: bool = True) -> Decoded:
    """Run `gen` (a fresh Generation with a drafter and a verifier) to its end: `speculative_decode`'s loop."""
    target, drafter, sampling, stopper, grammar = gen.target, gen.drafter, gen.sampling, gen.stopper, gen.grammar
    device, layers = target.device, drafter.hidden_layers
    # 0. Prefill, then the first token; invariant from here on: the target's cache == committed[:-1].
    start(gen, sync_timing)
    while not gen.done:
        t0 = now(device, sync_timing)
        # 1. Draft a chain or a tree; never more nodes than the budget allows, since each round adds a target token.
        noise = at(gen.generator, gen.committed.numel())  # positional noise: offset 0 is the first draft position
        max_tokens = stopper.remaining - 1
        draft = drafter.propose(gen.committed, max_tokens, sampling, noise)
        assert draft.tokens.numel() <= max_tokens, (drafter.name, draft.tokens.numel(), max_tokens)
        # 1b. Grammar: cut the draft where it breaks the grammar, add forced tokens; the masks of its rows.
        draft, allowed = grammar.restrict(draft, max_tokens)
        t1 = now(device, sync_timing)
        # 2. Score: one target forward over [last committed token, *draft] -> [n + 1] rows.
        base = target.length
        out = score(target, gen.committed[-1:], draft, layers)
        # 3. Verify: the accepted path plus one bonus or recovered token; 4. commit: the target keeps the accepted
        # path's KV; 5. feedback: the drafter observes the committed rows and the round's timings (verify seconds:
        # the score and steps 3-4).
        finish(gen, draft, out, allowed, base, t1 - t0, lambda: now(device, sync_timing) - t1)
    return gen.decoded()

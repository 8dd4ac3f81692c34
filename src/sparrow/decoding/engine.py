"""The speculative decoding loop: prefill, then rounds of draft -> score -> verify -> commit."""

from __future__ import annotations

import torch

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.drafters.base import Drafter
from sparrow.grammar import FREE, Constraint, masked
from sparrow.noise import Randomness, at
from sparrow.runtime.cached_model import CachedModel
from sparrow.stopping import Stopper
from sparrow.timing import now
from sparrow.tree import TreeLayout, on_first_branch
from sparrow.types import Decoded, Draft, GenerationStats, Prompt, StepStats, TargetOutput
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
    device, layers = target.device, drafter.hidden_layers
    start = now(device, sync_timing)
    with drafter.watch_prefill(target):  # e.g. the sparse drafter records this forward's queries
        out = target.prefill(prompt, layers)  # cache: prompt; invariant from here on: cache == committed[:-1]
    drafter.prefill(prompt, target, out)
    first = S.choose(masked(out.logits[-1], grammar.allowed()), sampling,
                     at(generator, prompt.input_ids.numel()))  # position: the prompt length
    grammar.commit(first.reshape(1).tolist())
    committed = torch.cat([prompt.input_ids.to(device), first.reshape(1)])
    stopper.push(committed[-1:].tolist())
    prefill_seconds = now(device, sync_timing) - start
    steps: list[StepStats] = []
    while not stopper.done:
        t0 = now(device, sync_timing)
        # 1. Draft a chain or a tree; never more nodes than the budget allows, since each round adds a target token.
        noise = at(generator, committed.numel())  # positional noise: offset 0 is the first draft position
        max_tokens = stopper.remaining - 1
        draft = drafter.propose(committed, max_tokens, sampling, noise)
        assert draft.tokens.numel() <= max_tokens, (drafter.name, draft.tokens.numel(), max_tokens)
        # 1b. Grammar: cut the draft where it breaks the grammar, add forced tokens; the masks of its rows.
        draft, allowed = grammar.restrict(draft, max_tokens)
        t1 = now(device, sync_timing)
        # 2. Score: one target forward over [last committed token, *draft] -> [n + 1] rows.
        base = target.length
        out = score(target, committed[-1:], draft, layers)
        # 3. Verify: the accepted path plus one bonus or recovered token.
        verdict = verifier.verify(draft, masked(out.logits, allowed), sampling, noise)
        # 4. Commit: the target keeps the accepted path's KV (compaction; a crop for chains).
        nodes = verdict.accepted_nodes
        target.keep(base, nodes)
        committed = torch.cat([committed, verdict.tokens.to(device)])
        grammar.commit(verdict.tokens.tolist())
        step = StepStats(len(draft), verdict.num_accepted, t1 - t0, now(device, sync_timing) - t1,
                         tree=draft.is_tree, first_branch=not draft.is_tree or on_first_branch(draft.parents, nodes))
        steps.append(step)
        # 5. Feedback: the target's outputs for the committed rows [root, *path] and the round's timings.
        drafter.observe(draft, verdict, out.rows(torch.cat([nodes.new_zeros(1), nodes + 1])), step)
        stopper.push(verdict.tokens.tolist(), verdict.num_accepted)  # EOS / stop string / length cut inside the block
    return Decoded(list(stopper.tokens), stopper.finish_reason or "length",
                   GenerationStats.from_steps(steps, prefill_seconds))

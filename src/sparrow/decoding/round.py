"""One generation's state and the two state changes of its rounds, shared by the engine and the batch.

    gen = Generation(target, drafter, verifier, prompt, sampling, stopper, generator)
    start(gen)                       # 0. prefill, the first token
    while not gen.done:              # the caller drafts (1), restricts (1b) and scores (2) a round, then
        finish(gen, draft, out, allowed, base, draft_seconds, verify_seconds)   # 3.-5.

The invariant between rounds: the target's KV cache holds the committed tokens except the last
(`cache == committed[:-1]`). How the caller drafts and scores is its own: alone (`sparrow.decoding.engine`) or
with other generations in one target forward (`sparrow.decoding.batch`); what a round does to the generation
is the same, so a generation in a batch runs exactly the rounds it would run alone.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.drafters.base import Drafter
from sparrow.grammar import FREE, Constraint, masked
from sparrow.noise import Randomness, at
from sparrow.policy.estimates import AcceptanceEstimate
from sparrow.runtime.cached_model import CachedModel
from sparrow.stopping import Stopper
from sparrow.timing import now
from sparrow.tree import on_first_branch
from sparrow.types import Decoded, Draft, GenerationStats, Prompt, StepStats, TargetOutput, Verdict
from sparrow.verifiers import Verifier


@dataclass
class Generation:
    """One generation: its own cache, drafter, verifier, randomness, stopping rules and grammar state."""

    target: CachedModel  # its own KV cache (in a batch: over the batch's model)
    drafter: Drafter | None  # None: plain decoding (a draft of 0 tokens every round)
    verifier: Verifier | None
    prompt: Prompt
    sampling: SamplingConfig
    stopper: Stopper
    generator: Randomness = None
    committed: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # prompt + generated
    steps: list[StepStats] = field(default_factory=list)
    prefill_seconds: float = 0.0
    started: float = 0.0  # perf_counter when a batch took it (`Batch.add`)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # a batch's: its drafts' acceptance
    grammar: Constraint = FREE  # structured output: its own grammar state (`sparrow.grammar`)

    @property
    def done(self) -> bool:
        return self.stopper.done

    def decoded(self) -> Decoded:
        return Decoded(list(self.stopper.tokens), self.stopper.finish_reason or "length",
                       GenerationStats.from_steps(self.steps, self.prefill_seconds))


def start(gen: Generation, sync_timing: bool = True, prefilled: TargetOutput | None = None) -> None:
    """0. Prefill: the target prefills the prompt (inside the drafter's `watch_prefill`), the drafter gets the
    prompt and the target's outputs, and the first token is chosen from the last prompt row (which may finish it).
    sync_timing: as `speculative_decode`'s, for the prefill seconds. prefilled: what the target's prefill gave when
    the caller ran it (a batch prefills joining generations in one forward, `sparrow.decoding.batch.prefill_together`:
    the target's cache holds the prompt, the drafter asks for no `watch_prefill`); its seconds are the caller's."""
    device = gen.target.device
    begin = now(device, sync_timing)
    layers = gen.drafter.hidden_layers if gen.drafter is not None else ()
    out = prefilled
    if out is None:
        with gen.drafter.watch_prefill(gen.target) if gen.drafter is not None else nullcontext():
            out = gen.target.prefill(gen.prompt, layers)  # cache: prompt; from here on cache == committed[:-1]
    if gen.drafter is not None:
        gen.drafter.prefill(gen.prompt, gen.target, out)
    first = S.choose(masked(out.logits[-1], gen.grammar.allowed()), gen.sampling,
                     at(gen.generator, gen.prompt.input_ids.numel()))  # position: the prompt length
    token = int(first)
    gen.grammar.commit([token])
    gen.committed = torch.cat([gen.prompt.input_ids.to(device), first.reshape(1)])
    gen.stopper.push([token])
    gen.prefill_seconds = now(device, sync_timing) - begin


def finish(gen: Generation, draft: Draft, out: TargetOutput, allowed: Tensor | None, base: int,
           draft_seconds: float, verify_seconds: Callable[[], float]) -> StepStats:
    """Steps 3-5 of a round whose draft (after `Constraint.restrict`, with its row masks `allowed`) the target
    scored: `out` holds the [len(draft) + 1] rows of [last committed token, *draft] (with the drafter's hidden
    layers), appended to the target's cache at `base`. verify_seconds: read once the round is committed (the
    engine: seconds since its score began, so with sync_timing=False what the host waited for)."""
    noise = at(gen.generator, gen.committed.numel())  # the round's noise: offset 0 is the first draft position
    logits = masked(out.logits, allowed)
    # 3. Verify: the accepted path plus one bonus or recovered token (plain decoding, or an empty draft: one token).
    if gen.verifier is not None and len(draft):
        verdict = gen.verifier.verify(draft, logits, gen.sampling, noise)
    else:
        verdict = Verdict(S.choose(logits[-1], gen.sampling, noise).reshape(1), 0)
    # 4. Commit: the target keeps the accepted path's KV (compaction; a crop for chains).
    nodes = verdict.accepted_nodes
    if verdict.path is None:  # a chain prefix: a crop, with no look at the nodes (on a GPU: no device-to-host copy)
        gen.target.rewind(base + 1 + verdict.num_accepted)
    else:
        gen.target.keep(base, nodes)
    gen.committed = torch.cat([gen.committed, verdict.tokens.to(gen.committed.device)])
    ids = verdict.host_ids()
    gen.grammar.commit(ids)
    step = StepStats(len(draft), verdict.num_accepted, draft_seconds, verify_seconds(), tree=draft.is_tree,
                     first_branch=not draft.is_tree or on_first_branch(draft.parents, nodes))
    gen.steps.append(step)
    # 5. Feedback: the target's outputs for the committed rows [root, *path] and the round's timings.
    if gen.drafter is not None:
        gen.drafter.observe(draft, verdict, out.rows(torch.cat([nodes.new_zeros(1), nodes + 1])), step)
    gen.stopper.push(ids, verdict.num_accepted)  # EOS / stop string / length cut inside the block
    return step

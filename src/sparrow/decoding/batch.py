"""Batched speculative decoding: generations that share each target forward (continuous batching).

    batch = Batch(model, policy)
    batch.add(sequence)              # prefill now; may join between any two steps
    finished = batch.step()          # every running sequence: draft -> one shared score -> verify -> commit

Each `Generation` is one generation with its own KV cache (a `CachedModel` over the shared model), its own
drafter (a fork of the pipeline's that shares its models), verifier, sampling randomness and Stopper, so it
runs exactly the rounds it would run alone: the engine's loop (`sparrow.decoding.engine`) with only the scoring forward
shared. That forward (`forward_batch`, `score_batch` for targets) pads the ragged inputs [last token, *draft] of
all sequences to one [B, Q] batch; a cache view (`BatchedKV`) appends each row's new keys to its own cache and
hands attention the rows' caches padded to one length, with a 4-D mask in which row b sees its own cached prefix
and its draft's ancestors (a chain: the tokens before; a tree: the tree mask) and nothing else. Each sequence
then keeps its own accepted length (`CachedModel.keep`): no sequence waits for another's rollback. Greedy output
is that of the sequence alone, token for token (float32); sampled output has the same distribution with its own
seed. Draft models draft together the same way (`draft_together`: one batched draft forward per position).

The draft budget (`BatchPolicy`): a step of B sequences that drafts k tokens each costs k draft positions of B
sequences plus one verify forward of T = sum(k_b + 1) tokens, and commits sum E_b[tokens](k)
(`sparrow.policy.estimates.expected_tokens`). The step's cap is the k with the most tokens per second, from each
sequence's acceptance and two cost tables interpolated between measured steps (`CostTable`): as the batch grows
the verify forward stops being memory-bound, so drafts get shorter, and stop where they no longer pay.
"""

from __future__ import annotations

import copy
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.drafters.base import Drafter
from sparrow.drafters.draft_loop import DraftSteps, Forward
from sparrow.grammar import FREE, Constraint, masked
from sparrow.noise import Randomness, at
from sparrow.policy.estimates import AcceptanceEstimate, ProbeSchedule, expected_tokens
from sparrow.runtime.cached_model import CachedModel, additive_mask
from sparrow.stopping import Stopper
from sparrow.timing import now
from sparrow.tree import TreeLayout, on_first_branch
from sparrow.types import Decoded, Draft, GenerationStats, Prompt, StepStats, TargetOutput, Verdict
from sparrow.verifiers import Verifier


@dataclass
class Generation:
    """One generation in a batch: its own cache, drafter, verifier, randomness and stopping rules."""

    target: CachedModel  # its own KV cache over the batch's model
    drafter: Drafter | None  # None: plain decoding (a draft of 0 tokens every step)
    verifier: Verifier | None
    prompt: Prompt
    sampling: SamplingConfig
    stopper: Stopper
    generator: Randomness = None
    committed: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # prompt + generated
    steps: list[StepStats] = field(default_factory=list)
    prefill_seconds: float = 0.0
    started: float = 0.0  # perf_counter at add()
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # for the batch's draft budget
    grammar: Constraint = FREE  # structured output: its own grammar state (`sparrow.grammar`)

    @property
    def done(self) -> bool:
        return self.stopper.done

    def decoded(self) -> Decoded:
        return Decoded(list(self.stopper.tokens), self.stopper.finish_reason or "length",
                       GenerationStats.from_steps(self.steps, self.prefill_seconds))


class BatchedKV:
    """The `cache` of one batched scoring forward: layer i's `update` appends row b's first n_b new
    keys and values to sequence b's own cache and returns all rows' caches, right-padded to one length."""

    def __init__(self, caches: list, new: list[int]) -> None:
        self.caches, self.new = caches, new

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given; the mask is 4-D

    def update(self, keys: Tensor, values: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """keys, values: [B, heads, Q, d] -> [B, heads, max_b(length_b + n_b), d]."""
        rows = [cache.layers[layer_idx].update(keys[b:b + 1, :, :n], values[b:b + 1, :, :n])
                for b, (cache, n) in enumerate(zip(self.caches, self.new))]
        if len(rows) == 1:  # one sequence: its own cache, as it is (no padded copy)
            return rows[0]
        # Several: a padded copy of every row's cache, each step (a paged or slotted cache would avoid it)
        length = max(k.shape[-2] for k, _ in rows)
        shape = (keys.shape[0], keys.shape[1], length, keys.shape[-1])
        all_keys, all_values = keys.new_zeros(shape), values.new_zeros(shape)
        for b, (k, v) in enumerate(rows):
            all_keys[b, :, :k.shape[-2]] = k[0]
            all_values[b, :, :v.shape[-2]] = v[0]
        return all_keys, all_values


def supports_batching(model: PreTrainedModel) -> str | None:
    """None when `forward_batch` can run `model`, else why not (sliding-window layers keep their own window)."""
    if model not in _BATCHABLE:
        _BATCHABLE[model] = _why_not_batched(model)
    return _BATCHABLE[model]


_BATCHABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> supports_batching(model)


def _why_not_batched(model: PreTrainedModel) -> str | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if "sliding_attention" in list(getattr(config, "layer_types", None) or []):
        return "it has sliding-window attention layers"
    if getattr(config, "model_type", "") in ("qwen2_5_vl", "qwen2_vl", "llava_onevision"):
        return "its positions depend on the prompt's media (M-RoPE)"
    return None


def score_batch(model: PreTrainedModel, seqs: list[Generation], drafts: list[Draft],
                hidden_layers: tuple[int, ...] = ()) -> list[TargetOutput]:
    """One target forward over every sequence's [last committed token, *draft] -> per sequence [n_b + 1] rows
    (the same rows `sparrow.decoding.engine.score` gives for it alone)."""
    assert len(seqs) == len(drafts) > 0
    device = seqs[0].target.device
    inputs = [torch.cat([seq.committed[-1:], draft.tokens.to(device)]) for seq, draft in zip(seqs, drafts)]
    trees = [draft.parents if draft.is_tree else None for draft in drafts]
    return forward_batch(model, [seq.target for seq in seqs], inputs, trees, hidden_layers)


@torch.inference_mode()
def forward_batch(model: PreTrainedModel, runners: list[CachedModel], inputs: list[Tensor],
                  trees: list[Tensor | None] | None = None, hidden_layers: tuple[int, ...] = ()) -> list[TargetOutput]:
    """One forward of `model` appending inputs[b] ([n_b] int64) to runners[b]'s cache, for every b -> per runner
    [n_b] rows, as `runners[b].forward(inputs[b])` would give them. trees[b]: the parents of inputs[b][1:] under
    inputs[b][0] (a draft tree: tree mask and depth positions); None: a chain."""
    assert len(runners) == len(inputs) > 0
    device = runners[0].device
    positions, masks = [], []
    for runner, tokens, parents in zip(runners, inputs, trees or [None] * len(inputs)):
        start, n = runner.length, tokens.numel()
        if parents is not None:
            layout = TreeLayout.of(parents.to(device), start)
            pos, local = layout.positions, layout.mask[:, start:]
        else:
            pos = torch.arange(start, start + n, device=device)
            local = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        positions.append(pos)
        masks.append((start, local))
    new = [t.numel() for t in inputs]
    q = max(new)
    length = max(start + n for (start, _), n in zip(masks, new))
    ids = torch.zeros(len(inputs), q, dtype=torch.long, device=device)
    pos = torch.zeros(len(inputs), q, dtype=torch.long, device=device)
    allowed = torch.zeros(len(inputs), q, length, dtype=torch.bool, device=device)
    for b, (tokens, p, (start, local)) in enumerate(zip(inputs, positions, masks)):
        n = tokens.numel()
        ids[b, :n], pos[b, :n] = tokens.to(device), p
        pos[b, n:] = p[-1]  # padding rows: any position; they see only key 0 and are never read
        allowed[b, :n, :start] = True
        allowed[b, :n, start:start + n] = local
        allowed[b, n:, 0] = True
    dtype = next(model.parameters()).dtype
    cache = BatchedKV([runner.cache for runner in runners], new)
    out = model(input_ids=ids, cache=cache, use_cache=True, position_ids=pos,
                attention_mask=additive_mask(allowed, dtype)[:, None], output_hidden_states=bool(hidden_layers))
    outputs = []
    for b, n in enumerate(new):
        hidden = torch.stack([out.hidden_states[i][b, :n] for i in hidden_layers]) if hidden_layers else None
        outputs.append(TargetOutput(out.logits[b, :n], hidden))
    return outputs


MAX_SHARED_CATCH_UP = 8
"""A draft forward of more tokens than this (a draft catching up after plain steps) runs alone: in a shared
forward every other row would be padded to its length."""


def draft_together(steps: dict[int, DraftSteps]) -> dict[int, Draft]:
    """Run several drafters' DraftSteps in lockstep: each round, the `Forward`s they ask for that run the same
    model go through one `forward_batch`; returns each one's Draft."""
    drafts: dict[int, Draft] = {}
    requests: dict[int, Forward] = {}

    def advance(key: int, answer: Tensor | None) -> None:
        try:
            requests[key] = next(steps[key]) if answer is None else steps[key].send(answer)
        except StopIteration as done:
            drafts[key] = done.value
            requests.pop(key, None)

    for key in steps:
        advance(key, None)
    while requests:
        groups: dict[int, list[int]] = {}
        for key, request in requests.items():  # alone: a model batching cannot run, a long catch-up (padding)
            model = request.runner.model
            together = supports_batching(model) is None and request.tokens.numel() <= MAX_SHARED_CATCH_UP
            groups.setdefault(id(model) if together else -key - 1, []).append(key)
        answers = {}
        for keys in groups.values():
            if len(keys) == 1:
                answers[keys[0]] = requests[keys[0]].run()
                continue
            runners = [requests[key].runner for key in keys]
            outs = forward_batch(runners[0].model, runners, [requests[key].tokens for key in keys])
            answers.update((key, out.logits[-1]) for key, out in zip(keys, outs))
        for key, answer in answers.items():
            advance(key, answer)
    return drafts


@dataclass
class CostTable:
    """Seconds of one forward of T tokens: decayed means per power-of-two bin of T, linear between the bins
    (flat below the first, the last segment's slope beyond the last). A CPU's forward costs about the same
    for 1 or 16 tokens (it reads the weights either way), then grows with T; one straight line fits neither."""

    decay: float = 0.9  # per observation, within its bin

    def __post_init__(self) -> None:
        self.bins: dict[int, list[float]] = {}  # bit length of T -> [weight, weighted T, weighted seconds]

    @property
    def known(self) -> bool:
        return bool(self.bins)

    def add(self, tokens: int, seconds: float) -> None:
        w, x, y = self.bins.get(tokens.bit_length(), (0.0, 0.0, 0.0))
        self.bins[tokens.bit_length()] = [self.decay * w + 1, self.decay * x + tokens, self.decay * y + seconds]

    def __call__(self, tokens: float) -> float:
        points = sorted((x / w, y / w) for w, x, y in self.bins.values())
        assert points, "no observation yet"
        if len(points) == 1:
            x, y = points[0]
            return y * max(1.0, tokens / x)
        if tokens <= points[0][0]:
            return points[0][1]
        segment = next((pair for pair in zip(points, points[1:]) if tokens <= pair[1][0]), (points[-2], points[-1]))
        (x0, y0), (x1, y1) = segment
        return y0 + max(0.0, (y1 - y0) / (x1 - x0)) * (tokens - x0)


@dataclass
class BatchPolicy:
    """The draft cap of a batch step: the k with the most expected tokens per second (see the module doc).

    Costs are the batch's own: verify(T) for a target forward of T tokens, and draft(B) seconds per draft
    position for B sequences drafting together (a draft model runs one batched forward per position). While no
    draft length pays, steps are plain; every `probe` such steps (doubling up to `max_probe` while it keeps
    losing) one step drafts the best length anyway, so acceptance and draft costs stay measured."""

    decay: float = 0.9
    adaptive: bool = True  # False: every sequence drafts what its own drafter chooses (tests, --fixed)
    probe: int = 4
    max_probe: int = 64

    def __post_init__(self) -> None:
        self.verify = CostTable(self.decay)  # (tokens in the batched forward, seconds)
        self.draft = CostTable(self.decay)  # (sequences drafting, seconds per draft position)
        self.probes = ProbeSchedule(self.probe, self.max_probe)
        self._step = 0

    def seed(self, points: list[tuple[int, float]]) -> None:
        """Measured (tokens, seconds) of forwards before serving (`measure_batch_cost`)."""
        for tokens, seconds in points:
            self.verify.add(tokens, seconds)

    def rate(self, seqs: list[Generation], limits: list[int], k: int) -> float:
        """Expected tokens per second of a step whose drafts are capped at k (unknown draft costs count as 0)."""
        ks = [min(k, limit) for limit in limits]
        tokens = sum(expected_tokens(seq.acceptance.value, j) for seq, j in zip(seqs, ks))
        drafting = sum(1 for j in ks if j)
        seconds = max(ks) * self.draft(drafting) if drafting and self.draft.known else 0.0
        return tokens / max(seconds + self.verify(sum(ks) + len(ks)), 1e-12)

    def cap(self, seqs: list[Generation], limits: list[int]) -> int:
        """Tokens each sequence may draft this step (each also at most its own limit). A sequence alone follows
        its drafter's own policy, which already weighs its draft and verify costs."""
        top = max(limits, default=0)
        self._step += 1
        if top == 0 or len(seqs) < 2 or not self.adaptive or not self.verify.known:
            return top
        rates = [self.rate(seqs, limits, k) for k in range(top + 1)]
        best = max(range(1, top + 1), key=rates.__getitem__)
        if rates[best] > rates[0]:  # drafting pays
            self.probes.restart(self._step + self.probes.start)
            return best
        if self.probes.due(self._step):  # a probe: the estimates may be stale
            self.probes.wait(self._step, won=False)
            return best
        return 0

    def observe(self, tokens: int, seconds: float, drafting: int = 0, positions: int = 0,
                draft_seconds: float = 0.0) -> None:
        """A step: its verify forward of `tokens` tokens took `seconds`; `drafting` sequences drafted up to
        `positions` tokens in `draft_seconds`."""
        self.verify.add(tokens, seconds)
        if drafting and positions:
            self.draft.add(drafting, draft_seconds / positions)


def measure_batch_cost(model: PreTrainedModel, tokens: tuple[int, ...] = (1, 16, 64), context: int = 32,
                       vocab: int | None = None) -> list[tuple[int, float]]:
    """Seconds of one forward of n tokens after a short context, for each n (the verify cost table's first points)."""
    runner = CachedModel(model)
    vocab = vocab or runner.vocab_size
    limit = runner.context_length or 10 ** 9
    ids = torch.arange(context + max(tokens)) * 7919 % vocab
    points = []
    for n in tokens:
        if context + n >= limit:
            continue
        runner.prefill(Prompt(ids[:context]))
        runner.forward(ids[context:context + n])  # warm-up
        runner.rewind(context)
        start = now(runner.device)
        runner.forward(ids[context:context + n])
        points.append((n, now(runner.device) - start))
    return points


class Batch:
    """Running sequences that share target forwards; they join (`add`) and leave (`step`, `remove`) between steps."""

    def __init__(self, model: PreTrainedModel, policy: BatchPolicy | None = None) -> None:
        self.model = model
        self.policy = policy or BatchPolicy()
        self.running: list[Generation] = []

    def __len__(self) -> int:
        return len(self.running)

    def add(self, seq: Generation) -> None:
        """Prefill `seq` (its target cache, its drafter) and choose its first token (which may finish it)."""
        seq.started = time.perf_counter()
        device = seq.target.device
        start = now(device)
        layers = seq.drafter.hidden_layers if seq.drafter is not None else ()
        with seq.drafter.watch_prefill(seq.target) if seq.drafter is not None else nullcontext():
            out = seq.target.prefill(seq.prompt, layers)
        if seq.drafter is not None:
            seq.drafter.prefill(seq.prompt, seq.target, out)
            if seq.drafter.length is not None:  # what its drafter learnt so far: the budget's first estimate
                seq.acceptance = copy.deepcopy(seq.drafter.length.acceptance)
        n = seq.prompt.input_ids.numel()
        first = S.choose(masked(out.logits[-1], seq.grammar.allowed()), seq.sampling, at(seq.generator, n))
        seq.grammar.commit([int(first)])
        seq.committed = torch.cat([seq.prompt.input_ids.to(device), first.reshape(1)])
        seq.stopper.push([int(first)])
        seq.prefill_seconds = now(device) - start
        if not seq.done:
            self.running.append(seq)
        else:
            seq.target.cache = None

    def remove(self, seq: Generation) -> None:
        """Drop a running sequence (its client went away); its cache goes with it."""
        if seq in self.running:
            self.running.remove(seq)
        seq.target.cache = None

    def step(self) -> list[Generation]:
        """One round for every running sequence; returns those that finished (and left the batch)."""
        seqs = self.running
        if not seqs:
            return []
        device = seqs[0].target.device
        t0 = now(device)
        limits = [seq.stopper.remaining - 1 if seq.drafter is not None else 0 for seq in seqs]
        cap = self.policy.cap(seqs, limits)
        proposed: dict[int, Draft] = {}
        together: dict[int, DraftSteps] = {}  # drafters that can share their draft forwards (draft models)
        for b, (seq, limit) in enumerate(zip(seqs, limits)):  # 1. draft: each its own state, forwards shared
            budget = min(cap, limit)
            noise = at(seq.generator, seq.committed.numel())
            if seq.drafter is None or budget == 0:
                proposed[b] = Draft.empty(device)
            elif seq.drafter.propose_steps is not None:
                together[b] = seq.drafter.propose_steps(seq.committed, budget, seq.sampling, noise)
            else:
                proposed[b] = seq.drafter.propose(seq.committed, budget, seq.sampling, noise)
        proposed.update(draft_together(together))
        drafts = [proposed[b] for b in range(len(seqs))]
        masks = []
        for b, (seq, draft, limit) in enumerate(zip(seqs, drafts, limits)):
            assert draft.tokens.numel() <= min(cap, limit), (seq.drafter and seq.drafter.name, len(draft), cap)
            drafts[b], allowed = seq.grammar.restrict(draft, limit)  # cut at the grammar, forced tokens added
            masks.append(allowed)
        drafting, phase = sum(1 for d in drafts if len(d)), now(device) - t0
        draft_seconds = [phase / max(drafting, 1) if len(d) else 0.0 for d in drafts]  # the phase, shared
        t1 = now(device)
        layers = tuple(sorted({i for seq in seqs if seq.drafter is not None for i in seq.drafter.hidden_layers}))
        bases = [seq.target.length for seq in seqs]
        outs = score_batch(self.model, seqs, drafts, layers)  # 2. one shared target forward
        verify_seconds = now(device) - t1
        self.policy.observe(sum(len(d) + 1 for d in drafts), verify_seconds, drafting,
                            max(len(d) for d in drafts), phase)
        finished = []
        for seq, draft, out, base, seconds, allowed in zip(seqs, drafts, outs, bases, draft_seconds, masks):
            noise = at(seq.generator, seq.committed.numel())
            logits = masked(out.logits, allowed)
            if seq.verifier is not None and len(draft):  # 3. verify: this sequence's own rule and randomness
                verdict = seq.verifier.verify(draft, logits, seq.sampling, noise)
            else:
                verdict = Verdict(S.choose(logits[-1], seq.sampling, noise).reshape(1), 0)
            nodes = verdict.accepted_nodes
            seq.target.keep(base, nodes)  # 4. commit: its own accepted length
            seq.committed = torch.cat([seq.committed, verdict.tokens.to(device)])
            seq.grammar.commit(verdict.tokens.tolist())
            step = StepStats(len(draft), verdict.num_accepted, seconds, verify_seconds, tree=draft.is_tree,
                             first_branch=not draft.is_tree or on_first_branch(draft.parents, nodes))
            seq.steps.append(step)
            if len(draft):
                seq.acceptance.observe(len(draft), verdict.num_accepted)
            if seq.drafter is not None:  # 5. feedback, as in the engine
                layers_out = (
                    out
                    if not layers or layers == seq.drafter.hidden_layers
                    else _select(out, layers, seq.drafter.hidden_layers)
                )
                seq.drafter.observe(draft, verdict, layers_out.rows(torch.cat([nodes.new_zeros(1), nodes + 1])), step)
            seq.stopper.push(verdict.tokens.tolist(), verdict.num_accepted)
            if seq.done:
                finished.append(seq)
        for seq in finished:
            self.remove(seq)
        return finished


def _select(out: TargetOutput, have: tuple[int, ...], want: tuple[int, ...]) -> TargetOutput:
    hidden = None if out.hidden is None or not want else out.hidden[[have.index(i) for i in want]]
    return TargetOutput(out.logits, hidden)

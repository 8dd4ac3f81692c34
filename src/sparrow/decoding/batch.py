"""Batched speculative decoding: generations that share each target forward (continuous batching).

    batch = Batch(model, policy)
    batch.add(sequence)              # prefill now; may join between any two steps
    finished = batch.step()          # every running sequence: draft -> one shared score -> verify -> commit

Each `Generation` (`sparrow.decoding.round`) is one generation with its own KV cache (a `CachedModel` over the
shared model), its own drafter (a fork of the pipeline's that shares its models), verifier, sampling randomness and
Stopper, so it runs exactly the rounds it would run alone: the engine's loop (`sparrow.decoding.engine`), with the
same `start` (prefill, first token) and `finish` (verify, commit, feedback), and only the forwards shared. The
scoring forward (`forward_batch`, `score_batch` for targets) pads the ragged inputs [last token, *draft] of all
sequences to one [B, Q] batch; a cache view (`BatchedKV`) appends each row's new keys to its own cache and hands
attention the rows' caches padded to one length, with a 4-D mask in which row b sees its own cached prefix and its
draft's ancestors (a chain: the tokens before; a tree: the tree mask) and nothing else. Each sequence then keeps
its own accepted length (`CachedModel.keep`): no sequence waits for another's rollback. Greedy output is that of
the sequence alone, token for token (float32); sampled output has the same distribution with its own
seed. Draft models draft together the same way (`draft_together`: one batched draft forward per position).

The draft budget of a step (how many tokens every sequence may draft, from its acceptance and the batch's measured
costs) is `sparrow.policy.batch.BatchPolicy`'s.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from sparrow.decoding.round import Generation, finish, start
from sparrow.drafters.draft_loop import DraftSteps, Forward
from sparrow.noise import at
from sparrow.policy.batch import BatchPolicy
from sparrow.policy.measure import DUMMY_ID_STRIDE
from sparrow.runtime.cached_model import CachedModel, additive_mask, prefill_module
from sparrow.timing import now
from sparrow.tree import TreeLayout
from sparrow.types import Draft, Prompt, TargetOutput


class BatchedKV:
    """The `cache` of one batched forward: layer i's `update` appends row b's n_b new keys and values (from
    position offsets[b] of the forward's rows: 0 for right padding) to sequence b's own cache and returns all rows'
    caches, right-padded to one length."""

    def __init__(self, caches: list, new: list[int], offsets: list[int] | None = None) -> None:
        self.caches, self.new = caches, new
        self.offsets = offsets or [0] * len(new)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given; the mask is 4-D

    def update(self, keys: Tensor, values: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """keys, values: [B, heads, Q, d] -> [B, heads, max_b(length_b + n_b), d]."""
        rows = [cache.layers[layer_idx].update(keys[b:b + 1, :, o:o + n], values[b:b + 1, :, o:o + n])
                for b, (cache, n, o) in enumerate(zip(self.caches, self.new, self.offsets))]
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


MAX_PREFILL_TOKENS = 4096
"""At most this many positions (rows x the longest prompt) in one shared prefill forward; a longer prompt prefills
alone."""
PREFILL_PADDING = 2.0
"""A shared prefill's positions are at most this many times its prompts' tokens (similar lengths go together)."""


def prefill_groups(prompts: list[int]) -> list[list[int]]:
    """Indices of prompts (their lengths) that prefill together: by increasing length, a group grows while its
    padded size (rows x the longest) stays within PREFILL_PADDING x its tokens and MAX_PREFILL_TOKENS."""
    groups: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(prompts)), key=prompts.__getitem__):
        n = prompts[i]
        rows = len(groups[-1]) + 1 if groups else 0
        if groups and rows * n <= min(PREFILL_PADDING * (tokens + n), MAX_PREFILL_TOKENS):
            groups[-1].append(i)
            tokens += n
        else:
            groups.append([i])
            tokens = n
    return groups


@torch.inference_mode()
def prefill_together(model: PreTrainedModel, runners: list[CachedModel], prompts: list[Tensor],
                     hidden_layers: tuple[int, ...] = ()) -> list[TargetOutput]:
    """One forward of `model` over several prompts ([n_b] int64), each into runners[b]'s emptied cache -> per
    runner what `runners[b].prefill` gives: the last prompt row's logits ([1, vocab]) and the hidden states of every
    prompt row. The prompts are left-padded, so every row's last prompt token is the forward's last position and
    only that position goes through the LM head; row b's padding positions see only its key 0 and are not cached."""
    assert len(runners) == len(prompts) > 0
    device = runners[0].device
    new = [p.numel() for p in prompts]
    q = max(new)
    ids = torch.zeros(len(prompts), q, dtype=torch.long, device=device)
    pos = torch.zeros(len(prompts), q, dtype=torch.long, device=device)
    allowed = torch.zeros(len(prompts), q, q, dtype=torch.bool, device=device)
    for b, (tokens, n) in enumerate(zip(prompts, new)):
        pad = q - n
        ids[b, pad:], pos[b, pad:] = tokens.to(device), torch.arange(n, device=device)
        allowed[b, pad:, :n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        allowed[b, :pad, 0] = True
    for runner in runners:
        runner.clear()
    dtype = next(model.parameters()).dtype
    cache = BatchedKV([runner.cache for runner in runners], new, [q - n for n in new])
    out = prefill_module(model)(input_ids=ids, cache=cache, use_cache=True, position_ids=pos, logits_to_keep=1,
                                attention_mask=additive_mask(allowed, dtype)[:, None],
                                output_hidden_states=bool(hidden_layers))
    outputs = []
    for b, n in enumerate(new):
        hidden = torch.stack([out.hidden_states[i][b, q - n:] for i in hidden_layers]) if hidden_layers else None
        outputs.append(TargetOutput(out.logits[b, -1:], hidden))
    return outputs


def _fastest(run: Callable[[], object], device: torch.device, repeats: int,
             reset: Callable[[], object] = lambda: None) -> float:
    """Seconds of the fastest of `repeats` calls of `run` after a warm-up call (`reset`, untimed, after each)."""
    times = []
    for _ in range(repeats + 1):
        t0 = now(device)
        run()
        times.append(now(device) - t0)
        reset()
    return min(times[1:])


def measure_feeds(model: PreTrainedModel, lengths: tuple[int, ...] = (16, 64, 256), vocab: int | None = None,
                  repeats: int = 2) -> list[tuple[int, float]]:
    """Seconds of one sequence's forward of n tokens into an empty cache, for each n: what a draft's catch-up costs
    (its lazy prompt prefill, or the steps it sat out; more than MAX_SHARED_CATCH_UP tokens run alone, see
    `draft_together`), the first points of a batch's feed cost table (`sparrow.policy.batch.BatchPolicy.seed`). The
    fastest of `repeats` runs after a warm-up."""
    runner = CachedModel(model)
    ids = torch.arange(max(lengths)) * DUMMY_ID_STRIDE % (vocab or runner.vocab_size)
    points = [(n, _fastest(lambda: runner.prefill(Prompt(ids[:n])), runner.device, repeats)) for n in lengths]
    runner.cache = None
    return points


def measure_rows(model: PreTrainedModel, rows: tuple[int, ...] = (1, 2, 4, 8), context: int = 32,
                 vocab: int | None = None, repeats: int = 2) -> list[tuple[int, float]]:
    """Seconds of one `forward_batch` of one token in each of n rows (each after its own short context), for each
    n: what a draft position costs n sequences drafting together (`draft_together`), the first points of a batch's
    draft cost table (`sparrow.policy.batch.BatchPolicy.seed`). The fastest of `repeats` runs after a warm-up."""
    runners = [CachedModel(model) for _ in range(max(rows))]
    ids = torch.arange(context + 1) * DUMMY_ID_STRIDE % (vocab or runners[0].vocab_size)
    prefill_together(model, runners, [ids[:context]] * len(runners))

    def rewind(n: int) -> None:
        for runner in runners[:n]:
            runner.rewind(context)

    return [(n, _fastest(lambda: forward_batch(model, runners[:n], [ids[context:]] * n), runners[0].device, repeats,
                         lambda: rewind(n))) for n in rows]


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


def probe_limits(behind: list[int | None], limits: list[int]) -> list[int]:
    """The draft limits of a probe step from how far each sequence's draft lags behind its committed text (None: no
    drafter, or no limit): only drafts at most MAX_SHARED_CATCH_UP tokens behind draft (a draft that sat out many
    plain steps, or never prefilled, would first feed them: at 32 streams a probe of every sequence took 3.4 s, the
    lazy prefills of 32 drafts, for one step's acceptance); if none is, the least behind one alone."""
    near = [lag is not None and lag <= MAX_SHARED_CATCH_UP for lag in behind]
    if not any(near) and any(lag is not None for lag in behind):
        near[min((lag, b) for b, lag in enumerate(behind) if lag is not None)[1]] = True
    return [limit if ok else 0 for limit, ok in zip(limits, near)]


class Batch:
    """Running sequences that share target forwards; they join (`add`) and leave (`step`, `remove`) between steps."""

    def __init__(self, model: PreTrainedModel, policy: BatchPolicy | None = None) -> None:
        self.model = model
        self.policy = policy or BatchPolicy()
        self.running: list[Generation] = []

    def __len__(self) -> int:
        return len(self.running)

    def add(self, *seqs: Generation) -> None:
        """Prefill `seqs` (their target caches, their drafters) and choose each one's first token (which may finish
        it). Text prompts of similar lengths prefill in one shared target forward (`prefill_together`); a prompt
        with media, whose drafter watches the target's prefill, or that begins like a sequence in the prefix cache
        (its runner's `prefix_cache`: it prefills only the rest) prefills alone."""
        for seq in seqs:
            seq.started = time.perf_counter()
        shareable = [seq for seq in seqs if not seq.prompt.model_inputs
                     and (seq.drafter is None or not seq.drafter.describe().watches_prefill)
                     and not seq.target.cached_prefix(seq.prompt, seq.drafter.hidden_layers if seq.drafter else ())]
        prefilled: dict[int, tuple[TargetOutput, float]] = {}
        for group in prefill_groups([seq.prompt.input_ids.numel() for seq in shareable]):
            if len(group) < 2:
                continue
            members = [shareable[i] for i in group]
            device = members[0].target.device
            t0 = now(device)
            layers = tuple(sorted({i for seq in members if seq.drafter is not None for i in seq.drafter.hidden_layers}))
            outs = prefill_together(self.model, [seq.target for seq in members],
                                    [seq.prompt.input_ids for seq in members], layers)
            seconds = now(device) - t0  # each waited for the whole forward
            for seq, out in zip(members, outs):
                if seq.drafter is not None and layers != seq.drafter.hidden_layers:
                    out = _select(out, layers, seq.drafter.hidden_layers)
                prefilled[id(seq)] = out, seconds
        for seq in seqs:
            out, seconds = prefilled.get(id(seq), (None, 0.0))
            start(seq, prefilled=out)  # alone where `out` is None
            seq.prefill_seconds += seconds
            length = seq.drafter.describe().length if seq.drafter is not None else None
            if length is not None:  # what its drafter learnt so far: the budget's first estimate
                seq.acceptance = copy.deepcopy(length.acceptance)
            if not seq.done:  # one that finished at once keeps its cache, as in `step`
                self.running.append(seq)

    def remove(self, seq: Generation) -> None:
        """Drop a running sequence (its client went away); its cache goes with it."""
        if seq in self.running:
            self.running.remove(seq)
        seq.target.cache = None

    def step(self) -> list[Generation]:
        """One round for every running sequence; returns those that finished (and left the batch). A finished one
        keeps its cache, between rounds, for `Pipeline.release` to drop or to hand to the prefix cache."""
        seqs = self.running
        if not seqs:
            return []
        device = seqs[0].target.device
        t0 = now(device)
        limits = [seq.stopper.remaining - 1 if seq.drafter is not None else 0 for seq in seqs]
        caches = [seq.drafter.batching if seq.drafter is not None else None for seq in seqs]  # own draft caches
        lags = [cache.behind(seq.committed) if cache is not None and limit else 0
                for seq, cache, limit in zip(seqs, caches, limits)]  # committed tokens each draft would first feed
        cap = self.policy.cap(seqs, limits, [lag if lag > MAX_SHARED_CATCH_UP else 0 for lag in lags])
        behind = [lag if seq.drafter is not None and min(cap, limit) else None
                  for seq, lag, limit in zip(seqs, lags, limits)]  # None: no draft
        # a probe measures acceptance: not worth a long draft catch-up
        allowed = probe_limits(behind, limits) if self.policy.probing else limits
        # a draft that first feeds many tokens (a lazy prompt prefill, steps it sat out) makes the phase no measure
        # of a draft position's cost: at 8 streams one such step (1.85 s, 8 lazy prefills) once priced drafting out
        # for good, since no probe could pay at that cost and so none ever measured it again
        catching_up = any(lag is not None and lag > MAX_SHARED_CATCH_UP and min(cap, limit)
                          for lag, limit in zip(behind, allowed))
        proposed: dict[int, Draft] = {}
        together: dict[int, DraftSteps] = {}  # drafters that can share their draft forwards (draft models)
        for b, (seq, limit) in enumerate(zip(seqs, allowed)):  # 1. draft: each its own state, forwards shared
            budget = min(cap, limit)
            noise = at(seq.generator, seq.committed.numel())
            if seq.drafter is None or budget == 0:
                proposed[b] = Draft.empty(device)
            elif caches[b] is not None:
                together[b] = caches[b].propose_steps(seq.committed, budget, seq.sampling, noise)
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
        self.policy.observe(sum(len(d) + 1 for d in drafts), verify_seconds, 0 if catching_up else drafting,
                            max(len(d) for d in drafts), phase)
        finished = []
        for seq, draft, out, base, seconds, allowed, limit in zip(seqs, drafts, outs, bases, draft_seconds, masks,
                                                                   limits):
            if seq.drafter is not None and layers and layers != seq.drafter.hidden_layers:
                out = _select(out, layers, seq.drafter.hidden_layers)  # the layers its drafter asked for
            step = finish(seq, draft, out, allowed, base, seconds, lambda: verify_seconds)  # 3.-5.: its own rule, state
            # what a cap of this length yields: a chain that stopped short of it failed there; a tree's nodes are
            # not draft positions
            reach = min(len(draft), step.num_accepted + 1) if draft.is_tree else max(min(cap, limit), len(draft))
            seq.acceptance.observe(len(draft), step.num_accepted, reach=reach)
            if seq.done:
                finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
        return finished


def _select(out: TargetOutput, have: tuple[int, ...], want: tuple[int, ...]) -> TargetOutput:
    hidden = None if out.hidden is None or not want else out.hidden[[have.index(i) for i in want]]
    return TargetOutput(out.logits, hidden)

"""Prefix caching: a prompt that begins like an earlier request's prompt and output prefills only the rest, and the
output is the one a whole prefill gives, for plain decoding and for every model-free drafter (float32, greedy)."""

from __future__ import annotations

import pytest
import torch
from batching import count_forwards
from transformers import DynamicCache

import sparrow
from sparrow.decoding.batch import Batch
from sparrow.drafters import build_drafter
from sparrow.drafters.base import DrafterBase
from sparrow.errors import UserError
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy
from sparrow.runtime.prefix_cache import MIN_REUSE, PrefixCache

SYSTEM = "You are a careful agent. The tools are read, search and edit; answer with one call. " * 2
TURNS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]


def _cache(n: int, seed: int = 0) -> DynamicCache:
    """A 2-layer cache of n positions (keys and values [1, 2 heads, n, 4])."""
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g), layer)
    return cache


def test_take_finds_the_longest_shared_prefix_and_the_entries_stay_within_their_bound():
    cache = PrefixCache(max_tokens=100)
    a, b = list(range(40)), list(range(30)) + [99] * 10
    cache.park(a, _cache(40, seed=1))
    cache.park(b, _cache(40, seed=2))
    assert cache.tokens == 80
    original = cache.entries[tuple(a)].layers[1].keys.clone()
    taken, shared = cache.take(list(range(35)) + [7, 7], DynamicCache)
    assert shared == 35 and taken.get_seq_length() == 35  # a (35 shared) over b (30): a copy of what is shared
    torch.testing.assert_close(taken.layers[1].keys, original[..., :35, :], rtol=0, atol=0)
    taken.layers[1].keys.zero_()
    assert torch.equal(cache.entries[tuple(a)].layers[1].keys, original)  # the entry stays, untouched
    assert cache.take(list(range(MIN_REUSE - 1)) + [500], DynamicCache) is None  # too little shared
    whole, shared = cache.take(b + [5, 6], DynamicCache)
    assert shared == len(b) and tuple(b) not in cache.entries  # extended whole: the entry itself, taken over
    _, shared = cache.take(a, DynamicCache)
    assert shared == len(a) - 1  # the last prompt row is always computed (its logits)
    for i in range(5):
        cache.park([i] * 30, _cache(30))
    assert cache.tokens <= 100 and list(cache.entries)[-1] == (4,) * 30  # oldest evicted first
    cache.park([1] * (MIN_REUSE - 1), _cache(MIN_REUSE - 1))
    assert (1,) * (MIN_REUSE - 1) not in cache.entries


@pytest.mark.parametrize("bad", [0, -5, True, "1000", 2.5])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(UserError, match="prefix_cache"):
        PrefixCache(bad)


@pytest.mark.parametrize("drafter", [None, "suffix", "prompt-lookup"])
def test_multi_turn_output_equals_whole_prefills_and_reuses_the_earlier_turns(loaded_target, one_thread, drafter):
    """Each turn's prompt is the conversation so far (earlier prompts and answers) plus a new message: with the
    prefix cache it prefills only the new message, and its output is the output of a pipeline without one."""
    def pipeline(prefix_cache: int) -> Pipeline:
        built = build_drafter(drafter, loaded_target, None, 8) if drafter else None
        return Pipeline(loaded_target, built, prefix_cache=prefix_cache)

    cached, whole = pipeline(4096), pipeline(0)
    conversation, accepted, before = SYSTEM, 0, 0
    for i, turn in enumerate(TURNS):
        conversation += turn
        results = []
        for pipe in (cached, whole):
            run = pipe.generate if drafter else pipe.generate_plain
            results.append(run(conversation, max_new_tokens=24))
        assert results[0].token_ids == results[1].token_ids, (i, drafter)
        prompt_tokens = cached.encode(conversation).input_ids.numel()
        if i:  # at least the last prompt came from the cache (and the answer, as far as its text tokenizes alike)
            assert before - 2 <= cached.runner.reused < prompt_tokens
        assert whole.runner.reused == 0
        accepted += results[0].stats.num_accepted_tokens if drafter else 0
        conversation += results[0].text + " "
        before = prompt_tokens
    assert drafter is None or accepted > 0


def test_a_request_after_another_prefix_takes_the_best_entry(loaded_target, one_thread):
    """Two alternating conversations: each turn finds its own conversation's entry, not the most recent one."""
    pipe, whole = (Pipeline(loaded_target, None, prefix_cache=prefix) for prefix in (4096, 0))
    conversations = [SYSTEM + "Alpha. ", "Other system text, long enough to be kept as an entry of its own. "]
    before = [0, 0]  # each conversation's previous prompt length
    for turn in TURNS:
        for c in range(2):
            conversations[c] += turn
            got, want = (p.generate_plain(conversations[c], max_new_tokens=12) for p in (pipe, whole))
            assert got.token_ids == want.token_ids
            assert pipe.runner.reused >= before[c] - 2  # its own conversation's entry, though the other ran last
            before[c] = len(pipe.encode(conversations[c]).input_ids)
            conversations[c] += got.text
    assert min(before) > 3 * MIN_REUSE


def test_a_failed_generation_leaves_nothing_stale(loaded_target, one_thread):
    """A generation stopped mid-way (an error in a callback) drops the cache; the next request prefills whole."""
    pipe, whole = (Pipeline(loaded_target, build_drafter("suffix", loaded_target, None, 8), prefix_cache=p)
                   for p in (4096, 0))

    def fail(_text: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pipe.generate(SYSTEM + TURNS[0], max_new_tokens=24, on_text=fail)
    got = pipe.generate(SYSTEM + TURNS[0], max_new_tokens=24)
    assert pipe.runner.reused == 0 and got.token_ids == whole.generate(SYSTEM + TURNS[0], max_new_tokens=24).token_ids


def test_what_cannot_use_it_is_refused(loaded_target):
    class ReadsHiddenStates(DrafterBase):  # as EAGLE's heads do, over every prompt row
        name, hidden_layers = "head", (1,)

    for drafter in (build_drafter("sparse", loaded_target, None, 4), ReadsHiddenStates()):
        with pytest.raises(UserError, match="prefix_cache does not combine"):
            Pipeline(loaded_target, drafter, prefix_cache=1024)
    with pytest.raises(UserError, match="not with compile"):
        Pipeline(loaded_target, None, compiled=True, prefix_cache=1024)
    with pytest.raises(UserError, match="prefix_cache must be"):
        sparrow.load("no-such-model", drafter="suffix", prefix_cache=-1)


def test_it_keeps_no_more_than_its_bound(loaded_target, one_thread):
    pipe = Pipeline(loaded_target, None, prefix_cache=64)
    for i in range(6):
        pipe.generate_plain(f"{SYSTEM} request {i}", max_new_tokens=8)
    cache = pipe.runner.prefix_cache
    assert cache.tokens <= 64 and all(isinstance(k, tuple) for k in cache.entries)
    assert all(c.get_seq_length() == len(k) for k, c in cache.entries.items())


@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "draft-model"])
def test_batched_turns_take_their_prefix_from_finished_sequences(loaded_target, one_thread, drafter):
    """The server's path: three conversations run together in a Batch; each finished sequence hands its cache to the
    pipeline's prefix cache (`release(keep=True)`), so each next turn prefills only its new message, alone (the
    turns without a kept prefix still prefill together), and every output equals a pipeline without the cache."""
    def pipeline(prefix_cache: int) -> Pipeline:
        draft = loaded_target if drafter == "draft-model" else None  # itself as the draft: every draft accepted
        built = build_drafter(drafter, loaded_target, draft, 4) if drafter else None
        return Pipeline(loaded_target, built, prefix_cache=prefix_cache)

    cached, whole = pipeline(4096), pipeline(0)
    conversations = [SYSTEM + turn for turn in TURNS]
    before, accepted = [0, 0, 0], 0
    for turn in range(3):
        batch = Batch(cached.target.model, BatchPolicy(adaptive=False))
        gens = [cached.sequence(c, max_new_tokens=16, plain=drafter is None) for c in conversations]
        calls = count_forwards(loaded_target.model)
        try:
            batch.add(*gens)
        finally:
            del loaded_target.model.forward
        assert calls["forwards"] == (1 if turn == 0 else 3)  # first turn: one shared prefill; then each alone
        while len(batch):
            batch.step()
        for i, gen in enumerate(gens):
            got = cached.result(gen)
            run = whole.generate if drafter else whole.generate_plain
            assert got.token_ids == run(conversations[i], max_new_tokens=16).token_ids, (turn, i, drafter)
            prompt_tokens = gen.prompt.input_ids.numel()
            assert (gen.target.reused == 0) if turn == 0 else (before[i] - 2 <= gen.target.reused < prompt_tokens)
            if drafter == "draft-model":  # the draft model keeps its own: its lazy prefill takes the earlier turns
                draft = gen.drafter.draft
                assert (draft.reused == 0) if turn == 0 else (before[i] - 2 <= draft.reused < prompt_tokens)
            accepted += got.stats.num_accepted_tokens
            cached.release(gen, keep=True)
            before[i] = prompt_tokens
            conversations[i] += got.text + " Next: "
    assert len(cached.runner.prefix_cache.entries) >= 3  # every finished turn was kept (a copied-from one stays)
    if drafter == "draft-model":  # one store for every fork of the drafter
        assert len(cached.drafter.draft.prefix_cache.entries) >= 3
        assert all(fork.draft.prefix_cache is cached.drafter.draft.prefix_cache for fork in cached._forks)
    assert drafter is None or accepted > 0


def test_a_draft_model_takes_its_prefix_from_the_last_generation(loaded_target, one_thread):
    """One generation at a time: the draft model's cache of the last conversation is kept too, so the next turn's
    draft prefill takes it; the output is the output without a prefix cache, with drafts accepted."""
    cached, whole = (Pipeline(loaded_target, build_drafter("draft-model", loaded_target, loaded_target, 4),
                              prefix_cache=p) for p in (4096, 0))
    conversation, before = SYSTEM + TURNS[0], 0
    for turn in range(3):
        got = cached.generate(conversation, max_new_tokens=16)
        assert got.token_ids == whole.generate(conversation, max_new_tokens=16).token_ids
        assert got.stats.num_accepted_tokens > 0
        prompt_tokens = cached.encode(conversation).input_ids.numel()
        assert (cached.drafter.draft.reused == 0) if turn == 0 else (before - 2 <= cached.drafter.draft.reused)
        before, conversation = prompt_tokens, conversation + got.text + " Next: "


def test_a_sequence_released_without_keep_leaves_nothing(loaded_target, one_thread):
    """A sequence dropped after a failure (`release` without keep) is not kept: the same prompt prefills whole."""
    pipe = Pipeline(loaded_target, None, prefix_cache=4096)
    gen = pipe.sequence(SYSTEM + TURNS[0], max_new_tokens=8, plain=True)
    batch = Batch(pipe.target.model, BatchPolicy(adaptive=False))
    batch.add(gen)
    batch.step()
    batch.remove(gen)
    pipe.release(gen)
    assert not pipe.runner.prefix_cache.entries
    again = pipe.sequence(SYSTEM + TURNS[0] + " more", max_new_tokens=8, plain=True)
    assert again.target.cached_prefix(again.prompt) == 0

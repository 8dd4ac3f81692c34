"""Sparse-to-Dense self-draft ("sparse"): lossless, selection shape rules, the capture wrapper's bit-identity,
sampling distribution, and argument errors. Tiny float32 models; prompts long enough that the selection drops
most of the prompt KV."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.drafters import REGISTRY, build_drafter
from sparrow.drafters.kv.selection import TopKAttention, attention_scores, kept_positions
from sparrow.drafters.sparse import SparseDrafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.runtime.attention import capture as attention_capture
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Prompt
from sparrow.verifiers import RejectionVerifier

LONG = ("Paris is the capital of France. Berlin is the capital of Germany. The quick brown fox jumps over "
        "the lazy dog. ") * 12 + "def add(a, b):"
PROMPTS = ["The quick brown fox", LONG]


@pytest.fixture(scope="module")
def sparse_target(arch, tokenizer) -> LoadedModel:
    """A private copy: building the drafter installs the capture wrapper on its model."""
    return LoadedModel(tiny_model(arch, seed=0), tokenizer, "tiny")


@pytest.fixture(scope="module")
def plain(sparse_target) -> dict[str, list[int]]:
    pipe = Pipeline(sparse_target, None)
    return {p: pipe.generate_plain(p, max_new_tokens=30).token_ids for p in PROMPTS}


def check_lossless(target, plain, drafter) -> tuple[int, int]:
    pipe = Pipeline(target, drafter)
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=30)
        assert result.token_ids == plain[prompt], (prompt[:20], result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    return drafted, accepted


def test_registered():
    assert "sparse" in REGISTRY and not REGISTRY["sparse"].needs_draft_model


@pytest.mark.parametrize("budget, adaptive", [(4, False), (16, True), (0.25, False)])
def test_greedy_equals_plain(sparse_target, plain, budget, adaptive):
    drafter = build_drafter("sparse", sparse_target, None, 4, adaptive=adaptive, budget=budget, sinks=2, window=8)
    drafted, accepted = check_lossless(sparse_target, plain, drafter)
    assert 0 < accepted <= drafted
    n = len(sparse_target.tokenizer(PROMPTS[-1])["input_ids"])
    assert drafter.kept[0].shape[1] < n  # the last prompt's selection really dropped entries


def test_full_budget_draft_is_the_target(sparse_target, plain):
    """Keeping every entry makes the draft the target itself: every draft accepted (checks positions and the
    per-round KV copy from the target cache)."""
    drafter = build_drafter("sparse", sparse_target, None, 4, budget=1.0)
    drafted, accepted = check_lossless(sparse_target, plain, drafter)
    assert accepted == drafted > 0


def test_custom_selector_and_span_stay_lossless(sparse_target, plain):
    first = lambda queries, keys, budget, span, *, layer, scaling: (  # noqa: E731
        torch.arange(span[0], span[0] + budget, device=keys.device).expand(keys.shape[0], -1))
    drafter = build_drafter("sparse", sparse_target, None, 3, budget=8, selector=first,
                            span=lambda prompt: (1, prompt.input_ids.numel() // 2))
    drafted, accepted = check_lossless(sparse_target, plain, drafter)
    assert 0 < accepted <= drafted


def test_selection_size_sinks_and_window(sparse_target):
    pipe = Pipeline(sparse_target, build_drafter("sparse", sparse_target, None, 2, budget=10, sinks=3, window=6))
    pipe.generate(LONG, max_new_tokens=2)
    n = len(sparse_target.tokenizer(LONG)["input_ids"])
    kv_heads = sparse_target.model.config.num_key_value_heads
    for idx in pipe.drafter.kept:
        assert idx.shape == (kv_heads, 3 + 10 + 6)
        for row in idx.tolist():
            assert row == sorted(set(row))
            assert row[:3] == [0, 1, 2] and row[-6:] == list(range(n - 6, n))


def test_selection_restricted_to_span(sparse_target):
    start, end = 40, 90
    pipe = Pipeline(sparse_target, build_drafter("sparse", sparse_target, None, 2, budget=5, span=(start, end)))
    pipe.generate(LONG, max_new_tokens=2)
    n = len(sparse_target.tokenizer(LONG)["input_ids"])
    outside = set(range(start)) | set(range(end, n))
    for idx in pipe.drafter.kept:
        for row in idx.tolist():
            assert outside <= set(row)  # everything outside the span stays
            inside = [i for i in row if start <= i < end]
            assert len(inside) == 5 and len(row) == len(outside) + 5


def test_top_k_picks_the_most_attended_keys():
    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(4, 3, 8, generator=g), torch.randn(2, 30, 8, generator=g)
    keys[:, 7] = queries[:, -1].reshape(2, 2, 8).mean(1) * 4  # key 7 gets most attention for every kv head
    chosen = TopKAttention()(queries, keys, 2, (5, 20), layer=0, scaling=8 ** -0.5)
    assert chosen.shape == (2, 2) and (chosen[:, 0] <= chosen[:, 1]).all() and (chosen == 7).any(dim=1).all()
    scores = attention_scores(queries, keys, 8 ** -0.5)
    assert scores.shape == (2, 30) and torch.allclose(scores.sum(-1), torch.ones(2))  # mean of softmaxes


def test_kept_positions_without_drop_is_everything():
    keys = torch.randn(2, 12, 4)
    idx = kept_positions(TopKAttention(), torch.randn(4, 3, 4), keys, 100, 2, 3, None, layer=0, scaling=0.5)
    assert idx.tolist() == [list(range(12))] * 2


@pytest.mark.parametrize("n, span", [(1, None), (2, None), (3, (0, 3)), (5, None), (5, (1, 5))])
def test_kept_positions_of_a_prompt_shorter_than_sinks_and_window_is_everything(n, span):
    """sinks 4 + window 3 > n: nothing is left to select in (this used to raise from torch.arange)."""
    idx = kept_positions(TopKAttention(), torch.randn(4, min(n, 3), 4), torch.randn(2, n, 4), 2, 4, 3, span, layer=0,
                         scaling=0.5)
    assert idx.tolist() == [list(range(n))] * 2


def test_capture_wrapper_is_bit_identical(arch, tokenizer):
    """Same weights, sdpa vs the capture wrapper with an active capture: identical logits, prefill and decode."""
    base = tiny_model(arch, seed=3)
    wrapped = copy.deepcopy(base)
    capture = attention_capture.QueryCapture(wrapped, window=5).start()
    try:
        assert wrapped.config._attn_implementation == attention_capture.IMPLEMENTATION
        ids = torch.tensor(tokenizer(LONG)["input_ids"])
        runs = []
        for model in (base, wrapped):
            cm = CachedModel(model)
            logits = [cm.prefill(Prompt(ids)).logits[-1]]
            token = logits[0].argmax()
            for step in range(3):  # feed 1, 2, 3 tokens
                logits.append(cm.forward(token.repeat(step + 1)).logits)
                token = logits[-1][-1].argmax()
            runs.append(logits)
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        assert capture.layers[0].queries.shape == (4, 5, 16) and capture.layers[0].length == ids.numel()
    finally:
        capture.stop()


def test_sampled_drafts_return_q(sparse_target):
    """Sampling: draft tokens are samples of q and q is returned (the verifier then uses min(1, p/q))."""
    drafter = SparseDrafter(sparse_target.model, num_draft_tokens=3, budget=4)
    target = CachedModel(sparse_target.model)
    ids = torch.tensor(sparse_target.tokenizer(LONG)["input_ids"])
    with drafter.watch_prefill(target):  # as the engine runs it: the capture records this prefill's queries
        target.prefill(Prompt(ids))
    drafter.prefill(Prompt(ids), target)
    sampling = SamplingConfig(temperature=0.9, top_k=5)
    draft = drafter.propose(torch.cat([ids, ids[-1:]]), 3, sampling, torch.Generator().manual_seed(0))
    assert draft.probs is not None and draft.probs.shape == (3, target.vocab_size)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(3))
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens.tolist()))
    assert ((draft.probs > 0).sum(-1) <= 5).all()
    greedy = drafter.propose(torch.cat([ids, ids[-1:]]), 3, SamplingConfig(), None)
    assert greedy.probs is None and target.length == ids.numel()  # the target cache is never touched


def test_sampling_preserves_the_target_distribution(tokenizer):
    """One speculative round after a fixed first token, many rounds: the emitted token follows the target's p
    (top-k 3 at temperature 1, so 3 bins), while the sparse draft's q differs (some drafts rejected). Cheap:
    one architecture; the verifier's exactness itself is tested in test_distribution.py."""
    model = tiny_model("llama", seed=0)
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    drafter = SparseDrafter(model, num_draft_tokens=1, budget=4, window=4)
    target, verifier = CachedModel(model), RejectionVerifier()
    ids = torch.tensor(tokenizer(LONG)["input_ids"])
    with drafter.watch_prefill(target):
        first = target.prefill(Prompt(ids)).logits[-1].argmax().reshape(1)
    drafter.prefill(Prompt(ids), target)
    committed = torch.cat([ids, first])
    p = S.probs(target.forward(first).logits[-1], sampling)
    target.rewind(ids.numel())
    g = torch.Generator().manual_seed(0)
    n, counts, accepted = 600, torch.zeros_like(p), 0
    for _ in range(n):
        draft = drafter.propose(committed, 1, sampling, g)
        verdict = verifier.verify(draft, target.forward(torch.cat([first, draft.tokens])).logits, sampling, g)
        target.rewind(ids.numel())
        counts[verdict.tokens[0]] += 1
        accepted += verdict.num_accepted
    assert 0 < accepted < n
    bound = 6 * (n * p * (1 - p)).sqrt() + 5
    assert bool(((counts - n * p).abs() <= bound).all()), (counts[p > 0], n * p[p > 0])


@pytest.mark.parametrize("options, message", [
    (dict(budget=0), "budget"), (dict(budget=1.5), "budget"), (dict(budget=-0.1), "budget"),
    (dict(budget="8"), "budget"),
    (dict(window=0), "window"), (dict(sinks=-1), "sinks"), (dict(span=(5, 2)), "span"), (dict(span=(-1, 4)), "span"),
    (dict(span=[1, 2]), "span"),
])
def test_bad_arguments(sparse_target, options, message):
    with pytest.raises(ValueError, match=message):
        build_drafter("sparse", sparse_target, None, 4, **options)


def test_span_beyond_prompt_is_an_error(sparse_target):
    pipe = Pipeline(sparse_target, build_drafter("sparse", sparse_target, None, 2, span=(0, 10_000)))
    with pytest.raises(ValueError, match="span"):
        pipe.generate("The quick brown fox", max_new_tokens=2)


def test_capture_switches_the_model_only_around_prefills(arch, tokenizer):
    """The drafter switches its target to the capture wrapper only for the target's prefill of a speculative
    generation (the engine runs it inside `watch_prefill`) and installs no hooks: plain decoding and the user's
    own forwards run sdpa and are not recorded; a stopped capture switches the model back (the context-manager
    form too)."""
    model = tiny_model(arch, seed=4)
    target = LoadedModel(model, tokenizer, "tiny")
    seen = []
    probe = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(model.config._attn_implementation))
    drafter = build_drafter("sparse", target, None, 4, budget=4, sinks=2, window=8)
    assert model.config._attn_implementation == "sdpa"
    result = Pipeline(target, drafter).generate(LONG, max_new_tokens=6)
    assert result.new_tokens == 6 and model.config._attn_implementation == "sdpa"
    assert seen[0] == attention_capture.IMPLEMENTATION and set(seen[1:]) == {"sdpa"}  # prefill, then decoding
    seen.clear()
    Pipeline(target, None).generate_plain(LONG, max_new_tokens=2)
    assert set(seen) == {"sdpa"} and drafter.capture.layers == {}  # not recorded
    probe.remove()
    assert not model._forward_hooks and not model._forward_pre_hooks
    with attention_capture.QueryCapture(model, window=4) as capture:
        assert capture.active and model.config._attn_implementation == attention_capture.IMPLEMENTATION
    assert not capture.active and model.config._attn_implementation == "sdpa"

"""Batched speculative decoding (sparrow.decoding.batch): each generation in a batch is exactly what it would be alone.

a) Greedy, float32, tiny Llama: every drafter (chains, and trees where it drafts them) x verifier runs five
   prompts of different lengths and budgets in one batch, two of them joining after two steps (requests that join
   together prefill in one shared target forward); each output equals plain greedy decoding token for token, and
   drafts were accepted. The same with plain decoding in a batch, with the draft cap of the batch policy, and with
   sequences leaving early (removed). A shared prefill gives each prompt its own prefill's rows and cache.
b) Sampling: seeded requests in a batch give the tokens they give alone; unseeded requests (rejection
   sampling) in a mixed batch follow the target's joint distribution of two tokens, checked against the
   exact table of a tiny 8-token model; accepting every draft (a known-wrong rule) fails the same check.
(The batch policy's own rule, on fake costs: tests/policy/test_batch_policy.py.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from batching import BUDGETS, PROMPTS, count_forwards, run_batch
from conftest import perturbed, tiny_model, tiny_tokenizer
from test_degenerate import SPECS

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.decoding.batch import Batch, measure_rows, prefill_groups, prefill_together, score_batch, supports_batching
from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy
from sparrow.types import Prompt, Verdict

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = dict(tree_budget=8, tree_topk=2, tree_depth=3)


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    """(target, a perturbed copy as the draft): what test_degenerate's SPECS build drafters from."""
    tokenizer = tiny_tokenizer()
    target = LoadedModel(tiny_model("llama", seed=0), tokenizer, "tiny")
    return target, LoadedModel(perturbed(target.model, 0.05, seed=1), tokenizer, "close")


@pytest.fixture(scope="module")
def plain_outputs(pair) -> list[list[int]]:
    pipe = Pipeline(pair[0], None)
    return [pipe.generate_plain(p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, BUDGETS)]


CASES = [(label, tree) for label, spec in SPECS.items() for tree in ([False, True] if spec.trees else [False])]


@pytest.mark.parametrize("verifier", ["auto", "rejection"])
@pytest.mark.parametrize("label,tree", CASES, ids=[f"{label}{'-tree' if tree else ''}" for label, tree in CASES])
def test_batched_greedy_equals_plain_for_every_drafter(pair, plain_outputs, label, tree, verifier):
    # adaptive cross-vocab: few drafts here
    drafter = SPECS[label].build(pair, 4, label != "cross-vocab", TREE if tree else {})
    pipe = Pipeline(pair[0], drafter, verifier)
    results = run_batch(pipe)
    for prompt, result, expected in zip(PROMPTS, results, plain_outputs):
        assert result.token_ids == expected, (label, tree, prompt)
    assert sum(r.stats.num_accepted_tokens for r in results) > 0, "no draft was accepted: nothing was tested"
    if tree and label != "auto":
        assert sum(r.stats.tree_steps for r in results) > 0


@pytest.mark.parametrize("quant", ["int8", "w8a8"])
def test_a_quantized_target_batched_equals_its_own_plain_decoding(pair, quant):
    """`sparrow serve --quant`: a batch over a quantized target (float32 activations) gives each sequence the
    quantized target's own greedy output, with drafts accepted (lossless relative to the quantized target)."""
    from sparrow.models.quantization import quantize_model

    target, close = pair
    quantized = LoadedModel(quantize_model(target.model, quant), target.tokenizer, f"tiny-{quant}")
    alone = Pipeline(quantized, None)
    expected = [alone.generate_plain(p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, BUDGETS)]
    results = run_batch(Pipeline(quantized, build_drafter("draft-model", quantized, close, 4, adaptive=False)))
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_accepted_tokens for r in results) > 0, "no draft was accepted: nothing was tested"


def test_a_quantized_target_prefills_together_with_its_dense_model_as_alone(pair):
    """A quantized target prefills with its dense source model (`sparrow.models.quantization.PREFILL`), alone and in
    a shared prefill of prompts of several lengths: each sequence still gets its own plain decoding, drafts
    accepted."""
    from sparrow.models.quantization import quantize_model

    target, close = pair
    quantized = LoadedModel(quantize_model(target.model, "int8"), target.tokenizer, "tiny-int8")
    prompts = ["Paris is the capital of France. " * n + "Paris is" for n in (5, 6, 8)]
    lengths = [len(target.tokenizer(p).input_ids) for p in prompts]
    assert prefill_groups(lengths) == [[0, 1, 2]], lengths  # one shared prefill
    alone = Pipeline(quantized, None)
    expected = [alone.generate_plain(p, max_new_tokens=12).token_ids for p in prompts]
    pipe = Pipeline(quantized, build_drafter("draft-model", quantized, close, 4, adaptive=False))
    batch = Batch(quantized.model, BatchPolicy(adaptive=False))
    gens = [pipe.sequence(p, max_new_tokens=12) for p in prompts]
    batch.add(*gens)
    while len(batch):
        batch.step()
    results = [pipe.result(gen) for gen in gens]
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_accepted_tokens for r in results) > 0, "no draft was accepted: nothing was tested"


def test_draft_models_share_their_forwards_and_draft_as_they_would_alone(pair, plain_outputs):
    """Fixed k, greedy: each sequence drafts and accepts exactly what it does alone, with fewer draft forwards."""
    target, close = pair
    pipe = Pipeline(target, build_drafter("draft-model", target, close, 4, adaptive=False))
    calls = Counter()
    forward = close.model.forward

    def counted(*args, **kwargs):
        calls["forwards"] += 1
        return forward(*args, **kwargs)

    close.model.forward = counted
    try:
        alone = [pipe.generate(p, max_new_tokens=n) for p, n in zip(PROMPTS, BUDGETS)]
        forwards_alone, calls["forwards"] = calls["forwards"], 0
        together = run_batch(pipe)
    finally:
        del close.model.forward
    assert [r.token_ids for r in together] == plain_outputs
    for a, b in zip(alone, together):
        assert (a.stats.num_draft_tokens, a.stats.num_accepted_tokens) == (b.stats.num_draft_tokens,
                                                                           b.stats.num_accepted_tokens)
    assert calls["forwards"] < 0.6 * forwards_alone, (calls["forwards"], forwards_alone)


def test_a_draft_is_prefilled_only_once_it_drafts(pair, plain_outputs):
    """In a batch, a draft model's prompt prefill waits for its first draft: never drafting, never paid."""

    class NeverDraft(BatchPolicy):
        def cap(self, seqs, limits, behind=()):
            return 0

    pipe = Pipeline(pair[0], SPECS["draft-model"].build(pair, 4, False, {}))
    batch = Batch(pipe.target.model, NeverDraft())
    gens = [pipe.sequence(p, max_new_tokens=n) for p, n in zip(PROMPTS, BUDGETS)]
    for gen in gens:
        batch.add(gen)
    while len(batch):
        batch.step()
    assert all(gen.drafter.draft.cache is None for gen in gens)
    assert [pipe.result(gen).token_ids for gen in gens] == plain_outputs
    for gen in gens:
        pipe.release(gen)
    assert run_batch(pipe)[0].stats.num_accepted_tokens > 0  # the same forks draft once the policy lets them


def test_a_step_whose_drafts_catch_up_is_no_measure_of_the_draft_cost(pair, plain_outputs):
    """The first drafting step prefills every draft lazily (and a draft that sat out steps feeds them first): its
    phase is timed, but not as a draft position's cost, which it would price far too high (at 8 streams one such step
    once kept a server from drafting for good). Steps whose drafts are in step are measured."""

    class Recording(BatchPolicy):
        def observe(self, tokens, seconds, drafting=0, positions=0, draft_seconds=0.0):
            self.seen.append(drafting)
            super().observe(tokens, seconds, drafting, positions, draft_seconds)

    policy = Recording(adaptive=False)
    policy.seen = []
    pipe = Pipeline(pair[0], SPECS["draft-model"].build(pair, 4, False, {}))
    batch = Batch(pipe.target.model, policy)
    gens = [pipe.sequence(p, max_new_tokens=n) for p, n in zip(PROMPTS, BUDGETS)]
    batch.add(*gens)
    while len(batch):
        batch.step()
    assert policy.seen[0] == 0  # every draft prefilled its prompt in that step
    assert any(policy.seen[1:])  # in step afterwards: measured
    assert [pipe.result(gen).token_ids for gen in gens] == plain_outputs
    for gen in gens:
        pipe.release(gen)


def test_plain_decoding_in_a_batch_equals_plain(pair, plain_outputs):
    pipe = Pipeline(pair[0], SPECS["draft-model"].build(pair, 4, True, {}))
    results = run_batch(pipe, plain=True)
    assert [r.token_ids for r in results] == plain_outputs
    assert all(r.stats.num_draft_tokens == 0 for r in results)


def test_the_batch_policy_cap_changes_lengths_not_tokens(pair, plain_outputs):
    """A cost line that makes long drafts expensive: the cap shortens drafts, the output stays the same."""
    policy = BatchPolicy()
    policy.seed([(1, 0.010), (8, 0.030), (64, 0.200)])
    pipe = Pipeline(pair[0], SPECS["prompt-lookup"].build(pair, 8, False, {}))
    results = run_batch(pipe, policy)
    assert [r.token_ids for r in results] == plain_outputs
    assert sum(r.stats.num_accepted_tokens for r in results) > 0


def test_a_removed_sequence_leaves_the_others_exact(pair, plain_outputs):
    pipe = Pipeline(pair[0], SPECS["draft-model"].build(pair, 4, False, {}))
    batch = Batch(pipe.target.model, BatchPolicy(adaptive=False))
    gens = [pipe.sequence(p, max_new_tokens=n) for p, n in zip(PROMPTS, BUDGETS)]
    for gen in gens:
        batch.add(gen)
    batch.step()
    batch.remove(gens[1])  # its client went away
    while len(batch):
        batch.step()
    for i, gen in enumerate(gens):
        if i != 1:
            assert pipe.result(gen).token_ids == plain_outputs[i]


@pytest.mark.parametrize("label", ["draft-model", "sparse"])
def test_requests_that_join_together_prefill_in_one_target_forward(pair, plain_outputs, label):
    """Three prompts of different lengths: one shared target prefill forward (a drafter that watches the target's
    prefill, sparse, prefills alone), and each output is its plain output."""
    pipe = Pipeline(pair[0], SPECS[label].build(pair, 4, False, {}))
    batch = Batch(pipe.target.model, BatchPolicy(adaptive=False))
    gens = [pipe.sequence(p, max_new_tokens=n) for p, n in zip(PROMPTS[:3], BUDGETS[:3])]
    calls = count_forwards(pair[0].model)
    try:
        batch.add(*gens)
    finally:
        del pair[0].model.forward
    assert calls["forwards"] == (1 if label == "draft-model" else 3)
    assert all(gen.prefill_seconds > 0 and gen.committed.numel() == gen.prompt.input_ids.numel() + 1 for gen in gens)
    while len(batch):
        batch.step()
    assert [pipe.result(gen).token_ids for gen in gens] == plain_outputs[:3]
    for gen in gens:
        pipe.release(gen)


def test_a_shared_prefill_gives_each_prompt_its_own_prefill(pair):
    """Left-padded prompts in one forward: each runner's last-row logits, every prompt row's hidden states and its
    cache equal its own prefill's (float32)."""
    from sparrow.runtime.cached_model import CachedModel

    model, layers = pair[0].model, (0, 1, 2)
    prompts = [pair[0].tokenizer(p, return_tensors="pt").input_ids[0] for p in PROMPTS]
    shared = [CachedModel(model) for _ in prompts]
    outs = prefill_together(model, shared, prompts, layers)
    for runner, prompt, out in zip(shared, prompts, outs):
        alone = CachedModel(model)
        expected = alone.prefill(Prompt(prompt), layers)
        assert out.logits.shape == expected.logits.shape and out.hidden.shape == expected.hidden.shape
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.hidden, expected.hidden, rtol=1e-4, atol=1e-4)
        assert runner.length == alone.length == prompt.numel()
        for mine, theirs in zip(runner.cache.layers, alone.cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-4)


def test_prefill_groups_keep_padding_and_size_bounded():
    assert prefill_groups([5, 4, 6]) == [[1, 0, 2]]  # similar lengths: one forward, shortest first
    assert prefill_groups([3, 100, 4, 50]) == [[0, 2], [3, 1]]  # 3 x 50 > 2 x 57 padded positions: a new group
    assert prefill_groups([3000, 3000]) == [[0], [1]]  # 6000 positions > MAX_PREFILL_TOKENS: alone
    assert prefill_groups([]) == []


def test_measure_rows_times_batched_one_token_forwards(pair):
    """The seed of a served batch's draft cost table: a forward of one token in each of n rows, per n."""
    points = measure_rows(pair[1].model, rows=(1, 2, 4), context=8)
    assert [n for n, _ in points] == [1, 2, 4] and all(seconds > 0 for _, seconds in points)
    policy = BatchPolicy()
    policy.seed([(1, 0.01)], points)
    assert policy.draft.known


def test_forked_drafters_share_the_models_but_not_the_state(pair):
    drafter = SPECS["draft-model"].build(pair, 4, True, {})
    fork = drafter.fork()
    assert fork is not drafter and fork.draft is not drafter.draft  # its own cache wrapper ...
    assert fork.draft.model is drafter.draft.model  # ... over the same weights
    assert fork.length is not drafter.length


def test_models_batching_cannot_run_are_named():
    from conftest import tiny_gemma3

    assert supports_batching(tiny_model("llama", 0)) is None
    assert "sliding" in supports_batching(tiny_gemma3(num_layers=2))


# --- b) sampling ----------------------------------------------------------------------------------------


def test_seeded_requests_in_a_batch_give_what_they_give_alone(pair):
    # a fixed k: after five generations alone an adaptive drafter may have measured that drafting does not pay
    # with a draft as large as this target, and the batch would then test nothing
    pipe = Pipeline(pair[0], SPECS["draft-model"].build(pair, 4, False, {}))
    options = dict(temperature=0.8, seed=7)
    alone = [pipe.generate(p, max_new_tokens=n, **options).token_ids for p, n in zip(PROMPTS, BUDGETS)]
    results = run_batch(pipe, **options)
    assert [r.token_ids for r in results] == alone
    assert sum(r.stats.num_accepted_tokens for r in results) > 0
    other = run_batch(pipe, temperature=0.8, seed=8)  # negative control: another seed, other tokens
    assert [r.token_ids for r in other] != alone


V, N, SAMPLING = 8, 2_000, SamplingConfig(temperature=1.5)
TOY_PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def toy() -> tuple[LoadedModel, LoadedModel]:
    """An 8-token target with a known next-token table, and a draft that differs from it."""
    target = tiny_model("llama", seed=3, vocab_size=V)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # back to moderate logits: every token has mass
    draft = tiny_model("llama", seed=4, vocab_size=V)  # an unrelated draft: accepting it all shows
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.25)
    tokenizer = tiny_tokenizer()
    return LoadedModel(target, tokenizer, "toy"), LoadedModel(draft, tokenizer, "toy-draft")


def exact_joint(model: torch.nn.Module) -> torch.Tensor:
    """[V, V]: P(t1 | prompt) P(t2 | prompt, t1)."""
    with torch.no_grad():
        first = S.probs(model(torch.tensor([TOY_PROMPT])).logits[0, -1], SAMPLING)
        rows = torch.tensor([TOY_PROMPT + [t] for t in range(V)])
        second = S.probs(model(rows).logits[:, -1], SAMPLING)
    return first[:, None] * second


def sampled_joint(toy, accept_everything: bool = False) -> torch.Tensor:
    """Counts of (t1, t2) over N generations of TOY_PROMPT, four per batch beside a sequence of another prompt."""
    target, draft = toy
    pipe = Pipeline(target, build_drafter("draft-model", target, draft, 2, adaptive=False), "rejection")
    pipe.eos_token_ids = lambda: frozenset()  # the tokenizer's EOS id is one of the 8 tokens: never stop early
    counts = torch.zeros(V, V)
    torch.manual_seed(0)  # unseeded requests draw from the global generator; fixed here for a repeatable test
    for _ in range(N // 4):
        batch = Batch(target.model, BatchPolicy(adaptive=False))
        gens = [pipe.sequence(TOY_PROMPT, max_new_tokens=3, temperature=SAMPLING.temperature) for _ in range(4)]
        other = pipe.sequence([5, 6], max_new_tokens=5, temperature=SAMPLING.temperature)
        for gen in [other, *gens]:
            batch.add(gen)
            if accept_everything and gen.verifier is not None:
                gen.verifier = AcceptAll()
        while len(batch):
            batch.step()
        for gen in gens:
            tokens = gen.stopper.tokens
            counts[tokens[0], tokens[1]] += 1
        for gen in [other, *gens]:
            pipe.release(gen)
    return counts


class AcceptAll:
    """Negative control: every draft token is accepted, so the output follows the draft."""

    def verify(self, draft, logits, sampling, generator) -> Verdict:
        bonus = S.sample(S.probs(logits[-1], sampling), generator)
        return Verdict(torch.cat([draft.tokens, bonus.reshape(1)]), len(draft))


def matches(counts: torch.Tensor, expected: torch.Tensor) -> bool:
    """Each bin within 6 standard deviations (+ 5) of its expectation (test_distribution's bound)."""
    mean = N * expected
    return bool(((counts - mean).abs() <= 6 * (mean * (1 - expected)).sqrt() + 5).all())


def test_unseeded_batched_sampling_follows_the_target_distribution(toy):
    expected = exact_joint(toy[0].model)
    assert matches(sampled_joint(toy), expected)


def test_negative_control_accepting_every_draft_fails(toy):
    expected = exact_joint(toy[0].model)
    assert not matches(sampled_joint(toy, accept_everything=True), expected)


def test_score_batch_rows_equal_single_forwards(pair):
    """The shared forward's logits for each row equal that sequence's own forward (float32)."""
    pipe = Pipeline(pair[0], SPECS["draft-model"].build(pair, 4, True, {}))
    gens = [pipe.sequence(p, max_new_tokens=8) for p in PROMPTS[:3]]
    batch = Batch(pipe.target.model)
    for gen in gens:
        batch.add(gen)
    drafts = [gen.drafter.propose(gen.committed, 3, gen.sampling, None) for gen in gens]
    bases = [gen.target.length for gen in gens]
    outs = score_batch(pipe.target.model, gens, drafts)
    for gen, draft, out, base in zip(gens, drafts, outs, bases):
        gen.target.rewind(base)
        alone = gen.target.forward(torch.cat([gen.committed[-1:], draft.tokens]))
        torch.testing.assert_close(out.logits, alone.logits, rtol=1e-4, atol=1e-4)
    assert Counter(len(d) for d in drafts)  # drafts of whatever lengths the drafter chose


def test_a_probe_drafts_only_with_drafts_nearly_in_step():
    """`probe_limits`: drafts within MAX_SHARED_CATCH_UP tokens keep their limit, the rest sit the probe out; when
    every draft is far behind, the least behind one probes alone; sequences with no drafter or no limit (None) stay
    at 0."""
    from sparrow.decoding.batch import MAX_SHARED_CATCH_UP, probe_limits

    near, far = MAX_SHARED_CATCH_UP, MAX_SHARED_CATCH_UP + 1
    assert probe_limits([1, far, near, None], [5, 5, 5, 0]) == [5, 0, 5, 0]
    assert probe_limits([300, far, 200], [5, 4, 5]) == [0, 4, 0]
    assert probe_limits([None, None], [3, 0]) == [0, 0]


def test_a_lazy_draft_is_far_behind_until_it_drafts(pair):
    """`DraftModelDrafter.behind`: a draft not prefilled yet lags by the whole committed text; right after a draft,
    by what that round committed at most."""
    pipe = Pipeline(pair[0], SPECS["draft-model"].build(pair, 4, False, {}))
    gen = pipe.sequence(PROMPTS[0], max_new_tokens=8)
    batch = Batch(pipe.target.model, BatchPolicy(adaptive=False))
    batch.add(gen)
    assert gen.drafter.behind(gen.committed) == gen.committed.numel()
    batch.step()
    assert 0 <= gen.drafter.behind(gen.committed) <= 5
    pipe.release(gen)

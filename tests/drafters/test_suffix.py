"""Suffix Decoding: the counted tries, the speculation rule, lossless output (chain and tree, one request, a
batch whose shared store holds other requests' outputs), the sampling distribution, and the store's bound."""

from __future__ import annotations

import pytest
import torch

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.decoding.batch import Batch
from sparrow.drafters import build_drafter
from sparrow.drafters.suffix import MATCH_BOUNDS, MatchRates, SuffixConfig, SuffixDrafter, speculate
from sparrow.drafters.suffix_tree import StoreLimits, SuffixStore, SuffixTrie, matches
from sparrow.errors import UserError
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy
from sparrow.types import Prompt, StepStats, Verdict
from sparrow.verifiers import RejectionVerifier

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]


# --- the trie -------------------------------------------------------------------------------------------------

def test_trie_counts_what_followed_each_pattern_and_forgets_removed_sequences():
    trie = SuffixTrie(depth=4)
    trie.extend(0, [1, 2, 3])
    trie.extend(0, [1, 2])  # appended one call later: the suffixes span both calls
    trie.extend(1, [9, 1, 2, 4])
    node = trie.find([1, 2])
    assert trie.count[node] == 3 and followers(trie, node) == {3: 1, 4: 1}
    assert trie.count[trie.find([3, 1, 2])] == 1 and trie.find([2, 9]) is None  # no pattern spans two sequences
    assert trie.find([1, 2, 3, 1, 2]) is None  # deeper than the trie
    trie.remove(1)
    assert followers(trie, trie.find([1, 2])) == {3: 1}
    trie.remove(0)
    assert trie.nodes == 0 and not trie.children(0)
    size = len(trie.count)
    trie.extend(2, [7, 7, 7])  # freed nodes are reused
    assert trie.nodes == 3 and len(trie.count) == size and followers(trie, trie.find([7])) == {7: 2}


def followers(trie: SuffixTrie, node: int) -> dict[int, int]:
    return {trie.token[c]: trie.count[c] for c in trie.children(node)}


def test_matches_are_the_suffixes_with_a_continuation_longest_first():
    trie = SuffixTrie(depth=8)
    context = [5, 1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2]
    trie.extend(0, context)
    assert [m for m, _ in matches(trie, context)] == [2, 1]  # "1 2" and "2" occurred before, followed by 3


def test_speculation_follows_counts_and_stops_under_the_probability_threshold():
    trie = SuffixTrie(depth=8)
    trie.extend(0, [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2])
    node = trie.find([1, 2])
    chain = speculate(trie, node, max_depth=8, min_prob=0.5, budget=8, topk=1)
    assert chain.tokens[:2] == [3, 4] and chain.parents[:2] == [-1, 0]  # 3 always; then 4 (2 of 3) over 5
    low = speculate(trie, node, max_depth=8, min_prob=0.7, budget=8, topk=1)
    assert low.tokens == [3]  # p(3, 4) = 2/3 < 0.7
    tree = speculate(trie, node, max_depth=2, min_prob=0.1, budget=8, topk=2)
    assert tree.tokens == [3, 4, 5] and tree.parents == [-1, 0, 0] and tree.first == 2
    assert tree.score == pytest.approx(1 + 2 / 3 + 1 / 3)


def test_a_chain_cut_by_the_tries_depth_continues_within_its_matchs_allowance():
    """A pattern of m tokens continues at most depth - m tokens in the trie; the chain goes on from the longest match
    of the context plus the chain so far, up to max_spec_factor x m tokens (before: 4 tokens here, from m = 2)."""
    seq = list(range(10, 40))
    drafter = SuffixDrafter(16, config=SuffixConfig(max_tree_depth=6, max_spec_factor=3.0, max_cached_requests=0))
    context = torch.tensor(seq + seq[:12])
    drafter.prefill(Prompt(context))
    draft = drafter.propose(context, 16, SamplingConfig(), torch.Generator())
    assert draft.tokens.tolist() == seq[12:27]  # m = 5 allows 15


def test_a_match_length_whose_drafts_do_not_pay_drafts_nothing_but_probes():
    """Measured costs of a float32 CPU (a 2-token verify costs 1.6 plain steps) and 1-token matches whose drafts were
    rejected: such a match drafts nothing, but for a probe now and then, while a long match still drafts (before:
    every 1-token match drafted its token)."""
    drafter = SuffixDrafter(16, adaptive=True, config=SuffixConfig(max_cached_requests=0))
    for _ in range(3):
        drafter.length.observe(StepStats(0, 0, 0.0, 0.08))
        for n, seconds in ((2, 0.135), (4, 0.14), (8, 0.155), (12, 0.16)):
            drafter.length.observe(StepStats(n, n, 1e-4 * n, seconds))
    one = torch.tensor([5, 9, 50, 51, 6, 7, 8, 11, 12, 13, 9])  # ends with 9: only "9" matched before (9 -> 50)
    drafter.prefill(Prompt(one))
    drafts = []
    for _ in range(40):  # each draft rejected
        draft = drafter.propose(one, 16, SamplingConfig(), torch.Generator())
        drafts.append(len(draft))
        if len(draft):
            drafter.observe(draft, Verdict(tokens=torch.tensor([99]), num_accepted=0), None,
                            StepStats(len(draft), 0, 1e-4, 0.125))
    assert drafts[-30:].count(1) <= 4 and drafts[-30:].count(0) >= 26, drafts  # probes only
    long = torch.tensor([5, 9, 50, 51, 52, 53, 6, 7, 5, 9, 50, 51])  # "5 9 50 51" matched: 4 tokens
    drafter.prefill(Prompt(long))
    assert drafter.propose(long, 16, SamplingConfig(), torch.Generator()).tokens.tolist()[:2] == [52, 53]


def _measured(drafter: SuffixDrafter) -> SuffixDrafter:
    """Costs of a float32 CPU (as above): a 2-token verify costs 1.7 plain steps, 13 tokens 2."""
    for _ in range(3):
        drafter.length.observe(StepStats(0, 0, 0.0, 0.08))
        for n, seconds in ((2, 0.135), (4, 0.14), (8, 0.155), (12, 0.16)):
            drafter.length.observe(StepStats(n, n, 1e-4 * n, seconds))
    return drafter


def test_match_rates_count_each_draft_position_at_the_length_it_continues():
    rates = MatchRates(prior=0.5, prior_trials=2.0, decay=1.0)
    rates.observe(1, drafted=6, accepted=2)  # lengths 1 and 2 accepted, 3 rejected, 4.. never tried
    assert rates.rates(1, 4) == pytest.approx([2 / 3, 2 / 3, 1 / 3, 0.5])
    rates.observe(9, drafted=3, accepted=3)  # a draft accepted whole: its positions 9, 10, 11, no rejection
    assert rates.rates(9, 1) == pytest.approx([(1 + 3) / (2 + 3)])
    assert MatchRates.bucket(1) == 0 and MatchRates.bucket(5) == 3 and MatchRates.bucket(100) == len(MATCH_BOUNDS) - 1


def test_a_short_match_inside_a_copy_drafts_the_long_continuation():
    """An edited word, then the copy resumes: the context's last token matches once (m = 1, Arctic's allowance 1
    token). Where long matches have proved reliable, the chain goes on to the round cap; where they have not (new
    text), the same match drafts nothing."""
    source = list(range(100, 140))
    context = torch.tensor([*source, 7, *source[:10], 99, source[11]])  # the copy, then an edit at source[10]
    drafted = {}
    for reliable in (True, False):
        drafter = _measured(SuffixDrafter(16, adaptive=True, config=SuffixConfig(max_cached_requests=0)))
        for accepted in (0, 0, 1, 0):  # 1-token matches: a quarter of their first tokens accepted
            drafter._rates.observe(1, drafted=1, accepted=accepted)
            drafter._rates.observe(2, drafted=14, accepted=14 if reliable else 0)  # copies from 2-token matches
        drafter.prefill(Prompt(context))
        drafted[reliable] = drafter.propose(context, 16, SamplingConfig(), torch.Generator()).tokens.tolist()
    long = drafted[True]
    assert len(long) >= 12 and long == source[12:12 + len(long)]  # the copy, from a 1-token match
    assert drafted[False] == []


def test_store_is_shared_by_forks_and_bounded_by_fifo_eviction():
    store = SuffixStore(depth=6, limits=StoreLimits(max_sequences=3, max_tokens=50))
    assert SuffixDrafter(store=store).fork().store is store
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        seq = store.start()
        store.extend(seq, torch.randint(0, 50, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist())
        assert store.sequences() <= 3 and store.tokens() <= 50
        assert store.trie.tokens() == store.tokens() and store.trie.nodes <= 50 * 6
    first = store.start()
    store.extend(first, list(range(80)))  # one output alone over the cap: it fills the store, then stops growing
    assert store.sequences() == 1 and store.tokens() == 50
    for _ in range(3):
        store.start()
    assert first not in store.trie and store.tokens() == 0 and store.trie.nodes == 0


def test_bad_options_are_refused():
    for bad in (dict(max_tree_depth=1), dict(max_spec_factor=0), dict(min_token_prob=1.5),
                dict(max_cached_tokens=-1)):
        with pytest.raises(UserError):
            SuffixConfig(**bad)


# --- lossless output ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def baselines(loaded_target) -> dict[str, list[int]]:
    pipe = Pipeline(loaded_target, None)
    return {p: pipe.generate_plain(p, max_new_tokens=40).token_ids for p in PROMPTS}


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("tree", [{}, dict(tree_budget=12, tree_topk=3, tree_depth=6)], ids=["chain", "tree"])
def test_greedy_output_equals_plain_with_drafts_accepted(loaded_target, baselines, tree, verifier):
    pipe = Pipeline(loaded_target, build_drafter("suffix", loaded_target, None, 8, **tree), verifier)
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=40)
        assert result.token_ids == baselines[prompt], (prompt, result.stats)
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0
    if tree:
        assert pipe.drafter.tree.budget == 12


def test_a_tree_really_branches_and_stays_lossless(loaded_target, baselines):
    """The store holds two different continuations of the prompt's end, so drafts are trees with siblings."""
    drafter = build_drafter("suffix", loaded_target, None, 8, tree_budget=12, tree_topk=3, tree_depth=6)
    pipe = Pipeline(loaded_target, drafter)
    prompt = PROMPTS[2]
    plain = baselines[prompt]
    ids = pipe.encode(prompt).input_ids.tolist()
    for continuation in (plain[:20], [plain[0], (plain[1] + 1) % 300, *plain[2:10]]):
        drafter.store.extend(drafter.store.start(), ids[-6:] + continuation)
    seen = []
    original = drafter.propose
    drafter.propose = lambda *a: seen.append(original(*a)) or seen[-1]
    result = pipe.generate(prompt, max_new_tokens=40)
    assert result.token_ids == plain and result.stats.num_accepted_tokens > 0
    assert any(d.is_tree for d in seen)


def test_other_requests_outputs_only_reach_drafts(loaded_target, baselines):
    """A store full of wrong continuations of the prompt (another request's text): they are drafted and
    rejected; the output stays the target's own."""
    drafter = build_drafter("suffix", loaded_target, None, 8, adaptive=False)
    pipe = Pipeline(loaded_target, drafter)
    prompt = PROMPTS[0]
    ids = pipe.encode(prompt).input_ids.tolist()
    wrong = [(t + 7) % 300 for t in baselines[prompt]]
    for _ in range(5):
        drafter.store.extend(drafter.store.start(), ids[-4:] + wrong)
    result = pipe.generate(prompt, max_new_tokens=40)
    assert result.token_ids == baselines[prompt]
    assert result.stats.num_draft_tokens > result.stats.num_accepted_tokens


def test_earlier_outputs_make_drafts_for_a_later_request(loaded_target, baselines):
    """The second run of a prompt drafts its whole output from the store (the first run's output)."""
    with_store = Pipeline(loaded_target, build_drafter("suffix", loaded_target, None, 8, adaptive=False))
    without = Pipeline(loaded_target, build_drafter("suffix", loaded_target, None, 8, adaptive=False,
                                                    max_cached_requests=0))
    prompt = PROMPTS[1]
    for pipe in (with_store, without):
        pipe.generate(prompt, max_new_tokens=40)
    again, alone = (pipe.generate(prompt, max_new_tokens=40) for pipe in (with_store, without))
    assert again.token_ids == alone.token_ids == baselines[prompt]
    assert again.stats.num_accepted_tokens > alone.stats.num_accepted_tokens
    assert again.stats.steps < alone.stats.steps


def test_batched_requests_share_one_store_and_keep_their_own_outputs(loaded_target, baselines):
    drafter = build_drafter("suffix", loaded_target, None, 8, adaptive=False)
    pipe = Pipeline(loaded_target, drafter)
    assert drafter.fork().store is drafter.store
    for prompt in PROMPTS:  # earlier requests: their outputs are in the store
        pipe.generate(prompt, max_new_tokens=40)
    before = drafter.store.sequences()
    batch = Batch(loaded_target.model, BatchPolicy(adaptive=False))
    gens = [pipe.sequence(p, max_new_tokens=40) for p in PROMPTS]
    for gen in gens:
        batch.add(gen)
    while len(batch):
        batch.step()
    results = [pipe.result(gen) for gen in gens]
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == baselines[prompt]
        assert result.stats.num_accepted_tokens >= len(result.token_ids) // 2  # drafted from the store
    assert drafter.store.sequences() == before + len(PROMPTS)


def test_memory_bound_holds_under_many_requests(loaded_target):
    drafter = build_drafter("suffix", loaded_target, None, 8, max_cached_requests=4, max_cached_tokens=120,
                            max_tree_depth=8)
    pipe = Pipeline(loaded_target, drafter)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    for i in range(12):
        pipe.generate(" ".join(words[i % 10:] + words[: i % 10]), max_new_tokens=25)
        assert drafter.store.sequences() <= 4 and drafter.store.tokens() <= 120
        assert drafter.store.trie.nodes <= 120 * 8
    assert drafter.store.tokens() > 0


# --- the sampling distribution --------------------------------------------------------------------------------

V, START, N = 6, 0, 3_000
g0 = torch.Generator().manual_seed(4321)
P_LOGITS = torch.randn(V, V, generator=g0) * 1.5  # target: row s = logits of the token after s
HISTORY = [0, 1, 2, 0, 1, 3, 0, 2, 4, 0, 1, 2, 5, 0, 3, 1]  # what the tries hold: several continuations of 0


def emitted(verifier, tree: bool, sampling: SamplingConfig) -> tuple[torch.Tensor, int]:
    """Joint counts of the first two emitted tokens after START, drafting with a SuffixDrafter whose store
    holds HISTORY; and the draft tokens proposed."""
    from sparrow.drafters.tree_draft import TreeShape

    g = torch.Generator().manual_seed(0)
    drafter = SuffixDrafter(4, config=SuffixConfig(min_token_prob=0.05),
                            tree=TreeShape(6, 3, 3) if tree else None)
    drafter.store.extend(drafter.store.start(), HISTORY)
    counts, drafted = torch.zeros(V, V), 0
    for _ in range(N):
        drafter.prefill(Prompt(torch.tensor([3, START])))
        committed = [3, START]
        while len(committed) < 4:
            draft = drafter.propose(torch.tensor(committed), 8, sampling, g)
            drafted += len(draft)
            # A Markov target: the row after a node (chain or tree) depends on that node's token only.
            rows = torch.tensor(committed[-1:] + draft.tokens.tolist())
            verdict = verifier.verify(draft, P_LOGITS[rows], sampling, g)
            drafter.observe(draft, verdict, None, StepStats(len(draft), verdict.num_accepted, 0.0, 0.0))
            committed += verdict.tokens.tolist()
        counts[committed[2], committed[3]] += 1
    return counts, drafted


def within(counts: torch.Tensor, sampling: SamplingConfig) -> bool:
    p = S.probs(P_LOGITS, sampling)
    expected = p[START][:, None] * p
    bound = 6 * (N * expected * (1 - expected)).sqrt() + 5
    return bool(((counts - N * expected).abs() <= bound).all())


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_preserves_the_target_distribution(tree, one_thread):
    sampling = SamplingConfig(temperature=1.0)
    counts, drafted = emitted(RejectionVerifier(), tree, sampling)
    assert drafted > N  # the tries really drafted
    assert within(counts, sampling)


def test_negative_control_accepting_the_drafts_fails(one_thread):
    sampling = SamplingConfig(temperature=1.0)
    counts, drafted = emitted(AlwaysAcceptChain(), False, sampling)
    assert drafted > N
    assert not within(counts, sampling)


class AlwaysAcceptChain:
    """Negative control for chains: every draft token accepted, then a target sample."""

    def verify(self, draft, target_logits, sampling, generator):
        from sparrow.types import Verdict

        bonus = S.sample(S.probs(target_logits[-1], sampling), generator)
        return Verdict(tokens=torch.cat([draft.tokens, bonus.reshape(1)]), num_accepted=len(draft))


def test_auto_probes_suffix_and_stays_lossless(loaded_target, baselines):
    auto = build_drafter("auto", loaded_target, None, 8)
    assert "suffix" in auto.candidates
    pipe = Pipeline(loaded_target, auto)
    prompt = PROMPTS[1]
    assert pipe.generate(prompt, max_new_tokens=40).token_ids == baselines[prompt]
    again = pipe.generate(prompt, max_new_tokens=40)  # the first output is in suffix's store now
    assert again.token_ids == baselines[prompt]
    # auto probes suffix beside prompt lookup; how often it then keeps it follows measured timings, which differ
    # from run to run on a shared CPU, so only the probe is asserted here (suffix's own drafting from an earlier
    # request's output is asserted exactly in test_earlier_outputs_make_drafts_for_a_later_request)
    assert any(r.choice == "suffix" for r in auto.rounds)


def test_auto_asks_suffix_only_for_its_drafts_never_for_empty_probes(loaded_target, baselines):
    """Suffix is free to ask, like prompt lookup. Probed like a model candidate instead, it was asked only in rounds
    where prompt lookup had no match, i.e. where the last token never occurred in the context, so its own trie had
    nothing either: most of its probe rounds drafted 0 tokens, were measured as plain steps plus its cost, lost, and
    its re-probes were spaced out."""
    auto = build_drafter("auto", loaded_target, None, 8)
    assert "suffix" not in auto.models  # never probed: asked every round the lookup's draft is not used
    pipe = Pipeline(loaded_target, auto)
    prompt = PROMPTS[0]
    used = []
    for _ in range(2):  # the second request finds the first one's output in suffix's store
        assert pipe.generate(prompt, max_new_tokens=40).token_ids == baselines[prompt]
        used += [r for r in auto.rounds if r.choice == "suffix"]
    assert used and all(r.drafted > 0 for r in used), used
    assert sum(r.accepted for r in used) > 0


def test_trie_nodes_are_no_objects_for_the_garbage_collector():
    """One Python object per node made appends ~15x slower (cyclic GC passes over every tracked node)."""
    import gc

    trie = SuffixTrie(depth=24)
    gc.collect()
    before = len(gc.get_objects())
    trie.extend(0, range(3000))
    assert trie.nodes > 50_000 and len(gc.get_objects()) - before < 100

"""FR-Spec reduced draft vocabulary (sparrow.drafters.vocab): drafts score only N target ids, output unchanged.

a) The reduced head: its logits at the kept ids are the full head's there, -inf elsewhere; the model it was
   built from keeps its own head (models are shared).
b) Greedy, float32, tiny Qwen2: draft-model (chain, tree), quantized-self and layer-skip with a reduced
   vocabulary equal plain decoding token for token, drafts were accepted and never left the set; alone and
   in a batch. A token outside the set is still produced (by the target) when it is the answer.
c) Sampling: a draft q that is zero outside the set keeps the target's joint distribution of two tokens under
   the rejection verifier (bins within 6 sd + 5, as tests/lossless/test_distribution.py); accepting every draft fails.
d) Frequencies: counting is deterministic and cached on disk; options and bad values are checked.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, perturbed, tiny_gemma3, tiny_model, tiny_tokenizer
from torch import nn

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.drafters import build_drafter
from sparrow.drafters import vocab as dv
from sparrow.drafters.vocab import DraftVocab, reduced_head, reduced_head_view, top_tokens
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.types import Draft, Verdict
from sparrow.verifiers import RejectionVerifier

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]
MAX_NEW = 30
N = 208  # of the tiny vocabulary's 320 ids (a multiple of 16: int4 packs the reduced rows too)


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    """(target, a perturbed copy as the draft model)."""
    tokenizer = tiny_tokenizer()
    target = LoadedModel(tiny_model("qwen2", seed=0), tokenizer, "tiny")
    return target, LoadedModel(perturbed(target.model, 0.05, seed=1), tokenizer, "close")


@pytest.fixture(scope="module")
def vocab(pair) -> DraftVocab:
    """The N most frequent ids of the tiny tokenizer on its own training corpus, EOS included."""
    target = pair[0]
    counts = torch.zeros(320, dtype=torch.long)
    for text in CORPUS:
        counts += torch.bincount(torch.tensor(target.tokenizer.encode(text)), minlength=320)
    return top_tokens(counts, N, dv.always_kept(target.tokenizer, target.model, 320))


@pytest.fixture(scope="module")
def plain(pair) -> dict[str, list[int]]:
    pipe = Pipeline(pair[0], None)
    return {p: pipe.generate_plain(p, max_new_tokens=MAX_NEW).token_ids for p in PROMPTS}


def recording(drafter) -> list[Draft]:
    """Record the drafts `drafter` proposes (wraps its propose on the instance)."""
    drafts: list[Draft] = []
    propose = drafter.propose

    def recorded(*args, **kwargs) -> Draft:
        drafts.append(propose(*args, **kwargs))
        return drafts[-1]

    drafter.propose = recorded
    return drafts


# --- a) the reduced head -------------------------------------------------------------------------------

def test_reduced_head_logits_equal_the_full_head_on_the_set_and_are_minus_inf_elsewhere(pair, vocab):
    model = pair[0].model
    head = model.get_output_embeddings()
    view = reduced_head_view(model, vocab)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.inference_mode():
        full, reduced = model(input_ids=ids).logits[0], view(input_ids=ids).logits[0]  # [6, 320]
    assert reduced.shape == full.shape
    torch.testing.assert_close(reduced[:, vocab.ids], full[:, vocab.ids], rtol=1e-6, atol=1e-5)
    outside = torch.ones(320, dtype=torch.bool)
    outside[vocab.ids] = False
    assert bool((reduced[:, outside] == float("-inf")).all())
    assert model.get_output_embeddings() is head and isinstance(view.get_output_embeddings(), dv.ReducedHead)
    assert view.model is model.model  # the decoder is shared, not copied
    assert reduced_head_view(model, vocab).get_output_embeddings() is view.get_output_embeddings()  # built once


@pytest.mark.parametrize("bits", ["int8", "int4", "w8a8"])
def test_a_quantized_head_stays_quantized_with_the_same_rows(pair, vocab, bits):
    from sparrow.models.quantization import LONG, quantized_copy
    from sparrow.runtime.quant import DynamicInt8Linear, QuantizedLinear

    quantized = quantized_copy(pair[0], bits, group_size=64, dense=LONG).model
    odd = DraftVocab(vocab.ids[:-8], 320)  # 200 rows: int4 packing needs a multiple of 16, so they stay dense
    same = DynamicInt8Linear if bits == "w8a8" else QuantizedLinear
    for kept, kind in ((vocab, same), (odd, nn.Linear if bits == "int4" else same)):
        view = reduced_head_view(quantized, kept)
        project = view.get_output_embeddings().project
        assert type(project) is kind
        if kind is nn.Linear:  # the source's dense rows
            assert torch.equal(project.weight, quantized.get_output_embeddings().dense[kept.ids])
            continue
        ids = torch.tensor([[5, 17, 42]])
        with torch.inference_mode():
            full, reduced = quantized(input_ids=ids).logits[0], view(input_ids=ids).logits[0]
        torch.testing.assert_close(reduced[:, kept.ids], full[:, kept.ids], rtol=1e-5, atol=1e-4)


# --- b) greedy equivalence -----------------------------------------------------------------------------

SPECS = {
    "draft-model": ("draft-model", {}),
    "draft-model-tree": ("draft-model", {"tree_budget": 8, "tree_topk": 2, "tree_depth": 4}),
    "quantized-self": ("quantized-self", {"bits": "int8"}),
    "quantized-self-int4": ("quantized-self", {"bits": "int4", "group_size": 64}),
    "quantized-self-w8a8": ("quantized-self", {"bits": "w8a8"}),
    "layer-skip": ("layer-skip", {"skip_set": "mlp=1", "backoff": False}),
}


def build(pair, label: str, draft_vocab, k: int = 4):
    name, options = SPECS[label]
    return build_drafter(name, pair[0], pair[1] if name == "draft-model" else None, k, **options,
                         draft_vocab=draft_vocab)


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("label", list(SPECS))
def test_reduced_vocabulary_greedy_equals_plain(pair, vocab, plain, label, verifier):
    drafter = build(pair, label, vocab)
    assert drafter.vocab is vocab
    drafts = recording(drafter)
    pipe = Pipeline(pair[0], drafter, verifier)
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=MAX_NEW)
        assert result.token_ids == plain[prompt], (label, prompt)
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0, "no draft was accepted: nothing was tested"
    drafted = torch.cat([d.tokens for d in drafts])
    assert drafted.numel() > 0 and bool(torch.isin(drafted, vocab.ids).all())
    if label == "draft-model-tree":
        assert any(d.is_tree for d in drafts)


def test_a_sliding_window_draft_with_a_reduced_vocabulary_equals_plain(pair, vocab):
    """Gemma-3 (sliding-window layers): the reduced-head view keeps the model's own cache handling."""
    gemma = LoadedModel(tiny_gemma3(), pair[0].tokenizer, "gemma")
    close = LoadedModel(perturbed(gemma.model, 0.05, seed=1), gemma.tokenizer, "close")
    prompt = "Paris is the capital of France. " * 3
    expected = Pipeline(gemma, None).generate_plain(prompt, max_new_tokens=MAX_NEW).token_ids
    result = Pipeline(gemma, build_drafter("draft-model", gemma, close, 4, draft_vocab=vocab)).generate(
        prompt, max_new_tokens=MAX_NEW)
    assert result.token_ids == expected and result.stats.num_accepted_tokens > 0


def test_a_token_outside_the_set_is_still_produced_by_the_target(pair, plain):
    """The draft is the target itself, so every draft is accepted except where the answer is the left-out token."""
    target = pair[0]
    prompt = PROMPTS[1]
    left_out = plain[prompt][3]
    vocab = DraftVocab(torch.tensor([i for i in range(320) if i != left_out]), 320)
    drafter = build_drafter("draft-model", target, target, 4, draft_vocab=vocab)
    drafts = recording(drafter)
    result = Pipeline(target, drafter).generate(prompt, max_new_tokens=MAX_NEW)
    assert result.token_ids == plain[prompt] and left_out in result.token_ids
    assert 0 < result.stats.num_accepted_tokens < result.stats.num_draft_tokens
    assert not bool((torch.cat([d.tokens for d in drafts]) == left_out).any())


def test_batched_reduced_vocabulary_drafts_equal_plain(pair, vocab):
    from batching import BUDGETS, run_batch
    from batching import PROMPTS as BATCH_PROMPTS

    target = pair[0]
    expected = [Pipeline(target, None).generate_plain(p, max_new_tokens=n).token_ids
                for p, n in zip(BATCH_PROMPTS, BUDGETS)]
    for label in ("draft-model", "layer-skip"):
        results = run_batch(Pipeline(target, build(pair, label, vocab)))
        assert [r.token_ids for r in results] == expected, label
        assert sum(r.stats.num_accepted_tokens for r in results) > 0


# --- c) sampling -----------------------------------------------------------------------------------------

V, START, SAMPLES = 6, 0, 3_000
KEPT = torch.tensor([0, 2, 3, 5])  # tokens 1 and 4 are never drafted
g0 = torch.Generator().manual_seed(7)
P_LOGITS = torch.randn(V, V, generator=g0) * 1.5  # target: row s = logits of the token after s
Q_FULL = nn.Linear(8, V, bias=False)  # draft: hidden state of token s -> logits, through a reduced head
with torch.no_grad():
    Q_FULL.weight.copy_(torch.randn(V, 8, generator=g0))
Q_HIDDEN = torch.randn(V, 8, generator=g0) * 1.5


class AlwaysAccept:
    """Negative control: accepts every draft token, so the output follows the (reduced) draft."""

    def verify(self, draft: Draft, target_logits, sampling, generator) -> Verdict:
        bonus = S.sample(S.probs(target_logits[-1], sampling), generator)
        return Verdict(tokens=torch.cat([draft.tokens, bonus.reshape(1)]), num_accepted=len(draft))


def two_token_counts(verifier, sampling: SamplingConfig, k: int = 3) -> torch.Tensor:
    """[V, V] counts of the first two emitted tokens over SAMPLES runs, drafts sampled from the reduced q."""
    head = reduced_head(Q_FULL, DraftVocab(KEPT, V))
    with torch.no_grad():
        q_logits = head(Q_HIDDEN)  # [V, V], -inf in columns 1 and 4
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V)
    for _ in range(SAMPLES):
        out: list[int] = []
        while len(out) < 2:
            last = out[-1] if out else START
            tokens, rows = [], []
            for _ in range(k):
                rows.append(S.probs(q_logits[last], sampling))
                last = int(S.sample(rows[-1], g))
                tokens.append(last)
            draft = Draft(tokens=torch.tensor(tokens), probs=torch.stack(rows))
            scored = torch.tensor([out[-1] if out else START, *tokens])
            out += verifier.verify(draft, P_LOGITS[scored], sampling, g).tokens.tolist()
        counts[out[0], out[1]] += 1
    return counts


def matches(counts: torch.Tensor, sampling: SamplingConfig) -> bool:
    p = S.probs(P_LOGITS, sampling)
    expected = p[START][:, None] * p  # P(a | START) P(b | a)
    bound = 6 * (SAMPLES * expected * (1 - expected)).sqrt() + 5
    return bool(((counts - SAMPLES * expected).abs() <= bound).all())


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)],
                         ids=["t1", "t0.7-topp0.9"])
def test_rejection_sampling_with_a_reduced_draft_keeps_the_target_distribution(sampling):
    counts = two_token_counts(RejectionVerifier(), sampling)
    assert counts[:, [1, 4]].sum() > 0  # the target still emits the tokens the draft never proposes
    assert matches(counts, sampling)


def test_negative_control_accepting_every_reduced_draft_fails():
    sampling = SamplingConfig(temperature=1.0)
    assert not matches(two_token_counts(AlwaysAccept(), sampling), sampling)


def test_sampled_pipeline_drafts_stay_in_the_set(pair, vocab):
    drafter = build(pair, "draft-model", vocab)
    drafts = recording(drafter)
    pipe = Pipeline(pair[0], drafter)
    first = pipe.generate(PROMPTS[0], max_new_tokens=MAX_NEW, temperature=0.8, seed=3)
    assert pipe.generate(PROMPTS[0], max_new_tokens=MAX_NEW, temperature=0.8, seed=3).token_ids == first.token_ids
    sampled = [d for d in drafts if d.probs is not None and len(d)]
    assert sampled
    outside = torch.ones(320, dtype=torch.bool)
    outside[vocab.ids] = False
    for d in sampled:
        assert bool(torch.isin(d.tokens, vocab.ids).all()) and float(d.probs[:, outside].sum()) == 0.0


# --- d) frequencies and options ------------------------------------------------------------------------

@pytest.fixture
def corpus(tmp_path, monkeypatch) -> list:
    """Two small text files as the corpus, and an empty sparrow cache."""
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    files = []
    for i, text in enumerate(["def add(a, b):\n    return a + b\n" * 20, "The quick brown fox. " * 30]):
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_text(text)
    monkeypatch.setattr(dv, "corpus_files", lambda: files)
    return files


def test_token_frequencies_are_deterministic_and_cached(pair, corpus, tmp_path, monkeypatch):
    tokenizer = pair[0].tokenizer
    counts = dv.token_frequencies(tokenizer, 320)
    assert counts.shape == (320,) and counts.dtype == torch.long and int(counts.sum()) > 0
    assert torch.equal(counts, dv.count_tokens(tokenizer, 320, corpus))
    assert len(list((tmp_path / "cache" / "draft_vocab").glob("*.pt"))) == 1

    def fail(*args):
        raise AssertionError("counted again: the cache was not used")

    monkeypatch.setattr(dv, "count_tokens", fail)
    assert torch.equal(dv.token_frequencies(tokenizer, 320), counts)


def test_the_default_corpus_is_a_deterministic_sample():
    files = dv.corpus_files(200_000)
    assert files and files == dv.corpus_files(200_000)
    assert all(f.name.endswith(tuple(s for part in dv.CORPUS_PARTS for s in part.suffixes)) for f in files)


def test_top_tokens_keeps_the_most_frequent_ids_and_the_special_ones():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7])
    assert top_tokens(counts, 3).ids.tolist() == [2, 3, 6]  # 9, 9, 7
    assert top_tokens(counts, 4, always=[5]).ids.tolist() == [2, 3, 5, 6]
    assert top_tokens(counts, 5).ids.tolist() == [0, 2, 3, 4, 6]
    assert top_tokens(counts, 6).ids.tolist() == [0, 1, 2, 3, 4, 6]  # ties: the lower id
    for bad in (0, 8, True):
        with pytest.raises(UserError, match="draft_vocab"):
            top_tokens(counts, bad)
    with pytest.raises(UserError, match="special tokens"):
        top_tokens(counts, 1, always=[1, 5])


def test_builders_resolve_a_size_from_the_frequencies_with_eos_kept(pair, corpus):
    target, close = pair
    eos = target.tokenizer.eos_token_id
    drafter = build_drafter("draft-model", target, close, 4, draft_vocab=50)
    assert len(drafter.vocab) == 50 and eos in drafter.vocab.ids.tolist()
    assert build_drafter("layer-skip", target, None, 4, skip_set="mlp=1", draft_vocab="60").vocab.ids.numel() == 60
    assert build_drafter("draft-model", target, close, 4, draft_vocab=0).vocab is None
    assert build_drafter("draft-model", target, close, 4, draft_vocab="auto").vocab is None  # 320 <= 64k: full
    assert build_drafter("draft-model", target, close, 4, draft_vocab=320).vocab is None  # every token


@pytest.mark.parametrize("value,match", [(-1, "integer >= 0"), ("x", "integer >= 0"), (1.5, "integer >= 0"),
                                         (True, "integer >= 0"), (321, "at most the vocabulary's size")])
def test_bad_sizes_are_refused_naming_the_option(pair, value, match):
    target, close = pair
    with pytest.raises(UserError, match=f"draft_vocab.*{match}"):
        build_drafter("draft-model", target, close, 4, draft_vocab=value)


@pytest.mark.parametrize("name", ["prompt-lookup", "sparse", "cross-vocab"])
def test_drafters_without_a_draft_head_refuse_the_option(pair, name):
    with pytest.raises(UserError, match="draft_vocab"):
        build_drafter(name, pair[0], pair[1], 4, draft_vocab=50)


def test_auto_gives_its_draft_model_the_reduced_vocabulary(pair, vocab, plain):
    auto = build_drafter("auto", pair[0], pair[1], 4, draft_vocab=vocab)
    model = auto.candidates["draft-model"]
    assert model.vocab is vocab and auto.candidates["prompt-lookup"].name == "prompt-lookup"
    pipe = Pipeline(pair[0], auto)
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=MAX_NEW)
        assert result.token_ids == plain[prompt], prompt
        accepted += sum(r.accepted for r in auto.rounds if r.choice == "draft-model")
    assert accepted > 0, auto.rounds  # the reduced-vocabulary draft model drafted, and was right


def test_cli_flag_is_checked_before_loading():
    from sparrow.cli.generate import draft_vocab_options
    from sparrow.drafters.plan import resolve_plan

    assert draft_vocab_options("0") == {}
    assert draft_vocab_options("32768") == {"draft_vocab": 32768}
    assert draft_vocab_options("auto") == {"draft_vocab": "auto"}
    with pytest.raises(UserError, match="--draft-vocab must be an integer >= 0"):
        draft_vocab_options("-5")
    with pytest.raises(UserError, match="--draft-vocab applies to"):  # the plan: the drafter has a draft LM head
        resolve_plan("no-such-model", drafter="prompt-lookup", flags=True, **draft_vocab_options("100"))

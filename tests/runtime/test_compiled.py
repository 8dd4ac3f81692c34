"""The compiled path (`sparrow.runtime.compiled`: static KV cache, torch.compile'd steps) gives the eager path's tokens
(float32, tiny random Llama): plain greedy decoding, speculative chains and trees with a draft model; and its
static cache rewinds and compacts like the dynamic one.

Compiling is slow on a CPU (tens of seconds a graph; inductor's on-disk cache makes reruns faster), so the
compiled runners are built once per module and every test reuses their graphs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import perturbed, tiny_gemma3, tiny_model

from sparrow.drafters import build_drafter
from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.compiled import HEADROOM, Q_BUCKETS, StaticCachedModel, check_compilable
from sparrow.tree import TreeLayout
from sparrow.types import Prompt

PROMPTS = ["The quick brown fox", "Paris is the capital of France. Paris is"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target(tokenizer, one_thread) -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tokenizer, "tiny")


@pytest.fixture(scope="module")
def draft(target, tokenizer) -> LoadedModel:
    return LoadedModel(perturbed(target.model, 0.05, seed=1), tokenizer, "close")


@pytest.fixture(scope="module")
def plain(target) -> dict[str, list[int]]:
    pipe = Pipeline(target, None)
    return {p: pipe.generate_plain(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def compiled_chain(target, draft) -> Pipeline:
    """Compiled target and draft; a fixed k of 3 keeps the shapes to the buckets 1, 2 and 4."""
    return Pipeline(target, build_drafter("draft-model", target, draft, 3, adaptive=False), compiled=True)


def test_pipeline_compiles_target_and_draft(compiled_chain):
    assert isinstance(compiled_chain.runner, StaticCachedModel) and compiled_chain.runner.compiled
    assert isinstance(compiled_chain.drafter, DraftModelDrafter)
    assert isinstance(compiled_chain.drafter.draft, StaticCachedModel)
    assert compiled_chain.runner.buckets == Q_BUCKETS  # dense linears: padded rows cost little (GGUF: FINE_BUCKETS)
    with pytest.raises(UserError, match="one generation at a time"):
        compiled_chain.sequence(PROMPTS[0], max_new_tokens=4)


def test_plain_decoding_compiled_equals_eager(compiled_chain, plain):
    from torch._dynamo.utils import counters

    for prompt in PROMPTS:
        assert compiled_chain.generate_plain(prompt, max_new_tokens=NEW_TOKENS).token_ids == plain[prompt]
    assert counters["stats"]["unique_graphs"] >= 1  # it really ran compiled graphs (fullgraph: no silent eager)


def test_speculative_chain_compiled_equals_eager(compiled_chain, plain):
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = compiled_chain.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == plain[prompt], (prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    assert 0 < accepted < drafted


def test_speculative_tree_compiled_target_equals_eager(compiled_chain, target, draft, plain):
    """A tree verified by the compiled target (tree mask, depth positions, keep's compaction); the draft expands
    its tree on an eager static cache (keep and tree masks there too, without compiling its tree shapes)."""
    drafter = build_drafter("draft-model", target, draft, 3, adaptive=False, tree_budget=6, tree_topk=2,
                            tree_depth=3)
    drafter.draft = StaticCachedModel(drafter.draft.model, compile=False)
    pipe = Pipeline(target, drafter)
    pipe.runner = compiled_chain.runner  # its compiled graphs (buckets up to 8)
    steps = accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == plain[prompt], (prompt, result.stats)
        steps += result.stats.tree_steps
        accepted += result.stats.num_accepted_tokens
    assert steps > 0 and accepted > 0


def _logits_close(a, b) -> bool:
    return torch.allclose(a.logits, b.logits, atol=1e-5, rtol=1e-5)


def test_warm_up_compiles_before_the_generation(compiled_chain, target):
    """After `warm_up` at a new capacity (a 300-token prompt: 1024 slots), plain decoding there compiles nothing
    more and gives the eager path's tokens."""
    from torch._dynamo.utils import counters

    ids = torch.randint(3, target.model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(4))
    runner = compiled_chain.runner
    graphs = counters["stats"]["unique_graphs"]
    runner.warm_up(Prompt(ids), largest=1)
    assert runner.capacity == 1024 and runner.length == 0
    assert counters["stats"]["unique_graphs"] > graphs  # the warm-up compiled the new shape
    graphs = counters["stats"]["unique_graphs"]
    got = compiled_chain.generate_plain(ids.tolist(), max_new_tokens=8).token_ids
    assert counters["stats"]["unique_graphs"] == graphs
    assert got == Pipeline(target, None).generate_plain(ids.tolist(), max_new_tokens=8).token_ids


def test_static_cache_rewind_and_keep_equal_dynamic(target):
    """Eager forwards on the static cache: chain, rewind, tree + keep, hidden states and growing the cache give
    the dynamic cache's logits."""
    dynamic, static = CachedModel(target.model), StaticCachedModel(target.model, compile=False)
    prompt = Prompt(input_ids=torch.arange(5, 25))
    for runner in (dynamic, static):
        runner.prefill(prompt)
    tokens = torch.tensor([7, 8, 9])
    assert _logits_close(dynamic.forward(tokens), static.forward(tokens))  # bucket 4: one row of padding
    for runner in (dynamic, static):
        runner.rewind(21)
    assert static.length == dynamic.length == 21
    assert _logits_close(dynamic.forward(tokens[:1]), static.forward(tokens[:1]))
    base = dynamic.length
    layout = TreeLayout.of(torch.tensor([-1, 0, 0, 1, 2]), base)
    tree = torch.tensor([4, 10, 11, 12, 13, 14])
    assert _logits_close(dynamic.forward(tree, layout.positions, layout.mask),
                         static.forward(tree, layout.positions, layout.mask))
    for runner in (dynamic, static):
        runner.keep(base, torch.tensor([1, 4]))  # root -> node 1 -> node 4: a branch off the first child
    assert static.length == dynamic.length == base + 3
    after = torch.tensor([30, 31])
    assert _logits_close(dynamic.forward(after), static.forward(after))
    hidden = [r.forward(torch.tensor([2]), hidden_layers=(0, -1)).hidden for r in (dynamic, static)]
    assert hidden[1].shape == (2, 1, 64) and torch.allclose(*hidden, atol=1e-5)
    capacity = static.capacity
    for i in range(capacity - static.length + 3):  # past the capacity: the cache moves into a larger one
        a, b = dynamic.forward(torch.tensor([i % 200])), static.forward(torch.tensor([i % 200]))
    assert static.capacity >= 2 * capacity >= 2 * HEADROOM and _logits_close(a, b)
    static.prefill(prompt)  # a new prompt reuses the cache and starts over
    dynamic.prefill(prompt)
    assert static.length == 20 and _logits_close(dynamic.forward(tokens), static.forward(tokens))


def test_refuses_sliding_window_and_vision_models():
    with pytest.raises(UserError, match="sliding-window"):
        StaticCachedModel(tiny_gemma3(num_layers=2))
    vlm = SimpleNamespace(config=SimpleNamespace(vision_config=object()))
    with pytest.raises(UserError, match="vision-language"):
        check_compilable(vlm)


def test_w8a8_target_is_refused_and_a_w8a8_draft_runs_eagerly(target, draft):
    from sparrow.models.quantization import LONG, quantized_copy
    from sparrow.runtime.cached_model import CachedModel

    w8a8_target = quantized_copy(target, "w8a8")
    with pytest.raises(UserError, match="w8a8 models .* cannot be compiled"):
        Pipeline(w8a8_target, None, compiled=True)
    w8a8_draft = quantized_copy(draft, "w8a8", dense=LONG)
    pipe = Pipeline(target, build_drafter("draft-model", target, w8a8_draft, 3, adaptive=False), compiled=True)
    assert isinstance(pipe.runner, StaticCachedModel) and type(pipe.drafter.draft) is CachedModel


@pytest.mark.parametrize("options", [{"exact": True}, {"quant": "w8a8"}], ids=["exact", "w8a8"])
def test_an_eager_target_compiles_only_its_draft_and_stays_exact(target, draft, plain, options):
    """compile=True where the target must stay eager (exact=True; a w8a8 target torch.compile cannot trace): the
    draft model compiles, the target runs exact eager forwards, and the output is the target's own plain output
    (of the w8a8 target there), drafts accepted."""
    import sparrow
    from sparrow.runtime.batch_invariant import is_exact

    pipe = sparrow.load(target, drafter="draft-model", draft=draft, num_draft_tokens=3, adaptive=False,
                        draft_quant="none", compile=True, **options)
    assert not pipe.compiled and pipe.draft_compiled and is_exact(pipe.target.model)
    assert type(pipe.runner) is CachedModel and isinstance(pipe.drafter.draft, StaticCachedModel)
    from torch._dynamo.utils import counters

    pipe.warm_up(PROMPTS[0])  # the draft's graphs, before the generation
    graphs = counters["stats"]["unique_graphs"]
    expected = plain if "quant" not in options else \
        {p: Pipeline(pipe.target, None).generate_plain(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS}
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == expected[prompt], prompt
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0, "no draft was accepted: nothing was tested"
    # the drafts' tokens come from outside inference mode: they reuse the warm-up's graphs, nothing recompiles
    assert counters["stats"]["unique_graphs"] == graphs
    with pytest.raises(UserError, match="one generation at a time"):
        pipe.sequence(PROMPTS[0], max_new_tokens=4)


def test_a_compiled_int4_target_verifies_exactly(target, draft):
    """An int4 target compiles and stays exact on the CPU: its verify graphs compute every row as its one-row graph
    does (`row_invariant`, `INVARIANT_OPTIONS`), so speculative output == the compiled target's own plain output,
    drafts accepted; exact=True keeps a dense target eager, and a dense compiled target is not exact. (Without the
    invariant inductor options the int4 1.5B's verify rows differed by up to 0.125 in a logit: docs/lossless.md.)"""
    import sparrow
    from sparrow.models.quantization import quantized_copy
    from sparrow.runtime.batch_invariant import is_exact
    from sparrow.runtime.compiled import row_invariant

    int4 = quantized_copy(target, "int4", group_size=32)
    assert row_invariant(int4.model) and not row_invariant(target.model)
    pipe = sparrow.load(int4, drafter="draft-model", draft=draft, num_draft_tokens=3, adaptive=False,
                        draft_quant="none", compile=True)
    assert pipe.compiled and pipe.exact and is_exact(pipe.target.model)
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == pipe.generate_plain(prompt, max_new_tokens=NEW_TOKENS).token_ids, prompt
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0, "no draft was accepted: nothing was tested"
    assert not sparrow.load(target, drafter="draft-model", draft=draft, draft_quant="none", compile=True,
                            exact=True).compiled  # dense and exact: eager
    assert not sparrow.load(target, drafter="prompt-lookup", compile=True).exact  # dense and compiled: not exact


def test_auto_compiles_its_draft_model_candidate(target, draft):
    import sparrow

    pipe = sparrow.load(target, drafter="auto", draft=draft, draft_quant="none", compile=True, exact=True)
    assert isinstance(pipe.drafter.candidates["draft-model"].draft, StaticCachedModel)


def test_draft_only_compile_without_a_draft_model_is_refused_before_loading():
    import sparrow

    for options in ({"exact": True}, {"quant": "w8a8"}):
        with pytest.raises(UserError, match="compiles only a draft model, and drafter 'prompt-lookup' drafts"):
            sparrow.load("no-such-model-is-loaded", drafter="prompt-lookup", compile=True, **options)


def test_generate_json_says_compiled(monkeypatch, tmp_path, target):
    from typer.testing import CliRunner

    from sparrow.cli import app

    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(app, ["generate", "The quick brown fox", "--target", str(tmp_path), "--drafter",
                                      "none", "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "4",
                                      "--compile", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["compiled"] is True and record["new_tokens"] == 4


def test_load_refuses_a_non_bool_compile(target):
    import sparrow

    with pytest.raises(UserError, match="compile must be True or False"):
        sparrow.load(target, drafter="none", compile="yes")


def test_warm_up_compiles_the_step_sizes_a_verify_of_its_drafter_runs(target, draft):
    """`Pipeline.warm_up` compiles the target's step for each bucket a verify of its drafter can fill: up to the
    first bucket that holds k + 1 rows (a chain of k) or a tree's budget + 1, with the drafter's hidden layers, and
    a one-row step without them (plain decoding). Before, it compiled every bucket (a GGUF target's ten, up to 64
    rows: the 1.5B's first warm-up took 21 minutes on 2 cores) and never the hidden-layer steps an eagle head asks
    for. A drafter that states no length still warms every bucket. (Eager static caches: the forwards it asks for
    are recorded, nothing compiles.)"""
    from sparrow.drafters.base import DrafterInfo, verify_rows
    from sparrow.policy.length import LengthPolicy

    def warmed(drafter) -> set[tuple[int, tuple[int, ...]]]:
        pipe = Pipeline(target, drafter)
        pipe.runner, pipe.compiled, pipe.draft_compiled = StaticCachedModel(target.model, compile=False), True, False
        seen, forward = set(), pipe.runner.forward
        pipe.runner.forward = lambda tokens, *a, hidden_layers=(), **k: (
            seen.add((tokens.numel(), hidden_layers)) or forward(tokens, *a, hidden_layers=hidden_layers, **k))
        pipe.warm_up(PROMPTS[0])
        assert pipe.runner.length == 0
        return seen

    chain = build_drafter("draft-model", target, draft, 3, adaptive=False)
    assert verify_rows(chain) == 4 and warmed(chain) == {(1, ()), (2, ()), (4, ())}
    assert warmed(build_drafter("draft-model", target, draft, 4)) == {(1, ()), (2, ()), (4, ()), (8, ())}  # 5 rows
    tree = build_drafter("draft-model", target, draft, 3, tree_budget=6, tree_topk=2, tree_depth=3)
    assert verify_rows(tree) == 7 and {n for n, _ in warmed(tree)} == {1, 2, 4, 8}
    assert verify_rows(None) == 1 and warmed(None) == {(1, ())}

    class Head:  # an eagle-like drafter: reads two of the target's hidden layers, drafts chains of up to 2
        name, hidden_layers, grammar = "head", (0, 1), None

        def describe(self) -> DrafterInfo:
            return DrafterInfo(length=LengthPolicy(2))

    assert warmed(Head()) == {(1, (0, 1)), (2, (0, 1)), (4, (0, 1)), (1, ())}  # 3 rows: bucket 4

    class Unsaid(Head):
        def describe(self) -> DrafterInfo:
            return DrafterInfo()

    class Auto(Head):
        def describe(self) -> DrafterInfo:
            return DrafterInfo(candidates=(chain, tree))

    assert verify_rows(Unsaid()) is None and {n for n, _ in warmed(Unsaid())} == set(Q_BUCKETS)
    assert verify_rows(Auto()) == 7 and verify_rows(type("Mixed", (Head,), {
        "describe": lambda self: DrafterInfo(candidates=(chain, Unsaid()))})()) is None

"""Lossless trees: greedy speculative output with tree drafts equals the target's own greedy output token for
token (float32 tiny Llama, Qwen2, Gemma-3 past its sliding window, Qwen2.5-VL on a video), drafts were
accepted, and at least one round accepted a branch other than the first child's (so the tree mattered)."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_gemma3, tiny_model

from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]
NEW_TOKENS = 40


def run_all(pipe: Pipeline, plain: Pipeline, prompts=PROMPTS, **options):
    drafted = accepted = branches = trees = 0
    for prompt in prompts:
        expected = plain.generate_plain(prompt, max_new_tokens=NEW_TOKENS, **options).token_ids
        result = pipe.generate(prompt, max_new_tokens=NEW_TOKENS, **options)
        assert result.token_ids == expected, (prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
        branches += result.stats.branch_steps
        trees += result.stats.tree_steps
    return drafted, accepted, branches, trees


@pytest.fixture(scope="module")
def close_draft(target_model, tokenizer) -> LoadedModel:
    return LoadedModel(perturbed(target_model, 0.05, seed=1), tokenizer, "close")


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("budget,topk,depth", [(4, 2, 3), (12, 4, 6), (24, 3, 8)])
def test_draft_model_tree_equals_plain(loaded_target, close_draft, verifier, budget, topk, depth):
    drafter = build_drafter("draft-model", loaded_target, close_draft, 8, tree_budget=budget, tree_topk=topk,
                            tree_depth=depth)
    pipe = Pipeline(loaded_target, drafter, verifier)
    drafted, accepted, branches, trees = run_all(pipe, Pipeline(loaded_target, None))
    assert trees > 0 and drafted > 0 and accepted > 0
    assert branches > 0  # a non-first sibling was the accepted one in some round


def test_draft_model_tree_with_an_unrelated_draft(loaded_target, arch, tokenizer):
    other = LoadedModel(tiny_model(arch, seed=99), tokenizer, "random")
    pipe = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, other, 8, tree_budget=10))
    run_all(pipe, Pipeline(loaded_target, None))  # exact even when almost nothing is accepted


def test_prompt_lookup_trie_equals_plain(loaded_target):
    prompts = ["a b a c a b a d a b a c a b", *PROMPTS]
    for verifier in ("greedy", "rejection"):
        drafter = build_drafter("prompt-lookup", loaded_target, None, 8, tree_budget=16, tree_topk=4, tree_depth=4)
        drafted, accepted, _, trees = run_all(Pipeline(loaded_target, drafter, verifier),
                                              Pipeline(loaded_target, None), prompts)
        assert trees > 0 and accepted > 0


def test_gemma3_tree_past_the_sliding_window(tokenizer):
    target = LoadedModel(tiny_gemma3(), tokenizer, "gemma3")
    draft = LoadedModel(perturbed(target.model, 0.05, seed=1), tokenizer, "close")
    pipe = Pipeline(target, build_drafter("draft-model", target, draft, 6, tree_budget=12, tree_topk=3,
                                          tree_depth=5))
    drafted, accepted, branches, trees = run_all(pipe, Pipeline(target, None))  # 40 tokens >> window of 8
    assert trees > 0 and accepted > 0 and branches > 0


def test_tree_on_a_video_llm(tmp_path):
    from vlm_models import moving_squares, save_tiny_vlm, write_mp4
    from vlm_models import perturbed as vlm_perturbed

    from sparrow.models import load_model

    load = lambda d: load_model(str(d), dtype="float32", device="cpu", progress=False)  # noqa: E731
    target = load(save_tiny_vlm("qwen2.5-vl", tmp_path / "t", seed=0))
    close = load(save_tiny_vlm("qwen2.5-vl", tmp_path / "c", model=vlm_perturbed(target.model, 0.03, seed=1)))
    video = str(write_mp4(tmp_path / "v.mp4", moving_squares(8, 64, 64), fps=4.0))
    pipe = Pipeline(target, build_drafter("draft-model", target, close, 6, tree_budget=12, tree_topk=3))
    drafted, accepted, _, trees = run_all(pipe, Pipeline(target, None), ["What moves in the video?"],
                                          video=video, frames=8)
    assert trees > 0 and accepted > 0


def test_tree_sampling_is_reproducible_and_valid(loaded_target, close_draft):
    pipe = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, close_draft, 8, tree_budget=8))
    options = dict(max_new_tokens=30, temperature=0.8, top_p=0.95, seed=3)
    a, b = pipe.generate(PROMPTS[0], **options), pipe.generate(PROMPTS[0], **options)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30 and a.stats.tree_steps > 0


def test_tree_options_are_validated(loaded_target, close_draft):
    with pytest.raises(ValueError, match="tree_budget"):
        build_drafter("draft-model", loaded_target, close_draft, 8, tree_budget=-1)
    with pytest.raises(ValueError, match="tree_topk"):
        build_drafter("draft-model", loaded_target, close_draft, 8, tree_budget=4, tree_topk=0)
    with pytest.raises(ValueError, match="tree_budget"):
        build_drafter("sparse", loaded_target, None, 8, tree_budget=4)  # no tree for this drafter (yet)


def test_tree_stats_in_json(loaded_target, close_draft):
    drafter = build_drafter("draft-model", loaded_target, close_draft, 8, tree_budget=8)
    stats = Pipeline(loaded_target, drafter).generate(PROMPTS[1], max_new_tokens=20).stats.to_dict()
    assert stats["tree_steps"] > 0 and "branch_steps" in stats
    assert torch.isfinite(torch.tensor(stats["mean_accepted_tokens"]))


def test_auto_chooses_among_chain_tree_and_plain(loaded_target, close_draft):
    drafter = build_drafter("auto", loaded_target, close_draft, 8, tree_budget=8)
    assert {"draft-model", "draft-model+tree"} <= set(drafter.candidates)
    pipe, plain = Pipeline(loaded_target, drafter), Pipeline(loaded_target, None)
    used = set()
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == plain.generate_plain(prompt, max_new_tokens=NEW_TOKENS).token_ids
        used |= set(drafter.choices)
    assert "draft-model+tree" in used  # probed at least (then kept or dropped by its measured speed)


def test_tree_drafter_backs_off_when_trees_do_not_pay(loaded_target, close_draft):
    drafter = build_drafter("draft-model", loaded_target, close_draft, 8, adaptive=True, tree_budget=8)
    assert drafter.tree_policy is not None and drafter.tree_policy.backoff  # adaptive: measured against plain decoding
    fixed = build_drafter("draft-model", loaded_target, close_draft, 8, adaptive=False, tree_budget=8)
    assert fixed.tree_policy is None  # --fixed: a tree every round
    run_all(Pipeline(loaded_target, fixed), Pipeline(loaded_target, None))


@pytest.mark.parametrize("name,options", [
    ("draft-model", {}), ("prompt-lookup", {}), ("layer-skip", {"skip_set": "mlp=1", "backoff": False}),
    ("quantized-self", {"bits": "int8"}),
], ids=["draft-model", "prompt-lookup", "layer-skip", "quantized-self"])
def test_a_tree_budget_beyond_the_tokens_left_is_cut_to_them(loaded_target, close_draft, name, options):
    """Near max_new_tokens the engine allows fewer draft tokens than the tree budget: every tree keeps at most
    that many nodes (the best ones, still a tree), and the output is still plain greedy's."""
    draft = close_draft if name == "draft-model" else None
    drafter = build_drafter(name, loaded_target, draft, 8, tree_budget=24, tree_topk=4, tree_depth=8, **options)
    sizes: list[tuple[int, int]] = []  # (nodes drafted, max_tokens allowed)
    propose = drafter.propose

    def recording(committed, max_tokens, *args):
        result = propose(committed, max_tokens, *args)
        sizes.append((result.tokens.numel(), max_tokens))
        return result

    drafter.propose = recording
    pipe, plain = Pipeline(loaded_target, drafter), Pipeline(loaded_target, None)
    for prompt in ("a b a c a b a d a b a c a b", "Paris is the capital of France. Paris is"):
        for new in (1, 2, 3, 5, 8, 12):
            expected = plain.generate_plain(prompt, max_new_tokens=new).token_ids
            assert pipe.generate(prompt, max_new_tokens=new).token_ids == expected, (prompt, new)
    assert all(nodes <= allowed for nodes, allowed in sizes), sizes
    assert any(0 < nodes == allowed < 24 for nodes, allowed in sizes), sizes  # the cut was needed and made

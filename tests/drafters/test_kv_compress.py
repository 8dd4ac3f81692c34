"""Draft-side KV compression (MM-ShiftKV, HybridKV) as sparse-drafter selectors: selector contract, RoPE
shifting, head classification, and losslessness on tiny VLMs with the target cache untouched."""

from __future__ import annotations

import pytest
import torch
from vlm_models import KINDS, byte_tokenizer, moving_squares, tiny_processor, tiny_vlm

from sparrow.drafters import build_drafter
from sparrow.drafters.kv.compress import (
    SELECTORS,
    HybridKV,
    MMShiftKV,
    build_selector,
    covering_set,
    find_inv_freq,
    head_stability,
    rope_shift,
)
from sparrow.drafters.visual_prune import visual_span
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.runtime.runner import runner_for
from sparrow.vision.prompt import visual_token_positions
from sparrow.vision.video import Video

pytestmark = pytest.mark.usefixtures("one_thread")


def random_layer(seed: int, heads: int = 4, kv_heads: int = 2, w: int = 8, n: int = 80, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, w, d, generator=g), torch.randn(kv_heads, n, d, generator=g)


@pytest.mark.parametrize("name", SELECTORS)
@pytest.mark.parametrize("budget", [1, 7, 16, 50])
def test_selector_contract(name, budget):
    queries, keys = random_layer(budget)
    selector = build_selector(name, None) if name != "mm-shiftkv" else MMShiftKV(1.0 / 10000 ** (
        torch.arange(0, 16, 2).float() / 16), groups=8, samples=4)
    span = (10, 60)
    out = selector(queries, keys, budget, span, layer=0, scaling=0.25)
    assert out.shape == (2, budget) and out.dtype == torch.long  # exactly the budget per KV head
    for row in out.tolist():
        assert row == sorted(set(row)) and all(span[0] <= i < span[1] for i in row)
    again = selector(queries, keys, budget, span, layer=0, scaling=0.25)
    assert torch.equal(out, again)  # deterministic


def test_rope_shift_equals_rope_at_the_later_position():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    rope = LlamaRotaryEmbedding(config)
    x = torch.randn(1, 4, 3, 16)
    pos = torch.tensor([[5, 9, 30]])
    delta = torch.tensor([7, 0, 100])

    def at(p):
        cos, sin = rope(x, p)
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    torch.testing.assert_close(rope_shift(at(pos), delta, rope.inv_freq), at(pos + delta), atol=1e-5, rtol=1e-5)


def test_covering_set_is_smallest_top_set():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    assert covering_set(probs, 0.5).tolist() == [[False, True, False, False]]
    assert covering_set(probs, 0.75).tolist() == [[False, True, True, False]]
    assert covering_set(probs, 1.0).all()


def test_hybridkv_classifies_heads_and_retrieves_chunks():
    length = 32
    steady = torch.softmax(torch.randn(length), 0).expand(6, length)  # every query attends alike: static
    moving = torch.eye(length)[torch.tensor([0, 9, 17, 25, 30, 3])]  # each query looks elsewhere: dynamic
    stability = head_stability(torch.stack([steady, moving]))
    assert stability[0] == pytest.approx(1.0) and stability[1] < 0.5
    hybrid = HybridKV(static_threshold=0.5, chunk=4)
    picked = hybrid.chunk_retrieval(moving, 8).tolist()
    assert len(picked) == 8 and picked == sorted(picked)
    assert all(p // 4 in {0, 9 // 4} for p in picked)  # two whole chunks, the first retrieved ones


def test_unknown_policy_raises():
    with pytest.raises(ValueError, match="draft KV policy"):
        build_selector("snapkv")


# --- tiny Video-LLMs: lossless, budget kept, target cache untouched ---------------------------------------


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    tok = byte_tokenizer()
    model = tiny_vlm(request.param, tok, seed=0)
    return LoadedModel(model, tok, request.param, tiny_processor(request.param, tok))


def sparse_drafter(target: LoadedModel, policy: str, budget: int):
    drafter = build_drafter("sparse", target, None, 4, budget=budget, sinks=2, window=4,
                            span=visual_span(target.model.config), selector=build_selector(policy, target.model))
    return drafter


def media(name: str) -> dict:
    if name == "image":
        from PIL import Image

        return dict(image=Image.fromarray(moving_squares(1, 112, 112)[0]))  # Qwen: 16 tokens, LLaVA-OV: 88
    return dict(video=Video.from_array(moving_squares(16)))


@pytest.mark.parametrize("policy", ["topk", "mm-shiftkv", "hybridkv"])
@pytest.mark.parametrize("kind", ["video", "image"])
def test_draft_kv_policy_lossless_budget_and_target_untouched(vlm, policy, kind):
    pipe = Pipeline(vlm, None)
    plain = pipe.generate_plain("What moves?", max_new_tokens=30, **media(kind)).token_ids
    prompt = pipe.encode("What moves?", **media(kind))
    n = prompt.input_ids.numel()
    visual = visual_token_positions(prompt, vlm.model.config)
    budget = max(1, visual.numel() // 2)
    drafter = sparse_drafter(vlm, policy, budget)
    result = Pipeline(vlm, drafter).generate("What moves?", max_new_tokens=30, **media(kind))
    assert result.token_ids == plain
    assert 0 < result.stats.num_accepted_tokens <= result.stats.num_draft_tokens
    # budget per layer and KV head: all text (outside the visual span) plus `budget` visual entries
    assert budget < visual.numel()
    for kept in drafter.kept:
        assert kept.shape == (vlm.model.config.get_text_config().num_key_value_heads, n - visual.numel() + budget)
        assert int(torch.isin(kept, visual).sum(-1).min()) == budget
    # the target's cache is never touched by the drafter (prefill, then a round of drafting)
    target = runner_for(vlm.model)
    with drafter.watch_prefill(target):  # as the engine runs it: the capture records this prefill's queries
        target.prefill(prompt)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in target.cache.layers]
    drafter.prefill(prompt, target)
    committed = torch.cat([prompt.input_ids, torch.tensor([plain[0]])])
    drafter.propose(committed, 4, pipe.request("x").sampling, None)
    assert target.length == n
    for (k, v), layer in zip(before, target.cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


def test_find_inv_freq(vlm):
    inv = find_inv_freq(vlm.model)
    head_dim = vlm.model.config.get_text_config().hidden_size // vlm.model.config.get_text_config().num_attention_heads
    assert inv is not None and inv.shape == (head_dim // 2,)


def test_visual_span_covers_exactly_the_visual_tokens(vlm):
    from sparrow.types import Prompt

    pipe = Pipeline(vlm, None)
    prompt = pipe.encode("What moves?", **media("video"))
    visual = visual_token_positions(prompt, vlm.model.config)
    span = visual_span(vlm.model.config)
    assert span(prompt) == (int(visual[0]), int(visual[-1]) + 1) and span(prompt)[1] - span(prompt)[0] == visual.numel()
    assert span(Prompt(torch.tensor([1, 2, 3]))) == (0, 3)  # text only: the sparse drafter's default span


def test_cli_draft_kv_policy_is_lossless(tmp_path):
    import json

    from typer.testing import CliRunner
    from vlm_models import save_tiny_vlm, write_mp4

    from sparrow.cli import app

    directory = save_tiny_vlm("qwen2.5-vl", tmp_path / "tiny", seed=0)
    clip = write_mp4(tmp_path / "clip.mp4", moving_squares(16))
    result = CliRunner().invoke(app, [
        "generate", "What moves?", "--target", str(directory), "--drafter", "sparse", "--draft-kv", "mm-shiftkv",
        "--draft-kv-budget", "4", "--video", str(clip), "--frames", "16", "--dtype", "float32", "--device", "cpu",
        "--max-new-tokens", "12", "-k", "4", "--compare", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["identical"] is True and record["drafter"] == "sparse"


def test_configure_draft_kv_needs_a_sparse_drafter(vlm):
    from sparrow.drafters.kv.compress import configure_draft_kv

    with pytest.raises(ValueError, match="sparse drafter"):
        configure_draft_kv(build_drafter("visual-prune", vlm, None, 4), "hybridkv", 8)
    drafter = build_drafter("sparse", vlm, None, 4)
    configure_draft_kv(drafter, "hybridkv", 8)
    assert isinstance(drafter.selector, HybridKV) and drafter.budget == 8
    with pytest.raises(ValueError, match="budget"):
        configure_draft_kv(drafter, None, 0)

"""Decoding-step attention (`sparrow.runtime.attention.decode`): one query row, or rows under one mask, packed by KV
head gives transformers' sdpa result; everything else goes to sdpa; a switched model decodes as before, and its
speculative output equals plain."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_gemma3, tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.runtime.attention import capture as attention_capture
from sparrow.runtime.attention import decode as decode_attention
from sparrow.runtime.attention.rowwise import use_rowwise
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Prompt


class Attention(torch.nn.Module):
    """What transformers' attention functions read from the calling module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


def qkv(q: int, n: int, dtype: torch.dtype, heads: int = 12, kv_heads: int = 2, dim: int = 32):
    g = torch.Generator().manual_seed(q * 1000 + n)
    return (
        torch.randn(1, heads, q, dim, generator=g).to(dtype),
        torch.randn(1, kv_heads, n, dim, generator=g).to(dtype),
        torch.randn(1, kv_heads, n, dim, generator=g).to(dtype),
    )


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(decode_attention, "sdpa_attention_forward", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_one_query_row_packed_by_kv_head_equals_sdpa(dtype, n, sdpa_calls):
    module = Attention(groups=6)
    query, key, value = qkv(1, n, dtype)
    got, _ = decode_attention.attend(module, query, key, value, None, scaling=0.2, dropout=0.0)
    assert sdpa_calls == []  # the packed path ran
    want, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.2, dropout=0.0)
    assert got.shape == want.shape == (1, 1, 12, 32) and got.dtype == dtype
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tolerance)


def masks(rows: int, n: int) -> dict[str, torch.Tensor]:
    """sdpa-format masks [1, 1, rows, n] for `rows` new query rows after n - rows cached keys."""
    past = n - rows
    causal = torch.arange(n)[None, :] <= (past + torch.arange(rows))[:, None]
    tree = causal.clone()
    tree[2:, past] = False  # rows 2.. are a second branch: they do not see the first draft node
    additive = torch.zeros(rows, n).masked_fill(~causal, float("-inf"))
    return {name: m.view(1, 1, rows, n) for name, m in (("causal", causal), ("tree", tree), ("additive", additive))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal", "tree", "additive"])
@pytest.mark.parametrize("rows", [1, 5])
def test_masked_rows_packed_by_kv_head_equal_sdpa(dtype, kind, rows, sdpa_calls):
    """A verify forward: several rows, one mask for every head (causal over the cache, or a draft tree's); or one
    row with a mask over every slot (a step of the static cache, `sparrow.runtime.compiled`: the slots after the
    row's own are stale and masked)."""
    module = Attention(groups=6)
    query, key, value = qkv(rows, 40, dtype)
    mask = masks(rows, 40)[kind].to(dtype) if kind == "additive" else masks(rows, 40)[kind]
    if rows == 1:
        mask = mask.clone()
        mask[..., 30:] = float("-inf") if kind == "additive" else False
    got, _ = decode_attention.attend(module, query, key, value, mask, scaling=0.2, dropout=0.0)
    assert sdpa_calls == []
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2, dropout=0.0)
    assert got.shape == want.shape == (1, rows, 12, 32)
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize(("heads", "dim"), [(4, 64), (4, 128), (12, 128), (8, 256)])
def test_packed_rows_are_batch_invariant_by_construction(heads, dim, monkeypatch):
    """Every row of a k-row masked forward (a verify on the static cache: one mask over every slot) equals that row
    attended alone, bit for bit, for k = 1..12: the packed query rows are padded past torch's short query blocks
    (`decode.padding`), whose BLAS kernel rounds otherwise. Without the padding some of these differ (planted)."""
    module = Attention(groups=heads // 2)

    def rows_vs_singles() -> bool:
        for k in range(1, 13):
            query, key, value = qkv(k, 40, torch.float32, heads=heads, dim=dim)
            mask = masks(k, 40)["causal"]
            block, _ = decode_attention.attend(module, query, key, value, mask, scaling=0.1)
            for i in range(k):
                one, _ = decode_attention.attend(module, query[:, :, i:i + 1], key, value, mask[:, :, i:i + 1],
                                                 scaling=0.1)
                if not torch.equal(block[:, i:i + 1], one):
                    return False
        return True

    assert rows_vs_singles()
    short = decode_attention.short_blocks(dim, torch.float32)
    if any(heads // 2 * k % decode_attention.QUERY_BLOCK in short for k in range(1, 13)):  # a short block unpadded
        monkeypatch.setattr(decode_attention, "padding", lambda rows, dim, dtype: 0)
        assert not rows_vs_singles(), "the unpadded rows agreed: the test cannot tell"


def test_padding_skips_short_blocks():
    short = decode_attention.short_blocks(128, torch.float32)
    block = decode_attention.QUERY_BLOCK
    for rows in range(1, 3 * block):
        extra = decode_attention.padding(rows, 128, torch.float32)
        assert (rows + extra) % block not in short and extra < block
        assert extra == 0 or rows % block in short
    assert decode_attention.short_blocks(128, torch.float32) is short  # measured once


def test_rowwise_prefill_on_a_static_cache_attends_its_first_slots(tokenizer):
    """A static cache hands attention all its slots and transformers no mask for an unmasked prefill (sdpa's
    is_causal: row i sees keys 0..i); row-wise attention read that as the last rows of the cache and attended
    empty slots (a compiled exact Qwen2 decoded nonsense)."""
    from sparrow.runtime.compiled import StaticCachedModel

    model = tiny_model("qwen2", seed=0)
    ids = torch.tensor([5, 9, 33, 2, 71, 8, 15, 4, 60])
    with torch.inference_mode():
        want = CachedModel(model).prefill(Prompt(ids)).logits
        use_rowwise(model)
        got = StaticCachedModel(model).prefill(Prompt(ids)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_everything_else_goes_to_sdpa(sdpa_calls):
    query, key, value = qkv(1, 9, torch.float32)
    cases = [(Attention(6), qkv(3, 3, torch.float32), None, {"is_causal": True}),  # a prefill: causal, no mask
             (Attention(6), qkv(3, 9, torch.float32), masks(3, 9)["causal"].expand(1, 12, 3, 9), {}),  # per head
             (Attention(6), (query, key, value), None, {"dropout": 0.1}),  # training
             (Attention(6), (query, key, value), None, {"position_bias": torch.zeros(1, 1, 1, 9)}),
             (Attention(1), qkv(1, 9, torch.float32, kv_heads=12), None, {})]  # no grouped heads
    for module, (q, k, v), attention_mask, kwargs in cases:
        before = len(sdpa_calls)  # (the dropout case's output is random: only where it went is checked)
        decode_attention.attend(module, q, k, v, attention_mask, **kwargs)
        assert len(sdpa_calls) == before + 1


def fresh_pair(tokenizer, arch: str) -> tuple[LoadedModel, LoadedModel]:
    """The same tiny model twice: as loaded (sdpa) and switched."""
    plain, switched = tiny_model(arch, seed=3), tiny_model(arch, seed=3)
    assert decode_attention.use(switched) == 1 and decode_attention.use(switched) == 0  # once
    assert switched.config._attn_implementation == decode_attention.NAME
    return LoadedModel(plain, tokenizer, "sdpa"), LoadedModel(switched, tokenizer, "switched")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_switched_model_decodes_as_before_and_speculates_losslessly(tokenizer, arch, sdpa_calls):
    plain, switched = fresh_pair(tokenizer, arch)
    prompt = "the cat sat on the mat and the cat sat on the"
    want = Pipeline(plain, None).generate_plain(prompt, max_new_tokens=24).token_ids
    calls, layers = len(sdpa_calls), switched.model.config.num_hidden_layers
    assert Pipeline(switched, None).generate_plain(prompt, max_new_tokens=24).token_ids == want
    assert len(sdpa_calls) == calls + layers  # sdpa ran the prefill; the 23 decoding steps took the packed path
    pipe = Pipeline(switched, build_drafter("prompt-lookup", switched, None, 4))
    result = pipe.generate(prompt, max_new_tokens=24)
    assert result.token_ids == want and result.stats.num_accepted_tokens > 0
    assert len(sdpa_calls) == calls + 2 * layers  # only the prefills went to sdpa: verifies (masked) were packed
    close = LoadedModel(perturbed(switched.model, 0.05, seed=1), tokenizer, "close")  # a draft that branches
    tree = Pipeline(switched, build_drafter("draft-model", switched, close, 6, tree_budget=12, tree_topk=3,
                                            tree_depth=5))
    result = tree.generate(prompt, max_new_tokens=24)  # tree verifies: one mask for every head, packed
    assert result.token_ids == want and result.stats.num_accepted_tokens > 0 and result.stats.tree_steps > 0


def decode_logits(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    cm = CachedModel(model)
    logits = [cm.prefill(Prompt(ids)).logits[-1]]
    for _ in range(4):  # one-token steps: the packed path
        logits.append(cm.forward(logits[-1].argmax().view(1)).logits[-1])
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_query_capture_on_a_switched_model_is_bit_identical_to_it(tokenizer, arch):
    """The capture wrapper calls what it replaced: the packed path on a switched model, sdpa on an unswitched one
    (the two may differ in the last bits at some shapes)."""
    _, switched = fresh_pair(tokenizer, arch)
    ids = torch.tensor(tokenizer("the cat sat on the mat and the dog sat on the log")["input_ids"])
    want = decode_logits(switched.model, ids)
    with attention_capture.QueryCapture(switched.model, window=4) as capture:
        assert switched.model.config._attn_implementation == attention_capture.IMPLEMENTATION
        got = decode_logits(switched.model, ids)
    assert capture.layers and all(torch.equal(a, b) for a, b in zip(want, got))
    assert switched.model.config._attn_implementation == decode_attention.NAME  # restored


def test_rowwise_accepts_a_switched_model(tokenizer):
    _, switched = fresh_pair(tokenizer, "qwen2")
    assert use_rowwise(switched.model)


def test_sliding_window_layers_keep_their_masks(tokenizer):
    """Gemma-3's sliding layers mask old keys once the cache outgrows the window: those steps go to sdpa with the
    mask, and the output stays the model's own."""
    plain, switched = tiny_gemma3(seed=1), tiny_gemma3(seed=1)
    decode_attention.use(switched)
    prompt = "a b c d e f g h i j k l m n o p"
    want = Pipeline(LoadedModel(plain, tokenizer, "p"), None).generate_plain(prompt, max_new_tokens=20).token_ids
    got = Pipeline(LoadedModel(switched, tokenizer, "s"), None).generate_plain(prompt, max_new_tokens=20).token_ids
    assert got == want

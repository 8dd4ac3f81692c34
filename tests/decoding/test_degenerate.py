"""Degenerate sizes: every drafter that runs on a tiny text model equals plain greedy decoding token for token
(float32) on prompts of 1, 2, 3, ... tokens (shorter than its window, sinks, budget or n-gram size), k 1..8,
chains and trees, max_new_tokens from 1 up to a full context (prompt + new tokens == the model's context),
with drafts accepted; the sparse drafter's short-prompt crash (the CLI's --compare warm-up prompt "Hello")
and the model it leaves behind; Gemma-3's sliding-window cache rewound within and past its window, and the
drafters on prompts shorter than, equal to and past that window."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from conftest import CORPUS, VOCAB, perturbed, tiny_gemma3, tiny_model, tiny_tokenizer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from typer.testing import CliRunner

from sparrow.cli import app
from sparrow.config import SamplingConfig, StoppingConfig
from sparrow.decoding.engine import speculative_decode
from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.runtime.attention import capture as attention_capture
from sparrow.runtime.cached_model import CachedModel
from sparrow.stopping import Stopper
from sparrow.types import Prompt
from sparrow.verifiers import GreedyVerifier

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 32  # the small model's max_position_embeddings: full contexts stay cheap
ALPHABET = (40, 65, 69, 72, 76, 271)  # a few tokens: prompts repeat, so prompt lookup finds matches
EXAMPLES = 60  # hypothesis examples per drafter (plus the explicit @example rows)


def small_context_model(seed: int) -> torch.nn.Module:
    """conftest.tiny_model's Llama with a CONTEXT-token context."""
    torch.manual_seed(seed)  # tests only: model construction draws from the global generator
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than the default init, so greedy text is not all ties
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model.float().eval()


@pytest.fixture(scope="module")
def pair(tokenizer) -> tuple[LoadedModel, LoadedModel]:
    """(target, a perturbed copy as the draft), built once."""
    target = LoadedModel(small_context_model(0), tokenizer, "tiny")
    return target, LoadedModel(perturbed(target.model, 0.05, seed=1), tokenizer, "close")


@dataclass(frozen=True)
class Spec:
    """A drafter configuration: the registry name, its options, whether it drafts trees, its draft model."""

    name: str
    options: dict
    trees: bool = False
    draft: str | None = None  # "close": the perturbed copy; "self": the target itself

    def build(self, pair, k: int, adaptive: bool, tree: dict):
        target, close = pair
        draft = {"close": close, "self": target, None: None}[self.draft]
        return build_drafter(self.name, target, draft, k, adaptive, **self.options, **tree)


SPECS = {
    "draft-model": Spec("draft-model", {}, trees=True, draft="close"),
    "prompt-lookup": Spec("prompt-lookup", {}, trees=True),
    "suffix": Spec("suffix", {}, trees=True),
    "layer-skip": Spec("layer-skip", {"skip_set": "mlp=1", "backoff": False}, trees=True),
    "quantized-self-int8": Spec("quantized-self", {"bits": "int8"}, trees=True),
    "quantized-self-int4": Spec("quantized-self", {"bits": "int4", "group_size": 64}, trees=True),
    "cross-vocab": Spec("cross-vocab", {}, draft="self"),  # the byte bridge with one tokenizer: drafts accepted
    "sparse": Spec("sparse", {}),  # the defaults: sinks 4, window 32, budget 1024, all > the prompts here
    "sparse-topk": Spec("sparse", {"budget": 3, "sinks": 2, "window": 4}),
    "sparse-fraction": Spec("sparse", {"budget": 0.25, "sinks": 0, "window": 1}),
    "sparse-mm-shiftkv": Spec("sparse", {"draft_kv": "mm-shiftkv", "budget": 2, "sinks": 1, "window": 3}),
    "sparse-hybridkv": Spec("sparse", {"draft_kv": "hybridkv", "budget": 2, "sinks": 1, "window": 3}),
    "auto": Spec("auto", {}, trees=True, draft="close"),
}


@dataclass(frozen=True)
class Case:
    prompt: tuple[int, ...]
    max_new_tokens: int
    k: int
    adaptive: bool
    verifier: str
    tree: tuple[int, int, int] | None  # (budget, topk, depth), None: a chain


@st.composite
def cases(draw) -> Case:
    """Weighted toward the corners: prompts of 1-3 tokens, max_new_tokens 1, a full context."""
    rnd = draw(st.randoms(use_true_random=False))
    n = rnd.randint(1, 3) if rnd.random() < 0.3 else rnd.randint(1, CONTEXT - 1)
    room = CONTEXT - n  # max_new_tokens == room: a full context
    m = rnd.choice((room, 1, rnd.randint(1, room)))
    prompt = tuple(rnd.choice(ALPHABET) for _ in range(n))
    tree = (rnd.randint(1, 10), rnd.randint(1, 3), rnd.randint(1, 5)) if rnd.random() < 0.5 else None
    return Case(prompt, m, rnd.randint(1, 8), rnd.random() < 0.5, rnd.choice(("auto", "rejection")), tree)


PLAIN: dict[tuple[tuple[int, ...], int], list[int]] = {}


def plain_tokens(target: LoadedModel, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    key = (prompt, max_new_tokens)
    if key not in PLAIN:
        PLAIN[key] = Pipeline(target, None).generate_plain(list(prompt), max_new_tokens=max_new_tokens).token_ids
    return PLAIN[key]


@pytest.mark.parametrize("label", SPECS)
def test_degenerate_sizes_equal_plain(pair, label):
    """Every drafter x prompt length x k x chain/tree x max_new_tokens (1 .. a full context): plain greedy
    output, no exception; and drafts were accepted somewhere."""
    spec, target = SPECS[label], pair[0]
    totals = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    @example(case=Case((ALPHABET[0],), 1, 1, False, "auto", None))  # the shortest everything
    @example(case=Case((ALPHABET[0],), CONTEXT - 1, 8, False, "auto", (10, 3, 5)))  # one token, then a full context
    @example(case=Case((ALPHABET[1], ALPHABET[1]), 3, 2, True, "rejection", (1, 1, 1)))
    @example(case=Case(ALPHABET[:3] * 10 + ALPHABET[:1], 1, 8, False, "auto", (4, 2, 2)))  # CONTEXT - 1 tokens
    @example(case=Case(ALPHABET[:2] * 8, CONTEXT - 16, 4, True, "auto", None))  # repetitive, full context
    def check(case: Case) -> None:
        tree = {}
        if spec.trees and case.tree is not None:
            tree = dict(zip(("tree_budget", "tree_topk", "tree_depth"), case.tree))
        drafter = spec.build(pair, case.k, case.adaptive, tree)
        result = Pipeline(target, drafter, case.verifier).generate(list(case.prompt),
                                                                   max_new_tokens=case.max_new_tokens)
        assert result.token_ids == plain_tokens(target, case.prompt, case.max_new_tokens), result.stats
        assert result.stats.num_accepted_tokens <= result.stats.num_draft_tokens
        totals["cases"] += 1
        totals["accepted"] += result.stats.num_accepted_tokens

    check()
    assert totals["cases"] >= EXAMPLES and totals["accepted"] > 0, totals  # it really drafted


# --- the sparse drafter: the short-prompt crash, and the model it leaves behind -------------------------------

@pytest.mark.parametrize("prompt", [[65], [271], [40, 69], [40, 69, 76]])
def test_sparse_defaults_on_prompts_shorter_than_the_sinks(pair, prompt):
    """Regression: a prompt shorter than sinks (4) + window (32) made `kept_positions` call torch.arange with
    bounds in the wrong order ("upper bound and lower bound inconsistent with step sign"). Now every entry is
    kept: the draft is the target itself, so every draft token is accepted."""
    target = pair[0]
    result = Pipeline(target, build_drafter("sparse", target, None, 8)).generate(prompt, max_new_tokens=4)
    assert result.token_ids == plain_tokens(target, tuple(prompt), 4)
    assert result.stats.num_accepted_tokens == result.stats.num_draft_tokens > 0


def hello_tokenizer() -> PreTrainedTokenizerFast:
    """conftest's tiny tokenizer, trained so that "Hello" is one token (as in smollm2-135m's)."""
    return tiny_tokenizer(corpus=[*CORPUS, *["Hello"] * 8])


def test_cli_compare_with_sparse_on_a_one_token_prompt(tmp_path, monkeypatch):
    """Regression: `sparrow generate "Hello" --drafter sparse --compare` (its warm-up prompt is "Hello" too)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = hello_tokenizer()
    assert len(tokenizer("Hello")["input_ids"]) == 1
    tiny_model("llama", seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    result = CliRunner().invoke(app, ["generate", "Hello", "--target", str(tmp_path), "--drafter", "sparse",
                                      "--compare", "--json", "--dtype", "float32", "--device", "cpu",
                                      "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert '"identical": true' in result.stdout


def attention_state(model: torch.nn.Module) -> tuple:
    """Everything a capture could leave behind: every config's attention implementation, and hooks."""
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    return (sorted((id(c), c._attn_implementation) for c in configs.values()),
            model.config._attn_implementation,
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()))


def test_sparse_leaves_the_model_as_it_was(tokenizer):
    """Building, generating, failing inside the prefill, and dropping the pipeline leave the user's model on its
    own attention implementation, without hooks, with bit-identical plain outputs; the capture is switched on
    only for the target's prefill of a speculative generation."""
    model = tiny_model("llama", seed=5)
    target = LoadedModel(model, tokenizer, "tiny")
    ids = torch.tensor([[40, 69, 76, 76, 79, 271, 65]])
    with torch.inference_mode():
        before_logits = model(ids).logits
    before = attention_state(model)
    seen = []
    probe = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation))
    drafter = build_drafter("sparse", target, None, 4, budget=2, sinks=1, window=2)
    pipe = Pipeline(target, drafter)
    for prompt in ([65], ids[0].tolist()):
        seen.clear()
        result = pipe.generate(prompt, max_new_tokens=6)
        assert result.token_ids == Pipeline(target, None).generate_plain(prompt, max_new_tokens=6).token_ids
        assert seen[0] == attention_capture.IMPLEMENTATION  # the target's prefill
        assert set(seen[1:]) == {"sdpa"}  # verification and the drafter's own forwards
    seen.clear()
    pipe.generate_plain(ids[0].tolist(), max_new_tokens=3)
    with torch.inference_mode():
        model(ids)  # the user's own forward: neither switched nor recorded
    assert set(seen) == {"sdpa"} and drafter.capture.layers == {}
    probe.remove()
    assert attention_state(model) == before
    # a prefill that fails inside the capture (a token id past the vocabulary) still switches the model back
    runner = pipe.runner
    with pytest.raises(IndexError):
        speculative_decode(runner, drafter, GreedyVerifier(), Prompt(torch.tensor([10 ** 6])), SamplingConfig(),
                           Stopper(StoppingConfig(max_new_tokens=2), tokenizer), None)
    assert attention_state(model) == before and not drafter.capture.active
    del pipe, drafter
    assert attention_state(model) == before
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before_logits)


def test_capture_restores_what_was_there_and_nests(tokenizer):
    """Two captures on one model (nested and interleaved): the model runs the wrapper while either is active,
    and is restored to its own implementation when the last one stops."""
    model = tiny_model("qwen2", seed=6)
    first = attention_capture.QueryCapture(model, window=2)
    second = attention_capture.QueryCapture(model, window=3)
    with first:
        with second:
            assert model.config._attn_implementation == attention_capture.IMPLEMENTATION
        assert model.config._attn_implementation == attention_capture.IMPLEMENTATION and first.active
    assert model.config._attn_implementation == "sdpa"
    first.start()
    second.start()
    first.stop()
    assert model.config._attn_implementation == attention_capture.IMPLEMENTATION
    second.stop()
    assert model.config._attn_implementation == "sdpa" and attention_capture._SWITCHED == {}


def test_sparse_refuses_a_model_without_sdpa(tokenizer):
    model = tiny_model("llama", seed=7)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        build_drafter("sparse", LoadedModel(model, tokenizer, "tiny"), None, 4)
    assert model.config._attn_implementation == "eager"


# --- sliding-window caches rewound into their prompt ------------------------------------------------------------

@pytest.mark.parametrize("n, back", [(3, 1), (6, 2), (7, 5)])
def test_sliding_window_cache_rewinds_within_its_window(n, back):
    """A prompt shorter than Gemma-3's window (8) can be rewound into, as a full-attention cache."""
    model = tiny_gemma3()
    ids = torch.arange(1, n + 1)
    runner, fresh = CachedModel(model), CachedModel(model)
    runner.prefill(Prompt(ids))
    runner.rewind(n - back)
    fresh.prefill(Prompt(ids[: n - back]))
    token = torch.tensor([7, 8])
    torch.testing.assert_close(runner.forward(token).logits, fresh.forward(token).logits, atol=1e-5, rtol=0)


def test_sliding_window_cache_refuses_to_rewind_into_a_full_window():
    """Past the window, prefill keeps only the window: a rewind into the prompt fails at once and says why, instead
    of breaking the next forward with a mask/key size mismatch (what a cross-vocab draft on Gemma-3 hit)."""
    runner = CachedModel(tiny_gemma3())
    runner.prefill(Prompt(torch.arange(1, 18)))
    with pytest.raises(AssertionError, match="sliding-window layer"):
        runner.rewind(16)
    runner.forward(torch.tensor([7, 8, 9]))
    runner.rewind(17)  # what was fed since the prefill can go


@pytest.mark.parametrize("name", ["cross-vocab", "draft-model", "prompt-lookup", "layer-skip"])
def test_sliding_window_drafters_on_short_and_long_prompts(tokenizer, name):
    """Gemma-3 (window 8): prompts shorter than, equal to and past the window. Regression: cross-vocab rewound
    its draft into the prompt it had just prefilled (now it prefills all but the last draft token)."""
    model = tiny_gemma3()
    target = LoadedModel(model, tokenizer, "gemma")
    options = {"skip_set": "mlp=1", "backoff": False} if name == "layer-skip" else {}
    draft = target if name in ("cross-vocab", "draft-model") else None
    pipe = Pipeline(target, build_drafter(name, target, draft, 4, **options))
    accepted = 0
    for n in (1, 3, 8, 20):
        prompt = [(7 * i + 3) % 300 + 1 for i in range(n)]
        result = pipe.generate(prompt, max_new_tokens=12)
        assert result.token_ids == Pipeline(target, None).generate_plain(prompt, max_new_tokens=12).token_ids
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0

"""CUDA checks (skipped without a GPU): bf16 greedy speculative decoding agrees with plain decoding of
the same bf16 model, and the verifiers and the sampler run on CUDA tensors with CUDA generators.

bf16 smoke tests on top of the exact fp32 CPU tests (test_equivalence.py): scoring k + 1 tokens in one
forward uses other kernels than decoding one token, and bf16 can flip near-ties, so agreement is a rate.
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_model

from sparrow import sampling as S
from sparrow.config import GREEDY, SamplingConfig
from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.types import Draft
from sparrow.verifiers import GreedyVerifier, RejectionVerifier
from sparrow.verifiers.loose import fidelity

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is", "for i in range(10):",
           "Speculative decoding drafts tokens", "The dog sleeps.", "Berlin is the capital of", "print(i * i)"]


def on_cuda_bf16(model: torch.nn.Module) -> torch.nn.Module:
    return model.to(device="cuda", dtype=torch.bfloat16)


def agreeing_tokens(pipe: Pipeline, prompt: str, spec: list[int]) -> int:
    """How many of `spec` equal plain decoding's choice after the same prefix. Plain decoding restarts from
    the speculative prefix after each disagreement, so one bf16 near-tie flip costs one token, not the rest."""
    ids = pipe.encode(prompt).input_ids.tolist()
    agree = i = 0
    while i < len(spec):
        plain = pipe.generate_plain(ids + spec[:i], max_new_tokens=len(spec) - i).token_ids
        same = next((j for j, (a, b) in enumerate(zip(plain, spec[i:])) if a != b), min(len(plain), len(spec) - i))
        agree += same
        i += same + 1  # skip the disagreeing token
    return agree


@pytest.mark.parametrize("k", [2, 4])
def test_bf16_greedy_speculative_output_agrees_with_plain_decoding(tokenizer, k):
    target_model = tiny_model("llama", seed=0)
    draft_model = perturbed(target_model, 0.05, seed=1)  # partial acceptance: both accepts and rejections
    target = LoadedModel(on_cuda_bf16(target_model), tokenizer, "tiny-bf16")
    draft = LoadedModel(on_cuda_bf16(draft_model), tokenizer, "close-bf16")
    pipe = Pipeline(target, build_drafter("draft-model", target, draft, k))
    plain = [pipe.generate_plain(p, max_new_tokens=40).token_ids for p in PROMPTS]
    spec = [pipe.generate(p, max_new_tokens=40) for p in PROMPTS]
    ids = [r.token_ids for r in spec]
    rate = sum(agreeing_tokens(pipe, p, s) for p, s in zip(PROMPTS, ids)) / sum(map(len, ids))
    print(f"bf16 cuda k={k}: per-token agreement {rate:.4f}; whole outputs {fidelity(ids, plain).to_dict()}")
    assert sum(r.stats.num_accepted_tokens for r in spec) > 0
    assert rate >= 0.9


def logits_for(choices: list[int], vocab: int = 10) -> torch.Tensor:
    out = torch.full((len(choices), vocab), -10.0, device="cuda")
    out[torch.arange(len(choices)), torch.tensor(choices)] = 10.0
    return out


@pytest.mark.parametrize("verifier", [GreedyVerifier(), RejectionVerifier()])
def test_verifiers_on_cuda_tensors(verifier):
    g = torch.Generator(device="cuda").manual_seed(0)
    chain = Draft(tokens=torch.tensor([3, 7, 5], device="cuda"))
    verdict = verifier.verify(chain, logits_for([3, 4, 5, 6]), GREEDY, g)
    assert verdict.tokens.device.type == "cuda" and verdict.tokens.tolist() == [3, 4] and verdict.num_accepted == 1
    tree = Draft(tokens=torch.tensor([3, 5, 4, 6, 7], device="cuda"),
                 parents=torch.tensor([-1, -1, 0, 1, 3], device="cuda"))
    verdict = verifier.verify(tree, logits_for([5, 0, 6, 0, 7, 9]), GREEDY, g)
    assert verdict.tokens.tolist() == [5, 6, 7, 9] and verdict.path.tolist() == [1, 3, 4]


@pytest.mark.parametrize("parents", [None, [-1, -1, 0, 1]])
def test_rejection_sampling_on_cuda_is_reproducible_and_draws_target_tokens(parents):
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    target = torch.randn(5, 50, generator=torch.Generator().manual_seed(2)).cuda()
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), -1).cuda()
    tokens = torch.multinomial(probs, 1, generator=torch.Generator(device="cuda").manual_seed(4))[:, 0]
    draft = Draft(tokens=tokens, probs=probs,
                  parents=None if parents is None else torch.tensor(parents, device="cuda"))
    runs = [RejectionVerifier().verify(draft, target, sampling, torch.Generator(device="cuda").manual_seed(7))
            for _ in range(3)]
    assert runs[0].tokens.tolist() == runs[1].tokens.tolist() == runs[2].tokens.tolist()
    allowed = S.probs(target, sampling) > 0  # [5, 50]: the last token must have target probability > 0
    rows = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), runs[0].accepted_nodes + 1])
    assert bool(allowed[rows[-1], runs[0].tokens[-1]])


def test_exponential_race_on_cuda_follows_the_distribution():
    p = torch.tensor([0.0, 0.1, 0.2, 0.0, 0.3, 0.4], device="cuda")
    n = 200_000
    draws = S.sample(p.expand(n, -1), torch.Generator(device="cuda").manual_seed(0))
    counts = torch.bincount(draws, minlength=p.numel()).float()
    assert counts[0] == 0 and counts[3] == 0
    assert ((counts - n * p).abs() <= 6 * (n * p * (1 - p)).sqrt() + 5).all(), counts


CUDA_DRAFTERS = [  # (drafter, uses the perturbed draft model, options)
    ("draft-model", True, {}),
    ("draft-model", True, {"tree_budget": 12, "tree_topk": 3, "tree_depth": 5}),
    ("prompt-lookup", False, {}),
    ("prompt-lookup", False, {"tree_budget": 12}),
    ("quantized-self", False, {"bits": "int8"}),
    ("layer-skip", False, {"skip_set": "mlp=2-3"}),
    ("layer-skip", False, {"skip_set": "mlp=2-3", "tree_budget": 12}),
    ("sparse", False, {}),
    ("auto", True, {}),
]


@pytest.mark.parametrize("name,with_draft,options", CUDA_DRAFTERS)
def test_every_drafter_is_exact_in_float32_on_cuda(tokenizer, name, with_draft, options):
    """The CPU equivalence tests, on CUDA tensors: greedy output equals plain greedy token for token, and
    drafts were accepted (no drafter may leave a tensor on the CPU or assume one)."""
    target_model = tiny_model("llama", seed=0, num_layers=4)
    draft_model = perturbed(target_model, 0.05, seed=1).cuda()
    target = LoadedModel(target_model.cuda(), tokenizer, "tiny-cuda")
    draft = LoadedModel(draft_model, tokenizer, "close-cuda") if with_draft else None
    pipe = Pipeline(target, build_drafter(name, target, draft, 4, **options))
    prompts = [*PROMPTS, "a b a c a b a d a b a c a b a"]
    accepted = 0
    for prompt in prompts:
        expected = pipe.generate_plain(prompt, max_new_tokens=32).token_ids
        result = pipe.generate(prompt, max_new_tokens=32)
        assert result.token_ids == expected, (name, options, prompt)
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0, (name, options)

"""Temperature, top-k and top-p produce the distributions they promise."""

from __future__ import annotations

import pytest
import torch

from sparrow import sampling as S
from sparrow.config import SamplingConfig


def test_greedy_probs_are_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert S.probs(logits, SamplingConfig()).tolist() == [[0, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_picks_what_argmax_picks_ties_and_nan_included(dtype):
    """`greedy` (torch.max's indices, the faster reduction) is argmax: the first of tied maxima, and NaN as the
    maximum; rows of coarse values tie often."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4000, 64, generator=g) * 2).round().to(dtype)  # integers in ~[-8, 8]: many ties per row
    logits[7, 3] = logits[9, 60] = float("nan")
    assert (logits == logits.max(-1, keepdim=True).values).sum(-1).gt(1).float().mean() > 0.3  # the ties are there
    assert torch.equal(S.greedy(logits), logits.argmax(-1))
    assert torch.equal(S.greedy(logits[5]), logits[5].argmax())  # a single row
    assert S.greedy(logits)[7] == 3 and S.greedy(logits)[9] == 60


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    expected = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(S.probs(logits, SamplingConfig(temperature=0.5)), expected)


def test_top_k_keeps_k_tokens_renormalised():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    p = S.probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert p[0] == 0 and p[3] == 0
    assert torch.allclose(p[1:3], torch.softmax(torch.tensor([4.0, 3.0]), -1))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = S.probs(probs.log(), SamplingConfig(temperature=1.0, top_p=0.75))
    assert p.tolist()[2:] == [0.0, 0.0]  # 0.5 + 0.3 >= 0.75: tokens 0, 1 kept
    assert torch.allclose(p[:2], torch.tensor([0.625, 0.375]))
    p = S.probs(probs.log(), SamplingConfig(temperature=1.0, top_p=0.1))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]  # the top token always stays


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_bad_sampling_values_name_the_argument(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingConfig(**kwargs)


def test_sample_follows_the_distribution_and_never_picks_zero_probability():
    """Exponential race: frequencies within 6 standard deviations (+ 5) of p; p = 0 never drawn."""
    p = torch.tensor([0.0, 0.1, 0.2, 0.0, 0.3, 0.4])
    n = 20_000
    draws = S.sample(p.expand(n, -1), torch.Generator().manual_seed(0))  # [n]
    assert draws.shape == (n,) and draws.dtype == torch.long
    counts = torch.bincount(draws, minlength=p.numel()).float()
    assert counts[0] == 0 and counts[3] == 0
    assert ((counts - n * p).abs() <= 6 * (n * p * (1 - p)).sqrt() + 5).all(), counts


def test_sample_needs_no_normalisation_and_keeps_batch_shape():
    p = torch.tensor([[[0.0, 3.0, 0.0]], [[5.0, 0.0, 0.0]]])  # [2, 1, 3], unnormalised one-hot rows
    assert S.sample(p, None).tolist() == [[1], [0]]


def test_sample_is_reproducible_with_a_seeded_generator():
    p = torch.softmax(torch.randn(8, 50, generator=torch.Generator().manual_seed(1)), -1)
    runs = [S.sample(p, torch.Generator().manual_seed(3)).tolist() for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_sample_never_picks_zero_probability_when_an_exponential_is_zero(monkeypatch):
    """E = 0 would make 0 / 0 = nan, which argmax picks; the clamp keeps zero-probability tokens at 0."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, generator=None: self.zero_())
    assert S.sample(torch.tensor([0.0, 0.0, 0.6, 0.4]), None).tolist() == 2

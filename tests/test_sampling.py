"""Temperature, top-k and top-p produce the distributions they promise."""

from __future__ import annotations

import pytest
import torch

from sparrow import sampling as S
from sparrow.config import SamplingConfig


def test_greedy_probs_are_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert S.probs(logits, SamplingConfig()).tolist() == [[0, 1, 0], [1, 0, 0]]


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

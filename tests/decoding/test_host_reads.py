"""Host reads per round: each `.item()`, `.tolist()`, `int()` / `bool()` of a tensor, `.cpu()` or data-dependent
shape (`nonzero`, `masked_select`, `unique`) is, on a GPU, a device-to-host copy that waits for the device. Counted
here on the CPU (where the same calls run), per speculative round: the verifier's one read, plus at most one of the
drafter's (issue #41: one host sync per round is the aim; the drafter's read of the committed tokens is what is
left)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import perturbed, tiny_model, tiny_tokenizer
from torch.overrides import TorchFunctionMode

from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero", "masked_select",
         "unique", "argwhere"}


class HostReads(TorchFunctionMode):
    """Counts the torch calls that read a tensor's values (or its data-dependent shape) back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny")


def reads_per_round(pipe: Pipeline, prompt: str, plain: bool = False) -> tuple[float, int]:
    run = pipe.generate_plain if plain else pipe.generate
    run(prompt, max_new_tokens=8)  # warm: lazy set-up reads stay out
    with HostReads() as reads:
        result = run(prompt, max_new_tokens=40)
    rounds = result.stats.steps if not plain else len(result.token_ids)
    return sum(reads.counts.values()) / rounds, result.stats.num_accepted_tokens


@pytest.mark.parametrize("name", ["draft-model", "prompt-lookup", "suffix"])
def test_a_chain_round_reads_the_device_at_most_twice(target, name):
    draft = LoadedModel(perturbed(target.model, 0.05, seed=1), target.tokenizer, "close") if name == "draft-model" \
        else None
    pipe = Pipeline(target, build_drafter(name, target, draft, 4))
    per_round, accepted = reads_per_round(pipe, "The quick brown fox jumps over the lazy dog. The quick brown")
    assert accepted > 0  # rounds that verified drafts were counted
    assert per_round <= 2.2, per_round  # (+ the first token's read, once a generation)


def test_plain_decoding_reads_once_per_token(target):
    per_token, _ = reads_per_round(Pipeline(target, None), "def add(a, b):", plain=True)
    assert per_token <= 1.05, per_token


def test_the_counter_sees_each_kind_of_read():  # negative control: a read the counter would miss passes anything
    x = torch.arange(4)
    with HostReads() as reads:
        x.tolist(), int(x[0]), bool(x[1]), x.nonzero(), x.cpu(), x[2].item()
    assert sum(reads.counts.values()) >= 6

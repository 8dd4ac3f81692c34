"""sparrow calls transformers and torch only through their current APIs: a generate through each main path
(plain, draft model, prompt lookup, tree, EAGLE head, a serving batch) raises no FutureWarning or
DeprecationWarning and logs no deprecation notice from transformers (such as "`past_key_values` is deprecated",
raised by every forward that still passes the cache under its old name). The warnings are recorded around
sparrow's calls only, so a deprecation inside the test's own setup does not count; transformers' "warn once"
memory is cleared first, so a notice an earlier test already printed is caught again here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import transformers
from conftest import perturbed, tiny_gemma3, tiny_model, tiny_tokenizer

from sparrow.decoding.batch import Batch
from sparrow.drafters import build_drafter
from sparrow.heads.factory import new_head
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Paris is the capital of France. Paris is"
DEPRECATIONS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


class _Notices(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecat" in message.lower():
            self.messages.append(message)


@contextmanager
def no_deprecations() -> Iterator[None]:
    """Fails if the block raises a Future/DeprecationWarning or transformers logs a deprecation notice."""
    logging.Logger.warning_once.cache_clear()  # transformers' warn-once memory (functools.lru_cache)
    notices = _Notices()
    logger = transformers.logging.get_logger("transformers")
    logger.addHandler(notices)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.removeHandler(notices)
    raised = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
              if issubclass(w.category, DEPRECATIONS)]
    assert not raised, raised
    assert not notices.messages, notices.messages


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny")


@pytest.fixture(scope="module")
def draft(target) -> LoadedModel:
    return LoadedModel(perturbed(target.model, 0.05, seed=1), target.tokenizer, "close")


def _draft_model(target, draft):
    return build_drafter("draft-model", target, draft, 4)


def _tree(target, draft):
    return build_drafter("draft-model", target, draft, 4, tree_budget=8, tree_topk=2, tree_depth=3)


def _prompt_lookup(target, draft):
    return build_drafter("prompt-lookup", target, None, 4)


def _eagle(target, draft):
    head = new_head(target.model, "eagle3", torch.Generator().manual_seed(5))
    return build_drafter("eagle", target, None, 4, head=head)


PATHS: dict[str, Callable] = {"draft-model": _draft_model, "tree": _tree, "prompt-lookup": _prompt_lookup,
                              "eagle": _eagle}


def test_plain_generate_raises_no_deprecation(target):
    pipe = Pipeline(target, None)
    with no_deprecations():
        assert len(pipe.generate_plain(PROMPT, max_new_tokens=8).token_ids) == 8


@pytest.mark.parametrize("path", sorted(PATHS))
def test_speculative_generate_raises_no_deprecation(target, draft, path):
    pipe = Pipeline(target, PATHS[path](target, draft))
    with no_deprecations():
        result = pipe.generate(PROMPT, max_new_tokens=12)
    assert len(result.token_ids) == 12 and result.stats.num_draft_tokens > 0


def test_sliding_window_model_raises_no_deprecation():
    """Gemma-3's sliding-window layers take the cache through their own code path (rewind, window masks)."""
    model = tiny_gemma3()
    target = LoadedModel(model, tiny_tokenizer(), "gemma")
    draft = LoadedModel(perturbed(model, 0.05, seed=1), target.tokenizer, "close")
    pipe = Pipeline(target, _tree(target, draft))
    with no_deprecations():
        assert pipe.generate(PROMPT, max_new_tokens=10).stats.num_draft_tokens > 0


@pytest.mark.parametrize("plain", [True, False])
def test_a_serving_batch_raises_no_deprecation(target, draft, plain):
    pipe = Pipeline(target, None if plain else _draft_model(target, draft))
    batch = Batch(target.model, BatchPolicy(adaptive=False))
    with no_deprecations():
        gens = [pipe.sequence(p, max_new_tokens=6, plain=plain) for p in (PROMPT, "def add(a, b):")]
        for gen in gens:
            batch.add(gen)
        while len(batch):
            batch.step()
        results = [pipe.result(gen) for gen in gens]
    for gen in gens:
        pipe.release(gen)
    assert [len(r.token_ids) for r in results] == [6, 6]


def test_the_check_catches_the_deprecated_cache_name(target):
    """Negative control: passing the cache as `past_key_values` (what sparrow did before) fails the check."""
    ids = target.tokenizer(PROMPT, return_tensors="pt").input_ids
    cache = transformers.DynamicCache(config=target.model.config)
    with pytest.raises(AssertionError, match="past_key_values"):
        with no_deprecations(), torch.inference_mode():
            target.model(input_ids=ids, past_key_values=cache, use_cache=True)

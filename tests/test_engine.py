"""`sparrow.engine.Engine`: batched, streaming generation without the server.

Requests submitted at different steps share steps and each equals plain greedy decoding of its prompt alone (float32,
drafts accepted); a bad request is refused at `submit` and never queued; `on_text` streams each request's text and
ends it when it returns a finish reason; a failing step fails the requests it ran and the engine goes on; a model
batching does not support (sliding-window layers) runs one request a step, whole; `prepare` seeds both cost tables.
"""

from __future__ import annotations

import pytest
from conftest import perturbed, tiny_gemma3, tiny_model, tiny_tokenizer

from sparrow.drafters import build_drafter
from sparrow.engine import Engine
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["def add(a, b):", "The quick brown fox", "Paris is the capital of France. Paris is", "a", "def f(x):"]
BUDGETS = [40, 12, 33, 25, 18]


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    target = LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")
    draft = LoadedModel(model=perturbed(target.model, 0.3, seed=1), tokenizer=target.tokenizer, name="draft")
    return Pipeline(target, build_drafter("draft-model", target, draft, 4))


def run(engine: Engine, arrivals: dict[int, list[int]]) -> tuple[dict, int]:
    """Submit PROMPTS[i] for i in arrivals[step] before that step; step until idle. (results by i, widest step)"""
    submitted, widest, step = {}, 0, 0
    while step <= max(arrivals) or engine.busy:
        for i in arrivals.get(step, []):
            submitted[i] = engine.submit(PROMPTS[i], max_new_tokens=BUDGETS[i])
        widest = max(widest, engine.size)
        for done in engine.step():
            assert done.error is None, done.error
        step += 1
    assert all(s.done for s in submitted.values())
    return {i: s.result for i, s in submitted.items()}, widest


def test_requests_joining_at_different_steps_each_equal_plain_decoding(pipe):
    engine = Engine(pipe, max_batch=4, policy=BatchPolicy(adaptive=False))
    results, widest = run(engine, {0: [0, 1], 2: [2], 3: [3, 4]})
    for i, result in results.items():
        assert result.token_ids == pipe.generate_plain(PROMPTS[i], max_new_tokens=BUDGETS[i]).token_ids, PROMPTS[i]
    assert widest > 1, "requests never shared a step"
    assert sum(r.stats.num_accepted_tokens for r in results.values()) > 0, "no draft was accepted"


def test_room_and_size_follow_max_batch(pipe):
    engine = Engine(pipe, max_batch=2)
    assert engine.room == 2 and not engine.busy
    engine.submit(PROMPTS[0], max_new_tokens=4)
    engine.submit(PROMPTS[1], max_new_tokens=4)
    assert engine.room == 0 and engine.size == 2
    while engine.busy:
        engine.step()
    assert engine.room == 2


def test_a_bad_request_is_refused_at_submit_and_never_queued(pipe):
    engine = Engine(pipe)
    with pytest.raises(UserError, match="temperature"):
        engine.submit(PROMPTS[0], temperature=-1.0)
    with pytest.raises(UserError, match="unknown option"):
        engine.submit(PROMPTS[0], max_tokens=3)
    assert not engine.busy and engine.step() == []
    with pytest.raises(UserError, match="max_batch"):
        Engine(pipe, max_batch=0)


def test_on_text_streams_and_a_finish_reason_from_it_ends_the_request(pipe):
    engine = Engine(pipe, max_batch=2)
    pieces: list[str] = []

    def stop_after_two(text: str) -> str | None:
        pieces.append(text)
        return "cancelled" if len(pieces) >= 2 else None

    short = engine.submit(PROMPTS[0], max_new_tokens=40, on_text=stop_after_two)
    other = engine.submit(PROMPTS[1], max_new_tokens=12)
    while engine.busy:
        engine.step()
    assert short.result.finish_reason == "cancelled" and "".join(pieces) == short.result.text
    assert len(short.result.token_ids) < 40
    assert other.result.token_ids == pipe.generate_plain(PROMPTS[1], max_new_tokens=12).token_ids


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(pipe, monkeypatch):
    engine = Engine(pipe, max_batch=2)
    first = engine.submit(PROMPTS[0], max_new_tokens=20)
    engine.step()  # prefilled and one round
    monkeypatch.setattr(engine._batch, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    failed = engine.step()
    assert failed == [first] and isinstance(first.error, RuntimeError) and first.result is None
    monkeypatch.undo()
    again = engine.submit(PROMPTS[1], max_new_tokens=12)
    while engine.busy:
        engine.step()
    assert again.result.token_ids == pipe.generate_plain(PROMPTS[1], max_new_tokens=12).token_ids


def test_an_unbatched_model_runs_one_request_a_step_whole():
    target = LoadedModel(model=tiny_gemma3(num_layers=2), tokenizer=tiny_tokenizer(), name="gemma")
    pipe = Pipeline(target, build_drafter("prompt-lookup", target, None, 4))
    engine = Engine(pipe, max_batch=4)
    assert "sliding" in engine.unbatched and engine.room == 1
    with pytest.raises(UserError, match="top_p"):
        engine.submit(PROMPTS[0], top_p=2.0)
    first = engine.submit(PROMPTS[0], max_new_tokens=10)
    assert engine.room == 0
    assert engine.step() == [first]
    assert first.result.token_ids == pipe.generate_plain(PROMPTS[0], max_new_tokens=10).token_ids


def test_prepare_seeds_both_cost_tables_once(pipe):
    engine = Engine(pipe, max_batch=4)
    engine.prepare()
    assert sorted(engine.policy.verify.bins) == [1, 2, 3] and sorted(engine.policy.draft.bins) == [1, 2, 3]
    bins = {k: v.mean(2) for k, v in engine.policy.verify.bins.items()}
    engine.prepare()  # known: not measured again
    assert {k: v.mean(2) for k, v in engine.policy.verify.bins.items()} == bins


def test_a_result_says_what_ran(pipe):
    """`GenerationResult.ran`: the drafter and formats, alone and batched alike; plain decoding says "none"."""
    alone = pipe.generate(PROMPTS[0], max_new_tokens=8).ran
    assert (alone.drafter, alone.dtype, alone.quant, alone.draft_quant, alone.compiled, alone.exact, alone.tree) == (
        "draft-model", "float32", None, None, False, False, None)
    assert pipe.generate_plain(PROMPTS[0], max_new_tokens=8).ran.drafter == "none"
    engine = Engine(pipe)
    batched = engine.submit(PROMPTS[1], max_new_tokens=8)
    while engine.busy:
        engine.step()
    assert batched.result.ran == alone

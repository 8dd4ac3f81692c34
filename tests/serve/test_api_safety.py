"""The public API under misuse: threads, errors mid-generation, many option combinations, odd arguments.

a) Threads: one pipeline (and a second one on the same LoadedModel) used from several threads gives every
   caller exactly what a single thread gets; `sparrow.generate` too.
b) An exception (or KeyboardInterrupt) inside a drafter's or the target's forward leaves the pipeline usable
   and its locks released: the next generation equals plain greedy decoding.
c) `sparrow.generate`'s cache is bounded: pipelines that differ in drafter options share one loaded model,
   and at most `size` pipelines are kept (asserted by counting loads and models, not by timing).
d) Argument checks: prompts (text, bytes, token ids), `stop`, `seed`, `max_new_tokens` and friends.
"""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch
from conftest import perturbed, tiny_model, tiny_tokenizer

import sparrow
from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.loading import PipelineCache
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "Paris is the capital",
           "Speculative decoding drafts", "The dog sleeps.", "return a + b", "print(i * i)"]
THREADS, PER_THREAD = 4, 4


@pytest.fixture(scope="module")
def target(one_thread) -> LoadedModel:
    return LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")


@pytest.fixture(scope="module")
def pipe(target) -> Pipeline:
    """Draft-model drafter on a perturbed copy: partial acceptance, so caches are cropped every round."""
    draft = LoadedModel(model=perturbed(target.model, 0.3, seed=1), tokenizer=target.tokenizer, name="draft")
    return Pipeline(target, build_drafter("draft-model", target, draft, 4))


def job(i: int) -> dict:
    """The i-th request: different prompts, lengths, stop strings, greedy and seeded sampling."""
    options = dict(max_new_tokens=16 + 3 * (i % 5))
    if i % 3 == 1:
        options.update(temperature=0.8, seed=i)
    if i % 4 == 2:
        options.update(stop=" the")
    return dict(prompt=PROMPTS[i % len(PROMPTS)], **options)


def run_threads(work, n: int = THREADS) -> list:
    """work(thread, barrier) in n threads started together; their return values (errors re-raised)."""
    barrier, results, errors = threading.Barrier(n), [None] * n, []

    def body(t: int) -> None:
        try:
            results[t] = work(t, barrier)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread hung (a lock left held?)"
    if errors:
        raise errors[0]
    return results


def outcome(result) -> tuple:
    return result.token_ids, result.text, result.finish_reason


# --- a) threads -----------------------------------------------------------------------------------------

def test_one_pipeline_from_many_threads_equals_one_thread(pipe, target):
    """4 threads x 4 generations on one pipeline, and plain decoding on a second pipeline built on the same
    LoadedModel (same module, separate runner) interleaved: every result equals the single-threaded one."""
    other = Pipeline(target, None)
    jobs = [job(i) for i in range(THREADS * PER_THREAD)]
    expected = [outcome(pipe.generate(**j)) for j in jobs]
    expected_plain = [outcome(other.generate_plain(**j)) for j in jobs]

    def work(t: int, barrier: threading.Barrier) -> list:
        barrier.wait()
        out = []
        for i in range(t, len(jobs), THREADS):
            out.append((i, outcome(pipe.generate(**jobs[i]))))
            out.append((-1 - i, outcome(other.generate_plain(**jobs[i]))))
        return out

    got = dict(pair for results in run_threads(work) for pair in results)
    assert [got[i] for i in range(len(jobs))] == expected
    assert [got[-1 - i] for i in range(len(jobs))] == expected_plain


def test_sparrow_generate_from_many_threads(monkeypatch, target):
    """The one-call API shares its cached pipelines between threads; k varies per call."""
    cache = PipelineCache(size=2)
    monkeypatch.setattr(sparrow, "PIPELINES", cache)
    monkeypatch.setattr("sparrow.loading.load_model", lambda spec, **kw: target)
    # adaptive=False: an adaptive draft length follows measured timings, and with it the random draws of a
    # seeded sampled request (its output distribution is the same, its exact tokens are not).
    options = dict(target="tiny", draft="tiny", dtype="float32", device="cpu", adaptive=False)
    jobs = [dict(job(i), num_draft_tokens=1 + i % 3) for i in range(THREADS * 2)]
    expected = [outcome(sparrow.generate(**j, **options)) for j in jobs]

    def work(t: int, barrier: threading.Barrier) -> list:
        barrier.wait()
        return [(i, outcome(sparrow.generate(**jobs[i], **options))) for i in range(t, len(jobs), THREADS)]

    got = dict(pair for results in run_threads(work) for pair in results)
    assert [got[i] for i in range(len(jobs))] == expected
    assert len(cache) <= 2 and cache.num_models == 1


def test_self_drafters_and_plain_decoding_on_one_model_from_many_threads(one_thread):
    """Sparse (switches the model's attention to its capture around prefills) and layer-skip (drafts in the
    target's own cache) pipelines and a plain one, all on one LoadedModel, each in its own thread."""
    shared = LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")
    pipes = [Pipeline(shared, build_drafter("sparse", shared, None, 3, budget=6, window=4)),
             Pipeline(shared, build_drafter("layer-skip", shared, None, 3, skip_set="mlp=1")),
             Pipeline(shared, None)]
    long_prompts = [p * 8 for p in PROMPTS] * 2  # prefill-heavy: prefills of different threads overlap

    def run(pipe: Pipeline, prompt: str) -> tuple:
        """Also the drafting statistics: a sparse drafter fed another prompt's queries is still lossless."""
        result = pipe.generate(prompt, max_new_tokens=8)
        return *outcome(result), result.stats.steps, result.stats.num_accepted_tokens

    expected = [[run(pipe, p) for p in long_prompts] for pipe in pipes]

    def work(t: int, barrier: threading.Barrier) -> list:
        barrier.wait()
        return [run(pipes[t], p) for p in long_prompts]

    assert run_threads(work, n=len(pipes)) == expected


# --- b) errors mid-generation ---------------------------------------------------------------------------

class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["drafter", "target"])
def test_pipeline_usable_after_an_error_mid_generation(pipe, target, monkeypatch, where, error):
    reference = Pipeline(target, None).generate_plain(PROMPTS[0], max_new_tokens=30).token_ids
    runner = pipe.drafter.draft if where == "drafter" else pipe.runner
    forward, calls = runner.forward, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # the third forward: mid-generation, caches half-updated
            raise error("injected")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", failing)
    with pytest.raises(error):
        pipe.generate(PROMPTS[0], max_new_tokens=30)
    monkeypatch.undo()
    # The next generation runs in another thread: it would hang if the failed one had kept a lock.
    [again] = run_threads(lambda t, barrier: pipe.generate(PROMPTS[0], max_new_tokens=30), n=1)
    assert again.token_ids == reference


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("drafter, method", [("sparse", "prefill"), ("sparse", "forward"),
                                             ("layer-skip", "forward")])
def test_self_drafter_pipelines_usable_after_an_error(one_thread, drafter, method, error):
    """Self-drafters change the target's state (its attention switch, its cache): an error in the target's
    prefill (while the sparse capture is on) or at its third forward leaves neither pipeline broken."""
    shared = LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")
    options = dict(budget=6, window=4) if drafter == "sparse" else dict(skip_set="mlp=1")
    pipe, plain = Pipeline(shared, build_drafter(drafter, shared, None, 3, **options)), Pipeline(shared, None)
    prompt = PROMPTS[0] * 4
    reference = plain.generate_plain(prompt, max_new_tokens=24).token_ids
    original, calls = getattr(pipe.runner, method), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == (1 if method == "prefill" else 3):
            raise error("injected")
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipe.runner, method, failing)
        with pytest.raises(error):
            pipe.generate(prompt, max_new_tokens=24)
    assert pipe.generate(prompt, max_new_tokens=24).token_ids == reference
    assert plain.generate_plain(prompt, max_new_tokens=24).token_ids == reference


# --- c) the bounded cache of sparrow.generate -----------------------------------------------------------

@pytest.fixture
def counted_loads(monkeypatch, target):
    """load_model replaced: each call builds a fresh tiny model (as a real load would) and is recorded."""
    loads: list[str] = []

    def load_model(spec: str, **kwargs) -> LoadedModel:
        loads.append(spec)
        return LoadedModel(model=tiny_model("llama", seed=len(loads)), tokenizer=target.tokenizer, name=spec)

    monkeypatch.setattr("sparrow.loading.load_model", load_model)
    return loads


def test_pipelines_differing_in_drafter_options_share_their_models(counted_loads):
    cache = PipelineCache(size=3)
    options = dict(dtype="float32", device="cpu")
    pipes = [cache.get("tiny", draft="tiny-draft", num_draft_tokens=k, **options) for k in (1, 2, 3)]
    pipes.append(cache.get("tiny", drafter="prompt-lookup", num_draft_tokens=4, **options))
    assert counted_loads == ["tiny", "tiny-draft"]  # 4 pipelines, each model loaded once
    assert len({id(p.target.model) for p in pipes}) == 1
    assert len(cache) == 3 and cache.num_models == 2
    assert cache.get("tiny", draft="tiny-draft", num_draft_tokens=3, **options) is pipes[2]  # a hit
    assert cache.get("tiny", draft="tiny-draft", num_draft_tokens=3, dtype="fp32", device="cpu") is pipes[2]


def test_quantized_models_are_shared_too(counted_loads):
    cache = PipelineCache(size=4)
    pipes = [cache.get("tiny", draft="tiny-draft", draft_quant="int8", num_draft_tokens=k, dtype="float32",
                       device="cpu") for k in (1, 2, 3)]
    assert counted_loads == ["tiny", "tiny-draft"]
    assert len({id(p.drafter.draft.model) for p in pipes}) == 1  # one int8 copy of the draft
    assert cache.num_models == 2  # the target and the int8 draft; the dense draft is not kept


def test_the_cache_keeps_at_most_size_pipelines_and_only_their_models(counted_loads):
    cache = PipelineCache(size=2)
    options = dict(drafter="prompt-lookup", dtype="float32", device="cpu")
    first = weakref.ref(cache.get("model-0", **options).target.model)
    for k in range(1, 9):  # 8 more option combinations over 4 models
        cache.get(f"model-{k % 4}", num_draft_tokens=k, **options)
        assert len(cache) <= 2 and cache.num_models <= 2
    gc.collect()
    assert first() is None  # model-0's first copy was freed with its pipelines
    assert len(counted_loads) <= 9


def test_sparrow_generate_uses_the_bounded_cache():
    assert isinstance(sparrow.PIPELINES, PipelineCache) and sparrow.PIPELINES.size == 4


# --- d) argument checks ---------------------------------------------------------------------------------

def test_stop_accepts_one_str_none_or_a_list(pipe):
    assert pipe.request("hi", stop="\n\n").stopping.stop_strings == ("\n\n",)
    assert pipe.request("hi", stop=None).stopping.stop_strings == ()
    assert pipe.request("hi", stop=("a", "bc")).stopping.stop_strings == ("a", "bc")
    assert pipe.request("hi", stop="a\udcffb").stopping.stop_strings == ("a\ufffdb",)  # argv's invalid byte


@pytest.mark.parametrize("stop", [[1], ["a", None], b"\n", 5, {"a": 1}, [b"x"]])
def test_stop_refuses_what_is_not_text(pipe, stop):
    with pytest.raises(UserError, match="stop"):
        pipe.request("hi", stop=stop)


def test_a_str_stop_is_one_stop_string(pipe):
    """stop="a b" stops at "a b", not at the first "a" or space."""
    text = pipe.generate_plain(PROMPTS[0], max_new_tokens=24).text
    piece = text[5:8]
    result = pipe.generate(PROMPTS[0], max_new_tokens=24, stop=piece)
    assert result.finish_reason == "stop" and result.text == text[: text.index(piece)]


def test_text_prompts_are_mended_the_same_whichever_way_they_come(pipe):
    """Invalid UTF-8 becomes U+FFFD: as bytes, as argv's surrogate escapes, or typed in."""
    ids = pipe.encode("x\ufffdy caf\u00e9").input_ids.tolist()
    assert pipe.encode(b"x\xffy caf\xc3\xa9").input_ids.tolist() == ids
    assert pipe.encode("x\udcffy caf\u00e9").input_ids.tolist() == ids
    assert pipe.encode(bytearray(b"def add")).input_ids.tolist() == pipe.encode("def add").input_ids.tolist()
    assert pipe.generate(b"def add(a, b):", max_new_tokens=4).token_ids == \
        pipe.generate("def add(a, b):", max_new_tokens=4).token_ids


def test_token_id_prompts(pipe):
    ids = [5, 9, 2]
    expected = pipe.encode(ids).input_ids.tolist()
    assert expected == ids
    for same in (tuple(ids), torch.tensor(ids), np.array(ids), [np.int64(t) for t in ids], range(5, 6)):
        assert pipe.encode(same).input_ids.tolist() == list(same)


@pytest.mark.parametrize("prompt, message", [
    ([1, True], "must be ints, got True"), ([1.0, 2.0], "must be ints, got 1.0"), (["a"], "must be ints"),
    ([1, 10**9], r"must lie in \[0, 320\)"), ([-1], "must lie in"), ([], "must not be empty"),
    (torch.tensor([1.0, 2.0]), "1-D of integer token ids"), (torch.tensor([[1, 2]]), "1-D"), (5, "got int"),
    ({1: 2}, "got dict"), (None, "got NoneType"), ("   ", "must not be empty"), (b"", "must not be empty"),
])
def test_bad_prompts_are_refused_naming_prompt(pipe, prompt, message):
    with pytest.raises(UserError, match=f"prompt.*{message}") as error:
        pipe.request(prompt)
    assert error.value.field == "prompt"


@pytest.mark.parametrize("option, value", [
    ("max_new_tokens", True), ("max_new_tokens", 1.5), ("max_new_tokens", "5"), ("max_new_tokens", 0),
    ("max_new_tokens", -1), ("seed", True), ("seed", -1), ("seed", 1.5), ("seed", 2**64), ("seed", "1"),
    ("temperature", "0.5"), ("temperature", True), ("top_k", 2.0), ("top_p", None), ("chat", "yes"),
])
def test_bad_options_are_refused_naming_them(pipe, option, value):
    with pytest.raises(UserError, match=option) as error:
        pipe.request("hi", **{option: value})
    assert error.value.field == option  # what the server's 400 names its field by


def test_max_new_tokens_none_is_the_rest_of_the_context(pipe):
    request = pipe.request("hi", max_new_tokens=None)
    context = pipe.runner.context_length
    assert request.stopping.max_new_tokens == context - request.prompt.input_ids.numel()


def test_a_request_is_built_once_and_generated_as_it_is(pipe, monkeypatch):
    request = pipe.request(PROMPTS[0], max_new_tokens=6)
    expected = pipe.generate(PROMPTS[0], max_new_tokens=6).token_ids

    def refuse(*args, **kwargs):
        raise AssertionError("a built request was tokenized again")

    monkeypatch.setattr(pipe, "encode", refuse)
    assert pipe.generate(request).token_ids == expected
    assert pipe.generate_plain(request).token_ids == pipe.generate_plain(request).token_ids
    with pytest.raises(UserError, match="a Request takes no options") as error:
        pipe.generate(request, max_new_tokens=3)
    assert error.value.field == "max_new_tokens"


def test_chat_messages_are_a_prompt(pipe):
    messages = [{"role": "user", "content": "hi"}]
    assert pipe.request(messages).prompt.input_ids.numel() > 0
    with pytest.raises(UserError, match="content must be a str") as error:
        pipe.request([{"role": "user", "content": 5}])
    assert error.value.field == "prompt"


def test_numpy_integers_are_integers(pipe):
    request = pipe.request("hi", max_new_tokens=np.int64(3), seed=np.uint64(7), top_k=np.int32(2))
    assert request.stopping.max_new_tokens == 3 and request.seed == 7 and request.sampling.top_k == 2


def test_unknown_generate_options_are_named():
    pipe = Pipeline(LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny"), None)
    with pytest.raises(UserError, match="unknown option 'max_tokens'; expected one of: max_new_tokens"):
        pipe.generate("hello", max_tokens=5)

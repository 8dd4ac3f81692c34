"""`sparrow serve`: the OpenAI-compatible server around a tiny float32 model with a draft-model drafter.

a) Streaming: the pieces the Stopper hands `on_text` concatenate to its text() for random token streams (broken
   UTF-8, special tokens, stop strings), and no piece boundary ever exposes part of a stop string.
b) The official `openai` client against a live uvicorn server on 127.0.0.1: chat and completion, streamed and
   not (streamed == non-streamed), greedy output == `generate_plain` token for token, stop strings, seeds, usage
   with speculative stats, errors (400 naming the field, 401, 404, 429) after which the server keeps serving.
c) FastAPI's TestClient: /health is 503 until the model is loaded, /metrics, malformed bodies, a client that
   disconnects mid-stream (its job ends at the next round), --timeout (finish_reason "length").
d) Nothing unasked: no /docs, /redoc or /openapi.json by default; `openapi=True` serves only the schema, behind
   the key; /metrics is behind the key unless `public_metrics=True`.
e) Shutdown with a deadline: a real `sparrow serve --shutdown-timeout 2` process (tests/serve/slow_server.py) gets
   SIGTERM while requests run and wait: the waiting ones get 503 at once, the running ones end at the deadline
   with finish_reason "length" (streams: a last chunk the openai client parses), the process exits within the
   deadline + 1 s; in process, a draining scheduler answers 503 to new requests and on /health, and a round that
   overruns the deadline is not waited for (the answer ends with the text so far; nothing generated yet: 503).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import perturbed, tiny_model, tiny_tokenizer
from fastapi.testclient import TestClient
from live import serving
from typer.testing import CliRunner

import sparrow
from sparrow.cli import app as cli
from sparrow.config import StoppingConfig
from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy
from sparrow.serve import Scheduler, create_app
from sparrow.serve.app import bad_request
from sparrow.serve.protocol import NAMES, ChatCompletionRequest
from sparrow.stopping import Stopper

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "The quick brown fox"}]
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only cost time on a shared CPU


class SpyPipeline(Pipeline):
    """Records every result; `gate` (an Event) holds generations back, `round_delay` slows every round."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.results: list = []
        self.gate: threading.Event | None = None
        self.round_delay = 0.0
        self.fail_next: BaseException | None = None  # raised by the next generation (a bug inside sparrow)

    def sequence(self, prompt, *, on_text=None, **options):  # what the server's batches run
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"

        def slow(text: str):
            time.sleep(self.round_delay)
            return on_text(text)

        return super().sequence(prompt, on_text=slow if on_text and self.round_delay else on_text, **options)

    def result(self, generation):
        result = super().result(generation)
        self.results.append(result)
        return result


@pytest.fixture(scope="module")
def pipe(one_thread) -> SpyPipeline:
    """Draft-model drafter on a perturbed copy: partial acceptance, so both accepted and rejected drafts."""
    target = LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")
    draft = LoadedModel(model=perturbed(target.model, 0.3, seed=1), tokenizer=target.tokenizer, name="draft")
    return SpyPipeline(target, build_drafter("draft-model", target, draft, 4))


@pytest.fixture(autouse=True)
def reset(pipe):
    pipe.gate, pipe.round_delay, pipe.fail_next = None, 0.0, None
    yield
    pipe.gate, pipe.round_delay, pipe.fail_next = None, 0.0, None


@contextlib.contextmanager
def live_server(pipe: Pipeline, **options):
    """uvicorn on 127.0.0.1 (a free port) in a thread; yields (base_url, scheduler) once /health is 200."""
    api_key = options.pop("api_key", None)
    scheduler = Scheduler(lambda: pipe, **options)
    with serving(create_app(scheduler, model_name="tiny", api_key=api_key)) as url:
        yield url, scheduler


@pytest.fixture(scope="module")
def server(pipe):
    with live_server(pipe, api_key=KEY, max_queue=4) as (url, _):
        yield url


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=30)


def metric(url: str, name: str) -> float:
    """One sample's value from /metrics (0 if absent; the key is ignored by a server without one)."""
    for line in httpx.get(f"{url}/metrics", headers=AUTH).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0


def wait_for(condition, seconds: float = 10, why=lambda: "") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting {why()}"
        time.sleep(0.02)


def streamed(chunks, chat: bool) -> tuple[list[str], str | None, object]:
    """(the non-empty text pieces, the finish reason, the usage) of a stream."""
    pieces, finish, usage = [], None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text = choice.delta.content if chat else choice.text
            if text:
                pieces.append(text)
            finish = choice.finish_reason or finish
    return pieces, finish, usage


# --- a) the streaming hook ----------------------------------------------------------------------------------


def test_streamed_pieces_concatenate_to_text_and_never_show_a_stop_string():
    tokenizer = tiny_tokenizer()
    rng = random.Random(0)
    ids = tokenizer("The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n")["input_ids"]
    special = tokenizer.convert_tokens_to_ids("<eos>")
    for case in range(300):
        tokens = [rng.choice(ids) if rng.random() < 0.6 else rng.randrange(320) for _ in range(rng.randrange(1, 40))]
        tokens = [t for t in tokens if t != special or rng.random() < 0.5]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        stop = ()
        if case % 2 and len(text) > 3:  # a stop string cut from the text itself (so it fires), or one that never does
            start = rng.randrange(len(text) - 2)
            stop = (text[start:start + rng.randrange(1, 4)],) if case % 4 == 1 else ("never there",)
        pieces: list[str] = []
        stopper = Stopper(StoppingConfig(max_new_tokens=len(tokens), stop_strings=stop), tokenizer, pieces.append)
        shown = []  # the text streamed so far, after each push
        mode = case % 3  # the rounds' tokens: all drafted, none drafted, or a random prefix of each round
        while not stopper.done:
            block = tokens[len(stopper.tokens):len(stopper.tokens) + rng.randrange(1, 6)]
            stopper.push(block, drafted=[len(block), 0, rng.randrange(len(block) + 1)][mode])
            shown.append("".join(pieces))
        final = stopper.text()
        for piece in pieces:  # provenance runs cover each piece exactly
            assert "".join(text for text, _ in piece.spans) == piece
            assert mode == 2 or all(drafted == (mode == 0) for _, drafted in piece.spans), (case, piece.spans)
        assert shown[-1] == final, (case, tokens, stop)
        assert all(final.startswith(text) for text in shown)  # nothing streamed is ever taken back
        assert not any(s in final for s in stop)


def test_on_text_can_end_a_generation_with_its_finish_reason(pipe):
    pieces: list[str] = []

    def on_text(text: str):
        pieces.append(text)
        return "length" if len(pieces) == 3 else None

    result = pipe.generate_plain(PROMPT, max_new_tokens=40, on_text=on_text)
    assert result.finish_reason == "length" and len(result.token_ids) == 3  # plain decoding: one token per push
    assert "".join(pieces) == result.text


# --- b) the openai client against a live server ------------------------------------------------------------


def test_greedy_completion_streamed_equals_non_streamed_equals_plain_decoding(client, pipe):
    plain = pipe.generate_plain(PROMPT, max_new_tokens=40)
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert pipe.results[-1].token_ids == plain.token_ids  # token for token
    assert full.choices[0].text == plain.text and full.choices[0].finish_reason == "length"
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    pieces, finish, _ = streamed(stream, chat=False)
    assert pipe.results[-1].token_ids == plain.token_ids
    assert "".join(pieces) == plain.text and finish == "length" and len(pieces) > 1
    assert full.usage.prompt_tokens == len(pipe.tokenizer(PROMPT)["input_ids"])
    assert full.usage.completion_tokens == 40 and full.usage.total_tokens == full.usage.prompt_tokens + 40


def test_greedy_chat_streamed_equals_non_streamed_with_usage_and_speculative_stats(client, pipe):
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=48, temperature=0)
    tokens = pipe.results[-1].token_ids
    prompt = "system: You write Python.\nuser: The quick brown fox\nassistant:"  # no chat template: role lines
    assert tokens == pipe.generate_plain(prompt, max_new_tokens=48).token_ids
    message = full.choices[0].message
    assert message.role == "assistant" and message.content == pipe.results[-1].text
    spec = full.usage.speculative
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] > 0 and spec["num_drafts"] > 0
    assert spec["mean_accepted_tokens"] > 1
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=48, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = streamed(stream, chat=True)
    assert "".join(pieces) == message.content and finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens == 48
    # the draft lengths follow measured costs (they may differ between the two requests), the text does not
    assert 0 < usage.speculative["num_accepted_tokens"] <= usage.speculative["num_draft_tokens"]


def test_stop_strings_end_the_text_and_never_leak_into_chunks(client, pipe):
    plain = pipe.generate_plain(PROMPT, max_new_tokens=40).text
    stop = plain[12:15]
    assert stop.strip() and plain.index(stop) >= 1
    expected = plain[:plain.index(stop)]
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "zzz"])
    assert full.choices[0].text == expected and full.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                       stream=True)
    pieces, finish, _ = streamed(stream, chat=False)
    assert "".join(pieces) == expected and finish == "stop"
    assert not any(stop in piece for piece in pieces)


def test_seeded_sampling_repeats_and_equals_seeded_plain_decoding(client, pipe):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0.8, seed=seed,
                                         top_p=0.95, extra_body={"top_k": 50}).choices[0].text

    first, again, other = sample(3), sample(3), sample(4)
    assert first == again != other
    assert first == pipe.generate_plain(PROMPT, max_new_tokens=30, temperature=0.8, seed=3, top_p=0.95,
                                        top_k=50).text
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0.8, seed=3,
                                       top_p=0.95, extra_body={"top_k": 50}, stream=True)
    assert "".join(streamed(stream, chat=False)[0]) == first


def test_errors_have_openai_shape_and_the_server_keeps_serving(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=-1)
    assert bad.value.body["param"] == "temperature" and "temperature" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as bad:  # over the context: found by the pipeline, still a 400
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5000)
    assert bad.value.body["param"] == "max_tokens" and "context" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=[])
    assert bad.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=5)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
    assert httpx.get(f"{server}/v1/models").status_code == 401  # no key at all
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text


def test_a_bug_answers_500_and_the_server_keeps_serving(client, server, pipe):
    pipe.fail_next = RuntimeError("boom")
    with pytest.raises(openai.InternalServerError) as bug:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
    assert bug.value.body["type"] == "internal_error" and "RuntimeError: boom" in bug.value.body["message"]
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5).usage.completion_tokens == 5


def test_a_full_queue_answers_429(pipe):
    pipe.gate = threading.Event()  # the worker holds the first request; one more may wait
    with live_server(pipe, max_queue=1) as (url, _):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        answers: list[int] = []
        waiting = [threading.Thread(target=lambda: answers.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                             timeout=30).status_code))
                   for _ in range(2)]
        for thread, gauge in zip(waiting, ("sparrow:num_requests_running", "sparrow:num_requests_waiting")):
            thread.start()  # the first one reaches the worker, the second one the queue
            wait_for(lambda: metric(url, gauge) == 1)
        full = httpx.post(f"{url}/v1/completions", json=body)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        pipe.gate.set()
        for thread in waiting:
            thread.join(30)
        assert answers == [200, 200]
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200


def test_the_batch_policy_knows_both_costs_before_the_first_step(pipe):
    """Before serving, the verify cost of 1..64 tokens and the draft model's cost per position for 1, 2, 4 rows
    (max_batch 4) are measured: the first batched steps do not draft blindly."""
    with live_server(pipe, max_batch=4) as (_, scheduler):
        wait_for(lambda: scheduler.policy.draft.known, why=lambda: "for the draft cost table's seed")
        assert scheduler.policy.verify.known
        assert sorted(scheduler.policy.draft.bins) == [1, 2, 3]  # bit lengths of 1, 2, 4 rows


def test_concurrent_requests_share_batches_and_each_equals_its_single_output(pipe):
    """Different prompts and lengths at once, some arriving while others run: each answer equals plain greedy
    decoding of its prompt alone, and batch steps really held several requests that drafted. The batch policy is
    fixed (every sequence drafts what its drafter chooses): with costs measured, tiny target and draft cost about the
    same, and on a slow AVX2 CPU no draft length paid, so no step drafted and nothing was accepted."""
    prompts = [PROMPT, "The quick brown fox", "Paris is the capital of France. Paris is", "a", "def f(x):"]
    budgets = [40, 12, 33, 25, 18]
    expected = [pipe.generate_plain(p, max_new_tokens=n).text for p, n in zip(prompts, budgets)]
    pipe.round_delay = 0.005  # rounds long enough that late requests join running ones
    with live_server(pipe, max_batch=4, policy=BatchPolicy(adaptive=False)) as (url, _):
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            time.sleep(0.03 * i)
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": budgets[i], "temperature": 0}
            answers[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert [answers.get(i) for i in range(len(prompts))] == expected
        steps = metric(url, "sparrow:batch_size_count")
        assert metric(url, "sparrow:batch_size_sum") / steps > 1.2, "requests never shared a step"
        assert metric(url, 'sparrow:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') > 0


# --- c) TestClient: loading, metrics, bodies, disconnects, timeouts ---------------------------------------


def test_health_is_503_until_the_model_is_loaded(pipe):
    loaded = threading.Event()

    def load():
        assert loaded.wait(30)
        return pipe

    with TestClient(create_app(Scheduler(load), model_name="tiny")) as http:
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "model_loading"
        early = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert early.status_code == 503
        loaded.set()
        deadline = time.monotonic() + 10
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_the_400_param_comes_from_the_errors_field_not_its_message():
    error = UserError("whatever the message says first", field="max_new_tokens")
    assert bad_request(error, NAMES).param == "max_tokens"
    assert bad_request(UserError("temperature is named but no field is"), NAMES).param is None
    assert bad_request(UserError("x", field="prompt"), ChatCompletionRequest(messages=[
        {"role": "user", "content": "hi"}]).names()).param == "messages"


def test_bad_bodies_are_400_naming_the_field(pipe):
    with TestClient(create_app(Scheduler(lambda: pipe), model_name="tiny")) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.02)
        cases = [
            ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
            ({"prompt": PROMPT, "max_tokens": "5"}, "max_tokens"),
            ({"prompt": PROMPT, "top_p": 0}, "top_p"),
            ({"prompt": PROMPT, "seed": -1}, "seed"),
            ({"prompt": PROMPT, "stop": [""]}, "stop"),
            ({"prompt": PROMPT, "bogus": 1}, "bogus"),
            ({"prompt": PROMPT, "presence_penalty": 0.5}, "presence_penalty"),
            ({"max_tokens": 3}, "prompt"),
            ({"prompt": ""}, "prompt"),
            ({"prompt": [1, 99999]}, "prompt"),
            ({"prompt": 5}, "prompt"),
            ({"prompt": PROMPT, "temperature": True}, "temperature"),
            ({"prompt": PROMPT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
            ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
            ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
            ({"prompt": PROMPT, "top_k": -2}, "top_k"),
            ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
            ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens"),  # over the context
            ({"messages": [{"role": "user", "content": "hi " * 2000}]}, "messages"),  # the prompt fills the context
        ]
        for body, param in cases:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            answer = http.post(path, json=body)
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["param"] == param, (body, error)
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        broken = http.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
        assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
        assert http.get("/v1/nothing").status_code == 404
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_metrics_count_requests_and_speculative_tokens(client, server):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    text = httpx.get(f"{server}/metrics", headers=AUTH).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    for name in ("sparrow:spec_decode_num_drafts_total", "sparrow:spec_decode_num_draft_tokens_total",
                 "sparrow:spec_decode_num_accepted_tokens_total", "sparrow:e2e_request_latency_seconds_count",
                 "sparrow:time_to_first_token_seconds_count", "sparrow:generation_tokens_total"):
        assert values[name] > 0, name
    assert values["sparrow:num_requests_waiting"] == 0
    assert values['sparrow:requests_total{endpoint="/v1/completions",status="200"}'] >= 1


def test_a_conversations_next_turn_takes_its_prefix_from_the_last_and_says_so(pipe):
    """--prefix-cache: the second turn's prompt begins with the first turn's prompt and answer, so its prefill takes
    them from the cache: usage.prompt_tokens_details.cached_tokens and the prefix-cache counters say how many, and
    the answer is the one a server without the cache gives."""
    cached = SpyPipeline(pipe.target, pipe.drafter.fork(), prefix_cache=4096)
    answers = {}
    for name, served in (("cached", cached), ("whole", pipe)):
        with TestClient(create_app(Scheduler(lambda served=served: served), model_name="tiny")) as http:
            wait_for(lambda: http.get("/health").status_code == 200)
            messages, turns = [dict(m) for m in MESSAGES], []
            for content in ("Tell me more about it.", "And then?"):
                body = {"messages": messages, "max_tokens": 12, "temperature": 0}
                answer = http.post("/v1/chat/completions", json=body).json()
                turns.append((answer["choices"][0]["message"]["content"], answer["usage"]))
                messages += [{"role": "assistant", "content": turns[-1][0]}, {"role": "user", "content": content}]
            answers[name] = turns
            counts = http.get("/metrics").text
        if name == "cached":
            first, second = (usage["prompt_tokens_details"]["cached_tokens"] for _, usage in turns)
            assert first == 0 and turns[0][1]["prompt_tokens"] - 4 <= second < turns[1][1]["prompt_tokens"], turns
            queries = sum(usage["prompt_tokens"] for _, usage in turns)
            assert f"sparrow:prefix_cache_queries_total {float(queries)}" in counts
            assert f"sparrow:prefix_cache_hits_total {float(second)}" in counts
        else:
            assert all(usage["prompt_tokens_details"]["cached_tokens"] == 0 for _, usage in turns)
            assert "sparrow:prefix_cache_queries_total 0.0" in counts
    assert [text for text, _ in answers["cached"]] == [text for text, _ in answers["whole"]]


def test_a_client_that_disconnects_mid_stream_ends_its_job_at_the_next_round(pipe):
    pipe.round_delay = 0.02  # 1000 tokens would take seconds
    with live_server(pipe) as (url, scheduler):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as answer:
            assert answer.status_code == 200
            next(answer.iter_lines())
        deadline = time.monotonic() + 10
        while not pipe.results or pipe.results[-1].finish_reason != "cancelled":
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.02)
        assert len(pipe.results[-1].token_ids) < 1000
        pipe.round_delay = 0.0
        after = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 3})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
        failures = httpx.get(f"{url}/metrics").text
        assert 'sparrow:request_failure_total{reason="cancelled"} 1.0' in failures


def test_timeout_ends_a_request_with_finish_reason_length(pipe):
    pipe.round_delay = 0.02
    with TestClient(create_app(Scheduler(lambda: pipe, timeout=0.2), model_name="tiny")) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.02)
        answer = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000, "temperature": 0}).json()
        assert answer["choices"][0]["finish_reason"] == "length"
        assert 0 < answer["usage"]["completion_tokens"] < 1000
        assert answer["choices"][0]["text"] == pipe.results[-1].text


def test_cli_serve_checks_its_flags_before_loading():
    runner = CliRunner()
    assert "--max-queue" in runner.invoke(cli, ["serve", "--help"]).output
    for flags, needle in [(["--max-queue", "0"], "--max-queue"), (["--timeout", "0"], "--timeout"),
                          (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
                          (["--ray", "--shutdown-timeout", "5"], "--shutdown-timeout applies without --ray"),
                          (["--port", "70000"], "--port"), (["-k", "0"], "-k"),
                          (["--prefix-cache", "-1"], "--prefix-cache must be an integer >= 0"),
                          (["--quant", "int3"], "invalid quant 'int3': expected one of auto, none, int8")]:
        result = runner.invoke(cli, ["serve", *flags])
        assert result.exit_code == 2 and needle in result.output, (flags, result.output)


def test_cli_serve_loads_the_target_in_the_format_asked(monkeypatch):
    """--quant reaches sparrow.load's plan (the scheduler's loader), as --draft-quant does."""
    seen = {}

    def load(plan):
        seen.update(target=plan.target, quant=plan.quant, draft_quant=plan.draft_quant, prefix_cache=plan.prefix_cache)
        raise UserError("loaded")

    class LoadAtOnce:
        def __init__(self, loader, **options):
            loader()

    monkeypatch.setattr(sparrow, "load", load)
    monkeypatch.setattr("sparrow.serve.Scheduler", LoadAtOnce)
    result = CliRunner().invoke(cli, ["serve", "--target", "tiny", "--quant", "int8", "--draft-quant", "int4",
                                      "--prefix-cache", "8192"])
    assert result.exit_code == 2 and "loaded" in result.output, result.output
    assert (seen["target"], seen["quant"], seen["draft_quant"], seen["prefix_cache"]) == ("tiny", "int8", "int4", 8192)


def test_invalid_utf8_in_prompts_and_messages_is_replaced_as_in_the_cli():
    """JSON may carry lone surrogates (\\udcff): decoded with U+FFFD, as sparrow.text does for every prompt, also
    through a chat template (whose tokenizer call would otherwise fail with a TypeError: a 500)."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    chat_pipe = Pipeline(LoadedModel(tiny_model("llama", seed=0), tokenizer, "tiny-chat"), None)
    with TestClient(create_app(Scheduler(lambda: chat_pipe), model_name="tiny")) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.02)
        raw = b'"x\\udcffy"'  # a JSON string holding a lone surrogate (what argv gives for the byte 0xff)
        for path, body in [
            ("/v1/completions", b'{"prompt": %s, "max_tokens": 3, "temperature": 0}' % raw),
            (
                "/v1/chat/completions",
                b'{"messages": [{"role": "user", "content": %s}], "max_tokens": 3, "temperature": 0}' % raw,
            ),
        ]:
            answer = http.post(path, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 200, answer.text


# --- d) nothing unasked ------------------------------------------------------------------------------------


def test_docs_redoc_and_the_schema_are_off_by_default(pipe):
    for api_key in (KEY, None):
        with TestClient(create_app(Scheduler(lambda: pipe), model_name="tiny", api_key=api_key)) as http:
            for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
                for headers in ({}, AUTH):
                    answer = http.get(path, headers=headers)
                    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", path


def test_openapi_serves_only_the_schema_behind_the_key(pipe):
    with TestClient(create_app(Scheduler(lambda: pipe), model_name="tiny", api_key=KEY, openapi=True)) as http:
        refused = http.get("/openapi.json")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        schema = http.get("/openapi.json", headers=AUTH)
        assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
        assert "/openapi.json" not in schema.json()["paths"]
        for path in ("/docs", "/redoc"):  # never: their pages load scripts from a public CDN
            assert http.get(path, headers=AUTH).status_code == 404


def test_metrics_need_the_key_unless_public(pipe):
    for api_key, public, without_key in ((KEY, False, 401), (KEY, True, 200), (None, False, 200)):
        app = create_app(Scheduler(lambda: pipe), model_name="tiny", api_key=api_key, public_metrics=public)
        with TestClient(app) as http:
            answer = http.get("/metrics")
            assert answer.status_code == without_key, (api_key, public)
            if without_key == 401:
                assert answer.json()["error"]["type"] == "authentication_error"
                assert http.get("/metrics", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
            metrics = http.get("/metrics", headers=AUTH)
            assert metrics.status_code == 200 and "sparrow:requests_total" in metrics.text


# --- e) shutdown with a deadline ---------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_log(tmp_path: Path) -> str:
    return "\n".join(line for line in (tmp_path / "server.log").read_text().splitlines()[-30:] if "Warning" not in line)


def test_sigterm_refuses_waiting_requests_at_once_and_ends_running_ones_by_the_deadline(tmp_path):
    from slow_server import tiny_pipeline

    deadline_seconds = 2.0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    import sparrow

    source = str(Path(sparrow.__file__).resolve().parents[1])  # the sparrow this test imported
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, str(TESTS), str(TESTS.parent),
                                                        os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen([sys.executable, str(TESTS / "slow_server.py"), "--port", str(port), "--api-key",
                                KEY, "--max-batch", "3", "--max-queue", "8", "--shutdown-timeout",
                                str(deadline_seconds)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        # the real CLI exposes nothing unasked
        assert [httpx.get(f"{url}{p}").status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
        assert httpx.get(f"{url}/metrics").status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
        outcomes: dict[str, object] = {}
        ended: dict[str, float] = {}

        def run(name: str, call) -> None:
            try:
                outcomes[name] = call()
            except Exception as e:  # noqa: BLE001 -- the test inspects it
                outcomes[name] = e
            ended[name] = time.monotonic()

        def chat_stream():
            return list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=900,
                                                       temperature=0, stream=True))

        def completion_stream():
            return list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=900, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))

        def completion():
            return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=900, temperature=0)

        running = {"chat_stream": chat_stream, "completion_stream": completion_stream, "completion": completion}
        waiting = {"waiting_stream": completion_stream, "waiting": completion}
        threads = []
        for group, gauge in ((running, "sparrow:num_requests_running"), (waiting, "sparrow:num_requests_waiting")):
            for name, call in group.items():
                threads.append(threading.Thread(target=run, args=(name, call)))
                threads[-1].start()
            wait_for(lambda gauge=gauge, count=len(group): metric(url, gauge) == count, 30,
                     lambda: (outcomes, server_log(tmp_path)))
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # 503 at once
        wait_for(lambda: all(name in ended for name in waiting), 1.0, lambda: (outcomes, server_log(tmp_path)))
        with contextlib.suppress(httpx.TransportError):  # a new request: 503, or no connection any more
            late = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, headers=AUTH)
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        process.wait(deadline_seconds + 1.5)
        exited = time.monotonic() - signalled
        print(f"exited {exited:.2f} s after SIGTERM (deadline {deadline_seconds} s)")
        for thread in threads:
            thread.join(10)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    log_text = server_log(tmp_path)
    assert exited <= deadline_seconds + 1.0, (exited, log_text)
    assert process.returncode == -signal.SIGTERM, (process.returncode, log_text)  # ended by its signal, as uvicorn does
    for name in waiting:
        error = outcomes[name]
        assert isinstance(error, openai.InternalServerError) and error.status_code == 503, (name, error)
        assert error.body["code"] == "shutting_down" and "shutting down" in error.body["message"]
    plain = tiny_pipeline().generate_plain(PROMPT, max_new_tokens=900).text
    for name in running:
        assert not isinstance(outcomes[name], Exception), (name, outcomes[name], log_text)
        took = ended[name] - signalled
        assert deadline_seconds - 0.5 <= took <= deadline_seconds + 1.0, (name, took)
    for name, chat in (("chat_stream", True), ("completion_stream", False)):
        chunks = outcomes[name]
        pieces, finish, usage = streamed(chunks, chat)
        assert pieces and finish == "length", (name, finish)
        last = next(c for c in reversed(chunks) if c.choices)
        assert last.choices[0].finish_reason == "length" and last.sparrow == {"ended_by": "shutdown"}
        if not chat:
            assert plain.startswith("".join(pieces)) and 0 < usage.completion_tokens < 900  # a lossless prefix
    full = outcomes["completion"]
    assert full.choices[0].finish_reason == "length" and full.sparrow == {"ended_by": "shutdown"}
    assert plain.startswith(full.choices[0].text) and 0 < full.usage.completion_tokens < 900


def test_a_draining_scheduler_refuses_new_requests_and_fails_health(pipe):
    scheduler = Scheduler(lambda: pipe)
    with TestClient(create_app(scheduler, model_name="tiny")) as http:
        wait_for(lambda: http.get("/health").status_code == 200)
        scheduler.drain(5.0)
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
        for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True})):
            answer = http.post(path, json=body)
            assert answer.status_code == 503 and answer.json()["error"]["type"] == "service_unavailable"


def test_a_round_that_overruns_the_deadline_is_not_waited_for(pipe):
    """Rounds of 2 x 0.8 s (two jobs in a step): the answers end HANDLER_GRACE_SECONDS past the deadline with the
    text so far, not at the round's end (up to 1.6 s later)."""
    from sparrow.serve.app import HANDLER_GRACE_SECONDS

    plain = pipe.generate_plain(PROMPT, max_new_tokens=200).text
    pipe.round_delay = 0.8
    with live_server(pipe, api_key=KEY, max_batch=2) as (url, scheduler):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
        outcomes: dict[str, object] = {}
        ended: dict[str, float] = {}
        texts: list[str] = []  # the stream's text chunks so far

        def streamed_request() -> None:
            chunks = []
            for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}):
                chunks.append(chunk)
                if chunk.choices and chunk.choices[0].text:
                    texts.append(chunk.choices[0].text)
            outcomes["stream"], ended["stream"] = chunks, time.monotonic()

        def whole_request() -> None:
            outcomes["whole"] = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200,
                                                          temperature=0)
            ended["whole"] = time.monotonic()

        threads = [threading.Thread(target=streamed_request), threading.Thread(target=whole_request)]
        for thread in threads:
            thread.start()
        # three rounds of the stream: the other request, admitted by its second step at the latest, has had one
        wait_for(lambda: len(texts) >= 3 and metric(url, "sparrow:num_requests_running") == 2, 20)
        drained = time.monotonic()
        scheduler.drain(0.1)
        for thread in threads:
            thread.join(10)
    for name in ("stream", "whole"):
        assert ended[name] - drained < 0.1 + HANDLER_GRACE_SECONDS + 0.3, (name, ended[name] - drained)
    chunks = outcomes["stream"]
    pieces, finish, usage = streamed(chunks, chat=False)
    last = next(c for c in reversed(chunks) if c.choices)
    assert finish == "length" and last.sparrow == {"ended_by": "shutdown"}
    assert pieces and plain.startswith("".join(pieces)) and 0 < usage.completion_tokens < 200
    whole = outcomes["whole"]
    assert whole.choices[0].finish_reason == "length" and whole.sparrow == {"ended_by": "shutdown"}
    assert plain.startswith(whole.choices[0].text) and whole.usage.completion_tokens < 200


def test_a_running_request_with_nothing_generated_by_the_deadline_gets_503(pipe):
    pipe.gate = threading.Event()  # the worker holds the job before its prefill
    try:
        with live_server(pipe) as (url, scheduler):
            answer: list[httpx.Response] = []
            thread = threading.Thread(target=lambda: answer.append(httpx.post(
                f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "stream": True}, timeout=30)))
            thread.start()
            wait_for(lambda: metric(url, "sparrow:num_requests_running") == 1)
            scheduler.drain(0.1)
            thread.join(5)
            assert answer and answer[0].status_code == 503 and answer[0].json()["error"]["code"] == "shutting_down"
    finally:
        pipe.gate.set()

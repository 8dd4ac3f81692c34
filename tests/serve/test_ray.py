"""`sparrow serve --ray`: the OpenAI-compatible app as a Ray Serve deployment of 2 replicas, on a local Ray instance
bound to 127.0.0.1 (2 CPUs, no dashboard), each replica loading its own tiny float32 model.

a) The official `openai` client through Ray's proxy: chat and completion, streamed and not; greedy output equals
   the single-process server's (uvicorn + create_app over the same `load`).
b) Requests spread over both replicas (`x-sparrow-replica` takes 2 values).
c) Killing a replica's actor: Serve replaces it (2 running replicas again), requests in flight end (completed, or
   an HTTP error with a body, or a closed connection) within their client timeout, and new requests succeed.
d) The CLI refuses --replicas/--ray-address/--replica-cpus without --ray, --replicas 0, --max-batch 0, and says how to
   get Ray when it is missing.
Also: the local instance listens on loopback; a model that fails to load fails the deployment with its message.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

ray = pytest.importorskip("ray")
from live import serving  # noqa: E402
from ray import serve  # noqa: E402

from sparrow.cli import app as cli  # noqa: E402
from sparrow.errors import UserError  # noqa: E402
from sparrow.serve import (  # noqa: E402
    Scheduler,
    create_app,
    ray_deploy,  # noqa: E402
)

TESTS = os.pathsep.join(str(Path(__file__).resolve().parents[i]) for i in (0, 1))  # this file's and conftest's
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "The quick brown fox"}]
KEY = "sk-ray"
DEPLOYMENT = "SparrowReplica"
FORWARD_SECONDS = 0.005


def load_tiny():
    """The `load` every replica runs (imported by reference: the replicas get tests/ on PYTHONPATH): the tiny
    float32 llama with a draft-model drafter on a perturbed copy, as in test_serve.py. Each target forward
    sleeps FORWARD_SECONDS, so that a long request is still running when the test kills its replica."""
    import time

    import torch
    from conftest import perturbed, tiny_model, tiny_tokenizer

    from sparrow.drafters import build_drafter
    from sparrow.models import LoadedModel
    from sparrow.pipeline import Pipeline

    torch.set_num_threads(1)  # tiny models: threads only cost time on a shared CPU (and float sums stay the same)
    target = LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")
    draft = LoadedModel(model=perturbed(target.model, 0.3, seed=1), tokenizer=target.tokenizer, name="draft")
    target.model.register_forward_hook(lambda *_: time.sleep(FORWARD_SECONDS))
    return Pipeline(target, build_drafter("draft-model", target, draft, 4))


def fail_to_load():
    from sparrow.errors import UserError

    raise UserError("--target 'nope' is not a preset, a file, a directory nor a hub id")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def replica_states() -> dict[str, int]:
    app = serve.status().applications.get(ray_deploy.APP_NAME)
    return dict(app.deployments[DEPLOYMENT].replica_states) if app and DEPLOYMENT in app.deployments else {}


def replica_actors() -> dict[str, str]:
    """replica id -> the name of its actor (namespace "serve"): "SERVE_REPLICA::<app>#<deployment>#<id>"."""
    return {actor["name"].rsplit("#", 1)[1]: actor["name"]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith(f"SERVE_REPLICA::{ray_deploy.APP_NAME}#{DEPLOYMENT}#")}


@pytest.fixture(scope="module")
def ray_url():
    """2 replicas behind Ray Serve's proxy on 127.0.0.1; Serve and Ray shut down after the module (and the
    loopback switch of `ray_deploy.loopback_only` is undone)."""
    from ray._private import ray_constants

    port = free_port()
    pythonpath = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}}
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)  # restored afterwards, as is the constant
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
        ray_deploy.start(host="127.0.0.1", port=port, num_cpus=2, object_store_memory=100 * 2**20,
                         log_to_driver=False)
        try:
            app = ray_deploy.deployment(load_tiny, model_name="tiny", api_key=KEY, num_replicas=2, max_queue=8,
                                        max_batch=4, num_cpus=0.5, runtime_env=runtime_env)
            ray_deploy.deploy(app)  # returns once both replicas have loaded their model
            yield f"http://127.0.0.1:{port}"
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def local_url():
    """The single-process server (uvicorn on 127.0.0.1 in a thread) over the same `load`."""
    with serving(create_app(Scheduler(load_tiny), model_name="tiny", api_key=KEY)) as url:
        yield url


def ok(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=5).status_code == 200
    return False


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def answers(url: str) -> list[str]:
    """Greedy completion and chat, streamed and not, through the openai client."""
    c = client(url)
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    pieces = [choice.text for chunk in stream for choice in chunk.choices if choice.text]
    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=32, temperature=0)
    chat_stream = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=32, temperature=0, stream=True)
    chat_pieces = [choice.delta.content for chunk in chat_stream for choice in chunk.choices if choice.delta.content]
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 40
    assert len(pieces) > 1 and len(chat_pieces) > 1
    return [full.choices[0].text, "".join(pieces), chat.choices[0].message.content, "".join(chat_pieces)]


def completion(url: str, max_tokens: int = 8, stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)


# --- a) the openai client through Ray == the single-process server ------------------------------------------


def test_greedy_output_through_ray_equals_the_single_process_server(ray_url, local_url):
    through_ray, local = answers(ray_url), answers(local_url)
    assert through_ray == local
    assert through_ray[0] == through_ray[1] and through_ray[2] == through_ray[3]  # streamed == non-streamed
    assert all(text.strip() for text in through_ray)


def test_the_local_ray_instance_listens_on_loopback(ray_url):
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}


def test_health_metrics_and_errors_come_from_the_replicas(ray_url):
    health = httpx.get(f"{ray_url}/health", timeout=30)
    assert health.status_code == 200 and health.headers["x-sparrow-replica"]
    metrics = httpx.get(f"{ray_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert metrics.status_code == 200 and "sparrow:requests_total" in metrics.text
    assert httpx.get(f"{ray_url}/metrics", timeout=30).status_code == 401  # behind the key, as in one process
    for path in ("/docs", "/redoc", "/openapi.json"):  # nothing unasked
        assert httpx.get(f"{ray_url}{path}", timeout=30).status_code == 404, path
    with pytest.raises(openai.BadRequestError) as bad:
        client(ray_url).completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    assert httpx.get(f"{ray_url}/v1/models", timeout=30).status_code == 401  # no key


# --- b) both replicas serve -----------------------------------------------------------------------------------


def test_requests_spread_over_both_replicas(ray_url):
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: completion(ray_url, max_tokens=4), range(20)))
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    served_by = {reply.headers["x-sparrow-replica"] for reply in replies}
    assert len(served_by) == 2 and served_by == set(replica_actors())
    assert len({reply.json()["choices"][0]["text"] for reply in replies}) == 1  # the same model on both


# --- c) a replica dies: replaced, nothing hangs ------------------------------------------------------------


def test_a_killed_replica_is_replaced_and_requests_in_flight_end_cleanly(ray_url):
    """4 streamed and 2 non-streamed long requests run while one replica's actor is killed: the ones on the other
    replica complete; the victim's end with an HTTP error with a body or a connection the client sees closed."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 900, "temperature": 0}
    headers = {"authorization": f"Bearer {KEY}"}
    ended: list[tuple[str, str]] = []  # (replica or "?", outcome) of each request
    started: list[str] = []  # the replica of each streamed request, once its response has begun

    def outcome(reply: httpx.Response, text: str, stream: bool) -> str:
        if reply.status_code != 200:
            assert reply.status_code >= 500 and text.strip(), (reply.status_code, text)
            return f"http {reply.status_code}"
        complete = text.rstrip().endswith("data: [DONE]") if stream else '"finish_reason":"length"' in text
        return "done" if complete else f"cut: {text[-80:]!r}"

    def request(stream: bool) -> None:
        replica = "?"
        try:
            with httpx.stream("POST", f"{ray_url}/v1/completions", json={**body, "stream": stream}, headers=headers,
                              timeout=60) as reply:
                replica = reply.headers.get("x-sparrow-replica", "?")
                if stream:
                    started.append(replica)
                ended.append((replica, outcome(reply, "".join(reply.iter_text()), stream)))
        except httpx.TimeoutException as e:
            ended.append((replica, f"HUNG: {e!r}"))
        except httpx.TransportError as e:  # the replica's connection closed: the client sees it
            ended.append((replica, f"closed: {type(e).__name__}"))

    before = replica_actors()
    assert len(before) == 2
    threads = [threading.Thread(target=request, args=(stream,), daemon=True) for stream in [True] * 4 + [False] * 2]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(started) == 4, 60, "the streams to start")
    victim = max(before, key=started.count)  # a replica with requests in flight
    ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(90)
    assert not any(thread.is_alive() for thread in threads), f"a request in flight hung: {ended}"
    assert len(ended) == len(threads) and not any(o.startswith("HUNG") for _, o in ended), ended
    survivor = next(replica for replica in before if replica != victim)
    assert all(o == "done" for replica, o in ended if replica == survivor), ended
    assert any(o != "done" for _, o in ended), ended  # the kill did interrupt requests in flight
    assert all(o == "done" or o.startswith(("http 5", "closed")) for _, o in ended), ended

    wait_for(lambda: replica_states() == {"RUNNING": 2} and victim not in replica_actors()
             and len(replica_actors()) == 2, 90, "Serve to replace the killed replica")
    replies = [completion(ray_url) for _ in range(6)]
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    assert victim not in {reply.headers["x-sparrow-replica"] for reply in replies}
    print("in flight during the kill:", sorted(ended), "victim", victim)


# --- a replica whose model fails to load ----------------------------------------------------------------------


def test_a_model_that_fails_to_load_fails_the_deployment_with_its_message(ray_url):
    """The CLI turns this UserError into one line and exit 2, as when the single-process server fails to load."""
    app = ray_deploy.deployment(fail_to_load, model_name="nope", num_replicas=1, num_cpus=0.5,
                                runtime_env={"env_vars": {"PYTHONPATH": TESTS}})
    try:
        with pytest.raises(UserError) as failed:
            ray_deploy.deploy(app, name="broken", route_prefix="/broken")
    finally:
        serve.delete("broken")
    assert str(failed.value) == ("the model failed to load on a Ray replica: "
                                 "--target 'nope' is not a preset, a file, a directory nor a hub id")
    assert replica_states() == {"RUNNING": 2} and completion(ray_url).status_code == 200


# --- d) the CLI -------------------------------------------------------------------------------------------


def test_cli_checks_the_ray_flags_before_loading(monkeypatch):
    runner = CliRunner()
    help_text = runner.invoke(cli, ["serve", "--help"]).output
    assert all(flag in help_text for flag in ("--ray", "--replicas", "--ray-address", "--replica-cpus", "--max-batch"))
    for flags, needle in [(["--replicas", "2"], "--replicas"), (["--replicas", "0"], "--replicas"),
                          (["--ray", "--replicas", "0"], "--replicas"), (["--max-batch", "0"], "--max-batch"),
                          (["--ray-address", "auto"], "--ray-address"), (["--replica-cpus", "2"], "--replica-cpus"),
                          (["--ray", "--replica-cpus", "0"], "--replica-cpus")]:
        result = runner.invoke(cli, ["serve", *flags])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], (flags, result.output)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    monkeypatch.delitem(sys.modules, "sparrow.serve.ray_deploy")
    monkeypatch.delattr(sys.modules["sparrow.serve"], "ray_deploy")
    result = runner.invoke(cli, ["serve", "--ray", "--replicas", "2"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: sparrow serve --ray needs the ray extra: pip install 'sparrow[ray]'"

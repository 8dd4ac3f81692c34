"""`sparrow serve --ray`: the same OpenAI-compatible app, replicated with Ray Serve on one machine or many.

    from sparrow.serve.ray_deploy import deployment, run
    app = deployment(lambda: sparrow.load("qwen2.5-coder-1.5b"), model_name="qwen2.5-coder-1.5b", num_replicas=2)
    run(app, host="127.0.0.1", port=8000)       # a local Ray instance on loopback; blocks until Ctrl-C

Each replica is a Ray actor that calls `load` itself (the callable is pickled and shipped to it, so it must
build the pipeline from what it captures, not from objects of the calling process), builds its own
`Scheduler` and `create_app(...)`, and serves `/v1/...`, `/health` and `/metrics` (behind the API key, and no
/docs, /redoc or /openapi.json, unless asked: `create_app`'s `public_metrics` and `openapi`) through Ray Serve's HTTP
proxy, which sends each request to the less busy of two replicas. Every response served through Ray carries
`x-sparrow-replica: <replica id>`. A replica loads its model in its constructor, so it takes traffic only
once the model is loaded; a model that fails to load fails the replica (Serve retries a few times, then
`deploy`/`run` raise with the replica's message), and `check_health` fails if a replica's scheduler holds no
model. A replica that dies is replaced by Serve; its requests in flight end with an HTTP 5xx with a body or a
connection the client sees closed, never a hang. `/metrics` shows the counters of the one replica that
answered that scrape.

More than one machine: every machine needs the same Python environment (sparrow with its `ray` extra) and the
model (installed, or reachable on the hub); each replica loads it on the machine Ray places it on.

    export RAY_AUTH_MODE=token && ray get-auth-token --generate && ray start --head --port 6379   # the head
    export RAY_AUTH_MODE=token && ray start --address HEAD_IP:6379     # every other machine, with the head's
                                                                       # ~/.ray/auth_token copied to its ~/.ray/
    sparrow serve --ray --ray-address auto --replicas 4 --host 0.0.0.0 --port 8000 --target ...   # the head

Each replica asks Ray for `--replica-cpus` CPUs (1 by default on a cluster; Ray also sets its torch threads to
that) and one GPU with `--device cuda`; a proxy on every machine listens on `--host`/`--port`, so clients may
call any machine. Ctrl-C (or SIGTERM) shuts Ray Serve down, and Ray itself when it is the local instance;
`ray stop` on each machine ends a cluster. Needs the `ray` extra: `pip install 'sparrow[ray]'`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparrow.errors import UserError
from sparrow.pipeline import Pipeline
from sparrow.serve.app import create_app
from sparrow.serve.scheduler import Scheduler

log = logging.getLogger("sparrow.serve")

REPLICA_HEADER = "x-sparrow-replica"
APP_NAME = "sparrow"  # the Ray Serve application's name
READY_POLL_SECONDS = 0.01
READY_TIMEOUT_SECONDS = 600.0  # the scheduler's worker starts at once (the model is loaded by then): a bound only
LOAD_FAILED = "sparrow: the model failed to load"  # marks a replica's load error in Serve's status messages


class ModelLoadFailed(Exception):
    """A replica's `load()` raised: `user` for a UserError, an OSError or an out-of-memory error (the input's
    fault: exit 2), else a bug (exit 1). Its message survives Serve's status as `LOAD_FAILED (kind): message`."""

    def __init__(self, error: BaseException) -> None:
        self.user = isinstance(error, (UserError, OSError)) or type(error).__name__ == "OutOfMemoryError"
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        kind = "user error" if self.user else f"bug: {type(error).__name__}"
        super().__init__(f"{LOAD_FAILED} ({kind}): {detail}")


class ReplicaApp:
    """ASGI middleware of a replica: tags every HTTP response with `x-sparrow-replica`, and finishes the
    lifespan's startup only once the scheduler holds the pipeline (no 503 "loading" from a RUNNING replica)."""

    def __init__(self, app: ASGIApp, replica: str, scheduler: Scheduler) -> None:
        self.app, self.replica_id, self.scheduler = app, replica, scheduler
        self.header = (REPLICA_HEADER.encode(), replica.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._started(send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)

    def _started(self, send: Send) -> Send:
        async def started(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                waited = 0.0
                while not self.scheduler.ready and self.scheduler.load_error is None and waited < READY_TIMEOUT_SECONDS:
                    await asyncio.sleep(READY_POLL_SECONDS)
                    waited += READY_POLL_SECONDS
                if not self.scheduler.ready:
                    error = self.scheduler.load_error or f"no model after {READY_TIMEOUT_SECONDS:.0f} s"
                    message = {"type": "lifespan.startup.failed", "message": f"the scheduler did not start: {error}"}
            await send(message)

        return started


@serve.ingress()
class SparrowReplica:
    """One replica: loads the pipeline, then serves `create_app` over it (see the module doc)."""

    async def __init__(self, load: Callable[[], Pipeline], model_name: str, api_key: str | None,
                     scheduler_options: dict[str, Any], app_options: dict[str, Any] | None = None) -> None:
        self.replica_id = serve.get_replica_context().replica_tag
        log.info("replica %s: loading the model", self.replica_id)
        try:
            pipeline = await asyncio.to_thread(load)
        except Exception as e:  # fails the replica; `deploy` finds the message in Serve's status
            log.exception("replica %s: loading the model failed", self.replica_id)
            raise ModelLoadFailed(e) from e
        self.scheduler = Scheduler(lambda: pipeline, **scheduler_options)
        self.sparrow_app = create_app(self.scheduler, model_name=model_name, api_key=api_key, **(app_options or {}))

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return ReplicaApp(self.sparrow_app, self.replica_id, self.scheduler)

    def check_health(self) -> None:
        """Called by Serve every few seconds; raising marks the replica unhealthy (Serve replaces it)."""
        if self.scheduler.load_error is not None:
            raise RuntimeError(f"replica {self.replica_id}: the model failed to load: {self.scheduler.load_error}")
        if not self.scheduler.ready:
            raise RuntimeError(f"replica {self.replica_id}: the scheduler holds no model")


def deployment(load: Callable[[], Pipeline], *, model_name: str, api_key: str | None = None,
               num_replicas: int = 1, max_queue: int = 32, timeout: float | None = None,
               max_batch: int | None = None, num_cpus: float = 1, num_gpus: float = 0,
               runtime_env: dict[str, Any] | None = None, openapi: bool = False,
               public_metrics: bool = False) -> serve.Application:
    """The Ray Serve application: `num_replicas` replicas, each calling `load()` and serving `create_app`.

    `max_queue`, `timeout` and `max_batch` go to each replica's Scheduler (`max_batch` only when given).
    A replica takes at most `max_queue + max_batch` requests at once (its own queue answers 429 beyond that);
    Ray's router sends each request to the less busy of two replicas. `num_cpus`, `num_gpus`: what each replica
    reserves (Ray sets its torch threads to `num_cpus`, and hides every GPU from a replica with `num_gpus=0`);
    `runtime_env`: Ray's, for each replica. `openapi`, `public_metrics`: `create_app`'s (both off: no schema,
    /metrics behind the key)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    scheduler_options: dict[str, Any] = {"max_queue": max_queue, "timeout": timeout}
    if max_batch is not None:
        scheduler_options["max_batch"] = max_batch
    actor_options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if runtime_env is not None:
        actor_options["runtime_env"] = runtime_env
    replica = serve.deployment(SparrowReplica, name="SparrowReplica", num_replicas=num_replicas,
                               ray_actor_options=actor_options,
                               max_ongoing_requests=max_queue + (max_batch or 1),
                               health_check_period_s=5, health_check_timeout_s=30)
    return replica.bind(load, model_name, api_key, scheduler_options,
                        {"openapi": openapi, "public_metrics": public_metrics})


def start(*, host: str, port: int, address: str | None = None, **init_options: Any) -> None:
    """Connect to the Ray cluster at `address` ("auto": the one `ray start` began on this machine), or start a
    local Ray instance whose services listen on 127.0.0.1 only (None); then start Serve's HTTP proxies on
    `host`:`port`. `init_options` go to `ray.init`."""
    import ray

    if address is None:
        loopback_only()
        ray.init(address="local", include_dashboard=False, **init_options)
    else:
        ray.init(address=address, **init_options)
    serve.start(http_options={"host": host, "port": port})


def loopback_only() -> None:
    """Make a local Ray instance use 127.0.0.1 as its node address, so that its GCS, raylet and workers listen
    on loopback only. On Linux Ray replaces 127.0.0.1 given as `_node_ip_address` by the machine's address
    and then listens on every interface; its own switch for single-machine Ray (what it does on macOS and
    Windows) is the environment variable below, read when ray is imported, so it is also set on the loaded
    module (ray is pinned to 2.60.0). Children (raylet, workers) inherit the variable."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def deploy(app: serve.Application, *, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """`serve.run`, returning once every replica has loaded its model. A replica whose model fails to load
    fails the deployment (after Serve's retries): UserError for the input's fault (a bad --target, a file
    that does not exist, out of memory), RuntimeError otherwise, either with the replica's message."""
    try:
        serve.run(app, name=name, route_prefix=route_prefix)
    except RuntimeError as e:
        raise deploy_error(name, e) from e


def deploy_error(name: str, error: RuntimeError) -> Exception:
    """The replicas' load error from Serve's status of application `name`, or Serve's own `error`."""
    try:
        status = serve.status().applications[name]
        messages = [status.message, *(d.message for d in status.deployments.values())]
    except Exception:  # the status is gone too: Serve's own error is all there is
        return error
    for message in messages:
        found = re.search(re.escape(LOAD_FAILED) + r" \((user error|bug: \w+)\): (.*)", message or "")
        if found:
            text = f"the model failed to load on a Ray replica: {found.group(2)}"
            if found.group(1) == "user error":
                return UserError(text)
            return RuntimeError(f"{text} ({found.group(1)}; the replica's traceback is in Ray's logs)")
    return RuntimeError(f"{error} {' '.join(m for m in messages if m)}".strip())


class Terminated(BaseException):
    """SIGTERM arrived while `run` served (a BaseException, like KeyboardInterrupt: no `except Exception` eats it)."""


def terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def run(app: serve.Application, *, host: str, port: int, address: str | None = None,
        num_cpus: int | None = None) -> None:
    """Deploy `app` (see `start`), block until Ctrl-C (KeyboardInterrupt) or SIGTERM (returns), then shut Ray
    Serve down, and Ray itself when it is the local instance (on a cluster: only this driver disconnects).
    `num_cpus`: the local instance's CPUs (default: this machine's)."""
    import ray

    main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    start(host=host, port=port, address=address, **({"num_cpus": num_cpus} if address is None and num_cpus else {}))
    if main:
        signal.signal(signal.SIGTERM, terminate)  # after ray.init, which sets its own (sys.exit mid-call)
    try:
        deploy(app)
        print(f"sparrow: serving on http://{host}:{port} through Ray Serve; Ctrl-C stops it", file=sys.stderr,
              flush=True)
        threading.Event().wait()
    except Terminated:
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        serve.shutdown()
        ray.shutdown()

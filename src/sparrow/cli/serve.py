"""`sparrow serve`: flags -> a Scheduler that loads the pipeline -> the OpenAI-compatible app under uvicorn.

The server starts listening at once (`/health` answers 503 until the model is loaded); a model that fails to
load stops the server, and the command exits as `sparrow generate` would (2 for a user error, 1 for a bug).
SIGTERM or Ctrl-C shuts it down within `--shutdown-timeout` seconds (`sparrow.serve.shutdown`). Nothing is served
unasked: no /docs, /redoc or /openapi.json (`--openapi`: the schema, behind the key), /metrics behind the key
(`--public-metrics`: without).

`--ray` serves the same app as a Ray Serve deployment of `--replicas` replicas (`sparrow.serve.ray_deploy`), on
a local Ray instance bound to 127.0.0.1, or on the cluster at `--ray-address` (more than one machine); each
replica loads the model itself; the command serves once every replica has loaded it, until Ctrl-C.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sparrow.cli import flags
from sparrow.cli._common import (
    DType,
    check_float,
    check_int,
    cli_errors,
    drafter_flags_given,
)
from sparrow.drafters.plan import resolve_plan
from sparrow.drafters.registry import drafter_names
from sparrow.errors import UserError

DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds: within the 30 s a platform (Kubernetes, Docker) waits before SIGKILL


@cli_errors
def serve(
    target: flags.Target = "qwen2.5-coder-1.5b",
    drafter: Annotated[str, typer.Option(help=f"Drafting method: {', '.join(drafter_names())}.")] = "draft-model",
    draft: Annotated[str, typer.Option(
        help="Draft model: preset, local dir or hub id; 'default' = the drafter's own default.")] = "default",
    k: flags.NumDraft = None,
    adaptive: flags.Adaptive = True,
    dtype: flags.Dtype = DType.auto,
    quant: flags.Quant = None,
    draft_quant: flags.DraftQuant = "auto",
    head: flags.Head = None,
    device: flags.Device = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar='SPARROW_API_KEY',
        help="Require 'Authorization: Bearer KEY' on /v1/ (env SPARROW_API_KEY).")] = None,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait; more get HTTP 429.")] = 32,
    timeout: Annotated[Optional[float], typer.Option(
        help="Seconds a request may generate; then it ends with finish_reason 'length'.")] = None,
    shutdown_timeout: Annotated[
        Optional[float],
        typer.Option(
            help="On SIGTERM/Ctrl-C: new and waiting requests get HTTP 503 at once; running ones may go on this many "
                "seconds, then end with finish_reason 'length'; the server exits within about a second more (default "
                "10)."
        ),
    ] = None,
    model_name: Annotated[Optional[str], typer.Option(help="The model name clients send (default: --target).")] = None,
    max_batch: Annotated[int, typer.Option(help="Requests decoded together in one batch step.")] = 8,
    prefix_cache: Annotated[int, typer.Option(metavar='TOKENS',
        help="Keep the KV of finished requests, up to this many tokens in all (LRU), so that a prompt that begins "
        "like one of them (a conversation's next turn, an agent's fixed preamble) prefills only the rest; 0: off. "
        "vLLM's automatic prefix caching; usage.prompt_tokens_details.cached_tokens says how many a request took. "
        "Not with drafters that read the target's prompt states (eagle, sparse, visual-prune).")] = 0,
    ray: Annotated[bool, typer.Option('--ray/--no-ray',
        help="Serve replicas with Ray Serve (needs the ray extra).")] = False,
    replicas: Annotated[Optional[int], typer.Option(
        help="With --ray: replicas, each loading the model (default 1).")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        help="With --ray: the Ray cluster to join ('auto', or HEAD_IP:6379); default: a local Ray instance on "
        "127.0.0.1.")] = None,
    openapi: Annotated[bool, typer.Option('--openapi/--no-openapi',
        help="Serve the OpenAPI schema at /openapi.json (behind --api-key). Off by default; /docs and /redoc are "
        "never served (they load scripts from a CDN).")] = False,
    public_metrics: Annotated[bool, typer.Option('--public-metrics/--private-metrics',
        help="Serve /metrics without --api-key (by default it needs the key when one is set).")] = False,
    replica_cpus: Annotated[Optional[float], typer.Option(
        help="With --ray: CPUs each replica reserves, and its torch threads (default: this machine's CPUs / "
        "--replicas on the local Ray instance, 1 on a cluster).")] = None,
    speculative_config: flags.SpeculativeConfig = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, streaming, /metrics)."""
    check_int("-k/--num-draft-tokens", k, 1)
    check_int("--max-queue", max_queue, 1)
    check_int("--max-batch", max_batch, 1)
    check_int("--prefix-cache", prefix_cache, 0)
    check_int("--replicas", replicas, 1)
    check_float("--replica-cpus", replica_cpus, "a number of CPUs > 0", lambda c: c > 0)
    for flag, value in (("--replicas", replicas), ("--ray-address", ray_address), ("--replica-cpus", replica_cpus)):
        if not ray and value is not None:
            raise UserError(f"{flag} needs --ray (without it one process serves the model)")
    if ray_address is not None and not ray_address.strip():
        raise UserError("--ray-address must not be empty")
    check_float("--timeout", timeout, "a number of seconds > 0", lambda t: t > 0)
    check_float("--shutdown-timeout", shutdown_timeout, "a number of seconds >= 0", lambda t: t >= 0)
    if ray and shutdown_timeout is not None:
        raise UserError("--shutdown-timeout applies without --ray (Ray Serve drains its replicas itself)")
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key must not be empty")
    from sparrow.cli.generate import head_options

    # the plan: every drafter and format argument checked before the server starts
    plan = resolve_plan(target, drafter=drafter, draft=draft, num_draft_tokens=k, adaptive=adaptive,
                        dtype=dtype.value, device=device, quant=quant, draft_quant=draft_quant,
                        prefix_cache=prefix_cache, speculative_config=speculative_config,
                        given=drafter_flags_given(), flags=True, **head_options(head))
    try:
        import uvicorn

        from sparrow.serve import Scheduler, create_app
        from sparrow.serve.shutdown import DeadlineServer
    except ImportError as e:
        raise UserError(
            f"sparrow serve needs the serve extra ({e.name} is missing): pip install 'sparrow[serve]'"
        ) from e
    if ray:
        try:
            from sparrow.serve import ray_deploy
        except ImportError as e:
            raise UserError("sparrow serve --ray needs the ray extra: pip install 'sparrow[ray]'") from e
    import sparrow

    def load() -> sparrow.Pipeline:
        return sparrow.load(plan)

    if ray:
        import math
        import os

        import torch

        replicas = replicas or 1
        cpus = os.cpu_count() or 1
        if replica_cpus is None:  # the local instance has this machine's CPUs: share them out
            replica_cpus = max(1, cpus // replicas) if ray_address is None else 1
        # a replica sees a GPU only if it asks Ray for one: with --device cuda, or by default where this one has one
        gpus = 1 if (device or "").startswith("cuda") or (device is None and torch.cuda.is_available()) else 0
        app = ray_deploy.deployment(load, model_name=model_name or target, api_key=api_key, num_replicas=replicas,
                                    max_queue=max_queue, timeout=timeout, max_batch=max_batch, num_cpus=replica_cpus,
                                    num_gpus=gpus, openapi=openapi, public_metrics=public_metrics)
        # a local instance with CPUs for every replica (Ray's CPUs are bookkeeping: none would wait for one)
        local_cpus = max(cpus, math.ceil(replicas * replica_cpus))
        ray_deploy.run(app, host=host, port=port, address=ray_address, num_cpus=local_cpus)
        return
    scheduler = Scheduler(load, max_queue=max_queue, timeout=timeout, max_batch=max_batch)
    app = create_app(scheduler, model_name=model_name or target, api_key=api_key, openapi=openapi,
                     public_metrics=public_metrics)
    server = DeadlineServer(uvicorn.Config(app, host=host, port=port, log_level="info"), scheduler,
                            DEFAULT_SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout)
    scheduler.on_load_error = lambda e: setattr(server, "should_exit", True)
    server.run()
    if scheduler.load_error is not None:
        raise scheduler.load_error

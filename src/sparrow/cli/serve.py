"""`sparrow serve`: flags -> a Scheduler that loads the pipeline -> the OpenAI-compatible app under uvicorn.

The server starts listening at once (`/health` answers 503 until the model is loaded); a model that fails to
load stops the server, and the command exits as `sparrow generate` would (2 for a user error, 1 for a bug).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sparrow.cli._common import DType, check_float, check_int, cli_errors
from sparrow.drafters.registry import check_drafter_args, drafter_names
from sparrow.errors import UserError


@cli_errors
def serve(
    target: Annotated[str, typer.Option(help="Target model: preset, GGUF file, local dir or hub id.")] = "qwen2.5-coder-1.5b",
    drafter: Annotated[str, typer.Option(help=f"Drafting method: {', '.join(drafter_names())}.")] = "draft-model",
    draft: Annotated[str, typer.Option(help="Draft model: preset, local dir or hub id; 'default' = the drafter's own default.")] = "default",
    k: Annotated[Optional[int], typer.Option("-k", "--num-draft-tokens", help="Tokens drafted per round (max, with --adaptive).")] = None,
    adaptive: Annotated[bool, typer.Option("--adaptive/--fixed", help="Adapt the draft length online, or draft exactly k.")] = True,
    dtype: Annotated[DType, typer.Option(help="bfloat16 for speed, float32 for exactness.")] = DType.bfloat16,
    draft_quant: Annotated[Optional[str], typer.Option(help="int8|int4 draft model (lossless).")] = None,
    device: Annotated[Optional[str], typer.Option(help="Default: cuda if available, else cpu.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="SPARROW_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/ (env SPARROW_API_KEY).")] = None,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait; more get HTTP 429.")] = 32,
    timeout: Annotated[Optional[float], typer.Option(help="Seconds a request may generate; then it ends with finish_reason 'length'.")] = None,
    model_name: Annotated[Optional[str], typer.Option(help="The model name clients send (default: --target).")] = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, streaming, /metrics)."""
    check_int("-k/--num-draft-tokens", k, 1)
    check_int("--max-queue", max_queue, 1)
    check_float("--timeout", timeout, "a number of seconds > 0", lambda t: t > 0)
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key must not be empty")
    check_drafter_args(drafter, k)
    try:
        import uvicorn

        from sparrow.serve import Scheduler, create_app
    except ImportError as e:
        raise UserError(f"sparrow serve needs the serve extra ({e.name} is missing): pip install 'sparrow[serve]'") from e
    import sparrow

    def load() -> sparrow.Pipeline:
        return sparrow.load(target, drafter=drafter, draft=draft, num_draft_tokens=k, adaptive=adaptive,
                            dtype=dtype.value, device=device, draft_quant=draft_quant)

    scheduler = Scheduler(load, max_queue=max_queue, timeout=timeout)
    app = create_app(scheduler, model_name=model_name or target, api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    scheduler.on_load_error = lambda e: setattr(server, "should_exit", True)
    server.run()
    if scheduler.load_error is not None:
        raise scheduler.load_error

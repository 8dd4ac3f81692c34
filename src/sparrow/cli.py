"""`sparrow` command line: builds configs from flags and prints results; no decoding logic here."""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from sparrow.drafters import DRAFTERS, REGISTRY, check_drafter_args

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Lossless speculative decoding for LLMs and Video-LLMs.")
err = Console(stderr=True)


class DType(str, Enum):
    bfloat16 = "bfloat16"
    float32 = "float32"
    float16 = "float16"


def fail(message: str) -> None:
    """One line on stderr, exit code 2, no traceback."""
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text.")],
    target: Annotated[str, typer.Option(help="Target model: preset, GGUF file, local dir or hub id.")] = "qwen2.5-coder-1.5b",
    drafter: Annotated[str, typer.Option(help=f"Drafting method: {', '.join(DRAFTERS)}.")] = "draft-model",
    draft: Annotated[str, typer.Option(help="Draft model for --drafter draft-model.")] = "qwen2.5-coder-0.5b",
    k: Annotated[Optional[int], typer.Option("-k", "--num-draft-tokens", help="Tokens drafted per round (max, with --adaptive).")] = None,
    adaptive: Annotated[bool, typer.Option("--adaptive/--fixed", help="Adapt the draft length online (confidence threshold + round cap, at most k) or draft exactly k.")] = True,
    max_new_tokens: Annotated[int, typer.Option(help="Maximum number of new tokens.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="1 = off.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the sampling generator.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    dtype: Annotated[DType, typer.Option(help="bfloat16 for speed, float32 for exactness.")] = DType.bfloat16,
    quant: Annotated[Optional[str], typer.Option(help="int8|int4 weight-only target: faster; lossless only relative to the quantized target.")] = None,
    draft_quant: Annotated[Optional[str], typer.Option(help="int8|int4 draft model, or the quantized-self copy's bits (default int4).")] = None,
    device: Annotated[Optional[str], typer.Option(help="Default: cuda if available, else cpu.")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the tokenizer's chat template.")] = False,
    compare: Annotated[bool, typer.Option(help="Also run plain decoding; report identical and speedup.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")] = False,
) -> None:
    """Generate text with speculative decoding."""
    import sparrow
    from sparrow.config import SamplingConfig, StoppingConfig

    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed, stop=tuple(stop or ()), chat=chat)
    try:  # cheap checks first, so a typo fails before minutes of model loading
        SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        StoppingConfig(max_new_tokens=max_new_tokens, stop_strings=tuple(stop or ()))
        if not prompt.strip():
            raise ValueError("prompt must not be empty")
        check_drafter_args(drafter, k)
        pipe = sparrow.load(target, drafter=drafter, draft=draft, num_draft_tokens=k, adaptive=adaptive,
                            dtype=dtype.value, device=device, progress=not as_json, quant=quant, draft_quant=draft_quant)
        pipe.request(prompt, **options)  # context-length checks need the tokenizer
        if compare:  # warm-up on a short prompt, so neither timed run pays one-time costs (kernels, allocator)
            pipe.generate_plain("Hello", max_new_tokens=4)
            pipe.generate("Hello", max_new_tokens=4)
        result = pipe.generate(prompt, **options)
        baseline = pipe.generate_plain(prompt, **options) if compare else None
    except (ValueError, RuntimeError, OSError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
        return
    stats = result.stats
    record = {
        "text": result.text, "token_ids": result.token_ids, "new_tokens": result.new_tokens,
        "finish_reason": result.finish_reason, "seconds": result.seconds,
        "tokens_per_second": result.tokens_per_second, "mean_accepted_tokens": stats.mean_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate, "drafter": pipe.drafter_name, "target": target,
        "draft": draft if drafter in REGISTRY and REGISTRY[drafter].needs_draft_model else None, "dtype": dtype.value,
        "temperature": temperature, "stats": stats.to_dict(), "quant": quant, "draft_quant": draft_quant,
        "lossless_relative_to": f"the {quant}-quantized target" if quant else "the target",
    }
    if baseline is not None:
        record["baseline"] = {"token_ids": baseline.token_ids, "seconds": baseline.seconds,
                              "tokens_per_second": baseline.tokens_per_second}
        record["identical"] = baseline.token_ids == result.token_ids
        record["speedup"] = result.tokens_per_second / baseline.tokens_per_second
    if as_json:
        sys.stdout.write(json.dumps(record) + "\n")
        return
    typer.echo(result.text)
    table = Table(show_header=False, box=None)
    table.add_row("drafter", f"{pipe.drafter_name} (target {target})")
    table.add_row("tokens", f"{result.new_tokens} in {result.seconds:.2f} s = {result.tokens_per_second:.2f} tok/s")
    table.add_row("mean accepted tokens / step", f"{stats.mean_accepted_tokens:.2f} (acceptance {stats.acceptance_rate:.2f})")
    if baseline is not None:
        table.add_row("plain decoding", f"{baseline.tokens_per_second:.2f} tok/s")
        table.add_row("speedup", f"{record['speedup']:.2f}x")
        table.add_row("identical to plain decoding", "yes" if record["identical"] else "no")
    err.print(table)


@app.command()
def models() -> None:
    """List the preset models and whether each is installed and cached."""
    from sparrow.models import list_presets

    table = Table("preset", "installed", "cached", "description")
    for row in list_presets():
        table.add_row(row["name"], "yes" if row["installed"] else "no", "yes" if row["cached"] else "no",
                      row["description"])
    Console().print(table)


if __name__ == "__main__":
    app()

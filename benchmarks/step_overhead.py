"""Per-step Python / framework overhead of a decode step and a verify step: eager vs static cache vs compiled.

For each model (and dtype), after a fixed context of random tokens, times one forward of q tokens (q = 1: a
decode / draft step; q = 8: a verify step of 7 drafts + the root), then rolls the cache back, for three runners:

* `eager`: sparrow's CachedModel (transformers' DynamicCache), the default path;
* `static`: sparrow.runtime.compiled.StaticCachedModel with compile=False (static cache, eager forwards);
* `compiled`: StaticCachedModel (static cache, torch.compile'd step with its defaults: CUDA graphs on CUDA,
  inductor freezing on a CPU; its compile time is reported apart);
* `compiled-nofreeze` (CPU only): the same without freezing (the weights stay graph inputs).

Overhead, defined: the step time of a *shrunk* model, the same architecture and depth (same layers, same ops,
same context and q) with every width cut so that the arithmetic is nearly free (hidden 64, 4 heads, 2 KV
heads, head_dim 16, MLP 128, vocabulary 512). What it still spends is the per-op cost (Python, dispatch,
allocation, kernel launches) that a real step pays as well, so it estimates the framework overhead of that
step for that runner. Each row also carries the matmul floor of the real weights: every nn.Linear of the model
(LM head included: the step computes all q rows' logits) applied to a [q, in] input, back to back, eagerly;
step - matmul floor is everything that is not a weight matmul (attention, norms, rope, overhead).

The variants are timed interleaved (one step of each in turn) so that drift on a shared machine hits them
alike; rows keep the median and the minimum over the repeats.

    python benchmarks/step_overhead.py run --out benchmarks/results/step_overhead/rows.jsonl
    python benchmarks/step_overhead.py run --models smollm2-135m --dtypes bfloat16 --reps 5 --out /tmp/x.jsonl
    python benchmarks/step_overhead.py render benchmarks/results/step_overhead/rows.jsonl > ....md
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from sparrow.bench.report import read_jsonl
from sparrow.errors import UserError
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.compiled import StaticCachedModel
from sparrow.types import Prompt

PLAN = (("smollm2-135m", "bfloat16"), ("smollm2-135m", "float32"), ("qwen2.5-coder-0.5b", "bfloat16"),
        ("qwen2.5-coder-1.5b", "bfloat16"))
"""(model, dtype) measured by default: bf16 for every size, fp32 for the smallest (its fp32 cache exists)."""
VARIANTS = ("eager", "static", "compiled", "compiled-nofreeze")
SHRUNK = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=512)


@dataclass(frozen=True)
class Row:
    """One (model, dtype, q, variant) measurement; times in milliseconds."""

    model: str
    dtype: str
    q: int
    variant: str
    context: int
    capacity: int | None  # static runners: the cache's slots (attention spans all of them, masked)
    step_ms: float  # median over `reps`
    step_min_ms: float
    overhead_ms: float  # the shrunk model's step (median): the per-step framework overhead estimate
    overhead_min_ms: float
    matmul_ms: float  # the real weights' matmuls alone, eager (median)
    matmul_min_ms: float
    compile_s: float | None  # compiled variants: first call of this shape (real model), including compilation
    graphs: int | None  # compiled: graphs dynamo built so far in this process
    layers: int
    threads: int
    reps: int
    cpu: str
    torch: str
    device: str


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def shrunk(model: nn.Module) -> nn.Module:
    """The same architecture and depth with every width cut (SHRUNK), random weights, same dtype and device."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    for key, value in SHRUNK.items():
        setattr(config, key, value)
    config.tie_word_embeddings = False
    config.pad_token_id = None  # a real vocabulary's padding id (Qwen2: 151643) is outside the shrunk one
    small = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    return small.to(next(model.parameters()).device).eval()


def matmul_floor(model: nn.Module, q: int) -> Callable[[], None]:
    """A step of every nn.Linear of `model` applied to a [q, in_features] input (the LM head included)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    param = next(model.parameters())
    inputs = {m.in_features: torch.randn(q, m.in_features, dtype=param.dtype, device=param.device) for m in linears}

    @torch.inference_mode()
    def run() -> None:
        for m in linears:
            torch.nn.functional.linear(inputs[m.in_features], m.weight, m.bias)
    return run


def stepper(runner: CachedModel, context: int, q: int, vocab: int) -> Callable[[], None]:
    """Prefill `context` random tokens; each call: one forward of q tokens, then rewind to the context."""
    g = torch.Generator().manual_seed(0)
    runner.prefill(Prompt(input_ids=torch.randint(0, vocab, (context,), generator=g)))
    tokens = torch.randint(0, vocab, (q,), generator=g).to(runner.device)

    def run() -> None:
        runner.forward(tokens)
        runner.rewind(context)
    return run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def runners(model: nn.Module, variants: list[str]) -> dict[str, CachedModel]:
    """A fresh runner of `model` per variant name (VARIANTS)."""
    make = {"eager": lambda: CachedModel(model), "static": lambda: StaticCachedModel(model, compile=False),
            "compiled": lambda: StaticCachedModel(model),
            "compiled-nofreeze": lambda: StaticCachedModel(model, freeze=False)}
    return {v: make[v]() for v in variants}


def measure(name: str, dtype: str, device: str | None, qs: list[int], context: int, reps: int,
            warmup: int, variants: list[str]) -> Iterator[Row]:
    """Rows of one model and dtype, yielded as each q is measured (a long run keeps what it measured)."""
    from torch._dynamo.utils import counters

    from sparrow.models import load_model

    loaded = load_model(name, dtype=dtype, device=device, progress=False)
    model = loaded.model
    small = shrunk(model)
    dev = next(model.parameters()).device
    if dev.type != "cpu":
        variants = [v for v in variants if v != "compiled-nofreeze"]
    big_runners, small_runners = runners(model, variants), runners(small, variants)
    for q in qs:
        steps = {("big", v): stepper(r, context, q, model.config.vocab_size) for v, r in big_runners.items()}
        steps |= {("small", v): stepper(r, context, q, SHRUNK["vocab_size"]) for v, r in small_runners.items()}
        steps[("matmul", "")] = matmul_floor(model, q)
        compile_s = {v: timed(steps[("big", v)], dev) for v in variants}  # the first call of a shape compiles
        for v in variants:
            timed(steps[("small", v)], dev)
        for _ in range(warmup):
            for fn in steps.values():
                fn()
        times: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
        for _ in range(reps):  # interleaved: one of each in turn
            for key, fn in steps.items():
                times[key].append(timed(fn, dev) * 1e3)
        for variant in variants:
            runner = big_runners[variant]
            row = Row(
                model=name, dtype=dtype, q=q, variant=variant, context=context,
                capacity=runner.capacity if isinstance(runner, StaticCachedModel) else None,
                step_ms=statistics.median(times[("big", variant)]), step_min_ms=min(times[("big", variant)]),
                overhead_ms=statistics.median(times[("small", variant)]),
                overhead_min_ms=min(times[("small", variant)]),
                matmul_ms=statistics.median(times[("matmul", "")]), matmul_min_ms=min(times[("matmul", "")]),
                compile_s=compile_s[variant] if variant.startswith("compiled") else None,
                graphs=int(counters["stats"]["unique_graphs"]) if variant.startswith("compiled") else None,
                layers=model.config.num_hidden_layers, threads=torch.get_num_threads(), reps=reps, cpu=cpu_name(),
                torch=torch.__version__, device=str(dev))
            print(json.dumps(asdict(row)), file=sys.stderr)
            yield row


def render(rows: list[dict], stat: str = "median") -> str:
    """Markdown: a row per (model, dtype, q); per runner the step time, and in brackets the overhead (the shrunk
    model's step), in ms (`stat`: the median or the minimum over the repeats); then the matmul floor and the
    compile seconds of the compiled variants."""
    key = {"median": "_ms", "min": "_min_ms"}[stat]
    head = rows[0]
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    compiled = [v for v in variants if v.startswith("compiled")]
    lines = [f"{head['cpu']} ({head['device']}), torch {head['torch']}, {head['threads']} threads, context "
             f"{head['context']}; {stat} of {head['reps']} interleaved steps, ms: step (overhead = the same-depth "
             "shrunk model's step).", "",
             "| model | dtype | q | " + " | ".join(variants) + " | matmul floor | "
             + " | ".join(f"{v} compile s" for v in compiled) + " |",
             "|---|---|---:|" + "---:|" * (len(variants) + 1 + len(compiled))]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["dtype"], r["q"]), {})[r["variant"]] = r
    for (model, dtype, q), by in groups.items():
        cells = [f"{by[v]['step' + key]:.2f} ({by[v]['overhead' + key]:.2f})" if v in by else "-" for v in variants]
        floor = next(iter(by.values())).get("matmul" + key, float("nan"))
        compile_s = [f"{by[v]['compile_s']:.0f}" if v in by else "-" for v in compiled]
        lines.append(f"| {model} | {dtype} | {q} | " + " | ".join(cells) + f" | {floor:.2f} | "
                     + " | ".join(compile_s) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure and append JSONL rows")
    run.add_argument("--models", nargs="*", help="default: every model of PLAN (with its dtypes)")
    run.add_argument("--dtypes", nargs="*", help="default: PLAN's dtypes for each model")
    run.add_argument("--q", nargs="+", type=int, default=[1, 8], help="tokens per step (default 1 and 8)")
    run.add_argument("--context", type=int, default=256)
    run.add_argument("--reps", type=int, default=30)
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    run.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    run.add_argument("--device", default=None)
    run.add_argument("--out", type=Path, default=Path("benchmarks/results/step_overhead/rows.jsonl"))
    show = sub.add_parser("render", help="markdown table of JSONL rows")
    show.add_argument("rows", type=Path)
    show.add_argument("--stat", choices=("median", "min"), default="median")
    args = parser.parse_args(argv)
    if args.command == "render":
        rows = [json.loads(line) for line in read_jsonl(args.rows) if line.strip()]
        sys.stdout.write(render(rows, args.stat))
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    plan = [(m, d) for m, d in PLAN if (not args.models or m in args.models)]
    if args.models:
        plan += [(m, "bfloat16") for m in args.models if m not in {p[0] for p in PLAN}]
    if args.dtypes:
        plan = list(dict.fromkeys((m, d) for m, _ in plan for d in args.dtypes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, dtype in plan:
        try:
            for row in measure(name, dtype, args.device, args.q, args.context, args.reps, args.warmup, args.variants):
                with args.out.open("a") as f:
                    f.write(json.dumps(asdict(row)) + "\n")
        except UserError as e:  # not installed / not cached here: the other models still run
            print(f"skipped {name} {dtype}: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""One decoding step of a GGUF target (--quant gguf): milliseconds per step, variants interleaved in one process.

After a prefix of `--context` random tokens, times one forward of a single token (a plain decoding step; with
`--rows`, of each number of tokens listed: a verify of n - 1 drafted tokens) and rewinds the cache, for each variant:

* `eager`: the model in sparrow's CachedModel (a DynamicCache whose layers append in place,
  `sparrow.runtime.kv_buffer`; the forward of `sparrow.runtime.decoder`), what `--quant gguf` runs;
* `transformers`: the same through transformers' own model forward (the same bits);
* `dynamic`: the same with transformers' own DynamicCache layers (a `torch.cat` of the whole cache every forward);
* `compiled` (with --compile): the model in sparrow.runtime.compiled.StaticCachedModel (static cache, the one-row
  step through torch.compile / inductor, the GGUF matmul an opaque custom op), what `--compile --no-exact` runs; its
  compile time is reported;
* `static` (with --compile): the same runner without compiling (static cache, eager forwards).

(Rows of 2026-11-28 in benchmarks/results/gguf_step.jsonl.gz also have `unfused` / `fused` variants: q / k / v and
gate / up grouped into one kernel call each, tried and not kept, see docs/results/gguf-kernels.md.)

Each round runs the variants in order and then in reverse (ABBA), `--steps` steps each (1: the finest
interleaving), so that load on a shared machine hits them alike; the summary gives the median, min, 10th and 25th
percentiles and max of every step timed (on a busy machine the low percentiles are the quiet moments), and the
load average before and after. The resident memory (VmRSS) is printed at the end beside the file's size (run one
variant alone to read a variant's own).

    python benchmarks/gguf_step.py --target qwen2.5-coder-1.5b --rounds 5 --steps 10
    python benchmarks/gguf_step.py --variants eager,compiled --compile
    python benchmarks/gguf_step.py --variants eager,compiled --compile --rows 1,8,9,12,16 --rounds 3 --steps 3
    python benchmarks/gguf_step.py --variants eager,dynamic --context 3000 --rows 1,4 [--skip-matmuls]
    python benchmarks/gguf_step.py --variants eager,transformers --rounds 5 --steps 3 --rows 1,4,9

`--skip-matmuls` replaces every GGUF matmul by a zero output of its shape: what is left is the step's cost outside
its weights (attention, the cache, norms, Python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from sparrow.models.gguf_native import load_gguf_model
from sparrow.paths import default_cache_dir
from sparrow.runtime import gguf_kernels
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.compiled import StaticCachedModel
from sparrow.runtime.cpu import cpu_info
from sparrow.runtime.gguf_linear import GGUFLinear
from sparrow.types import Prompt


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--variants", default="eager,static")
    parser.add_argument("--compile", action="store_true", help="allow the compiled / static variants")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", default="1", help="tokens per timed forward, comma-separated (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="append a JSON row per variant")
    parser.add_argument("--skip-matmuls", action="store_true", help="time everything but the GGUF matmuls")
    args = parser.parse_args()
    variants = args.variants.split(",")
    rows = [int(n) for n in args.rows.split(",")]
    load0 = os.getloadavg()
    runners, extra = {}, {}
    model = load_gguf_model(args.target).model
    if args.skip_matmuls:
        GGUFLinear.forward = lambda self, x: x.new_zeros(*x.shape[:-1], self.out_features)
    for variant in variants:
        if variant == "eager":
            runners[variant] = CachedModel(model)
        elif variant == "transformers":
            runners[variant] = CachedModel(model)
            runners[variant].decoder = None
        elif variant == "dynamic":
            runners[variant] = CachedModel(model)
            runners[variant]._empty = lambda: DynamicCache(config=model.config)
        elif variant in ("compiled", "static") and (args.compile or variant == "static"):
            runners[variant] = StaticCachedModel(model, compile=variant == "compiled")
        else:
            parser.error(f"unknown variant {variant!r} (eager, transformers, dynamic, static, compiled; compiled "
                         "needs --compile)")
    prompt = Prompt(torch.randint(100, 20000, (args.context,), generator=torch.Generator().manual_seed(0)))
    tokens = {n: torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n)) for n in rows}
    logits = {}
    for variant, runner in runners.items():
        start = time.perf_counter()
        if isinstance(runner, StaticCachedModel):
            runner.warm_up(prompt, largest=max(rows))
        runner.prefill(prompt)
        for n in rows:
            logits[variant, n] = runner.forward(tokens[n]).logits
            runner.rewind(args.context)
        extra[variant] = {"first_step_seconds": round(time.perf_counter() - start, 2)}
        print(f"{variant}: ready in {extra[variant]['first_step_seconds']} s (compile included)", flush=True)
    times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in variants for n in rows}
    for _ in range(args.rounds):
        for variant in [*variants, *reversed(variants)]:
            runner = runners[variant]
            for n in rows:
                for _ in range(args.steps):
                    t = time.perf_counter()
                    runner.forward(tokens[n])
                    times[variant, n].append((time.perf_counter() - t) * 1e3)
                    runner.rewind(args.context)
    load1 = os.getloadavg()
    info = cpu_info()
    commit = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or None
    print(f"\n{info.model} ({' '.join(f for f in info.flags if f in ('avx2', 'fma', 'avx512f', 'avx512_vnni'))}), "
          f"{torch.get_num_threads()} threads; load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    for variant, n in times:
        ms = times[variant, n]
        same = torch.equal(logits[variant, n], logits[variants[0], n])
        deciles = statistics.quantiles(ms, n=10)
        row = {"bench": "gguf_step", "target": args.target, "variant": variant, "rows": n, "context": args.context,
               "median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2),
               "p10_ms": round(deciles[0], 2), "p25_ms": round(statistics.quantiles(ms, n=4)[0], 2),
               "steps": len(ms), "same_logits_as_" + variants[0]: same, "cpu": info.model,
               "threads": torch.get_num_threads(), "isa": gguf_kernels.isa(), "skip_matmuls": args.skip_matmuls,
               "sparrow": commit,
               "load": [round(load0[0], 2), round(load1[0], 2)], "date": time.strftime("%Y-%m-%d"), **extra[variant]}
        print(f"{variant} {n} rows: median {row['median_ms']:.1f} ms (min {row['min_ms']:.1f}, "
              f"p10 {row['p10_ms']:.1f}, p25 {row['p25_ms']:.1f}, max {row['max_ms']:.1f}, {len(ms)} steps), "
              f"logits equal {variants[0]}'s: {same}")
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    path = Path(args.target) if args.target.endswith(".gguf") else default_cache_dir() / "gguf" / f"{args.target}.gguf"
    size = path.stat().st_size if path.is_file() else None
    print(f"resident memory {rss_mb():.0f} MB{'' if size is None else f' (file {size / 2**20:.0f} MB)'}")


if __name__ == "__main__":
    main()

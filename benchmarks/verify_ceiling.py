"""The fastest any drafter could make a target on this machine: its verify cost curve and the ceiling it sets.

A speculative round that commits n tokens runs at least one target forward of n tokens (the last committed
token and n - 1 accepted drafts), so a drafter that costs nothing and is always right still commits at most
n / verify(n) tokens a second. Where verify(n) grows with n (a CPU whose kernels are compute-bound for a few
rows) that ceiling is finite, whatever the drafter; where verify(n) is nearly flat it grows with n. The curve is
sparrow's own (`sparrow.policy.measure_cost_curve`: median of interleaved forwards after a context of
`--context` tokens, then rolled back), on the target as `sparrow.load` would run it (`--dtype auto`: the dtype
and, for float32, the linear path this machine measured fastest).

    python benchmarks/verify_ceiling.py --target qwen2.5-coder-1.5b --max-tokens 32 --context 256 \
        --out benchmarks/results/verify_ceiling/avx2-epyc.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from sparrow.models import load_model
from sparrow.policy.measure import measure_cost_curve, measured_lengths
from sparrow.runtime import cpu
from sparrow.runtime.cached_model import CachedModel
from sparrow.runtime.onednn import routed


def measure(target: str, dtype: str, max_tokens: int, context: int, repeats: int) -> list[dict]:
    loaded = load_model(target, dtype=dtype, progress=False)
    model = loaded.model
    curve = measure_cost_curve(CachedModel(model), max_tokens, None, context_tokens=context, repeats=repeats)
    info = cpu.cpu_info()
    points = measured_lengths(max_tokens)  # the measured n; the curve interpolates the others
    base = curve.verify_seconds[0]
    common = {"target": target, "dtype": str(model.dtype).removeprefix("torch."),
              "float32_onednn": any(map(routed, model.modules())), "device": str(next(model.parameters()).device),
              "cpu": info.model, "flags": list(info.flags), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "machine": platform.machine(), "context": context, "repeats": repeats}
    return [{**common, "n": n, "verify_seconds": curve.verify_seconds[n - 1],
             "cost_vs_one_token": curve.verify_seconds[n - 1] / base,
             "ceiling_tokens_per_second": n / curve.verify_seconds[n - 1]} for n in points]


def render(rows: list[dict]) -> str:
    first = rows[0]
    lines = [f"{first['target']}, {first['dtype']}{' (oneDNN linears)' if first['float32_onednn'] else ''}, "
             f"{first['cpu']} ({', '.join(first['flags']) or 'no listed flags'}), {first['threads']} threads, torch "
             f"{first['torch']}, after a {first['context']}-token context, median of {first['repeats']}:", "",
             "| tokens in the forward (n) | verify seconds | cost vs one token | ceiling tok/s (free, always-right "
                 "drafts) |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['n']} | {r['verify_seconds']:.3f} | {r['cost_vs_one_token']:.2f}x | "
              f"{r['ceiling_tokens_per_second']:.2f} |"
              for r in rows]
    best = max(rows, key=lambda r: r["ceiling_tokens_per_second"])
    lines += ["", f"Ceiling: {best['ceiling_tokens_per_second']:.2f} tok/s at n = {best['n']} (plain decoding: "
                  f"{rows[0]['ceiling_tokens_per_second']:.2f} tok/s, decode only, no prefill)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=32, help="drafted tokens at most (forwards up to n = this + "
                        "1)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens before each timed forward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="append the rows to this JSONL file")
    args = parser.parse_args()
    if args.max_tokens < 1 or args.context < 1 or args.repeats < 1:
        parser.error("--max-tokens, --context and --repeats must be >= 1")
    rows = measure(args.target, args.dtype, args.max_tokens, args.context, args.repeats)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        args.out.with_suffix(".md").write_text(render(rows) + "\n")
    print(render(rows))


if __name__ == "__main__":
    main()

"""The verify sizes a drafter's rounds score, and what each size cost, with the target compiled and eager.

For each runner (`--compile`'d static cache, then the eager one) one pipeline is loaded, warmed up on every prompt
(the compiled one compiles the buckets its drafter's verifies fill at each prompt's cache capacity), and each prompt
generated once with the drafter's store of earlier outputs emptied; every target forward of the generation is timed
(tokens scored, seconds). A row per (runner, prompt): tok/s, rounds, and per verify size the count and mean
milliseconds. It shows whether speculation's rounds land between the compiled buckets (a compiled verify of n tokens
computes its bucket's rows: on GGUF kernels rows are compute).

    python benchmarks/verify_sizes.py --drafter suffix --prompts code-prime,summary-garden --out rows.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import time
from pathlib import Path

import torch

import sparrow
from sparrow.drafters.base import forget_requests
from sparrow.runtime.cpu import cpu_info

HERE = Path(__file__).parent


def prompts(ids: list[str]) -> dict[str, str]:
    data = json.loads((HERE / "prompts.json").read_text())
    found = {p["id"]: p["prompt"].format(**data["texts"]) for p in data["prompts"]}
    missing = [i for i in ids if i not in found]
    if missing:
        raise SystemExit(f"unknown prompt id(s) {', '.join(missing)}; expected some of: {', '.join(found)}")
    return {i: found[i] for i in ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quant", default="gguf")
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--prompts", default="code-prime,summary-garden")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="append a JSON row per runner and prompt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts = prompts(args.prompts.split(","))
    info = cpu_info()
    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    for compiled in (True, False):
        pipe = sparrow.load(args.target, drafter=args.drafter, quant=args.quant, compile=compiled, progress=False)
        start = time.perf_counter()
        for text in texts.values():
            pipe.warm_up(text, chat=True)
        pipe.generate(next(iter(texts.values())), max_new_tokens=8, chat=True)
        warm_up = time.perf_counter() - start
        runner = pipe.runner
        forward, log = runner.forward, []

        def timed(tokens, *rest, **options):
            t = time.perf_counter()
            out = forward(tokens, *rest, **options)
            log.append((tokens.numel(), time.perf_counter() - t))
            return out

        runner.forward = timed
        try:
            for prompt_id, text in texts.items():
                forget_requests(pipe.drafter)
                log.clear()
                result = pipe.generate(text, max_new_tokens=args.max_new_tokens, chat=True)
                seconds = collections.defaultdict(list)
                for n, s in log:
                    seconds[n].append(s)
                sizes = {n: {"rounds": len(s), "mean_ms": round(1e3 * sum(s) / len(s), 2)}
                         for n, s in sorted(seconds.items())}
                row = {"bench": "verify_sizes", "target": args.target, "quant": args.quant, "drafter": args.drafter,
                       "runner": "compiled" if compiled else "eager", "prompt_id": prompt_id,
                       "tokens_per_second": round(result.tokens_per_second, 2), "new_tokens": len(result.token_ids),
                       "rounds": len(log), "verify_seconds": round(sum(s for _, s in log), 3), "sizes": sizes,
                       "warm_up_seconds": round(warm_up, 1), "token_ids": result.token_ids, "cpu": info.model,
                       "threads": torch.get_num_threads(), "sparrow": commit, "load": round(os.getloadavg()[0], 2),
                       "date": time.strftime("%Y-%m-%d")}
                print(f"{prompt_id:16s} {row['runner']:8s} {row['tokens_per_second']:6.2f} tok/s, {len(log)} rounds; "
                      + ", ".join(f"{n}: {v['rounds']} x {v['mean_ms']} ms" for n, v in sizes.items()), flush=True)
                if args.out is not None:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            del runner.forward
        del pipe, runner


if __name__ == "__main__":
    main()

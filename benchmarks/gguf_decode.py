"""Decoding on the GGUF kernels (--quant gguf) against sparrow's default target (dense, --dtype auto).

One process, greedy, chat template, the prompts' ids from benchmarks/prompts.json, `--tokens` new tokens. Methods:

* plain-default: plain decoding of the target as `sparrow generate` loads it by default (dense, --dtype auto:
  float32 on a CPU without bf16, its linears through oneDNN where that measured faster);
* plain-gguf: plain decoding of the target on its GGUF file's blocks (8-bit activations);
* gguf+prompt-lookup, gguf+draft-model: speculative decoding of the GGUF target (the draft: the 0.5B preset on its
  GGUF blocks too); their output must equal plain-gguf's (`identical` in the rows).

Each round runs the methods in order and then in reverse (ABBA), so a passing load on a shared machine hits all of
them; the rows keep every run. tok/s = new tokens / wall seconds of the generation (prefill included), and
decode tok/s = tokens after the first / seconds after the prefill.

    python benchmarks/gguf_decode.py --target qwen2.5-coder-1.5b --rounds 2 --out benchmarks/results/gguf_decode.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import sparrow
from sparrow.bench.runner import write_rows
from sparrow.models import load_model
from sparrow.models.gguf_native import load_gguf_model
from sparrow.pipeline import Pipeline
from sparrow.runtime import gguf_kernels
from sparrow.runtime.cpu import cpu_info

HERE = Path(__file__).parent
METHODS = ("plain-default", "plain-gguf", "gguf+prompt-lookup", "gguf+draft-model")


def prompts(ids: list[str]) -> list[dict]:
    data = json.loads((HERE / "prompts.json").read_text())
    found = {p["id"]: {**p, "prompt": p["prompt"].format(**data["texts"])} for p in data["prompts"]}
    return [found[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--prompts", default="code-prime")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    methods = args.methods.split(",")
    start = time.perf_counter()
    gguf_target = load_gguf_model(args.target)
    loaded = {"gguf_seconds": round(time.perf_counter() - start, 2)}
    pipes: dict[str, Pipeline] = {}
    if "plain-default" in methods:
        start = time.perf_counter()
        pipes["plain-default"] = Pipeline(load_model(args.target), None)
        loaded["default_seconds"] = round(time.perf_counter() - start, 2)
    if "plain-gguf" in methods:
        pipes["plain-gguf"] = sparrow.load(gguf_target, quant="gguf", drafter="none", draft=None)
    if "gguf+prompt-lookup" in methods:
        pipes["gguf+prompt-lookup"] = sparrow.load(gguf_target, quant="gguf", drafter="prompt-lookup", draft=None)
    if "gguf+draft-model" in methods:
        draft = load_gguf_model(args.draft)
        pipes["gguf+draft-model"] = sparrow.load(gguf_target, quant="gguf", drafter="draft-model", draft=draft)
    info = cpu_info()
    meta = {"bench": "gguf_decode", "target": args.target, "tokens": args.tokens, "cpu": info.model,
            "flags": list(info.flags), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernels": gguf_kernels.isa(), "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
            **loaded}
    rows = []
    plain_ids: dict[str, list[int]] = {}
    for p in prompts(args.prompts.split(",")):
        pipes[methods[0]].generate(p["prompt"], max_new_tokens=4, chat=True)  # warm-up
        for rnd in range(args.rounds):
            for method in [*methods, *reversed(methods)]:
                pipe = pipes[method]
                t = time.perf_counter()
                run = pipe.generate_plain if method.startswith("plain") else pipe.generate
                result = run(p["prompt"], max_new_tokens=args.tokens, chat=True)
                wall = time.perf_counter() - t
                ids = result.token_ids
                if method == "plain-gguf":
                    plain_ids.setdefault(p["id"], ids)
                n = len(ids)
                row = {**meta, "method": method, "prompt": p["id"], "round": rnd, "new_tokens": n,
                       "seconds": round(wall, 3), "tok_s": round(n / wall, 3),
                       "decode_tok_s": round((n - 1) / max(wall - result.stats.prefill_seconds, 1e-9), 3),
                       "prefill_seconds": round(result.stats.prefill_seconds, 3), "steps": result.stats.steps,
                       "accepted": result.stats.num_accepted_tokens, "token_ids": ids}
                rows.append(row)
                print(f"{p['id']} {method}: {row['tok_s']:.2f} tok/s ({row['decode_tok_s']:.2f} decode), "
                      f"{n} tokens, {result.stats.steps} steps", flush=True)
    for row in rows:  # speculative output against the GGUF target's own plain decoding
        if row["method"].startswith("gguf+") and row["prompt"] in plain_ids:
            row["identical"] = row["token_ids"] == plain_ids[row["prompt"]]
    print(f"\n{info.model} ({' '.join(info.flags)}), {meta['threads']} threads, GGUF kernels: {meta['kernels']}")
    for method in methods:
        runs = [r for r in rows if r["method"] == method]
        rates = [r["tok_s"] for r in runs]
        same = {r.get("identical") for r in runs} - {None}
        print(f"{method}: median {statistics.median(rates):.2f} tok/s (min {min(rates):.2f}, max {max(rates):.2f}, "
              f"{len(rates)} runs){'' if not same else ', identical to plain-gguf: ' + str(same == {True})}")
    if args.out is not None:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()

"""Foundation benchmark: sparrow's drafters against transformers' own assisted generation.

One process, the same prompts (code writing, repeating/editing a text, summarising a text),
greedy, chat template, bfloat16 by default. Each method's speedup is measured against its own
plain baseline in the same run: sparrow methods against sparrow's plain decoding, transformers
modes against transformers' plain `generate`. Writes one JSONL row per (prompt, method, repeat)
and prints / writes a markdown table rendered from those rows.

    python benchmarks/speculative_vs_transformers.py --out benchmarks/results/foundation
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from common import hf_generate, load_prompts, render_speedup_table

from sparrow.drafters import build_drafter
from sparrow.models import load_model
from sparrow.pipeline import Pipeline

HERE = Path(__file__).parent
SPARROW_METHODS = ("sparrow-draft-model", "sparrow-draft-model-adaptive", "sparrow-prompt-lookup")
HF_METHODS = ("hf-assisted", "hf-prompt-lookup")
BASELINE = {**{m: "sparrow-plain" for m in SPARROW_METHODS}, **{m: "hf-plain" for m in HF_METHODS}}


def peer_options(method: str, draft) -> dict:
    """transformers' assisted generation with the draft model, or its prompt lookup."""
    if method == "hf-assisted":
        return {"assistant_model": draft.model}
    return {"prompt_lookup_num_tokens": 10} if method == "hf-prompt-lookup" else {}


def run_method(method: str, pipes: dict[str, Pipeline], target, draft, prompt: str, max_new_tokens: int) -> dict:
    if method.startswith("hf-"):
        ids = pipes["sparrow-plain"].encode(prompt, chat=True).input_ids
        start = time.perf_counter()
        tokens = hf_generate(target, ids, max_new_tokens, **peer_options(method, draft))
        seconds = time.perf_counter() - start
        return {"token_ids": tokens, "seconds": seconds, "mean_accepted_tokens": None, "acceptance_rate": None}
    pipe = pipes[method]
    run = pipe.generate_plain if method == "sparrow-plain" else pipe.generate
    result = run(prompt, max_new_tokens=max_new_tokens, chat=True)
    stats = result.stats
    return {"token_ids": result.token_ids, "seconds": result.seconds,
            "mean_accepted_tokens": stats.mean_accepted_tokens if method != "sparrow-plain" else 1.0,
            "acceptance_rate": stats.acceptance_rate if method != "sparrow-plain" else None,
            "acceptance_per_position": list(stats.acceptance_per_position),
            "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds}


def render(rows: list[dict]) -> str:
    return render_speedup_table(rows, BASELINE, per_step="tok/step", identical_key="identical_to_baseline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("-k", type=int, default=8, help="draft tokens per round for sparrow's drafters")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompts", type=Path, default=HERE / "prompts.json")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "foundation")
    args = parser.parse_args()

    target = load_model(args.target, dtype=args.dtype, device=args.device)
    draft = load_model(args.draft, dtype=args.dtype, device=args.device)
    pipes = {
        "sparrow-plain": Pipeline(target, None),
        "sparrow-draft-model": Pipeline(target, build_drafter("draft-model", target, draft, args.k)),
        "sparrow-draft-model-adaptive": Pipeline(target, build_drafter("draft-model", target, draft, args.k,
                                                                       adaptive=True)),
        "sparrow-prompt-lookup": Pipeline(target, build_drafter("prompt-lookup", target, None, args.k)),
    }
    methods = ["sparrow-plain", "hf-plain", *SPARROW_METHODS, *HF_METHODS]
    prompts = load_prompts(args.prompts)
    for method in methods:  # warm-up: one-time kernel and allocator costs stay out of the timings
        run_method(method, pipes, target, draft, prompts[0]["prompt"], 8)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {"target": args.target, "draft": args.draft, "dtype": args.dtype, "k": args.k,
              "max_new_tokens": args.max_new_tokens, "device": str(target.model.device),
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads()}
    rows = []
    with open(args.out.with_suffix(".jsonl"), "w") as sink:
        for repeat in range(args.repeats):
            for p in prompts:
                outputs = {}
                for method in methods:
                    out = run_method(method, pipes, target, draft, p["prompt"], args.max_new_tokens)
                    outputs[method] = out["token_ids"]
                    base = BASELINE.get(method)
                    row = {**config, "method": method, "prompt_id": p["id"], "kind": p["kind"], "repeat": repeat,
                           "new_tokens": len(out["token_ids"]),
                           "tokens_per_second": len(out["token_ids"]) / out["seconds"],
                           "identical_to_baseline": (out["token_ids"] == outputs[base]) if base else None,
                           "identical_to_sparrow_plain": out["token_ids"] == outputs["sparrow-plain"], **out}
                    rows.append(row)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    print(f"{p['id']:16s} {method:30s} {row['tokens_per_second']:6.2f} tok/s "
                          f"{row['new_tokens']:4d} tokens  identical={row['identical_to_baseline']}", flush=True)
    table = render(rows)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

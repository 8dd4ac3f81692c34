"""A trained head against plain decoding and prompt lookup (and, with --draft, a draft model dense and
quantized), on the foundation prompts, in one process.

    python benchmarks/heads.py --target smollm2-135m --out benchmarks/results/heads/smollm2-135m
    python benchmarks/heads.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --draft-quants none,int4 \
        --out benchmarks/results/heads/qwen2.5-coder-1.5b

The head is the one `sparrow train head --target PRESET` keeps for the preset (or `--head DIR`). Rows (JSONL, one
per config x prompt) and a markdown table rendered from them: tokens/s (prefill included), speedup over plain
decoding in the same process (plain runs first and again last for each prompt; the speedup is over the mean of
the two, so drift over the run cancels), tokens per target forward (accepted drafts + the bonus token), the
draft's cost per drafted token as a fraction of a target forward, and whether the output equals plain decoding.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quantized import ONE_PER_KIND, load_prompts  # noqa: E402

CONFIGS = {  # name -> sparrow.load keyword arguments (None: plain decoding)
    "plain": None,
    "eagle-chain": {"drafter": "eagle"},
    "eagle-tree": {"drafter": "eagle", "tree_budget": "auto"},
    "prompt-lookup": {"drafter": "prompt-lookup"},
}


def configs(args: argparse.Namespace) -> dict[str, dict | None]:
    """CONFIGS, the head's with --head, plus a draft-model config per --draft-quants format with --draft."""
    head = {} if args.head is None else {"head": args.head}
    out = {name: (None if options is None else {**options, **(head if options["drafter"] == "eagle" else {})})
           for name, options in CONFIGS.items()}
    for fmt in args.draft_quants.split(",") if args.draft else ():
        out["draft-model" + ("" if fmt == "none" else f"-{fmt}")] = {
            "drafter": "draft-model", "draft": args.draft, "draft_quant": None if fmt == "none" else fmt}
    return out


def run(args: argparse.Namespace) -> list[dict]:
    import sparrow
    from sparrow.models import load_model

    torch.set_num_threads(args.threads)
    target = load_model(args.target, dtype=args.dtype)
    draft = load_model(args.draft, dtype=args.dtype) if args.draft else None
    prompts = load_prompts(args.prompts, ONE_PER_KIND if args.prompt_ids is None else tuple(args.prompt_ids.split(",")))
    plan = configs(args)
    pipes = {name: sparrow.load(target, **({**options, "draft": draft} if options and "draft" in options
                                           else options or {"drafter": "prompt-lookup"}))
             for name, options in plan.items()}
    rows = []
    for p in prompts:
        group = [measure(name, pipe, plan[name] is None, p, args) for name, pipe in pipes.items()]
        again = measure("plain", pipes["plain"], True, p, args)  # plain both first and last: drift cancels
        plain = next(row for row in group if row["config"] == "plain")
        plain["tokens_per_second_runs"] = [plain["tokens_per_second"], again["tokens_per_second"]]
        baseline = plain["tokens_per_second"] = statistics.mean(plain["tokens_per_second_runs"])
        for row in group:
            row["speedup"] = row["tokens_per_second"] / baseline
            row["identical"] = row["token_ids"] == plain["token_ids"]
            print(f"{p['id']:16s} {row['config']:14s} {row['tokens_per_second']:6.2f} tok/s {row['speedup']:.2f}x "
                  f"tokens/forward {row['tokens_per_forward']:.2f} identical {row['identical']}", flush=True)
        rows.extend(group)
    return rows


def measure(name: str, pipe, plain: bool, p: dict, args: argparse.Namespace) -> dict:
    """One warm-up and one timed generation of prompt `p` by `pipe` (plain decoding when `plain`)."""
    generate = pipe.generate_plain if plain else pipe.generate
    generate(p["prompt"], max_new_tokens=8, chat=True)  # warm-up
    result = generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=True)
    s = result.stats
    n = len(result.token_ids)
    verify_per_forward = s.verify_seconds / max(s.steps, 1)
    return {"config": name, "prompt_id": p["id"], "tokens": n, "seconds": result.seconds,
            "tokens_per_second": n / result.seconds, "steps": s.steps,
            "tokens_per_forward": 1.0 if plain else n / max(s.steps, 1),
            "drafted": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
            "draft_cost_fraction": (s.draft_seconds / s.num_draft_tokens / verify_per_forward
                                    if s.num_draft_tokens and verify_per_forward else None),
            "token_ids": result.token_ids}


def render(rows: list[dict], meta: dict) -> str:
    out = [f"{meta['target']}, {meta['cpu']}, {meta['threads']} threads, {meta['dtype']}, greedy, chat template, "
           f"{meta['max_new_tokens']} new tokens at most, torch {meta['torch']}", "",
           "| config | mean tok/s | mean speedup | tokens per forward | draft cost / target forward | identical |",
           "|---|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["config"] for r in rows):
        group = [r for r in rows if r["config"] == name]
        costs = [r["draft_cost_fraction"] for r in group if r["draft_cost_fraction"] is not None]
        out.append(f"| {name} | {statistics.mean(r['tokens_per_second'] for r in group):.2f} | "
                   f"{statistics.mean(r['speedup'] for r in group):.2f}x | "
                   f"{statistics.mean(r['tokens_per_forward'] for r in group):.2f} | "
                   f"{f'{statistics.mean(costs):.2f}' if costs else '-'} | "
                   f"{sum(r['identical'] for r in group)}/{len(group)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--head", default=None, help="head directory (default: the preset's trained head)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft", default=None, help="also run --drafter draft-model with this draft model")
    parser.add_argument("--draft-quants", default="none,int4", help="the draft's weight formats (none = dense)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-ids", default=None)
    parser.add_argument("--prompts", type=Path, default=HERE / "prompts.json")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.jsonl and OUT.md")
    args = parser.parse_args()
    from sparrow.runtime.cpu import cpu_info

    meta = {
        "target": args.target,
        "draft": args.draft,
        "cpu": cpu_info().model,
        "threads": args.threads,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    rows = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_name(args.out.name + ".jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({**meta, **r}) + "\n")
    table = render(rows, meta)
    args.out.with_name(args.out.name + ".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()

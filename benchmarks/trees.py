"""Chain vs tree drafting, through `sparrow bench` (Spec-Bench protocol, same process, JSONL rows + report).

Registers a `<drafter>+tree` variant of each tree-capable drafter (draft-model, quantized-self,
prompt-lookup) with the given tree options, then runs the bench on the quick Spec-Bench set or on the
foundation prompts (benchmarks/prompts.json, written as a Spec-Bench question file). Also records this
machine's verify cost curve: one target forward of n = 1 .. 33 tokens after a 128-token context.

    python benchmarks/trees.py quick --draft-quant int4 --out benchmarks/results/trees/quick-int4
    python benchmarks/trees.py foundation --out benchmarks/results/trees/foundation
    python benchmarks/trees.py cost-curve --out benchmarks/results/trees/cost_curve.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TREE_DRAFTERS = ("draft-model", "quantized-self", "prompt-lookup", "auto")


def register_tree_variants(budget, topk: int, depth: int) -> list[str]:
    from sparrow.drafters.registry import REGISTRY

    names = []
    for name in TREE_DRAFTERS:
        entry = REGISTRY[name]
        build = functools.partial(entry.builder, tree_budget=budget, tree_topk=topk, tree_depth=depth)
        REGISTRY[f"{name}+tree"] = dataclasses.replace(entry, build=build)
        names.append(f"{name}+tree")
    return names


def foundation_questions(path: Path) -> Path:
    """benchmarks/prompts.json as a Spec-Bench question file (category = the prompt's kind)."""
    sys.path.insert(0, str(HERE))
    from common import load_prompts

    rows = [{"question_id": p["id"], "category": p["kind"], "turns": [p["prompt"]]}
            for p in load_prompts(HERE / "prompts.json")]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    return " ".join(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512_vnni", "avx2")))


def cost_curve(target: str, dtype: str, out: Path, max_tokens: int = 32, context: int = 128, repeats: int = 5) -> None:
    from sparrow.models import load_model
    from sparrow.runtime.runner import runner_for
    from sparrow.timing import now
    from sparrow.types import Prompt

    runner = runner_for(load_model(target, dtype=dtype, progress=False).model)
    ids = (torch.arange(context + max_tokens + 1) * 7919 % runner.vocab_size).long()
    runner.prefill(Prompt(ids[:context]))
    rows = []
    for n in [1, *range(1, max_tokens + 2)]:  # the first n = 1 is a warm-up
        times = []
        for _ in range(repeats):
            t0 = now(runner.device)
            runner.forward(ids[context:context + n])
            times.append(now(runner.device) - t0)
            runner.rewind(context)
        rows.append({"n": n, "ms": 1000 * statistics.median(times)})
    rows = rows[1:]
    base = rows[0]["ms"]
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"target": target, "dtype": dtype, "context": context, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(), "torch": torch.__version__}
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps({**meta, **r, "relative": r["ms"] / base}) + "\n")
    for r in rows:
        print(f"n={r['n']:3d}  {r['ms']:8.1f} ms  {r['ms'] / base:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["quick", "foundation", "cost-curve"])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft-quant", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", default="draft-model,draft-model+tree,quantized-self,quantized-self+tree,"
                                             "prompt-lookup,prompt-lookup+tree")
    parser.add_argument("--tree-budget", default="auto")
    parser.add_argument("--tree-topk", type=int, default=4)
    parser.add_argument("--tree-depth", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.what == "cost-curve":
        return cost_curve(args.target, args.dtype, args.out)
    budget = args.tree_budget if args.tree_budget == "auto" else int(args.tree_budget)
    register_tree_variants(budget, args.tree_topk, args.tree_depth)
    from sparrow.bench.command import run
    from sparrow.bench.data import DEFAULT_DATA

    # (beside, not inside, the output directory: the report reads every *.jsonl there as rows)
    data = (
        DEFAULT_DATA if args.what == "quick" else foundation_questions(args.out.parent / "foundation-questions.jsonl")
    )
    report = run(data=data, methods=args.methods, per_task=1 if args.what == "quick" else None,
                 quick=args.what == "quick", max_new_tokens=args.max_new_tokens, target=args.target, draft=args.draft,
                 dtype=args.dtype, draft_quant=args.draft_quant, out=args.out, progress=False, chat=True,
                 categories=None, limit=None, repeats=1, first_repeat=0, warmup=1, all_turns=False,
                 cross_draft="smollm2-135m", k=None, adaptive=True, device=None, quant=None, lookup_tokens=10)
    print(report)


if __name__ == "__main__":
    main()

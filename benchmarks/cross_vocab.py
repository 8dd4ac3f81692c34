"""Cross-vocabulary benchmark: sparrow's cross-vocab drafter against transformers' universal assisted decoding.

One process, the same prompts (code writing, repeating/editing a text, summarising a text),
greedy, chat template, bfloat16 by default, 128 new tokens. Methods:

* sparrow-plain / hf-plain: plain decoding of the target (sparrow's loop / transformers' generate);
* sparrow-cross-vocab: `--drafter cross-vocab` with the default back-off (sparrow.policy.length.LengthPolicy);
* sparrow-cross-vocab-fixed: the same drafter always drafting `k` steps (no back-off);
* hf-uad: `generate(assistant_model=d, tokenizer=t, assistant_tokenizer=ta)` (transformers' UAD);
* sparrow-draft-model: for reference, sparrow's same-vocabulary draft model (`--ref-draft`, adaptive).

Speedups are against the method's own plain baseline in the same run (sparrow methods against
sparrow-plain, hf-uad against hf-plain). Mean accepted tokens = tokens committed per target
forward after the prompt (sparrow: `stats.mean_accepted_tokens`; transformers: new tokens / target
forwards, counted with a forward hook, its first forward also scoring the prompt). Writes one
JSONL row per (prompt, method, repeat) and a markdown table rendered from the rows.

    python benchmarks/cross_vocab.py --out benchmarks/results/cross_vocab_run
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
BASELINE = {"sparrow-cross-vocab": "sparrow-plain", "sparrow-cross-vocab-fixed": "sparrow-plain",
            "sparrow-draft-model": "sparrow-plain", "hf-uad": "hf-plain"}


class ForwardCounter:
    """Counts top-level forwards of a model (target forwards of transformers' generate)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.calls += 1


def peer_options(method: str, draft, target) -> dict:
    """transformers' universal assisted decoding (draft with another tokenizer)."""
    if method == "hf-uad":
        return {"assistant_model": draft.model, "tokenizer": target.tokenizer, "assistant_tokenizer": draft.tokenizer}
    return {}


def run_method(method: str, pipes: dict[str, Pipeline], target, draft, counter: ForwardCounter, prompt: str,
               max_new_tokens: int) -> dict:
    if method.startswith("hf-"):
        ids = pipes["sparrow-plain"].encode(prompt, chat=True).input_ids
        before = counter.calls
        start = time.perf_counter()
        tokens = hf_generate(target, ids, max_new_tokens, **peer_options(method, draft, target))
        seconds = time.perf_counter() - start
        forwards = counter.calls - before
        return {"token_ids": tokens, "seconds": seconds, "target_forwards": forwards,
                "mean_accepted_tokens": len(tokens) / forwards if forwards else None, "acceptance_rate": None}
    pipe = pipes[method]
    plain = method == "sparrow-plain"
    result = (pipe.generate_plain if plain else pipe.generate)(prompt, max_new_tokens=max_new_tokens, chat=True)
    stats = result.stats
    return {"token_ids": result.token_ids, "seconds": result.seconds, "target_forwards": stats.steps + 1,
            "mean_accepted_tokens": 1.0 if plain else stats.mean_accepted_tokens,
            "acceptance_rate": None if plain else stats.acceptance_rate,
            "num_draft_tokens": stats.num_draft_tokens, "num_accepted_tokens": stats.num_accepted_tokens,
            "rounds_with_draft": stats.drafted_per_position[0] if stats.drafted_per_position else 0,
            "acceptance_per_position": list(stats.acceptance_per_position),
            "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds}


def render(rows: list[dict]) -> str:
    return render_speedup_table(rows, BASELINE, per_step="tok/fwd", identical_key="identical_to_sparrow_plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="smollm2-135m", help="draft with another vocabulary")
    parser.add_argument("--ref-draft", default="qwen2.5-coder-0.5b", help="same-vocabulary draft ('' to skip)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("-k", type=int, default=8, help="most draft steps per round for sparrow's drafters")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompts", type=Path, default=HERE / "prompts.json")
    parser.add_argument("--ids", default="", help="comma-separated prompt ids (default: all)")
    parser.add_argument("--methods", default="", help="comma-separated methods (default: all)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cross_vocab_run")
    args = parser.parse_args()

    target = load_model(args.target, dtype=args.dtype, device=args.device)
    draft = load_model(args.draft, dtype=args.dtype, device=args.device)
    counter = ForwardCounter(target.model)
    pipes = {
        "sparrow-plain": Pipeline(target, None),
        "sparrow-cross-vocab": Pipeline(target, build_drafter("cross-vocab", target, draft, args.k)),
        "sparrow-cross-vocab-fixed": Pipeline(target, build_drafter("cross-vocab", target, draft, args.k,
                                                                    backoff=False)),
    }
    methods = ["sparrow-plain", "hf-plain", "sparrow-cross-vocab", "sparrow-cross-vocab-fixed", "hf-uad"]
    if args.ref_draft:
        ref = load_model(args.ref_draft, dtype=args.dtype, device=args.device)
        pipes["sparrow-draft-model"] = Pipeline(target, build_drafter("draft-model", target, ref, args.k,
                                                                      adaptive=True))
        methods.append("sparrow-draft-model")
    if args.methods:
        methods = [m for m in methods if m in args.methods.split(",") or m == "sparrow-plain"]
    prompts = load_prompts(args.prompts, [i for i in args.ids.split(",") if i])
    for method in methods:  # warm-up: one-time kernel and allocator costs stay out of the timings
        run_method(method, pipes, target, draft, counter, prompts[0]["prompt"], 8)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {"target": args.target, "draft": args.draft, "ref_draft": args.ref_draft or None, "dtype": args.dtype,
              "k": args.k, "max_new_tokens": args.max_new_tokens, "temperature": 0.0,
              "device": str(target.model.device), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    rows = []
    with open(args.out.with_suffix(".jsonl"), "w") as sink:
        for repeat in range(args.repeats):
            for p in prompts:
                outputs = {}
                for method in methods:
                    out = run_method(method, pipes, target, draft, counter, p["prompt"], args.max_new_tokens)
                    outputs[method] = out["token_ids"]
                    base = BASELINE.get(method)
                    row = {**config, "method": method, "prompt_id": p["id"], "kind": p["kind"], "repeat": repeat,
                           "new_tokens": len(out["token_ids"]),
                           "tokens_per_second": len(out["token_ids"]) / out["seconds"],
                           "identical_to_baseline": (out["token_ids"] == outputs[base]) if base in outputs else None,
                           "identical_to_sparrow_plain": out["token_ids"] == outputs["sparrow-plain"], **out}
                    rows.append(row)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    print(f"{p['id']:16s} {method:26s} {row['tokens_per_second']:6.2f} tok/s "
                          f"{row['new_tokens']:4d} tokens  mat={row['mean_accepted_tokens']}  "
                          f"identical={row['identical_to_sparrow_plain']}", flush=True)
    table = render(rows)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

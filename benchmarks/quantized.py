"""Quantized benchmark: quantized self-draft, quantized draft models and quantized targets.

One process, greedy, chat template, 128 new tokens, code / edit (repeat) / summary prompts:

* plain-bf16: plain decoding of the bf16 target (the baseline of every speedup);
* quantized-self-int4 / -int8: a weight-only copy of the target drafts, the bf16 target verifies;
* draft-model-bf16 / -int4 / -w8a8: the 0.5B draft, dense, int4 or w8a8 (int8 weights and activations);
* plain-int8 / plain-int4 / plain-w8a8: plain decoding of a quantized target;
* int4-target+draft-int4 / w8a8-target+draft-w8a8: a quantized target with the 0.5B draft in the same format
  (lossless relative to that quantized target);
* llama.cpp (optional): plain decoding of the same GGUF through llama-cpp-python when it is installed.

Writes one JSONL row per (prompt, method, repeat) and a markdown table rendered from the rows
(`<out>.jsonl`, `<out>.table.md`).
Quantized targets also report their agreement with the bf16 target: the share of identical
outputs and the top-1 agreement (teacher-forced: how often the bf16 target's argmax, given the
same prefix, is the token the quantized target emitted).

    python benchmarks/quantized.py --out benchmarks/results/quantized
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel, load_model
from sparrow.models.quantization import LONG, quantized_copy
from sparrow.pipeline import Pipeline
from sparrow.policy.measure import follow_cost_curve

HERE = Path(__file__).parent
ONE_PER_KIND = ("code-prime", "edit-garden", "summary-harbour")
LOSSLESS = {"quantized-self-int4", "quantized-self-int8", "draft-model-bf16", "draft-model-int4", "draft-model-w8a8"}
# speculative on a quantized target: its own plain decoding
REFERENCE = {"int4-target+draft-int4": "plain-int4", "w8a8-target+draft-w8a8": "plain-w8a8"}


def load_prompts(path: Path, ids: tuple[str, ...] | None) -> list[dict]:
    data = json.loads(path.read_text())
    prompts = [{**p, "prompt": p["prompt"].format(**data["texts"])} for p in data["prompts"]]
    return [p for p in prompts if ids is None or p["id"] in ids]


def build_pipes(target: LoadedModel, draft: LoadedModel, k: int, methods: set[str] | None = None
                ) -> dict[str, Pipeline]:
    """Every method's pipeline (or those in `methods`; the copies they need are built lazily)."""
    makers = _makers(target, draft, k)
    return {m: make() for m, make in makers.items() if methods is None or m in methods}


def _makers(target: LoadedModel, draft: LoadedModel, k: int) -> dict[str, Any]:
    def lossless(draft_model: LoadedModel) -> Pipeline:
        drafter = build_drafter("draft-model", target, draft_model, k, adaptive=True)
        follow_cost_curve(drafter, Pipeline(target, None).runner)
        return Pipeline(target, drafter)

    def on_quantized(fmt: str) -> Pipeline:
        quantized = quantized_copy(target, fmt)
        drafter = build_drafter("draft-model", quantized, quantized_copy(draft, fmt, dense=LONG), k, adaptive=True)
        follow_cost_curve(drafter, Pipeline(quantized, None).runner)
        return Pipeline(quantized, drafter)

    return {
        "plain-bf16": lambda: Pipeline(target, None),
        "quantized-self-int4": lambda: Pipeline(
            target, build_drafter("quantized-self", target, None, k, adaptive=True, bits="int4")
        ),
        "quantized-self-int8": lambda: Pipeline(
            target, build_drafter("quantized-self", target, None, k, adaptive=True, bits="int8")
        ),
        "draft-model-bf16": lambda: Pipeline(target, build_drafter("draft-model", target, draft, k)),
        "draft-model-int4": lambda: lossless(quantized_copy(draft, "int4", dense=LONG)),
        "draft-model-w8a8": lambda: lossless(quantized_copy(draft, "w8a8")),
        "plain-int8": lambda: Pipeline(quantized_copy(target, "int8"), None),
        "plain-int4": lambda: Pipeline(quantized_copy(target, "int4"), None),
        "plain-w8a8": lambda: Pipeline(quantized_copy(target, "w8a8"), None),
        "int4-target+draft-int4": lambda: on_quantized("int4"),
        "w8a8-target+draft-w8a8": lambda: on_quantized("w8a8"),
    }


def memory_bytes(pipe: Pipeline) -> int:
    """Weight bytes a method reads: the target plus the draft, shared tensors counted once."""
    models = [pipe.runner.model]
    draft = getattr(pipe.drafter, "draft", None)
    if draft is not None:
        models.append(draft.model)
    seen = {}
    for m in models:
        for t in [*m.parameters(), *m.buffers()]:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def top1_agreement(reference: LoadedModel, prompt_ids: torch.Tensor, tokens: list[int]) -> float:
    """Share of `tokens` that are `reference`'s argmax given the same prefix (teacher-forced)."""
    if not tokens:
        return 1.0
    ids = torch.cat([prompt_ids, torch.tensor(tokens)]).to(reference.model.device)
    with torch.inference_mode():
        logits = reference.model(input_ids=ids[None]).logits[0, prompt_ids.numel() - 1 : -1]
    return float((logits.argmax(-1).cpu() == torch.tensor(tokens)).float().mean())


def run_method(method: str, pipe: Pipeline, prompt: str, max_new_tokens: int) -> dict:
    plain = method.startswith("plain-")
    result = (pipe.generate_plain if plain else pipe.generate)(prompt, max_new_tokens=max_new_tokens, chat=True)
    stats = result.stats
    length = getattr(pipe.drafter, "length", None)
    return {"token_ids": result.token_ids, "seconds": result.seconds,
            "mean_accepted_tokens": 1.0 if plain else stats.mean_accepted_tokens,
            "acceptance_rate": None if plain else stats.acceptance_rate,
            "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds,
            "final_draft_cap": getattr(length, "last_cap", None)}


def llama_cpp_runner(target: str, gguf: Path | None, threads: int):
    """Plain decoding through llama-cpp-python, or None when it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp row", flush=True)
        return None
    if gguf is None:
        from sparrow.models.presets import PRESETS, gguf_path
        from sparrow.paths import default_cache_dir
        gguf = gguf_path(PRESETS[target], default_cache_dir())
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, verbose=False)

    def run(prompt_ids: list[int], max_new_tokens: int) -> dict:
        start, tokens = time.perf_counter(), []
        for token in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            if token == llm.token_eos() or len(tokens) >= max_new_tokens:
                break
            tokens.append(token)
        return {"token_ids": tokens, "seconds": time.perf_counter() - start, "mean_accepted_tokens": 1.0}
    return run


def render(rows: list[dict]) -> str:
    by = defaultdict(list)
    for r in rows:
        by[(r["kind"], r["method"])].append(r)
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    base = {kind: statistics.mean(r["tokens_per_second"] for r in by[(kind, "plain-bf16")]) for kind in kinds}
    head = ["method", *kinds, "mean speedup", "tok/step", "weights GB", "identical", "top-1 agreement with bf16"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for method in methods:
        group = [r for r in rows if r["method"] == method]
        cells = []
        speedups = []
        for kind in kinds:
            tps = statistics.mean(r["tokens_per_second"] for r in by[(kind, method)])
            speedups.append(tps / base[kind])
            cells.append(f"{tps:.2f} tok/s ({speedups[-1]:.2f}x)")
        same = [r["identical_to_reference"] for r in group]
        ref = group[0]["reference"]
        agreement = [r["top1_agreement_bf16"] for r in group if r["top1_agreement_bf16"] is not None]
        cells += [f"**{statistics.mean(speedups):.2f}x**",
                  f"{statistics.mean(r['mean_accepted_tokens'] for r in group):.2f}",
                  f"{group[0]['weights_bytes'] / 1e9:.2f}" if group[0]["weights_bytes"] else "n/a",
                  f"{sum(same)}/{len(same)} vs {ref}",
                  f"{statistics.mean(agreement):.3f}" if agreement else "1 (lossless)"]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--device", default=None)
    parser.add_argument("-k", type=int, default=8, help="maximum draft tokens per round")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--all-prompts", action="store_true", help="every prompt, not one per kind")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the methods")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp (default: the target preset's)")
    parser.add_argument("--prompts", type=Path, default=HERE / "prompts.json")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "quantized")
    args = parser.parse_args()

    start = time.perf_counter()
    target = load_model(args.target, dtype="bfloat16", device=args.device)
    draft = load_model(args.draft, dtype="bfloat16", device=args.device)
    wanted = None if not args.methods else {*args.methods.split(","), "plain-bf16"}
    pipes = build_pipes(target, draft, args.k, wanted)
    setup_seconds = time.perf_counter() - start
    if args.methods:
        pipes = {m: p for m, p in pipes.items() if m in args.methods.split(",") or m == "plain-bf16"}
    llama = llama_cpp_runner(args.target, args.gguf, torch.get_num_threads()) if target.model.device.type == "cpu" \
        else None
    prompts = load_prompts(args.prompts, None if args.all_prompts else ONE_PER_KIND)
    for method, pipe in pipes.items():  # warm-up: one-time kernel and allocator costs stay out of the timings
        run_method(method, pipe, prompts[0]["prompt"], 8)

    config = {
        "target": args.target,
        "draft": args.draft,
        "k_max": args.k,
        "max_new_tokens": args.max_new_tokens,
        "device": str(target.model.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "setup_seconds": setup_seconds,
        "cost_curves": {
            m: {"draft_ms": 1e3 * curve.draft_seconds, "verify_ms": [1e3 * s for s in curve.verify_seconds]}
            for m, p in pipes.items()
            if (curve := getattr(getattr(p.drafter, "length", None), "curve", None)) is not None
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(args.out.with_suffix(".jsonl"), "w") as sink:
        for repeat in range(args.repeats):
            for p in prompts:
                prompt_ids = pipes["plain-bf16"].encode(p["prompt"], chat=True).input_ids
                outputs = {}
                methods = [*pipes, *(["llama.cpp"] if llama is not None else [])]
                for method in methods:
                    if method == "llama.cpp":
                        out, weights = llama(prompt_ids.tolist(), args.max_new_tokens), None
                    else:
                        out, weights = run_method(method, pipes[method], p["prompt"], args.max_new_tokens), \
                            memory_bytes(pipes[method])
                    outputs[method] = out["token_ids"]
                    reference = REFERENCE.get(method, "plain-bf16")
                    quantized_target = method.startswith("plain-int") or method in REFERENCE or method == "llama.cpp"
                    row = {
                        **config,
                        "method": method,
                        "prompt_id": p["id"],
                        "kind": p["kind"],
                        "repeat": repeat,
                        "new_tokens": len(out["token_ids"]),
                        "tokens_per_second": len(out["token_ids"]) / out["seconds"],
                        "reference": reference,
                        "identical_to_reference": out["token_ids"] == outputs.get(reference),
                        "identical_to_bf16": out["token_ids"] == outputs["plain-bf16"],
                        "top1_agreement_bf16": top1_agreement(target, prompt_ids, out["token_ids"])
                        if quantized_target
                        else None,
                        "lossless_relative_to": "int4 target"
                        if method in REFERENCE
                        else "bf16 target"
                        if method in LOSSLESS
                        else None,
                        "load_average_1min": os.getloadavg()[0],
                        "weights_bytes": weights,
                        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                        **out,
                    }
                    rows.append(row)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    print(f"{p['id']:16s} {method:24s} {row['tokens_per_second']:6.2f} tok/s {row['new_tokens']:4d} "
                          f"tokens  acc/step={row['mean_accepted_tokens']:.2f} "
                          f"identical({reference})={row['identical_to_reference']}", flush=True)
    table = render(rows)
    args.out.with_suffix(".table.md").write_text(table + "\n")  # quantized.md is the README section
    print(table)


if __name__ == "__main__":
    main()

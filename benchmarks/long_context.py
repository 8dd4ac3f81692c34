"""Long-context benchmark: plain decoding vs layer-skip, sparse, prompt lookup, a draft model and a LongSpec head.

2k-16k prompt tokens, one process, greedy, bfloat16; sparse is StD's sparse self-drafting.

The target prefills each prompt once, in the plain run; the other methods restore a copy of that
prefilled cache instead of prefilling again (a 16k prefill takes minutes on a small CPU). Their decode
is the real thing; their end-to-end time is the measured target prefill + their own drafter prefill
(e.g. the draft model's prefill) + decode. The sparse drafter's prompt queries are captured during that
same plain prefill and handed to its capture when the cache is restored. Plain decodes again after the
other methods (its prefill restored) and its decode rate is the mean of both runs, so no method gains from
running after it. Reported per method and length:
decode-only and end-to-end tokens/s and speedups over plain, mean tokens per target forward, peak RSS (and CUDA
peak memory), identical-to-plain, and the memory each side keeps per length: the target's KV cache, the sparse
drafter's selected draft KV, the LongSpec head's sliding-window cache (flat however long the prompt: its
cross-attention reads the target's cache in place).

    flock /tmp/sparrow-cpu.lock python benchmarks/long_context.py --lengths 2048 4096 --max-new-tokens 64
    python benchmarks/long_context.py --render-only          # table + plot from the JSONL rows

Methods: plain, layer-skip, sparse (or sparse:<budget>, e.g. sparse:512 or sparse:0.05), prompt-lookup,
draft-model, longspec (or longspec:<head dir>, a head trained with `sparrow train head --arch longspec`). Plain
`longspec` is an untrained head (random init from a torch.Generator seeded with --longspec-seed): its rows say so
in "head", and its acceptance says nothing about a trained one; its memory and draft cost are the real thing.
Rows are appended to <out>.jsonl; the table and plot use the latest row per (length, method).
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import psutil
import torch
from long_prompts import build_prompt, documentation
from transformers import DynamicCache

from sparrow.drafters import REGISTRY, build_drafter
from sparrow.drafters.kv.draft_kv import kv_bytes
from sparrow.drafters.longspec import LongSpecDrafter, WindowCache
from sparrow.drafters.sparse import DEFAULT_BUDGET, SparseDrafter
from sparrow.heads.factory import new_head
from sparrow.models import load_model
from sparrow.pipeline import Pipeline
from sparrow.runtime.attention.capture import QueryCapture
from sparrow.runtime.cached_model import CachedModel
from sparrow.timing import now
from sparrow.types import Prompt, TargetOutput

HERE = Path(__file__).parent
METHODS = ("plain", "layer-skip", "sparse", "prompt-lookup", "draft-model", "longspec")
DEFAULT_TARGET = "qwen2.5-coder-1.5b"


class RestoringRunner(CachedModel):
    """A CachedModel whose prefill of the snapshot's prompt restores a copy of the snapshot's cache.

    `captures`: the sparse drafters' query captures. The real (plain) prefill runs inside all of them; a restore
    hands each capture that is running (the engine's `watch_prefill` around this prefill) the queries it recorded
    then, as if the target had prefilled again."""

    def __init__(self, model, captures: Sequence[QueryCapture] = ()) -> None:
        super().__init__(model)
        self.captures = tuple(captures)
        self.snapshot: tuple[torch.Tensor, DynamicCache, TargetOutput] | None = None
        self.queries: dict[int, dict] = {}  # id(capture) -> its recorded layers
        self.restore_seconds = 0.0

    @staticmethod
    def _copy(cache: DynamicCache, config) -> DynamicCache:
        copy = DynamicCache(config=config)
        for i, layer in enumerate(cache.layers):
            copy.update(layer.keys.clone(), layer.values.clone(), i)
        return copy

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        start = now(self.device)
        # the snapshot holds no hidden states: a drafter that asks for them gets a real prefill
        if self.snapshot is not None and not hidden_layers and torch.equal(self.snapshot[0], prompt.input_ids):
            self.cache, self.position_offset = self._copy(self.snapshot[1], self.model.config), 0
            for capture in self.captures:
                if capture.active:
                    capture.layers = dict(self.queries[id(capture)])
            self.restore_seconds = now(self.device) - start
            return TargetOutput(self.snapshot[2].logits.clone())
        self.restore_seconds = 0.0
        if hidden_layers:
            return super().prefill(prompt, hidden_layers)
        with ExitStack() as stack:
            for capture in self.captures:
                stack.enter_context(capture)
            out = super().prefill(prompt)
        self.queries = {id(capture): dict(capture.layers) for capture in self.captures}
        self.snapshot = (prompt.input_ids.clone(), self._copy(self.cache, self.model.config),
                         TargetOutput(out.logits.clone()))
        return out


class PeakMemory:
    """Peak RSS (sampled every 20 ms) and CUDA peak allocation while the block runs."""

    def __enter__(self) -> PeakMemory:
        self.process, self.rss, self._stop = psutil.Process(), 0, threading.Event()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.rss = max(self.rss, self.process.memory_info().rss)
            self._stop.wait(0.02)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.rss = max(self.rss, self.process.memory_info().rss)
        self.cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def sparse_budget(method: str, default: int | float) -> int | float:
    if ":" not in method:
        return default
    value = method.split(":", 1)[1]
    return float(value) if "." in value else int(value)


def longspec_head(method: str) -> str | None:
    """The head directory of "longspec:<dir>" (None for plain "longspec": an untrained head)."""
    return method.split(":", 1)[1] if ":" in method else None


def build(method: str, target, draft, sparse_default, longspec_seed: int = 0) -> object | None:
    if method == "plain":
        return None
    if method.startswith("sparse"):
        return SparseDrafter(target.model, REGISTRY["sparse"].default_num_draft_tokens, adaptive=True,
                             budget=sparse_budget(method, sparse_default))
    if method.startswith("longspec"):
        head = longspec_head(method)
        if head is None:  # untrained: its own seeded generator, on the target's device (no global seed)
            generator = torch.Generator(device=next(target.model.parameters()).device).manual_seed(longspec_seed)
            head = new_head(target.model, "longspec", generator=generator)
        return build_drafter("eagle", target, None, None, adaptive=True, head=head)
    return build_drafter(method, target, draft if method == "draft-model" else None, None, adaptive=True)


def window_bytes(cache: WindowCache) -> int:
    """Bytes of a LongSpec drafter's own cache: its window rows' keys, values and positions."""
    return cache.keys.nbytes + cache.values.nbytes + cache.positions.nbytes


class HeadStatePeak:
    """The most bytes a LongSpec drafter's window cache holds while drafting (read after each run of head rows;
    the chain drafter's `_run`, which every committed and draft row goes through)."""

    def __init__(self, drafter: LongSpecDrafter) -> None:
        self.peak, self.rows = 0, 0
        run = drafter._run

        def measured(*args, **kwargs):
            out = run(*args, **kwargs)
            self.peak = max(self.peak, window_bytes(drafter.cache))
            self.rows = max(self.rows, drafter.cache.rows)
            return out

        drafter._run = measured


def run_length(length: int, methods: list[str], target, draft, text: str, args) -> list[dict]:
    ids = build_prompt(target.tokenizer, length, text)
    drafters = {m: build(m, target, draft, args.budget, args.longspec_seed) for m in ["plain", *methods]
                if m != "layer-skip" or "layer-skip" in REGISTRY}
    runner = RestoringRunner(target.model, [d.capture for d in drafters.values() if isinstance(d, SparseDrafter)])
    peaks = {m: HeadStatePeak(d) for m, d in drafters.items() if isinstance(d, LongSpecDrafter)}
    rows, plain = [], None
    for method in ["plain", *[m for m in methods if m != "plain"]]:
        row = {"length": length, "prompt_tokens": len(ids), "method": method, "max_new_tokens": args.max_new_tokens,
               "target": args.target, "dtype": args.dtype, "machine": platform.machine(),
               "threads": torch.get_num_threads()}
        if method not in drafters:
            rows.append({**row, "available": False, "note": f"drafter {method!r} is not registered"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        drafter = drafters[method]
        pipe = Pipeline(target, drafter)
        pipe.runner = runner
        with PeakMemory() as memory:
            run = pipe.generate_plain if drafter is None else pipe.generate
            result = run(ids, max_new_tokens=args.max_new_tokens)
        stats = result.stats
        if method == "plain":
            plain = {"tokens": result.token_ids, "prefill": stats.prefill_seconds}
        decode_seconds = result.seconds - stats.prefill_seconds
        e2e_seconds = result.seconds if drafter is None else plain["prefill"] + result.seconds - runner.restore_seconds
        row.update({
            "available": True, "new_tokens": result.new_tokens, "seconds": result.seconds,
            "target_prefill_seconds": plain["prefill"], "restore_seconds": runner.restore_seconds,
            "drafter_prefill_seconds": stats.prefill_seconds - runner.restore_seconds if drafter else 0.0,
            "decode_seconds": decode_seconds, "e2e_seconds": e2e_seconds,
            "decode_tokens_per_second": (result.new_tokens - 1) / decode_seconds,
            "e2e_tokens_per_second": result.new_tokens / e2e_seconds,
            "mean_accepted_tokens": stats.mean_accepted_tokens if drafter else 1.0,
            "acceptance_rate": stats.acceptance_rate if drafter else None,
            "steps": stats.steps, "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds,
            "draft_ms_per_token": (1000 * stats.draft_seconds / stats.num_draft_tokens
                                   if stats.num_draft_tokens else None),
            "target_ms_per_forward": 1000 * stats.verify_seconds / stats.steps if stats.steps else None,
            "peak_rss_bytes": memory.rss, "cuda_peak_bytes": memory.cuda,
            "identical_to_plain": result.token_ids == plain["tokens"],
            "target_kv_bytes": kv_bytes(runner.cache),  # prompt + generated tokens, all layers
        })
        if isinstance(drafter, SparseDrafter):
            row.update({"budget": drafter.budget, "sinks": drafter.sinks, "window": drafter.window,
                        "draft_prompt_entries": int(drafter.kept[0].shape[1]),
                        "draft_kv_bytes": kv_bytes(drafter.cache)})  # its selected prompt KV + the generated tokens'
        if isinstance(drafter, LongSpecDrafter):
            head = drafter.head
            row.update({
                "head": longspec_head(method) or f"untrained (random init, seed {args.longspec_seed})",
                "head_window": head.config.window, "head_kv_layer": head.config.kv_layer,
                "head_state_bytes": window_bytes(drafter.cache),  # between rounds: at most `window` committed rows
                "head_state_rows": drafter.cache.rows,
                "head_state_peak_bytes": peaks[method].peak, "head_state_peak_rows": peaks[method].rows,  # drafting
                "head_parameter_bytes": sum(p.nbytes for p in head.parameters()),  # its own (embedding, LM head shared)
            })
        if method == "plain":
            row["text"] = result.text
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
    plain_decode_again(rows[0], target, runner, ids, args.max_new_tokens)
    return rows


def plain_decode_again(row: dict, target, runner: RestoringRunner, ids, max_new_tokens: int) -> None:
    """Plain decoding once more, last (its prefill restored): `row`'s (plain's, run first) decode rate becomes the
    mean of both runs, so speedups do not gain from the run order."""
    pipe = Pipeline(target, None)
    pipe.runner = runner
    result = pipe.generate_plain(ids, max_new_tokens=max_new_tokens)
    again = (result.new_tokens - 1) / (result.seconds - result.stats.prefill_seconds)
    row["decode_tokens_per_second_runs"] = [row["decode_tokens_per_second"], again]
    row["decode_tokens_per_second"] = (row["decode_tokens_per_second"] + again) / 2
    print(json.dumps({"length": row["length"], "plain_decode_tokens_per_second_runs": row[
        "decode_tokens_per_second_runs"]}), flush=True)


def latest(rows: list[dict]) -> dict[tuple[int, str], dict]:
    out = {}
    for r in rows:
        out[(r["length"], r["method"])] = r
    return out


def render(rows: list[dict]) -> str:
    by = latest(rows)
    lengths = sorted({k[0] for k in by})
    methods = list(dict.fromkeys(k[1] for k in by))
    lines = ["| method | " + " | ".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for method in methods:
        cells = []
        for n in lengths:
            r, base = by.get((n, method)), by.get((n, "plain"))
            if r is None:
                cells.append("—")
            elif not r.get("available", True):
                cells.append("missing")
            elif method == "plain":
                cells.append(f"{r['decode_tokens_per_second']:.2f} tok/s decode, "
                             f"prefill {r['target_prefill_seconds']:.0f} s, RSS {r['peak_rss_bytes'] / 2**30:.1f} GiB")
            else:
                decode = r["decode_tokens_per_second"] / base["decode_tokens_per_second"]
                e2e = r["e2e_tokens_per_second"] / base["e2e_tokens_per_second"]
                cells.append(f"{r['decode_tokens_per_second']:.2f} tok/s, **{decode:.2f}x** decode, {e2e:.2f}x e2e, "
                             f"{r['mean_accepted_tokens']:.2f} tok/step, RSS {r['peak_rss_bytes'] / 2**30:.1f} GiB, "
                             f"{'identical' if r['identical_to_plain'] else 'DIFFERENT'}"
                             + (", untrained head" if str(r.get("head", "")).startswith("untrained") else ""))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    memory = render_memory(by, lengths, methods)
    if memory:
        lines += ["", memory]
    return "\n".join(lines)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def render_memory(by: dict[tuple[int, str], dict], lengths: list[int], methods: list[str]) -> str:
    """Draft-side memory per length: the target's KV cache (plain, for scale), the sparse drafter's draft KV, the
    LongSpec head's window cache. Empty when no row has these fields (rows from before they were recorded)."""
    lines, heads = [], {}
    for method in methods:
        cells = []
        for n in lengths:
            r = by.get((n, method)) or {}
            if method == "plain" and r.get("target_kv_bytes") is not None:
                cells.append(f"target KV {mib(r['target_kv_bytes'])}")
            elif r.get("draft_kv_bytes") is not None:
                cells.append(f"draft KV {mib(r['draft_kv_bytes'])}")
            elif r.get("head_state_bytes") is not None:
                heads[method] = r["head"]
                cell = (f"window cache {mib(r['head_state_bytes'])} ({r['head_state_rows']} rows), "
                        f"peak {mib(r['head_state_peak_bytes'])}")
                if r.get("draft_ms_per_token") is not None:
                    cell += f", {r['draft_ms_per_token']:.1f} ms/draft token"
                cells.append(cell)
            else:
                cells.append("—")
        if any(c != "—" for c in cells):
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    header = ["Draft-side memory per length (after the run; the LongSpec head's cross-attention reads the target's "
              "KV cache in place, so its own memory is the window cache alone):", "",
              "| method | " + " | ".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    notes = [f"{method}: head {head}" for method, head in heads.items()]
    return "\n".join(header + lines + ([""] + notes if notes else []))


def targets(rows: list[dict]) -> str:
    """The target(s) the rows measured (rows from before "target" was recorded: the default target)."""
    return ", ".join(dict.fromkeys(r.get("target", DEFAULT_TARGET) for r in rows)) or DEFAULT_TARGET


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = latest(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(k[1] for k in by):
        if method == "plain":
            continue
        points = sorted((n, r, by[(n, "plain")]) for (n, m), r in by.items()
                        if m == method and r.get("available", True) and (n, "plain") in by)
        if not points:
            continue
        xs = [n for n, _, _ in points]
        line, = ax.plot(xs, [r["decode_tokens_per_second"] / b["decode_tokens_per_second"] for _, r, b in points],
                        marker="o", label=f"{method} (decode)")
        ax.plot(xs, [r["e2e_tokens_per_second"] / b["e2e_tokens_per_second"] for _, r, b in points],
                marker="x", linestyle="--", color=line.get_color(), alpha=0.6, label=f"{method} (end-to-end)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"{targets(rows)}, greedy, long prompts")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--methods", nargs="+", default=list(METHODS),
                        help=f"any of {', '.join(METHODS)}; sparse:<budget>, longspec:<head dir>")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=lambda s: float(s) if "." in s else int(s), default=DEFAULT_BUDGET,
                        help="sparse: KV entries kept per layer and KV head (int) or fraction of the prompt (float)")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--longspec-seed", type=int, default=0,
                        help="longspec (no head dir): seed of the untrained head's random init")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "long_context")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    jsonl = args.out.with_suffix(".jsonl")
    if not args.render_only:
        for m in args.methods:
            if m.split(":")[0] not in METHODS:
                parser.error(f"unknown method {m!r}; expected one of {', '.join(METHODS)} "
                             "(sparse:<budget> and longspec:<head dir> allowed)")
        target = load_model(args.target, dtype=args.dtype, device=args.device, progress=False)
        draft = (load_model(args.draft, dtype=args.dtype, device=args.device, progress=False)
                 if "draft-model" in args.methods else None)
        text = documentation()
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        for length in args.lengths:
            rows = run_length(length, args.methods, target, draft, text, args)
            with jsonl.open("a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    table = render(rows)
    args.out.with_suffix(".md").write_text(
        f"# Long-context decoding ({targets(rows)} target, greedy)\n\n"
        "Generated by `benchmarks/long_context.py` from the latest JSONL row per (length, method). Speedups over "
        "plain decoding of the same prompt in the same process; decode = after the prefill, end-to-end = target "
        "prefill (measured once) + drafter prefill + decode.\n\n" + table + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()

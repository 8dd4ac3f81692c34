"""Video-LLM benchmark: plain decoding vs the video drafters, per frame count.

For a target VLM (and optionally a smaller draft VLM of the same family; transformers ids or local
directories) and a folder of videos (or synthetic moving-square videos), one process, greedy:

* plain: plain decoding of the target (the baseline of every speedup; its outputs are the reference);
* visual-prune: SpecVLM-style draft on 1 - drop_rate of the visual tokens (the draft VLM, or the target
  itself when no draft is given);
* sparse, sparse-mm-shiftkv, sparse-hybridkv: the target self-drafts with `--budget` visual KV entries per
  layer and KV head, chosen by StD's top-K / MM-ShiftKV / HybridKV (the target's cache is untouched);
* draft-model: the draft VLM on the full video (no pruning; only with --draft);
* visual-prune-kv, draft-model-kv: the same two with a draft-side KV policy on the draft's own cache
  (`--draft-kv`, `--budget` visual entries per layer and KV head, `--retrieve-every` for hybridkv);
* loose: visual-prune drafts, LOSSY loose verification (LVSpec-style), reported with its fidelity
  (identical outputs, token agreement) against plain decoding;
* sparrow-head: `--drafter eagle` with a Sparrow head (`--head DIR`, e.g. from `sparrow train head --arch sparrow`;
  without it a randomly initialised one, labelled untrained): text-anchored window attention, no visual KV.

Per (video, frame count, method): decode-only speedup (tokens / (seconds - prefill)), end-to-end speedup
(prefill included), mean accepted tokens per target forward, peak memory (CUDA: max allocated; CPU: the
process's peak RSS, which only grows, so it is not a per-method number), the draft's own KV cache after the
run (draft-model, visual-prune, sparse; prompt plus generated tokens) and, for lossless methods,
whether the output is identical to plain decoding, and the drafter's cost: milliseconds per drafted token, and
for sparrow-head the keys each head row attended to on average (bounded by its text window, whatever the number
of frames). A target directory made by `benchmarks/vlm_proxy.py` (a PROXY.json beside its config: the real
qwen2.5-coder-1.5b language model with a random vision tower) labels every row with what it is. One JSONL
row per run, a markdown table per frame
count (`<out>.jsonl`, `<out>.md`).

    python benchmarks/video.py --target Qwen/Qwen2.5-VL-7B-Instruct --draft Qwen/Qwen2.5-VL-3B-Instruct \
        --videos clips/ --frames 8 16 32 64 --out benchmarks/results/video_qwen7b
    python benchmarks/video.py --tiny qwen2.5-vl --out benchmarks/results/video_tiny   # CPU smoke run
    python benchmarks/vlm_proxy.py   # real language model, random vision tower (see there); then, e.g.:
    python benchmarks/video.py --target ~/.cache/sparrow/proxy/qwen2.5-vl-coder-1.5b --methods plain visual-prune \
        sparrow-head --head HEAD_DIR --videos /usr/share/doc/opencv-doc/examples/data/vtest.avi --frames 8 32 64
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from sparrow.drafters import build_drafter
from sparrow.drafters.kv.compress import build_selector
from sparrow.drafters.sparrow import SparrowDrafter
from sparrow.drafters.visual_prune import visual_span
from sparrow.models import LoadedModel, load_model
from sparrow.pipeline import Pipeline
from sparrow.runtime.cpu import cpu_info
from sparrow.verifiers.loose import fidelity
from sparrow.vision.video import IMAGE_SUFFIXES, Video, read_video

HERE = Path(__file__).parent
VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm")
METHODS = ("plain", "visual-prune", "visual-prune-kv", "sparse", "sparse-mm-shiftkv", "sparse-hybridkv", "draft-model",
           "draft-model-kv", "loose", "sparrow-head")
QUESTION = "Describe what happens in this video in detail."


def synthetic_video(num_frames: int, size: int, seed: int) -> np.ndarray:
    """(T, size, size, 3) uint8: two coloured squares moving across a noisy background."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(20, 60, (num_frames, size, size, 3), dtype=np.uint8)
    s = max(4, size // 6)
    for t in range(num_frames):
        x, y = (3 * t + seed) % (size - s), (2 * t + 5 * seed) % (size - s)
        frames[t, y:y + s, x:x + s] = (220, 30, 30)
        frames[t, size - s - y:size - y, size - s - x:size - x] = (30, 200, 60)
    return frames


def videos_from(folder: Path | None, count: int, size: int, max_frames: int) -> list[tuple[str, object]]:
    """(name, source) pairs: files / frame directories (subdirectories holding two or more images) of `folder`,
    else `count` synthetic videos."""
    if folder is not None:
        items = sorted(p for p in folder.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES or p.is_dir() and sum(
            f.suffix.lower() in IMAGE_SUFFIXES for f in p.iterdir()) >= 2)
        if not items:
            raise ValueError(f"--videos: no video files or frame directories in {folder}")
        return [(p.name, p) for p in items]
    return [(f"synthetic-{i}", synthetic_video(max_frames, size, seed=i)) for i in range(count)]


def sample(source, frames: int) -> Video:
    if isinstance(source, np.ndarray):
        return Video.from_array(source, fps=2.0, num_frames=frames)
    return read_video(source, frames=frames)


def build_methods(target: LoadedModel, draft: LoadedModel | None, args) -> dict[str, Pipeline]:
    """One pipeline per method; drafters keep their query capture stopped until their turn."""
    pipes: dict[str, Pipeline] = {"plain": Pipeline(target, None)}
    k = args.k
    for name in args.methods:
        if name in ("plain",):
            continue
        if name.startswith("draft-model") and draft is None:
            print(f"skipping {name}: no --draft", file=sys.stderr)
            continue
        policy = dict(draft_kv=args.draft_kv, draft_kv_budget=args.budget, retrieve_every=args.retrieve_every)
        if name in ("visual-prune", "loose", "visual-prune-kv"):
            drafter = build_drafter("visual-prune", target, draft, k, adaptive=args.adaptive, drop_rate=args.drop_rate,
                                    **(policy if name == "visual-prune-kv" else {}))
        elif name == "draft-model-kv":
            drafter = build_drafter("draft-model", target, draft, k, adaptive=args.adaptive, **policy)
        elif name == "sparrow-head":
            drafter = build_drafter("eagle", target, None, k, adaptive=args.adaptive, head=sparrow_head(target, args))
        elif name.startswith("sparse"):
            policy = name.removeprefix("sparse-") if name != "sparse" else "topk"
            drafter = build_drafter("sparse", target, None, k, adaptive=args.adaptive, budget=args.budget,
                                    span=visual_span(target.model.config),
                                    selector=build_selector(policy, target.model))
        else:
            drafter = build_drafter(name, target, draft, k, adaptive=args.adaptive)
        if getattr(drafter, "capture", None) is not None:
            drafter.capture.stop()
        pipes[name] = Pipeline(target, drafter, "loose" if name == "loose" else "auto")
    return pipes


def sparrow_head(target: LoadedModel, args):
    """The --head directory, or a randomly initialised Sparrow head from a seeded generator (labelled untrained)."""
    if args.head is not None:
        return str(args.head)
    from sparrow.heads import new_head

    generator = torch.Generator(device=target.model.device).manual_seed(args.head_seed)
    return new_head(target.model, "sparrow", generator=generator)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_once(pipe: Pipeline, video: Video, max_new_tokens: int) -> dict:
    device = pipe.runner.device
    capture = getattr(pipe.drafter, "capture", None)
    if capture is not None:
        capture.start()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        result = (pipe.generate if pipe.drafter is not None else pipe.generate_plain)(
            QUESTION, video=video, max_new_tokens=max_new_tokens)
    finally:
        if capture is not None:
            capture.stop()
    stats = result.stats
    decode = max(result.seconds - stats.prefill_seconds, 1e-9)
    head = pipe.drafter if isinstance(pipe.drafter, SparrowDrafter) else None
    pruning = getattr(pipe.drafter, "last_pruning", None)
    return {
        "token_ids": result.token_ids, "new_tokens": result.new_tokens, "seconds": result.seconds,
        "prefill_seconds": stats.prefill_seconds, "decode_seconds": decode,
        "tokens_per_second": result.tokens_per_second, "decode_tokens_per_second": result.new_tokens / decode,
        "mean_accepted_tokens": stats.mean_accepted_tokens if pipe.drafter is not None else 1.0,
        "acceptance_rate": stats.acceptance_rate, "peak_memory_mb": peak_memory_mb(device),
        "draft_visual_tokens": int(pruning.kept.numel()) if pruning is not None else None,
        "draft_kv_mib": draft_kv_mib(pipe.drafter),
        "draft_ms_per_token": 1000 * stats.draft_seconds / stats.num_draft_tokens if stats.num_draft_tokens else None,
        "target_ms_per_forward": 1000 * stats.verify_seconds / stats.steps if stats.steps else None,
        "head_keys_per_row": head.keys_attended / head.rows_seen if head is not None and head.rows_seen else None,
        "head_cache_rows": head.cache.rows if head is not None else None,
    }


def draft_kv_mib(drafter) -> float | None:
    """MiB of the keys and values in the drafter's own cache (None: it keeps none, e.g. plain decoding)."""
    from sparrow.drafters.kv.draft_kv import kv_bytes
    from sparrow.heads.eagle import HeadCache

    cache = getattr(drafter, "cache", None)  # sparse
    if isinstance(cache, HeadCache):  # a Sparrow head: its text rows only
        return sum(t.numel() * t.element_size() for t in (cache.keys, cache.values)) / 2**20
    if cache is None and drafter is not None and hasattr(drafter, "draft"):
        cache = getattr(getattr(drafter.draft, "runner", drafter.draft), "cache", None)
    return kv_bytes(cache) / 2**20 if cache is not None else None


def render(rows: list[dict]) -> str:
    """Markdown: per frame count, a row per method with mean speedups over plain and the rest."""
    by = defaultdict(list)
    for r in rows:
        by[(r["frames"], r["method"])].append(r)
    out = []
    for frames in sorted({r["frames"] for r in rows}):
        plain = by[(frames, "plain")]
        base_dec = statistics.mean(r["decode_tokens_per_second"] for r in plain)
        base_e2e = statistics.mean(r["tokens_per_second"] for r in plain)
        visual = statistics.mean(r["visual_tokens"] for r in plain)
        out += [f"\n### {frames} frames ({visual:.0f} visual tokens)\n",
                "| method | decode speedup | end-to-end speedup | mean accepted | identical to plain | "
                "peak memory MiB | draft visual tokens | draft KV MiB | draft ms/token | target ms/forward |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for method in dict.fromkeys(r["method"] for r in rows):
            group = by[(frames, method)]
            if not group:
                continue
            dec = statistics.mean(r["decode_tokens_per_second"] for r in group) / base_dec
            e2e = statistics.mean(r["tokens_per_second"] for r in group) / base_e2e
            acc = statistics.mean(r["mean_accepted_tokens"] for r in group)
            same = sum(r["identical"] for r in group)
            ident = f"{same}/{len(group)}"
            if method == "loose":
                agreement = statistics.mean(r["fidelity_token_agreement"] for r in group)
                ident += f" (LOSSY; token agreement {agreement:.3f})"
            mem = max(r["peak_memory_mb"] for r in group)
            kept = [r["draft_visual_tokens"] for r in group if r["draft_visual_tokens"] is not None]
            kept = f"{statistics.mean(kept):.0f}" if kept else "all" if method in ("draft-model",) else (
                "0" if method == "sparrow-head" else "-")
            kv = [r["draft_kv_mib"] for r in group if r.get("draft_kv_mib") is not None]
            kv = f"{statistics.mean(kv):.3g}" if kv else "-"
            draft_ms = [r["draft_ms_per_token"] for r in group if r.get("draft_ms_per_token") is not None]
            draft_ms = f"{statistics.mean(draft_ms):.0f}" if draft_ms else "-"
            target_ms = [r["target_ms_per_forward"] for r in group if r.get("target_ms_per_forward") is not None]
            target_ms = f"{statistics.mean(target_ms):.0f}" if target_ms else "-"
            out.append(f"| {method} | {dec:.2f}x | {e2e:.2f}x | {acc:.2f} | {ident} | {mem:.0f} | {kept} | {kv} | "
                       f"{draft_ms} | {target_ms} |")
    return "\n".join(out)


def tiny_pair(kind: str, directory: Path) -> tuple[str, str]:
    """Save a tiny random target VLM and a perturbed copy (the draft) of `kind`; returns their directories."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from vlm_models import byte_tokenizer, perturbed, save_tiny_vlm, tiny_vlm

    model = tiny_vlm(kind, byte_tokenizer(), seed=0, num_layers=4)
    target = save_tiny_vlm(kind, directory / "target", model=model)
    draft = save_tiny_vlm(kind, directory / "draft", model=perturbed(model, 0.05, seed=1))
    return str(target), str(draft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target VLM: transformers id or local directory")
    parser.add_argument("--draft", help="smaller draft VLM of the same family (optional)")
    parser.add_argument("--tiny", choices=("qwen2.5-vl", "llava-onevision"),
                        help="build a tiny random target/draft pair in a temp dir instead (CPU smoke run)")
    parser.add_argument("--videos", type=Path, help="folder of videos / frame directories (default: synthetic)")
    parser.add_argument("--num-videos", type=int, default=2, help="synthetic videos when --videos is not given")
    parser.add_argument("--size", type=int, default=224, help="synthetic frame size in pixels")
    parser.add_argument("--frames", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--drop-rate", type=float, default=0.9)
    parser.add_argument("--budget", type=float, default=0.1,
                        help="sparse and *-kv drafters: visual KV kept per layer/KV head (int count or fraction)")
    parser.add_argument("--draft-kv", default="hybridkv", choices=("topk", "mm-shiftkv", "hybridkv"),
                        help="policy of visual-prune-kv / draft-model-kv")
    parser.add_argument("--retrieve-every", type=int, default=0,
                        help="hybridkv: re-choose dynamic heads' chunks every R rounds (0: fixed at prefill)")
    parser.add_argument("--head", type=Path, help="sparrow-head: a Sparrow head directory (default: untrained)")
    parser.add_argument("--head-seed", type=int, default=0, help="sparrow-head without --head: init seed")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "video")
    args = parser.parse_args()
    if (args.target is None) == (args.tiny is None):
        parser.error("give exactly one of --target, --tiny")
    if args.budget >= 1:
        args.budget = int(args.budget)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        target_spec, draft_spec = tiny_pair(args.tiny, Path(tmp)) if args.tiny else (args.target, args.draft)
        target = load_model(target_spec, dtype=args.dtype, device=args.device, progress=False)
        draft = load_model(draft_spec, dtype=args.dtype, device=args.device, progress=False) if draft_spec else None
    pipes = build_methods(target, draft, args)
    videos = videos_from(args.videos, args.num_videos, args.size, max(args.frames))
    from sparrow.vision.prompt import visual_token_positions

    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    proxy = Path(args.target or "", "PROXY.json").expanduser()
    meta = {"target": args.tiny and f"tiny random {args.tiny}" or args.target,
            "target_is": json.loads(proxy.read_text())["what"] if proxy.is_file() else None,
            "head": (str(args.head) if args.head else f"untrained (random init, seed {args.head_seed})")
            if "sparrow-head" in pipes else None, "draft": args.draft or (
        args.tiny and "perturbed copy of the tiny target"), "device": str(pipes["plain"].runner.device),
        "dtype": args.dtype, "k": args.k, "adaptive": args.adaptive, "drop_rate": args.drop_rate,
        "budget": args.budget, "draft_kv": args.draft_kv, "retrieve_every": args.retrieve_every,
        "max_new_tokens": args.max_new_tokens, "machine": platform.machine(), "cpu": cpu_info().model,
        "torch": torch.__version__, "threads": torch.get_num_threads()}
    warm = sample(videos[0][1], min(args.frames))
    for pipe in pipes.values():  # one-time costs (allocator, kernels) outside the timed runs
        run_once(pipe, warm, 4)
    with open(f"{args.out}.jsonl", "w") as jsonl:
        for name, source in videos:
            for frames in args.frames:
                video = sample(source, frames)
                prompt = pipes["plain"].encode(QUESTION, video=video)
                visual = int(visual_token_positions(prompt, target.model.config).numel())
                for repeat in range(args.repeats):
                    reference = None
                    for method, pipe in pipes.items():
                        row = run_once(pipe, video, args.max_new_tokens)
                        if method == "plain":
                            reference = row["token_ids"]
                        row.update(meta, video=name, frames=frames, visual_tokens=visual, method=method,
                                   repeat=repeat, identical=row["token_ids"] == reference,
                                   lossy=method == "loose")
                        if method == "loose":
                            row.update({f"fidelity_{k}": v for k, v in
                                        fidelity([row["token_ids"]], [reference]).to_dict().items()})
                        rows.append(row)
                        jsonl.write(json.dumps(row) + "\n")
                        jsonl.flush()
                        print(f"{name} {frames:>3}f {method:<18} {row['decode_tokens_per_second']:8.1f} tok/s "
                              f"decode, accepted {row['mean_accepted_tokens']:.2f}, identical {row['identical']}",
                              file=sys.stderr)
    table = render(rows)
    loose = [r for r in rows if r["method"] == "loose"]
    if loose:
        f = fidelity([r["token_ids"] for r in loose], [next(p["token_ids"] for p in rows if p["method"] == "plain"
                      and p["video"] == r["video"] and p["frames"] == r["frames"] and p["repeat"] == r["repeat"])
                      for r in loose])
        table += (f"\n\nloose verification (LOSSY) fidelity vs plain decoding over {f.samples} outputs: "
                  f"identical {f.identical:.2f}, token agreement {f.token_agreement:.3f}, "
                  f"prefix agreement {f.prefix_agreement:.3f}")
    header = "# Video-LLM speculative decoding\n\n" + ", ".join(f"{k}={v}" for k, v in meta.items()) + "\n"
    Path(f"{args.out}.md").write_text(header + table + "\n")
    print(table)


if __name__ == "__main__":
    main()

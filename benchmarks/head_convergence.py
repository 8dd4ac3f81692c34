"""Which training choices make an EAGLE-3 head converge faster, measured on the CPU (issue #42, item 3).

    PYTHONPATH=src nice -n 10 python benchmarks/head_convergence.py --target smollm2-135m
    PYTHONPATH=src python benchmarks/head_convergence.py render benchmarks/results/heads/convergence-CPU.jsonl.gz

One target, one corpus (the GPU recipe's: token sequences from the standard library's and installed packages'
.py/.md/.rst files, split into training and held-out sets by file, plus the target's own greedy answers to prompts
built from the training files; never the evaluation sets), its features (the hidden states of the head's three
layers and its top-k next-token log-probs) extracted ONCE and shared by every variant. Each variant trains a fresh
head from the same seed on the same data order for the same budget of training positions (`--steps` optimiser
steps of `--batch-size` sequences; a batch-size variant keeps the positions and changes the steps), with the
recipe's step (`sparrow.training.batched`, gradient clip 0.5, linear warmup then a cosine decay over the steps),
then is evaluated on the held-out features: top-1 agreement at draft depths 1 .. `--eval-depth` (the head's own
outputs feed the deeper depths, as the training-time test does) and the expected tokens per chain round
1 + a1 + a1 a2 + ... over 3 depths and over all of them. One axis changes at a time against the baseline (the GPU
recipe's defaults, scaled to the CPU where the CLI says so); the baseline runs with `--seeds` seeds to show the
noise. Rows are written as each variant ends (`OUT.jsonl.gz`, gzip -9n, and the table `OUT.md`), with the CPU
model and flags (`sparrow.runtime.cpu`); positions/s are of a busy machine unless it was idle.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sparrow.runtime.cpu import cpu_info
from sparrow.training.batched import batched_ttt_loss
from sparrow.training.heads import frequent_tokens, fresh_head
from sparrow.training.loop import Evaluation, new_optimiser
from sparrow.training.orchestrator import lr_scale
from sparrow.training.recipe_data import RecipeSettings, build_corpus, eos_ids, load_target, target_features

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Variant:
    """One training recipe; `axis` names what differs from the baseline."""

    name: str
    axis: str = "baseline"
    init: str = "lm_head"  # sparrow.training.heads.INITS (the recipe's default before this study; now "layer")
    train_lm_head: bool = False
    ttt_steps: int = 3
    decay: float = 0.8
    optimizer: str = "adamw"
    lr: float = 3e-4
    batch_size: int = 4
    seed: int = 0


def variants(base: Variant, seeds: int) -> list[Variant]:
    """The baseline (`seeds` seeds), then one axis at a time."""
    lr, b = base.lr, base.batch_size
    return [  # the most telling first: a run cut short keeps them
        *[replace(base, name=f"baseline seed {s}", seed=s) for s in range(seeds)],
        replace(base, name="init: + last layer", axis="init", init="layer"),
        replace(base, name="Muon", axis="optimizer", optimizer="muon"),
        replace(base, name=f"lr {lr * 3:.0e}", axis="lr", lr=lr * 3),
        replace(base, name="TTT 1", axis="ttt", ttt_steps=1),
        replace(base, name="decay 1.0", axis="decay", decay=1.0),
        replace(base, name="init: random (LM head trained)", axis="init", init="none", train_lm_head=True),
        replace(base, name=f"lr {lr / 3:.0e}", axis="lr", lr=lr / 3),
        replace(base, name="decay 0.6", axis="decay", decay=0.6),
        replace(base, name=f"batch {2 * b}", axis="batch", batch_size=2 * b),
        replace(base, name="TTT 5", axis="ttt", ttt_steps=5),
        replace(base, name=f"Muon lr {lr * 3:.0e}", axis="optimizer", optimizer="muon", lr=lr * 3),
        # Muon's updates are scaled to 0.2 x AdamW's RMS (match_rms_adamw): its learning rates run ~10x AdamW's
        replace(base, name=f"Muon lr {lr * 10:.0e}", axis="optimizer", optimizer="muon", lr=lr * 10),
        replace(base, name="LM head trained (from the target's rows)", axis="init", train_lm_head=True),
    ]


# --- features, once -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cached:
    """One sequence's features: tokens [n], fused hidden states [n, 3D], top-k label ids [n, k], log-probs."""

    tokens: Tensor
    hidden: Tensor
    ids: Tensor
    logprobs: Tensor


def extract(model: nn.Module, sequences: list[Tensor], layers: tuple[int, ...], top_k: int, batch: int = 8
            ) -> list[Cached]:
    """The target's features of each sequence, `batch` sequences a forward (sorted by length: little padding)."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].numel())
    out: dict[int, Cached] = {}
    for start in range(0, len(order), batch):
        chosen = order[start : start + batch]
        tokens, lengths = pad([sequences[i] for i in chosen])
        hidden, ids, logprobs = target_features(model, tokens, lengths, layers, top_k)
        for row, i in enumerate(chosen):
            n = int(lengths[row])
            out[i] = Cached(tokens[row, :n].clone(), hidden[row, :n].clone(), ids[row, :n].int(),
                            logprobs[row, :n].clone())
    return [out[i] for i in range(len(sequences))]


def pad(sequences: list[Tensor]) -> tuple[Tensor, Tensor]:
    lengths = torch.tensor([s.numel() for s in sequences])
    tokens = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for row, s in enumerate(sequences):
        tokens[row, : s.numel()] = s
    return tokens, lengths


def batch_of(cached: list[Cached]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Right-padded tokens [B, T], lengths [B], features [B, T, 3D], label ids [B, T, k] and log-probs."""
    tokens, lengths = pad([c.tokens for c in cached])
    t = tokens.shape[1]
    hidden = torch.zeros(len(cached), t, cached[0].hidden.shape[1])
    ids = torch.zeros(len(cached), t, cached[0].ids.shape[1], dtype=torch.long)
    logprobs = torch.zeros(len(cached), t, cached[0].ids.shape[1])
    for row, c in enumerate(cached):
        n = c.tokens.numel()
        hidden[row, :n], ids[row, :n], logprobs[row, :n] = c.hidden, c.ids, c.logprobs
    return tokens, lengths, hidden, ids, logprobs


# --- one variant ----------------------------------------------------------------------------------------------


def train_variant(model: nn.Module, train: list[Cached], held_out: list[Cached], draft_vocab: Tensor,
                  variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
    """Train a fresh head as `variant` says for the fixed budget, evaluate it on `held_out`; its row."""
    shape = {} if args.intermediate_size is None else {"intermediate_size": args.intermediate_size}
    head = fresh_head(model, "eagle3", variant.seed, draft_vocab, init=variant.init, **shape)
    optimiser = new_optimiser(head, variant.lr, frozen=() if variant.train_lm_head else ("lm_head",),
                              kind=variant.optimizer)
    steps = max(1, round(args.steps * args.batch_size / variant.batch_size))  # the same training positions
    warmup = max(1, round(args.warmup * steps))
    order = torch.Generator().manual_seed(variant.seed)
    positions, losses, seconds = 0, [], 0.0
    for step in range(steps):
        picks = torch.randint(len(train), (variant.batch_size,), generator=order).tolist()
        tokens, lengths, hidden, ids, logprobs = batch_of([train[i] for i in picks])
        for group in optimiser.param_groups:
            group["lr"] = variant.lr * lr_scale(step, warmup, step / steps)
        start = time.perf_counter()
        head.train()
        optimiser.zero_grad(set_to_none=True)
        batch = batched_ttt_loss(head, tokens, lengths, hidden, ids, logprobs, variant.ttt_steps, variant.decay)
        if batch.loss.requires_grad:
            batch.loss.backward()
            nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimiser.step()
        seconds += time.perf_counter() - start
        positions += batch.positions
        losses.append(float(batch.loss.detach()))
    evaluation = evaluate(head, held_out, args.eval_depth, variant.batch_size)
    three = Evaluation(evaluation.loss, evaluation.agreement[:3], evaluation.sequences)
    tail = max(1, steps // 10)
    return {"variant": variant.name, "axis": variant.axis, "settings": asdict(variant), "steps": steps,
            "warmup": warmup, "positions": positions, "train_seconds": seconds,
            "positions_per_second": positions / max(seconds, 1e-9),
            "train_loss_last_tenth": sum(losses[-tail:]) / tail, "held_out_loss": evaluation.loss,
            "agreement": list(evaluation.agreement), "expected_tokens_3": three.expected_accepted,
            "expected_tokens": evaluation.expected_accepted, "eval_sequences": evaluation.sequences}


@torch.no_grad()
def evaluate(head: Any, held_out: list[Cached], depth: int, batch_size: int) -> Evaluation:
    """Held-out top-1 agreement at depths 1 .. `depth` over all held-out rows, and the mean loss (decay 0.8)."""
    head.eval()
    agreed, rows, losses = [0] * depth, [0] * depth, []
    for start in range(0, len(held_out), batch_size):
        batch = batched_ttt_loss(head, *batch_of(held_out[start : start + batch_size]), depth, 0.8)
        losses.append(float(batch.loss))
        for j, (a, r) in enumerate(zip(batch.agreed, batch.rows)):
            agreed[j] += a
            rows[j] += r
    agreement = tuple(a / r for a, r in zip(agreed, rows) if r)
    return Evaluation(sum(losses) / max(len(losses), 1), agreement, len(held_out))


# --- the run --------------------------------------------------------------------------------------------------


def cpu_slug() -> str:
    """"amd-epyc-avx2": the CPU model and its widest vector extension, for file names."""
    info = cpu_info()
    widest = next((f for f in ("amx_tile", "avx512f", "avx2", "sve", "asimd") if f in info.flags), info.arch)
    words = re.sub(r"\(r\)|\(tm\)|cpu|processor|[@].*$", " ", info.model.lower())
    return "-".join([*re.findall(r"[a-z0-9]+", words)[:4], widest.replace("_", "")])


def machine() -> dict[str, Any]:
    info = cpu_info()
    try:
        load = [round(x, 2) for x in __import__("os").getloadavg()]
    except OSError:
        load = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return {"cpu": info.model, "arch": info.arch, "flags": list(info.flags), "logical_cpus": info.logical_cpus,
            "threads": torch.get_num_threads(), "load_average": load, "torch": torch.__version__,
            "commit": commit.stdout.strip() or None, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def load(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """The target in float32 on the CPU: a model directory, or a sparrow preset (installed)."""
    if Path(args.target).is_dir():
        return load_target(RecipeSettings(out="", target=args.target), torch.device("cpu"))
    from sparrow.models import load_model

    loaded = load_model(args.target, dtype="float32", device="cpu")
    return loaded.model.eval().requires_grad_(False), loaded.tokenizer


def features(model: nn.Module, tokenizer: Any, args: argparse.Namespace
             ) -> tuple[list[Cached], list[Cached], Tensor, dict[str, Any], float]:
    """The corpus (files + the target's answers), the draft vocabulary and the features of both splits."""
    settings = RecipeSettings(out="", target=args.target, data=tuple(args.data or ()), tokens=args.tokens,
                              held_out_tokens=args.held_out_tokens, seq_len=args.seq_len, distill=args.distill,
                              distill_tokens=args.distill_tokens, distill_batch=args.distill_batch, seed=0)
    eos = eos_ids(model, tokenizer)
    train_seqs, held_seqs, corpus, _ = build_corpus(model, tokenizer, settings, time.monotonic() + args.distill_seconds,
                                                    eos)
    print(json.dumps({"corpus": corpus}), flush=True)
    train_seqs = [s[: 2 * args.seq_len] for s in train_seqs if s.numel() >= 2]
    held_seqs = [s[: 2 * args.seq_len] for s in held_seqs if s.numel() >= 2][: args.eval_sequences]
    vocab = model.get_output_embeddings().weight.shape[0]
    draft_vocab = frequent_tokens(train_seqs, min(args.draft_vocab, vocab), vocab, always=[i for i in eos if i < vocab])
    layers = fresh_head(model, "eagle3", 0, draft_vocab).config.target_layers
    mark = time.monotonic()
    return extract(model, train_seqs, layers, args.top_k), extract(model, held_seqs, layers, args.top_k), \
        draft_vocab, corpus, mark


@contextlib.contextmanager
def float32_newton_schulz(active: bool) -> Iterator[None]:
    """torch's Muon orthogonalises in bfloat16, which a CPU without bf16 instructions emulates: 10.5 s per 576 x 1728
    matrix on the AVX2 EPYC here (a float32 matmul of that size: 0.05 s), about 80 s a step for smollm2-135m's head.
    On such a CPU the study runs the same Newton-Schulz iteration in float32 (slightly more precise, not slower)."""
    import torch.optim._muon as muon

    def orthogonalised(grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
                       ) -> Tensor:
        a, b, c = ns_coefficients
        x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + torch.addmm(gram, gram, gram, beta=b, alpha=c) @ x
        return x.T if grad.size(0) > grad.size(1) else x

    original = muon._zeropower_via_newtonschulz
    muon._zeropower_via_newtonschulz = orthogonalised if active else original
    try:
        yield
    finally:
        muon._zeropower_via_newtonschulz = original


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    out = Path(args.out or HERE / "results" / "heads" / f"convergence-{cpu_slug()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model, tokenizer = load(args)
    loaded = time.monotonic() - started
    key = hashlib.sha256(json.dumps([args.target, args.data, args.tokens, args.held_out_tokens, args.seq_len,
                                     args.distill, args.distill_tokens, args.draft_vocab, args.top_k,
                                     args.eval_sequences]).encode()).hexdigest()[:16]
    cache = Path(args.cache) / f"{key}.pt"
    if cache.is_file():  # a rerun (e.g. of the variants a cut run missed) reuses the corpus and features
        saved = torch.load(cache, weights_only=False)
        train, held_out, draft_vocab, corpus = saved["train"], saved["held_out"], saved["draft_vocab"], saved["corpus"]
        mark = time.monotonic()
    else:
        train, held_out, draft_vocab, corpus, mark = features(model, tokenizer, args)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"train": train, "held_out": held_out, "draft_vocab": draft_vocab, "corpus": corpus}, cache)
    setup = {"target": args.target, "load_seconds": loaded, "corpus": corpus,
             "corpus_seconds": mark - started - loaded, "feature_seconds": time.monotonic() - mark,
             "features_cached": str(cache),
             "train_sequences": len(train), "train_positions": sum(c.tokens.numel() - 1 for c in train),
             "held_out_sequences": len(held_out), "held_out_positions": sum(c.tokens.numel() - 1 for c in held_out),
             "draft_vocab": int(draft_vocab.numel()), "seq_len": args.seq_len, "steps": args.steps,
             "batch_size": args.batch_size, "warmup_share": args.warmup, "eval_depth": args.eval_depth,
             "top_k": args.top_k, "intermediate_size": args.intermediate_size, "command": args.command}
    print(json.dumps(setup), flush=True)
    base = Variant("baseline", ttt_steps=args.ttt_steps, lr=args.lr, batch_size=args.batch_size)
    chosen = variants(base, args.seeds)
    if args.variants:
        wanted = [w.strip() for w in args.variants.split(",")]
        chosen = [v for v in chosen if v.name in wanted or v.axis in wanted]
    rows: list[dict[str, Any]] = read(Path(f"{out}.jsonl.gz")) if args.resume else []
    done = {r["variant"] for r in rows}
    for variant in [v for v in chosen if v.name not in done]:
        with float32_newton_schulz(active=not cpu_info().bf16):
            trained = train_variant(model, train, held_out, draft_vocab, variant, args)
        row = {**trained, "setup": setup, "machine": machine(),
               "muon_newton_schulz": "float32" if not cpu_info().bf16 else "bfloat16"}
        rows.append(row)
        write(out, rows)
        print(json.dumps({k: row[k] for k in ("variant", "agreement", "expected_tokens", "positions_per_second")}),
              flush=True)
    return rows


def write(out: Path, rows: list[dict[str, Any]]) -> None:
    """OUT.jsonl.gz (gzip -9n: no name, no time) and OUT.md, rewritten whole."""
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
    Path(f"{out}.jsonl.gz").write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    Path(f"{out}.md").write_text(render(rows))


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]


def render(rows: list[dict[str, Any]]) -> str:
    """A markdown table, a row per variant: agreement by depth, expected tokens per round, against the baseline."""
    if not rows:
        return ""
    setup, m = rows[0]["setup"], rows[-1]["machine"]
    depth = max(len(r["agreement"]) for r in rows)
    base = [r["expected_tokens"] for r in rows if r["axis"] == "baseline"]
    mean = sum(base) / len(base) if base else math.nan
    lines = [
        f"Held-out top-1 agreement of EAGLE-3 heads for `{setup['target']}` after the same training budget "
        f"({setup['steps']} steps of {setup['batch_size']} sequences of <= {2 * setup['seq_len']} tokens, "
        f"{setup['train_positions']:,} training positions from {setup['train_sequences']} sequences; "
        f"{setup['held_out_positions']:,} held-out positions). CPU: {m['cpu']} ({m['arch']}, "
        f"{', '.join(m['flags'])}), {m['threads']} torch thread(s), load average {m['load_average']} "
        f"(a busy machine: positions/s are indicative only), torch {m['torch']}, commit {m['commit']}, {m['date']}.",
        "",
        f"Command: `{setup['command']}`",
        "",
        "| variant | " + " | ".join(f"a{j + 1}" for j in range(depth)) + " | E[tokens] 3 | E[tokens] "
        f"{depth} | vs baseline | held-out loss | positions | positions/s |",
        "|---|" + "---:|" * (depth + 6),
    ]
    for r in rows:
        cells = [f"{a:.3f}" for a in r["agreement"]] + [""] * (depth - len(r["agreement"]))
        delta = r["expected_tokens"] - mean
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + f" | {r['expected_tokens_3']:.3f} | "
                     f"{r['expected_tokens']:.3f} | {delta:+.3f} | {r['held_out_loss']:.3f} | {r['positions']:,} | "
                     f"{r['positions_per_second']:.0f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="a sparrow preset or a model directory")
    p.add_argument("--data", action="append", help="training files (repeatable); default: stdlib + site-packages")
    p.add_argument("--out", default=None, help="rows OUT.jsonl.gz and table OUT.md (default: "
                   "benchmarks/results/heads/convergence-<cpu>)")
    p.add_argument("--tokens", type=int, default=24_000, help="training tokens from files")
    p.add_argument("--held-out-tokens", type=int, default=4_000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--distill", type=int, default=32, help="the target's greedy answers (training; a tenth held out)")
    p.add_argument("--distill-tokens", type=int, default=128)
    p.add_argument("--distill-batch", type=int, default=16)
    p.add_argument("--distill-seconds", type=float, default=300.0, help="at most this long answering")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--steps", type=int, default=80, help="optimiser steps of the baseline (the budget)")
    p.add_argument("--batch-size", type=int, default=4, help="the baseline's sequences per step")
    p.add_argument("--warmup", type=float, default=0.08, help="warmup steps, a share of the steps")
    p.add_argument("--lr", type=float, default=3e-4, help="the baseline's learning rate")
    p.add_argument("--ttt-steps", type=int, default=3, help="the baseline's training-time-test depths")
    p.add_argument("--eval-depth", type=int, default=6, help="held-out agreement at depths 1 .. this")
    p.add_argument("--eval-sequences", type=int, default=48)
    p.add_argument("--seeds", type=int, default=2, help="baseline runs (seeds 0 ..) to show the noise")
    p.add_argument("--variants", default=None, help="comma-separated names or axes to run (default: all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resume", action="store_true", help="keep OUT's rows and run only the variants it lacks")
    p.add_argument("--cache", default="/tmp/sparrow-head-convergence", help="where features are kept between runs")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["render"]:
        for path in argv[1:]:
            print(render(read(Path(path))), end="")
        return 0
    args = parser().parse_args(argv)
    args.command = " ".join(["python benchmarks/head_convergence.py", *argv])
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

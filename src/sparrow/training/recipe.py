"""The fast GPU recipe for an EAGLE-3 head: one command that does the whole run within a time budget, and whose
latest results survive the process being killed.

    python -m sparrow.training.recipe run --target DIR|FILE.gguf|--gguf-chunks DIR --out OUT [--time-budget 480]
    python -m sparrow.training.recipe prepare --preset qwen2.5-coder-1.5b --dir .gpu/gguf   (here, before)

`run`, in order, all inside `--time-budget` seconds of wall time from its start:
1. the target: a transformers directory, a GGUF file, or a GGUF carried over as numbered chunks (`--gguf-chunks`,
   joined and sha256-checked: `sparrow.training.chunks`); `--dtype` auto: bf16 on a GPU and on a CPU with bf16
   instructions (avx512_bf16, AMX), else float32;
2. the corpus (`sparrow.training.data`): token sequences from offline .py/.md/.rst files (`--data`, default the
   standard library and installed packages), a held-out split by file; then the target's own greedy answers to
   prompts built from the training files (self-distillation), `--distill-batch` prompts a `generate` call, for at
   most `--distill-share` of the time left after loading; kept in OUT/corpus.safetensors (a resumed run reuses it)
   and, as compressed token ids, in OUT/answers.npz (`sparrow.training.answers`); `--answers FILE` (repeatable)
   trains on the answers of earlier runs too and generates new ones only to prompts they have not answered
   (`--distill 0`: none), and that run's answers.npz holds them all;
3. the head: started from `--init-head` (an export or head directory; `auto`, the default: the head shipped for
   the preset whose GGUF the target is, `sparrow/heads/shipped/<preset>/`, when there is one; `none`), its shape
   and draft vocabulary then the export's; else a fresh one with a draft vocabulary of the `--draft-vocab` most
   frequent target tokens of the training sequences (EOS included), its norm and LM head from the target's and (by
   default, `--init-from-target layer`) its decoder layer from the target's last one.
   Unless `--train-lm-head`, the LM head stays those target rows (frozen), so the export leaves it out;
4. training: each step draws `--batch-size` sequences, runs the target over them ONLINE (no_grad; its hidden
   states of the head's three layers and its top-k next-token log-probs, nothing cached on disk), then the head's
   training-time test over `--ttt-steps` draft depths on the whole padded batch (`sparrow.training.batched`) under
   bf16 autocast where the target runs in bf16; AdamW (0.9, 0.95), linear warmup, then a cosine decay over the
   training time left;
5. at the end (always, also when the budget or `--max-steps` ends training, or training fails): a held-out
   evaluation (top-1 agreement per depth, expected tokens per round), the checkpoint, the int4 export and
   OUT/eval.json.
Every `--checkpoint-every` seconds (default 60) and at the end: OUT/checkpoint/ (the dense head in SpecForge's
layout, float32, plus recipe_state.pt: step, optimiser, data order; written beside and swapped in whole), OUT/int4/
(`sparrow.heads.quantized`: manifest + shards within 16 MB, swapped in whole; what the repository ships) and a row
of OUT/metrics.jsonl. `--resume` continues from OUT/checkpoint with its corpus, head and optimiser (a fresh time
budget). A head whose int4 export would not fit 16 MB is refused before training.

Imports: torch, transformers, safetensors, numpy and sparrow modules that import only those (the device machines
are bare: no typer, rich, gguf unless installed for a GGUF target, av).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.heads.layout import exported_tensors, load_head, save_head, shipped_head_dir
from sparrow.heads.quantized import check_size
from sparrow.models.presets import PRESETS, _part_paths, get_preset, not_installed_error
from sparrow.paths import atomic_dir
from sparrow.training import orchestrator
from sparrow.training.answers import Answers, read_answers, tokenizer_fingerprint, write_answers
from sparrow.training.batched import batched_ttt_loss
from sparrow.training.chunks import CHUNK_BYTES, SUMS, chunk_bytes_beside, split_file, tree_bytes
from sparrow.training.heads import frequent_tokens, fresh_head
from sparrow.training.loop import Evaluation, new_optimiser
from sparrow.training.orchestrator import Schedule, append_row, check_out, export, write_report
from sparrow.training.recipe_data import (
    RecipeSettings,
    build_corpus,
    eos_ids,
    load_corpus,
    load_target,
    padded,
    save_corpus,
    target_dtype,
    target_features,
)
from sparrow.training.trainer import resumed_head

STATE = "recipe_state.pt"
METRICS = "metrics.jsonl"
CORPUS = "corpus.safetensors"
ANSWERS = "answers.npz"
EXPORT = "int4"  # OUT/int4: the head's int4 export
EXPORT_BITS = 4
# training batches are padded to a multiple of this many positions: on the H200 the head's step took 0.64 s in the
# first minute and 0.20 s five minutes later (same shapes of weights and optimiser; again 0.52 s after a resume),
# probably a warming cache of kernels and memory blocks over batches of every length up to 1024 (unmeasured since)
PAD_MULTIPLE = 64


# --- checkpoints and exports -----------------------------------------------------------------------------------


def write_checkpoint(out: Path, head: Any, optimiser: torch.optim.Optimizer, generator: torch.Generator,
                     progress: dict[str, Any], settings: RecipeSettings) -> dict[str, Any]:
    """OUT/checkpoint (dense head + recipe_state.pt) and OUT/int4, each swapped in whole; the export's record."""
    with atomic_dir(out / "checkpoint") as fresh:
        save_head(head, fresh)
        state = {"progress": progress, "optimiser": optimiser.state_dict(), "generator": generator.get_state(),
                 "head_config": asdict(head.config), "settings": asdict(settings)}
        torch.save(state, fresh / STATE)
    return export(head, out / EXPORT, EXPORT_BITS)


# --- the run ---------------------------------------------------------------------------------------------------


@dataclass
class _Meter:
    """Training figures since the last metrics row (or of an evaluation's batches)."""

    loss: float = 0.0
    steps: int = 0
    positions: int = 0
    agreed: list[int] | None = None
    rows: list[int] | None = None
    target_seconds: float = 0.0
    head_seconds: float = 0.0

    def add(self, loss: float, batch: Any, target_seconds: float, head_seconds: float) -> None:
        self.loss += loss
        self.steps += 1
        self.positions += batch.positions
        self.agreed = [a + b for a, b in zip(self.agreed, batch.agreed)] if self.agreed else list(batch.agreed)
        self.rows = [a + b for a, b in zip(self.rows, batch.rows)] if self.rows else list(batch.rows)
        self.target_seconds += target_seconds
        self.head_seconds += head_seconds

    def row(self) -> dict[str, Any]:
        seconds = self.target_seconds + self.head_seconds
        return {"loss": self.loss / max(self.steps, 1), "steps_in_row": self.steps,
                "agreement": [a / max(r, 1) for a, r in zip(self.agreed or [], self.rows or [])],
                "positions_per_second": self.positions / seconds if seconds > 0 else None,
                "target_seconds": self.target_seconds, "head_seconds": self.head_seconds}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(head: Any, model: nn.Module, sequences: Sequence[Tensor], settings: RecipeSettings,
             device: torch.device, autocast: bool) -> Evaluation:
    """Held-out top-1 agreement per draft depth (target-fed context, as in training) and the mean loss."""
    head.eval()
    chosen = list(sequences[: settings.eval_sequences])
    meter = _Meter()
    for start in range(0, len(chosen), settings.batch_size):
        tokens, lengths = padded([s for s in chosen[start : start + settings.batch_size] if s.numel() >= 2],
                                 settings.seq_len * 2)
        tokens, lengths = tokens.to(device), lengths.to(device)
        features, ids, logprobs = target_features(model, tokens, lengths, head.config.target_layers, settings.top_k)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            batch = batched_ttt_loss(head, tokens, lengths, features, ids, logprobs, settings.ttt_steps,
                                     settings.decay)
        meter.add(float(batch.loss), batch, 0.0, 0.0)
    row = meter.row()
    return Evaluation(row["loss"], tuple(row["agreement"]), len(chosen))


class _OnlineSteps:
    """The recipe's side of the orchestrator: each step runs the target over its batch (online features), a
    checkpoint is OUT/checkpoint + OUT/int4 + a row of OUT/metrics.jsonl."""

    def __init__(self, head: Any, model: nn.Module, train: list[Tensor], held_out: list[Tensor],
                 settings: RecipeSettings, device: torch.device, autocast: bool, out: Path, started: float,
                 progress: dict[str, Any]) -> None:
        self.head, self.model, self.train, self.held_out, self.settings = head, model, train, held_out, settings
        self.device, self.autocast, self.out, self.started, self.progress = device, autocast, out, started, progress
        self.optimiser = new_optimiser(head, settings.lr, frozen=() if settings.train_lm_head else ("lm_head",),
                                       kind=settings.optimizer)
        self.order = torch.Generator().manual_seed(settings.seed)
        self.meter = _Meter()
        self.exported: dict[str, Any] = {}

    def step(self, step: int) -> None:
        settings, device = self.settings, self.device
        self.head.train()
        picks = torch.randint(len(self.train), (settings.batch_size,), generator=self.order).tolist()
        tokens, lengths = padded([self.train[i] for i in picks], settings.seq_len * 2, multiple=PAD_MULTIPLE)
        tokens, lengths = tokens.to(device), lengths.to(device)
        t0 = time.monotonic()
        features, ids, logprobs = target_features(self.model, tokens, lengths, self.head.config.target_layers,
                                                  settings.top_k)
        _sync(device)
        t1 = time.monotonic()
        self.optimiser.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
            batch = batched_ttt_loss(self.head, tokens, lengths, features, ids, logprobs, settings.ttt_steps,
                                     settings.decay)
        if batch.loss.requires_grad:  # a constant zero when no row had a label in the draft vocabulary
            batch.loss.backward()
            nn.utils.clip_grad_norm_(self.head.parameters(), settings.clip)
            self.optimiser.step()
        _sync(device)
        t2 = time.monotonic()
        self.progress["step"] += 1
        self.progress["tokens_seen"] += batch.positions
        self.progress["train_seconds"] += t2 - t0
        self.meter.add(float(batch.loss.detach()), batch, t1 - t0, t2 - t1)

    def checkpoint(self, step: int) -> None:
        self.exported = write_checkpoint(self.out, self.head, self.optimiser, self.order, self.progress,
                                         self.settings)
        if self.meter.steps:
            append_row(self.out / METRICS, {"elapsed": time.monotonic() - self.started, "stage": "training",
                                            **self.progress, **self.meter.row()})
        self.meter = _Meter()

    def evaluate(self, step: int) -> Evaluation | None:
        self.head.eval()
        if not self.held_out:
            return None
        return evaluate(self.head, self.model, self.held_out, self.settings, self.device, self.autocast)


def run(settings: RecipeSettings, started: float | None = None) -> dict[str, Any]:
    """The whole recipe (see the module docstring); returns what OUT/eval.json holds."""
    started = time.monotonic() if started is None else started
    deadline = started + settings.time_budget
    reserve = max(5.0, 0.05 * settings.time_budget)  # the final evaluation, checkpoint and exports
    out = Path(settings.out)
    state = _resume_state(out, settings)
    if state is not None:
        saved = state["settings"]
        settings = replace(RecipeSettings(**{**saved, "data": tuple(saved["data"]),
                                             "answers": tuple(saved.get("answers", ()))}),
                           out=settings.out, target=settings.target, gguf_chunks=settings.gguf_chunks,
                           device=settings.device, time_budget=settings.time_budget, max_steps=settings.max_steps,
                           resume=True)
    init = None if state is not None else initial_head_dir(settings)  # options checked before the target loads
    for file in () if state is not None else settings.answers:
        if not Path(file).is_file():
            raise UserError(f"--answers {file!r}: no such file")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16 = target_dtype(settings.dtype, device) == torch.bfloat16
    autocast = settings.autocast if settings.autocast is not None else bf16
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    timings: dict[str, float] = {}
    model, tokenizer = load_target(settings, device)
    timings["load_seconds"] = time.monotonic() - started
    eos = eos_ids(model, tokenizer)
    append_row(out / METRICS, {"elapsed": timings["load_seconds"], "stage": "target loaded", "device": str(device)})
    if (out / CORPUS).is_file() and state is not None:
        train, held_out, corpus = load_corpus(out / CORPUS)
    else:
        # a share of the time left once the target is loaded (loading took 73 of 480 s on an H200)
        now = time.monotonic()
        distill_deadline = now + settings.distill_share * max(0.0, deadline - reserve - now)
        fingerprint = tokenizer_fingerprint(tokenizer, model.get_output_embeddings().weight.shape[0])
        kept = Answers()
        for file in settings.answers:
            kept = kept.plus(read_answers(file, fingerprint))
        train, held_out, corpus, answers = build_corpus(
            model, tokenizer, settings, distill_deadline, eos,
            lambda split, n: append_row(out / METRICS, {"elapsed": time.monotonic() - started, "stage": "distilling",
                                            "split": split, "answers": n}), kept)
        corpus["answers_from"] = list(settings.answers)
        save_corpus(out / CORPUS, train, held_out, corpus)
        write_answers(out / ANSWERS, answers, fingerprint)
    timings["corpus_seconds"] = time.monotonic() - started - timings["load_seconds"]
    train = [s for s in train if s.numel() >= 2]
    append_row(out / METRICS, {"elapsed": time.monotonic() - started, "stage": "corpus", **corpus,
                   "train_sequences": len(train), "held_out_sequences": len(held_out)})
    if state is not None:
        head = resumed_head(out / "checkpoint", state, model, device)
        progress = dict(state["progress"])
    else:
        if init is not None:  # the export's shape, draft vocabulary and (dequantized) weights
            head = load_head(init, model, device=device).float()
        else:
            vocab = model.get_output_embeddings().weight.shape[0]
            ids = frequent_tokens(train, min(settings.draft_vocab, vocab), vocab, always=[i for i in eos if i < vocab])
            shape = {} if settings.intermediate_size is None else {"intermediate_size": settings.intermediate_size}
            head = fresh_head(model, "eagle3", settings.seed, ids, init=settings.init_from_target, **shape)
        progress = {"step": 0, "tokens_seen": 0, "train_seconds": 0.0}
    # refused before any training, not at its end (a trained LM head is exported with the head)
    check_size(dict(head.state_dict()) if settings.train_lm_head else exported_tensors(head)[1], EXPORT_BITS)
    steps = _OnlineSteps(head, model, train, held_out, settings, device, autocast, out, started, progress)
    schedule = Schedule(settings.lr, settings.warmup, steps=settings.max_steps, until=deadline - reserve,
                        checkpoint_seconds=settings.checkpoint_every, cosine=True, steps_reached="max steps",
                        always_finish=True)
    outcome = orchestrator.train(steps, schedule, state, progress["step"])
    evaluation = None if outcome.evaluation is None else outcome.evaluation.record()
    report = {
        "target": settings.target or settings.gguf_chunks, "device": _device_name(device),
        "torch": torch.__version__, "transformers": _transformers_version(), "stopped": outcome.stopped,
        "error": outcome.error,
        "elapsed_seconds": time.monotonic() - started, **timings, **progress,
        "train_positions_per_second": progress["tokens_seen"] / max(progress["train_seconds"], 1e-9),
        "corpus": {**corpus, "train_sequences": len(train), "held_out_sequences": len(held_out)},
        "init_head": None if init is None else str(init),
        "head": {"draft_vocab_size": head.config.draft_vocab_size, "intermediate_size": head.config.intermediate_size,
                 "target_layers": list(head.config.target_layers), "ttt_steps": settings.ttt_steps},
        "held_out": evaluation, "export": steps.exported,
        "answers": {"file": str(out / ANSWERS),
                    "bytes": (out / ANSWERS).stat().st_size if (out / ANSWERS).is_file() else None},
        "settings": asdict(settings),
    }
    write_report(out, report)
    append_row(out / METRICS, {"elapsed": report["elapsed_seconds"], "stage": "done", "stopped": outcome.stopped,
                               "held_out": evaluation})
    return report


def initial_head_dir(settings: RecipeSettings) -> Path | None:
    """The head a fresh run starts from (`--init-head`): the directory given, None for `none`, and for `auto` the
    head shipped for the preset whose GGUF file the target is (by file name), when the package ships one."""
    if settings.init_head == "none":
        return None
    if settings.init_head != "auto":
        path = Path(settings.init_head)
        if not path.is_dir():
            raise UserError(f"--init-head {settings.init_head!r}: no such directory (give a head export, auto or none)")
        return path
    if settings.gguf_chunks is not None:
        sums = Path(settings.gguf_chunks) / SUMS
        name = sums.read_text().split()[-1] if sums.is_file() else ""
    else:
        name = Path(settings.target or "").name
    presets = [key for key, preset in PRESETS.items() if preset.gguf_file == name]
    return shipped_head_dir(presets[0]) if presets else None


def _resume_state(out: Path, settings: RecipeSettings) -> dict[str, Any] | None:
    path = out / "checkpoint" / STATE
    check_out(out, settings.resume, path if path.is_file() else None, f" ({path})")
    return torch.load(path, map_location="cpu", weights_only=True) if settings.resume else None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def prepare(preset: str, directory: str, chunk_bytes: int | None) -> list[Path]:
    """Cut an installed preset's GGUF (its package parts, as sparrow's loader joins them) into chunks + SHA256SUMS
    under `directory`, checked against the preset's sha256; chunks of `chunk_bytes`, by default as large as fits
    one device call beside the working tree here (a shipped head included). Runs here, not on the device."""
    if chunk_bytes is None:
        tree = tree_bytes()
        chunk_bytes = CHUNK_BYTES if tree is None else chunk_bytes_beside(tree)
    spec = get_preset(preset)
    parts = _part_paths(spec)
    if parts is None:
        raise not_installed_error(spec)
    return split_file(parts, spec.gguf_file, directory, chunk_bytes, expected_sha256=spec.sha256)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparrow.training.recipe", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="split an installed preset's GGUF into chunks to carry to a device")
    p.add_argument("--preset", default="qwen2.5-coder-1.5b")
    p.add_argument("--dir", default=".gpu/gguf")
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="default: what fits one device call beside the working tree (64 MiB - tree - 2 MiB)")
    r = commands.add_parser("run", help="the whole recipe within --time-budget seconds")
    defaults = RecipeSettings(out="", target="-")
    for f in fields(RecipeSettings):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name) if f.name not in ("target",) else None
        if f.name == "out":
            r.add_argument(flag, required=True)
        elif f.name in ("data", "answers"):
            r.add_argument(flag, action="append", default=None, help="a directory or file (repeatable)")
        elif f.name in ("resume",):
            r.add_argument(flag, action="store_true")
        elif f.name in ("autocast", "train_lm_head"):
            r.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"float": float, "int": int}.get(type(default).__name__, str)
            if f.name in ("intermediate_size", "max_steps", "threads"):
                kind = int
            r.add_argument(flag, type=kind, default=default, help=f"default: {default}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    # Growable CUDA memory segments: batches of many lengths otherwise keep the caching allocator splitting and
    # freeing blocks (read before the first CUDA allocation; no effect on a CPU)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            chunks = prepare(args.preset, args.dir, args.chunk_bytes)
            print(json.dumps({"dir": args.dir, "chunks": [str(c) for c in chunks]}))
            return 0
        values = {f.name: getattr(args, f.name) for f in fields(RecipeSettings)}
        values["data"] = tuple(values["data"] or ())
        values["answers"] = tuple(values["answers"] or ())
        values["train_lm_head"] = bool(values["train_lm_head"])
        report = run(RecipeSettings(**values), started)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("stopped", "step", "tokens_seen", "elapsed_seconds", "held_out")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fast GPU recipe for an EAGLE-3 head: one command that does the whole run within a time budget, and whose
latest results survive the process being killed.

    python -m sparrow.training.recipe run --target DIR|FILE.gguf|--gguf-chunks DIR --out OUT [--time-budget 480]
    python -m sparrow.training.recipe prepare --preset qwen2.5-coder-1.5b --dir .gpu/gguf   (here, before)

`run`, in order, all inside `--time-budget` seconds of wall time from its start:
1. the target: a transformers directory, a GGUF file, or a GGUF carried over as numbered chunks (`--gguf-chunks`,
   joined and sha256-checked: `sparrow.training.chunks`); bf16 on a GPU, float32 on a CPU;
2. the corpus (`sparrow.training.data`): token sequences from offline .py/.md/.rst files (`--data`, default the
   standard library and installed packages), a held-out split by file; then the target's own greedy answers to
   prompts built from the training files (self-distillation), `--distill-batch` prompts a `generate` call, for at
   most `--distill-share` of the budget; kept in OUT/corpus.safetensors (a resumed run reuses it);
3. a draft vocabulary: the `--draft-vocab` most frequent target tokens of the training sequences (EOS included);
4. training: each step draws `--batch-size` sequences, runs the target over them ONLINE (no_grad; its hidden
   states of the head's three layers and its top-k next-token log-probs, nothing cached on disk), then the head's
   training-time test over `--ttt-steps` draft depths on the whole padded batch (`sparrow.training.batched`) under
   bf16 autocast on a GPU; AdamW (0.9, 0.95), linear warmup, then a cosine decay over the training time left;
5. at the end (always, also when the budget or `--max-steps` ends training, or training fails): a held-out
   evaluation (top-1 agreement per depth, expected tokens per round), the checkpoint, the int8 export and
   OUT/eval.json.
Every `--checkpoint-every` seconds (default 60) and at the end: OUT/checkpoint/ (the dense head in SpecForge's
layout, float32, plus recipe_state.pt: step, optimiser, data order; written beside and swapped in whole), OUT/int8/
(`sparrow.heads.int8`: manifest + shards, swapped in whole) and a row of OUT/metrics.jsonl. `--resume` continues
from OUT/checkpoint with its corpus, head and optimiser (a fresh time budget).

Imports: torch, transformers, safetensors, numpy and sparrow modules that import only those (the device machines
are bare: no typer, rich, gguf unless installed for a GGUF target, av).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.heads.factory import new_head
from sparrow.heads.layout import export_int8, save_head
from sparrow.models.presets import _part_paths, get_preset, not_installed_error
from sparrow.training.batched import batched_ttt_loss
from sparrow.training.chunks import CHUNK_BYTES, join_chunks, split_file
from sparrow.training.data import CorpusSpec, default_roots, distill_prompt, file_sequences
from sparrow.training.heads import frequent_tokens, init_from_target
from sparrow.training.loop import Evaluation, new_optimiser
from sparrow.training.trainer import resumed_head

STATE = "recipe_state.pt"
METRICS = "metrics.jsonl"
EVAL = "eval.json"
CORPUS = "corpus.safetensors"


@dataclass(frozen=True)
class RecipeSettings:
    """The options of `run` (see `python -m sparrow.training.recipe run --help`)."""

    out: str
    target: str | None = None  # a transformers directory or a .gguf file
    gguf_chunks: str | None = None  # a directory of chunks + SHA256SUMS (`prepare`)
    data: tuple[str, ...] = ()  # default: the standard library and installed packages
    device: str | None = None  # default: cuda if available
    time_budget: float = 480.0
    tokens: int = 2_000_000  # training tokens from files
    held_out_tokens: int = 20_000
    seq_len: int = 512
    distill: int = 4096  # at most this many self-distilled answers (and the time share)
    distill_tokens: int = 256
    distill_batch: int = 128
    distill_share: float = 0.25  # of the budget
    draft_vocab: int = 16384
    intermediate_size: int | None = 3584  # fits the int8 export in 60 MB for a 1.5B target (None: the target's)
    ttt_steps: int = 6  # = the eagle drafter's default draft length
    batch_size: int = 32
    top_k: int = 32
    lr: float = 3e-4
    warmup: int = 50
    clip: float = 0.5
    decay: float = 0.8
    checkpoint_every: float = 60.0  # seconds
    eval_sequences: int = 64
    max_steps: int | None = None
    seed: int = 0
    resume: bool = False
    autocast: bool | None = None  # bf16 autocast (default: on a GPU)
    threads: int | None = None  # CPU threads for torch (default: torch's)

    def __post_init__(self) -> None:
        if (self.target is None) == (self.gguf_chunks is None):
            raise UserError("give exactly one of --target (a model directory or .gguf file) and --gguf-chunks DIR")
        for name in ("time_budget", "checkpoint_every", "lr", "distill_share"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("tokens", "seq_len", "distill_tokens", "distill_batch", "draft_vocab", "ttt_steps",
                     "batch_size", "top_k", "warmup", "eval_sequences"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)}")


# --- the target ------------------------------------------------------------------------------------------------


def load_target(settings: RecipeSettings, device: torch.device) -> tuple[nn.Module, Any]:
    """The target model (eval, frozen; bf16 on a GPU, float32 on a CPU) and its tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = settings.target
    if settings.gguf_chunks is not None:
        spec = str(join_chunks(settings.gguf_chunks))
    path = Path(spec)
    if not path.exists():
        raise UserError(f"--target {spec!r}: no such directory or .gguf file")
    major = int(transformers.__version__.split(".")[0])
    minor = int(transformers.__version__.split(".")[1])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    if path.suffix == ".gguf":
        where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    else:
        where = {"pretrained_model_name_or_path": str(path)}
    with fast_gguf_loading(path, os.cpu_count() or 1) if path.suffix == ".gguf" else contextlib.nullcontext():
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, **{dtype_key: dtype})
    return model.to(device).eval().requires_grad_(False), tokenizer


def _file_offset(data: Any) -> int:
    """The byte offset of a GGUFReader tensor's array in its file (the same for every reader of the file)."""
    import numpy as np

    root = data
    while isinstance(getattr(root, "base", None), np.ndarray):  # up to the array over the whole mapped file
        root = root.base
    return int(data.__array_interface__["data"][0]) - int(root.__array_interface__["data"][0])


@contextlib.contextmanager
def fast_gguf_loading(path: Path, workers: int) -> Iterator[None]:
    """transformers parses a GGUF's metadata anew for the config, the tokenizer and the weights (gguf's reader walks
    a 151k-token vocabulary field by field: ~40 s each on this project's CPU), then dequantizes its tensors one
    after another. Inside this block the file is parsed once: `gguf.GGUFReader` (which transformers imports when
    it loads) returns that reader for this file, and `gguf.dequantize` answers from its tensors dequantized
    beforehand on `workers` threads (matched by their offset in the file); any other call goes to gguf's own."""
    from concurrent.futures import ThreadPoolExecutor

    import gguf

    original_reader, original = gguf.GGUFReader, gguf.dequantize
    reader = original_reader(str(path))
    with ThreadPoolExecutor(max(1, workers)) as pool:
        arrays = list(pool.map(lambda t: original(t.data, t.tensor_type), reader.tensors))
    done = {(_file_offset(t.data), int(t.tensor_type)): a for t, a in zip(reader.tensors, arrays)}
    del arrays

    def read(where: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and Path(where).resolve() == path.resolve():
            return reader
        return original_reader(where, *args, **kwargs)

    def lookup(data: Any, qtype: Any) -> Any:
        found = done.pop((_file_offset(data), int(qtype)), None)
        return found if found is not None else original(data, qtype)

    gguf.GGUFReader, gguf.dequantize = read, lookup
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.dequantize = original_reader, original


def eos_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    ids = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return sorted(int(i) for i in ids)


@torch.no_grad()
def target_features(model: nn.Module, tokens: Tensor, lengths: Tensor, layers: Sequence[int], top_k: int,
                    chunk_rows: int = 4096) -> tuple[Tensor, Tensor, Tensor]:
    """One target forward over a right-padded batch tokens [B, T] (lengths [B]) -> its hidden states of `layers`
    (transformers' hidden_states indices) concatenated [B, T, len(layers) * D] and its top-k next-token ids
    [B, T, k] and float32 log-probs, the LM head applied `chunk_rows` rows at a time."""
    b, t = tokens.shape
    mask = (torch.arange(t, device=tokens.device)[None] < lengths[:, None].to(tokens.device)).long()
    out = model.get_decoder()(input_ids=tokens, attention_mask=mask, output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i] for i in layers], -1)
    final = out.last_hidden_state.flatten(0, 1)
    head = model.get_output_embeddings()
    ids, logprobs = [], []
    for start in range(0, final.shape[0], chunk_rows):
        chunk = head(final[start : start + chunk_rows]).float().log_softmax(-1).topk(top_k, dim=-1)
        logprobs.append(chunk.values)
        ids.append(chunk.indices)
    return features, torch.cat(ids).view(b, t, -1), torch.cat(logprobs).view(b, t, -1)


# --- the corpus ----------------------------------------------------------------------------------------------


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as a user turn with the chat template (when the tokenizer has one), ready for the answer."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


@torch.no_grad()
def distilled(model: nn.Module, tokenizer: Any, snippets: Sequence[str], settings: RecipeSettings, deadline: float,
              eos: list[int], progress: Callable[[int], None] | None = None) -> list[Tensor]:
    """prompt + the target's greedy answer for snippets, `distill_batch` left-padded prompts per generate call,
    until the snippets or the time (`deadline`, checked between calls) run out; `progress(answers)` after each call."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    out: list[Tensor] = []
    for start in range(0, len(snippets), settings.distill_batch):
        if time.monotonic() >= deadline:
            break
        prompts = [chat_ids(tokenizer, distill_prompt(s))[-settings.seq_len :] for s in
                   snippets[start : start + settings.distill_batch]]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                   max_new_tokens=settings.distill_tokens, min_new_tokens=1, pad_token_id=pad,
                                   eos_token_id=eos or None, temperature=None, top_p=None, top_k=None)
        for p, row in zip(prompts, generated[:, width:].cpu()):
            ends = torch.isin(row, torch.tensor(eos)).nonzero() if eos else row.new_zeros(0, 1)
            answer = row[: int(ends[0]) + 1] if ends.numel() else row
            out.append(torch.cat([torch.tensor(p), answer]))
        if progress is not None:
            progress(len(out))
    return out


def build_corpus(model: nn.Module, tokenizer: Any, settings: RecipeSettings, deadline: float, eos: list[int],
                 progress: Callable[[str, int], None] | None = None
                 ) -> tuple[list[Tensor], list[Tensor], dict[str, Any]]:
    """(training sequences, held-out sequences, a summary) from files and self-distilled answers;
    `progress(split, answers)` after each generate call."""
    roots = settings.data or tuple(str(r) for r in default_roots())
    spec = CorpusSpec(roots=tuple(roots), tokens=settings.tokens, held_out_tokens=settings.held_out_tokens,
                      sequence_length=settings.seq_len, seed=settings.seed)
    train, held_out, files, snippets = file_sequences(spec, tokenizer, torch.Generator().manual_seed(settings.seed))
    start = time.monotonic()
    held_count = max(1, settings.distill // 10) if settings.distill else 0
    report = (lambda split: None) if progress is None else (lambda split: lambda n: progress(split, n))
    answers_held = distilled(model, tokenizer, snippets["held_out"][:held_count], settings, deadline, eos,
                             report("held_out"))
    answers = distilled(model, tokenizer, snippets["train"][: settings.distill], settings, deadline, eos,
                        report("train"))
    summary = {"files": {k: len(v) for k, v in files.items()}, "file_sequences": len(train),
               "file_tokens": sum(t.numel() for t in train), "distilled": len(answers),
               "distilled_tokens": sum(t.numel() for t in answers), "distilled_held_out": len(answers_held),
               "distill_seconds": time.monotonic() - start}
    return train + answers, held_out + answers_held, summary


def save_corpus(path: Path, train: list[Tensor], held_out: list[Tensor], summary: dict[str, Any]) -> None:
    tensors = {f"train.{i}": t.contiguous() for i, t in enumerate(train)}
    tensors.update({f"held_out.{i}": t.contiguous() for i, t in enumerate(held_out)})
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata={"summary": json.dumps(summary)})
    os.replace(partial, path)


def load_corpus(path: Path) -> tuple[list[Tensor], list[Tensor], dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        summary = json.loads((handle.metadata() or {}).get("summary", "{}"))
    tensors = load_file(str(path))

    def split(name: str) -> list[Tensor]:
        return [tensors[f"{name}.{i}"] for i in range(sum(k.startswith(name + ".") for k in tensors))]

    return split("train"), split("held_out"), summary


# --- batches ---------------------------------------------------------------------------------------------------


def padded(sequences: Sequence[Tensor], limit: int) -> tuple[Tensor, Tensor]:
    """Sequences (cut to `limit`) right-padded with 0 -> tokens [B, T], lengths [B]."""
    cut = [s[:limit] for s in sequences]
    lengths = torch.tensor([s.numel() for s in cut])
    tokens = torch.zeros(len(cut), int(lengths.max()), dtype=torch.long)
    for row, s in enumerate(cut):
        tokens[row, : s.numel()] = s
    return tokens, lengths


# --- checkpoints and exports -----------------------------------------------------------------------------------


def _swap_in(fresh: Path, directory: Path) -> None:
    """Replace `directory` by `fresh` (the old one whole until the new one is in place)."""
    old = directory.with_name(directory.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if directory.exists():
        os.replace(directory, old)
    os.replace(fresh, directory)
    if old.exists():
        shutil.rmtree(old)


def write_checkpoint(out: Path, head: Any, optimiser: torch.optim.Optimizer, generator: torch.Generator,
                     progress: dict[str, Any], settings: RecipeSettings) -> None:
    """OUT/checkpoint (dense head + recipe_state.pt) and OUT/int8, each swapped in whole."""
    fresh = out / "checkpoint.tmp"
    if fresh.exists():
        shutil.rmtree(fresh)
    save_head(head, fresh)
    state = {"progress": progress, "optimiser": optimiser.state_dict(), "generator": generator.get_state(),
             "head_config": asdict(head.config), "settings": asdict(settings)}
    torch.save(state, fresh / STATE)
    _swap_in(fresh, out / "checkpoint")
    export_int8(head, out / "int8", replace=True)


def _metrics(out: Path, row: dict[str, Any]) -> None:
    with (out / METRICS).open("a") as f:
        f.write(json.dumps(row) + "\n")


# --- the run ---------------------------------------------------------------------------------------------------


@dataclass
class _Meter:
    """Training figures since the last metrics row."""

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


def lr_scale(step: int, warmup: int, fraction: float) -> float:
    """The learning rate's factor at optimiser step `step` (0-based) with `fraction` of the training time spent:
    linear warmup over `warmup` steps, then a cosine decay over the time, never below 0.1."""
    return min(1.0, (step + 1) / warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * min(max(fraction, 0.0), 1.0))))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(head: Any, model: nn.Module, sequences: Sequence[Tensor], settings: RecipeSettings,
             device: torch.device, autocast: bool) -> dict[str, Any]:
    """Held-out top-1 agreement per draft depth (target-fed context, as in training), the mean loss and the
    expected tokens per round 1 + a1 + a1 a2 + ... (`sparrow.training.heads.Evaluation`)."""
    head.eval()
    chosen = list(sequences[: settings.eval_sequences])
    agreed: list[int] = []
    rows: list[int] = []
    losses = []
    for start in range(0, len(chosen), settings.batch_size):
        tokens, lengths = padded([s for s in chosen[start : start + settings.batch_size] if s.numel() >= 2],
                                 settings.seq_len * 2)
        tokens, lengths = tokens.to(device), lengths.to(device)
        features, ids, logprobs = target_features(model, tokens, lengths, head.config.target_layers, settings.top_k)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            batch = batched_ttt_loss(head, tokens, lengths, features, ids, logprobs, settings.ttt_steps,
                                     settings.decay)
        losses.append(float(batch.loss))
        agreed = [a + b for a, b in zip(agreed, batch.agreed)] if agreed else list(batch.agreed)
        rows = [a + b for a, b in zip(rows, batch.rows)] if rows else list(batch.rows)
    agreement = tuple(a / max(r, 1) for a, r in zip(agreed, rows))
    evaluation = Evaluation(sum(losses) / max(len(losses), 1), agreement, len(chosen))
    return {"sequences": len(chosen), "loss": evaluation.loss, "agreement_per_depth": list(agreement),
            "expected_tokens_per_round": evaluation.expected_accepted}


def run(settings: RecipeSettings, started: float | None = None) -> dict[str, Any]:
    """The whole recipe (see the module docstring); returns what OUT/eval.json holds."""
    started = time.monotonic() if started is None else started
    deadline = started + settings.time_budget
    reserve = max(5.0, 0.05 * settings.time_budget)  # the final evaluation, checkpoint and exports
    out = Path(settings.out)
    state = _resume_state(out, settings)
    if state is not None:
        settings = replace(RecipeSettings(**{**state["settings"], "data": tuple(state["settings"]["data"])}),
                           out=settings.out, target=settings.target, gguf_chunks=settings.gguf_chunks,
                           device=settings.device, time_budget=settings.time_budget, max_steps=settings.max_steps,
                           resume=True)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    autocast = settings.autocast if settings.autocast is not None else device.type == "cuda"
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    timings: dict[str, float] = {}
    model, tokenizer = load_target(settings, device)
    timings["load_seconds"] = time.monotonic() - started
    eos = eos_ids(model, tokenizer)
    _metrics(out, {"elapsed": timings["load_seconds"], "stage": "target loaded", "device": str(device)})
    if (out / CORPUS).is_file() and state is not None:
        train, held_out, corpus = load_corpus(out / CORPUS)
    else:
        distill_deadline = min(deadline - reserve, started + settings.distill_share * settings.time_budget)
        train, held_out, corpus = build_corpus(
            model, tokenizer, settings, distill_deadline, eos,
            lambda split, n: _metrics(out, {"elapsed": time.monotonic() - started, "stage": "distilling",
                                            "split": split, "answers": n}))
        save_corpus(out / CORPUS, train, held_out, corpus)
    timings["corpus_seconds"] = time.monotonic() - started - timings["load_seconds"]
    train = [s for s in train if s.numel() >= 2]
    _metrics(out, {"elapsed": time.monotonic() - started, "stage": "corpus", **corpus,
                   "train_sequences": len(train), "held_out_sequences": len(held_out)})
    if state is not None:
        head = resumed_head(out / "checkpoint", state, model, device)
        progress = dict(state["progress"])
    else:
        vocab = model.get_output_embeddings().weight.shape[0]
        ids = frequent_tokens(train, min(settings.draft_vocab, vocab), vocab, always=[i for i in eos if i < vocab])
        shape = {} if settings.intermediate_size is None else {"intermediate_size": settings.intermediate_size}
        generator = torch.Generator(device=device).manual_seed(settings.seed)
        head = new_head(model, "eagle3", generator, draft_vocab=ids, **shape).float()
        init_from_target(head, model)
        progress = {"step": 0, "tokens_seen": 0, "train_seconds": 0.0}
    optimiser = new_optimiser(head, settings.lr)
    order = torch.Generator().manual_seed(settings.seed)
    if state is not None:
        optimiser.load_state_dict(state["optimiser"])
        order.set_state(state["generator"])
    train_start = time.monotonic()
    train_until = deadline - reserve
    stopped, error = "time budget", None
    meter, last_checkpoint = _Meter(), time.monotonic()
    signalled: list[int] = []
    try:
        with _stop_on_signals(signalled):  # SIGTERM / SIGINT end training; the exports below still run
            while True:
                if signalled:
                    stopped = f"signal {signalled[0]}"
                    break
                if settings.max_steps is not None and progress["step"] >= settings.max_steps:
                    stopped = "max steps"
                    break
                if time.monotonic() >= train_until:
                    break
                head.train()
                fraction = (time.monotonic() - train_start) / max(train_until - train_start, 1e-9)
                for group in optimiser.param_groups:
                    group["lr"] = settings.lr * lr_scale(progress["step"], settings.warmup, fraction)
                picks = torch.randint(len(train), (settings.batch_size,), generator=order).tolist()
                tokens, lengths = padded([train[i] for i in picks], settings.seq_len * 2)
                tokens, lengths = tokens.to(device), lengths.to(device)
                t0 = time.monotonic()
                features, ids, logprobs = target_features(model, tokens, lengths, head.config.target_layers,
                                                          settings.top_k)
                _sync(device)
                t1 = time.monotonic()
                optimiser.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    batch = batched_ttt_loss(head, tokens, lengths, features, ids, logprobs, settings.ttt_steps,
                                             settings.decay)
                if batch.loss.requires_grad:  # a constant zero when no row had a label in the draft vocabulary
                    batch.loss.backward()
                    nn.utils.clip_grad_norm_(head.parameters(), settings.clip)
                    optimiser.step()
                _sync(device)
                t2 = time.monotonic()
                progress["step"] += 1
                progress["tokens_seen"] += batch.positions
                progress["train_seconds"] += t2 - t0
                meter.add(float(batch.loss.detach()), batch, t1 - t0, t2 - t1)
                if time.monotonic() - last_checkpoint >= settings.checkpoint_every:
                    write_checkpoint(out, head, optimiser, order, progress, settings)
                    _metrics(out, {"elapsed": time.monotonic() - started, "stage": "training", **progress,
                                   **meter.row()})
                    meter, last_checkpoint = _Meter(), time.monotonic()
    except Exception as failure:  # noqa: BLE001 - the head trained so far is still exported below
        stopped, error = "error", f"{type(failure).__name__}: {failure}"
        print(f"training stopped by {error}; exporting what there is", file=sys.stderr)
    head.eval()
    evaluation = evaluate(head, model, held_out, settings, device, autocast) if held_out else None
    write_checkpoint(out, head, optimiser, order, progress, settings)
    if meter.steps:
        _metrics(out, {"elapsed": time.monotonic() - started, "stage": "training", **progress, **meter.row()})
    int8_bytes = sum(p.stat().st_size for p in (out / "int8").glob("*.safetensors"))
    report = {
        "target": settings.target or settings.gguf_chunks, "device": _device_name(device),
        "torch": torch.__version__, "transformers": _transformers_version(), "stopped": stopped, "error": error,
        "elapsed_seconds": time.monotonic() - started, **timings, **progress,
        "train_positions_per_second": progress["tokens_seen"] / max(progress["train_seconds"], 1e-9),
        "corpus": {**corpus, "train_sequences": len(train), "held_out_sequences": len(held_out)},
        "head": {"draft_vocab_size": head.config.draft_vocab_size, "intermediate_size": head.config.intermediate_size,
                 "target_layers": list(head.config.target_layers), "ttt_steps": settings.ttt_steps},
        "held_out": evaluation, "int8": {"dir": str(out / "int8"), "bytes": int8_bytes},
        "settings": asdict(settings),
    }
    (out / EVAL).write_text(json.dumps(report, indent=1) + "\n")
    _metrics(out, {"elapsed": report["elapsed_seconds"], "stage": "done", "stopped": stopped,
                   "held_out": evaluation})
    return report


@contextlib.contextmanager
def _stop_on_signals(signalled: list[int]) -> Iterator[None]:
    """Inside the block SIGTERM and SIGINT append their number to `signalled` instead of ending the process (main
    thread only; elsewhere nothing changes); the previous handlers come back after it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kinds = (signal.SIGTERM, signal.SIGINT)
    previous = {kind: signal.signal(kind, lambda number, frame: signalled.append(number)) for kind in kinds}
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler)


def _resume_state(out: Path, settings: RecipeSettings) -> dict[str, Any] | None:
    path = out / "checkpoint" / STATE
    if settings.resume:
        if not path.is_file():
            raise UserError(f"--resume: {str(out)!r} holds no checkpoint ({path}) to continue")
        return torch.load(path, map_location="cpu", weights_only=True)
    if path.is_file():
        raise UserError(f"--out {str(out)!r} already holds a run: pass --resume to continue it, or another --out")
    return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def prepare(preset: str, directory: str, chunk_bytes: int) -> list[Path]:
    """Cut an installed preset's GGUF (its package parts, as sparrow's loader joins them) into chunks + SHA256SUMS
    under `directory`, checked against the preset's sha256. Runs here (sparrow installed), not on the device."""
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
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES)
    r = commands.add_parser("run", help="the whole recipe within --time-budget seconds")
    defaults = RecipeSettings(out="", target="-")
    for f in fields(RecipeSettings):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name) if f.name not in ("target",) else None
        if f.name == "out":
            r.add_argument(flag, required=True)
        elif f.name == "data":
            r.add_argument(flag, action="append", default=None, help="a directory or file (repeatable)")
        elif f.name in ("resume",):
            r.add_argument(flag, action="store_true")
        elif f.name == "autocast":
            r.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"float": float, "int": int}.get(type(default).__name__, str)
            if f.name in ("intermediate_size", "max_steps", "threads"):
                kind = int
            r.add_argument(flag, type=kind, default=default, help=f"default: {default}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            chunks = prepare(args.preset, args.dir, args.chunk_bytes)
            print(json.dumps({"dir": args.dir, "chunks": [str(c) for c in chunks]}))
            return 0
        values = {f.name: getattr(args, f.name) for f in fields(RecipeSettings)}
        values["data"] = tuple(values["data"] or ())
        report = run(RecipeSettings(**values), started)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("stopped", "step", "tokens_seen", "elapsed_seconds", "held_out")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

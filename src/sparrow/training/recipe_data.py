"""The GPU recipe's data: the target loaded from a preset's GGUF (its metadata parsed once), its online features
(hidden states and top-k labels of a batch), the offline corpus plus self-distilled answers generated in large
batches, and their padding."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.runtime.cpu import cpu_info
from sparrow.training.answers import Answers
from sparrow.training.chunks import join_chunks
from sparrow.training.data import CorpusSpec, default_roots, distill_prompt, file_sequences

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def target_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The target's dtype for `--dtype` (auto: bfloat16 on a GPU and on a CPU with bfloat16 instructions, where it
    runs ~2x the float32 rate; float32 on a CPU without them, where torch would emulate bfloat16)."""
    if setting != "auto":
        return DTYPES[setting]
    return torch.bfloat16 if device.type != "cpu" or cpu_info().bf16 else torch.float32


def load_target(settings: RecipeSettings, device: torch.device) -> tuple[nn.Module, Any]:
    """The target model (eval, frozen; in `target_dtype`) and its tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = target_dtype(settings.dtype, device)
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



def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as a user turn with the chat template (when the tokenizer has one), ready for the answer."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])



@torch.no_grad()
def distilled(model: nn.Module, tokenizer: Any, prompts: Sequence[list[int]], settings: RecipeSettings,
              deadline: float, eos: list[int], progress: Callable[[int], None] | None = None) -> list[Tensor]:
    """prompt + the target's greedy answer for `prompts` (token ids, in order), `distill_batch` left-padded prompts
    per generate call, until the prompts or the time (`deadline`, checked between calls) run out;
    `progress(answers)` after each call."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    out: list[Tensor] = []
    for start in range(0, len(prompts), settings.distill_batch):
        if time.monotonic() >= deadline:
            break
        batch = prompts[start : start + settings.distill_batch]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                   max_new_tokens=settings.distill_tokens, min_new_tokens=1, pad_token_id=pad,
                                   eos_token_id=eos or None, temperature=None, top_p=None, top_k=None)
        for p, row in zip(batch, generated[:, width:].cpu()):
            ends = torch.isin(row, torch.tensor(eos)).nonzero() if eos else row.new_zeros(0, 1)
            answer = row[: int(ends[0]) + 1] if ends.numel() else row
            out.append(torch.cat([torch.tensor(p), answer]))
        if progress is not None:
            progress(len(out))
    return out


def new_prompts(tokenizer: Any, snippets: Sequence[str], known: set[tuple[int, ...]], count: int, seq_len: int
                ) -> list[list[int]]:
    """The first `count` distillation prompts (token ids, at most `seq_len`) of `snippets` not in `known` (answered
    by an earlier run)."""
    chosen: list[list[int]] = []
    for snippet in snippets:
        if len(chosen) >= count:
            break
        prompt = chat_ids(tokenizer, distill_prompt(snippet))[-seq_len:]
        if tuple(prompt) not in known:
            chosen.append(prompt)
    return chosen


def build_corpus(model: nn.Module, tokenizer: Any, settings: RecipeSettings, deadline: float, eos: list[int],
                 progress: Callable[[str, int], None] | None = None, kept: Answers | None = None
                 ) -> tuple[list[Tensor], list[Tensor], dict[str, Any], Answers]:
    """(training sequences, held-out sequences, a summary, the answers) from files and the target's answers: those
    `kept` from earlier runs, then up to `--distill` new ones (a tenth as many held out) to prompts not answered
    before, generated until `deadline` (`progress(split, answers)` after each generate call). The answers are the
    last `summary["distilled"]` training and `summary["distilled_held_out"]` held-out sequences."""
    kept = kept if kept is not None else Answers()
    roots = settings.data or tuple(str(r) for r in default_roots())
    spec = CorpusSpec(roots=tuple(roots), tokens=settings.tokens, held_out_tokens=settings.held_out_tokens,
                      sequence_length=settings.seq_len, seed=settings.seed)
    train, held_out, files, snippets = file_sequences(spec, tokenizer, torch.Generator().manual_seed(settings.seed))
    start = time.monotonic()
    held_count = max(1, settings.distill // 10) if settings.distill else 0
    report = (lambda split: None) if progress is None else (lambda split: lambda n: progress(split, n))
    known = kept.prompts()
    new_sequences, new_lengths = {}, {}
    for split, count in (("held_out", held_count), ("train", settings.distill)):
        prompts = new_prompts(tokenizer, snippets[split], known, count, settings.seq_len)
        new_sequences[split] = tuple(distilled(model, tokenizer, prompts, settings, deadline, eos, report(split)))
        new_lengths[split] = tuple(len(p) for p in prompts[: len(new_sequences[split])])
    answers = kept.plus(Answers(new_sequences, new_lengths))
    ours, ours_held = list(answers.sequences["train"]), list(answers.sequences["held_out"])
    summary = {"files": {k: len(v) for k, v in files.items()}, "file_sequences": len(train),
               "file_tokens": sum(t.numel() for t in train), "distilled": len(ours),
               "distilled_new": len(new_sequences["train"]), "distilled_tokens": sum(t.numel() for t in ours),
               "distilled_held_out": len(ours_held), "distill_seconds": time.monotonic() - start}
    return train + ours, held_out + ours_held, summary, answers


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



def padded(sequences: Sequence[Tensor], limit: int, multiple: int = 1) -> tuple[Tensor, Tensor]:
    """Sequences (cut to `limit`) right-padded with 0 -> tokens [B, T], lengths [B]; T is the longest length rounded
    up to a `multiple` (a few batch shapes instead of one per length, for the GPU's kernels and allocator)."""
    cut = [s[:limit] for s in sequences]
    lengths = torch.tensor([s.numel() for s in cut])
    width = -(-int(lengths.max()) // multiple) * multiple
    tokens = torch.zeros(len(cut), width, dtype=torch.long)
    for row, s in enumerate(cut):
        tokens[row, : s.numel()] = s
    return tokens, lengths


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
    distill_batch: int = 256
    distill_share: float = 0.25  # of the time left after loading the target
    draft_vocab: int = 16384
    # with the LM head the target's rows (train_lm_head off), the int4 export of a 1.5B target's head fits 16 MB
    intermediate_size: int | None = 2816  # None: the target's
    train_lm_head: bool = False  # off: the LM head stays the target's rows of the draft vocabulary, not exported
    init_head: str = "auto"  # an export or head directory to start from; auto: the preset's shipped head; none
    # a fresh head from the target's: lm_head (+ final norm), or also its last layer (+ fc); layer won on the CPU
    # (docs/heads.md, "Convergence on the CPU")
    init_from_target: str = "layer"
    optimizer: str = "adamw"  # or muon (sparrow.training.loop.OPTIMISERS)
    answers: tuple[str, ...] = ()  # answers files of earlier runs (answers.npz): trained on, their prompts not asked
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
    dtype: str = "auto"  # the target's: auto (target_dtype), bfloat16 or float32
    autocast: bool | None = None  # the head's steps under bf16 autocast (default: where the target runs in bf16)
    threads: int | None = None  # CPU threads for torch (default: torch's)

    def __post_init__(self) -> None:
        if self.init_from_target not in ("lm_head", "layer"):  # "none" would leave a frozen random LM head
            raise UserError(f"--init-from-target must be lm_head or layer, got {self.init_from_target!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise UserError(f"--dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise UserError(f"--optimizer must be adamw or muon, got {self.optimizer!r}")
        if (self.target is None) == (self.gguf_chunks is None):
            raise UserError("give exactly one of --target (a model directory or .gguf file) and --gguf-chunks DIR")
        for name in ("time_budget", "checkpoint_every", "lr", "distill_share"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("tokens", "seq_len", "distill_tokens", "distill_batch", "draft_vocab", "ttt_steps",
                     "batch_size", "top_k", "warmup", "eval_sequences"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)}")


"""Training text for a head that exists offline on a fresh machine: installed source files and docs, plus the
target's own answers to prompts drawn from them (self-distillation).

Files: `.py`, `.md` and `.rst` files under the given roots (default: the Python standard library and the
installed packages), listed in sorted order and shuffled with a seeded torch.Generator, so the sample is the
same on every machine with the same packages. A file belongs to the held-out split when a hash of its path
relative to its root says so (`held_out_percent`), never by position in the sample, so the split does not move
when the corpus grows. Files are cut into token sequences of `sequence_length`. Spec-Bench questions are
never used: no file under a `benchmarks` or `spec_bench` directory and no `.json`/`.jsonl` file is read.

Self-distillation: for some files of each split, the target answers a short chat prompt ("Explain and
continue ...") built from the file's opening lines, with plain greedy decoding; prompt + answer is one
sequence. The head learns the target's own continuations, as it will draft them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from sparrow.errors import UserError
from sparrow.pipeline import Pipeline

SUFFIXES = (".py", ".md", ".rst")
EXCLUDED_DIRS = frozenset({"__pycache__", "benchmarks", "spec_bench", "Spec-Bench", ".git", "node_modules"})
MIN_FILE_BYTES, MAX_FILE_BYTES = 256, 256_000
MIN_SEQUENCE = 16  # shorter tail chunks are dropped
SNIPPET_CHARS = 1200


def default_roots() -> list[Path]:
    """The standard library and the installed packages of this Python."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]), Path(paths["purelib"])]
    return [r for i, r in enumerate(roots) if r.is_dir() and r not in roots[:i]]


@dataclass(frozen=True)
class CorpusSpec:
    """What a corpus is made of; equal specs (on the same files and target) make equal corpora."""

    roots: tuple[str, ...]  # directories (or single files) searched for SUFFIXES files
    tokens: int  # training tokens from files (self-distilled ones come on top)
    held_out_tokens: int  # held-out tokens from files
    sequence_length: int = 512
    chunks_per_file: int = 4  # at most this many sequences from one file (variety)
    held_out_percent: int = 5
    distill: int = 0  # self-distilled training answers (held-out: distill // 10, at least 1 if distill > 0)
    distill_tokens: int = 128  # new tokens per answer
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.roots:
            raise UserError("--data: give at least one directory or file")
        for name, value, low in (("--tokens", self.tokens, 1), ("--held-out-tokens", self.held_out_tokens, 0),
                                 ("--seq-len", self.sequence_length, MIN_SEQUENCE), ("--distill", self.distill, 0),
                                 ("--distill-tokens", self.distill_tokens, 1)):
            if value < low:
                raise UserError(f"{name} must be an integer >= {low}, got {value}")
        if not 0 < self.held_out_percent < 100:
            raise UserError(f"held_out_percent must be in 1..99, got {self.held_out_percent}")

    @property
    def held_out_distill(self) -> int:
        return max(1, self.distill // 10) if self.distill else 0


@dataclass(frozen=True)
class Corpus:
    """Token sequences ([n] target ids each) of both splits, and the files they came from."""

    train: list[Tensor]
    held_out: list[Tensor]
    files: dict[str, list[str]] = field(default_factory=dict)  # split -> source files used

    @property
    def train_tokens(self) -> int:
        return sum(t.numel() for t in self.train)


def source_files(roots: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """Every SUFFIXES file under `roots` of a usable size, as (path, path relative to its root), sorted."""
    found: list[tuple[Path, str]] = []
    for root in map(Path, roots):
        if root.is_file():
            found.append((root, root.name))
            continue
        if not root.is_dir():
            raise UserError(f"--data {str(root)!r}: no such directory or file")
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_DIRS and not d.startswith("."))
            for name in sorted(names):
                path = Path(directory) / name
                if path.suffix in SUFFIXES and _usable(path):
                    found.append((path, str(path.relative_to(root))))
    return sorted(found, key=lambda item: (item[1], str(item[0])))


def _usable(path: Path) -> bool:
    try:
        return MIN_FILE_BYTES <= path.stat().st_size <= MAX_FILE_BYTES
    except OSError:
        return False


def is_held_out(relative: str, percent: int) -> bool:
    """The split of a file, by a hash of its relative path (stable as files come and go)."""
    return int.from_bytes(hashlib.sha256(relative.encode()).digest()[:4], "big") % 100 < percent


def chunk(tokens: Tensor, length: int, limit: int) -> list[Tensor]:
    """[n] ids -> up to `limit` consecutive pieces of `length` ids (a last piece >= MIN_SEQUENCE kept)."""
    pieces = [tokens[i : i + length] for i in range(0, tokens.numel(), length)]
    return [p for p in pieces if p.numel() >= MIN_SEQUENCE][:limit]


def file_sequences(spec: CorpusSpec, tokenizer, generator: torch.Generator
                   ) -> tuple[list[Tensor], list[Tensor], dict[str, list[str]], dict[str, list[str]]]:
    """Sequences of both splits from a seeded sample of the files, and the files and snippets used."""
    files = source_files(spec.roots)
    if not files:
        raise UserError(f"--data {', '.join(spec.roots)}: no {'/'.join(SUFFIXES)} files of "
                        f"{MIN_FILE_BYTES}..{MAX_FILE_BYTES} bytes found")
    order = torch.randperm(len(files), generator=generator).tolist()
    splits: dict[str, list[Tensor]] = {"train": [], "held_out": []}
    budget = {"train": spec.tokens, "held_out": spec.held_out_tokens}
    used: dict[str, list[str]] = {"train": [], "held_out": []}
    snippets: dict[str, list[str]] = {"train": [], "held_out": []}
    for index in order:
        path, relative = files[index]
        split = "held_out" if is_held_out(relative, spec.held_out_percent) else "train"
        have = sum(t.numel() for t in splits[split])
        if have >= budget[split]:
            if all(sum(t.numel() for t in splits[s]) >= budget[s] for s in splits):
                break
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        head = text[: spec.chunks_per_file * spec.sequence_length * 8]  # enough for its chunks (<= 8 chars a token)
        ids = torch.tensor(tokenizer(head)["input_ids"], dtype=torch.long)
        pieces = chunk(ids, spec.sequence_length, spec.chunks_per_file)
        if not pieces:
            continue
        room = budget[split] - have
        kept = []
        for piece in pieces:
            if room <= 0:
                break
            kept.append(piece[:max(room, MIN_SEQUENCE)])
            room -= kept[-1].numel()
        splits[split].extend(kept)
        used[split].append(str(path))
        snippets[split].append(text[:SNIPPET_CHARS])
    if not splits["train"]:
        raise UserError(f"--data {', '.join(spec.roots)}: no training text found (every file is held out)")
    if spec.held_out_tokens and not splits["held_out"]:
        raise UserError(f"--data {', '.join(spec.roots)}: none of its {len(files)} files falls in the held-out "
                        f"split at --held-out-percent {spec.held_out_percent}: raise it or give more files")
    return splits["train"], splits["held_out"], used, snippets


# Self-distillation asks for several kinds of answer, so that the head also sees the target copy, summarise and answer
# in prose, not only explain code (a head distilled on explanations alone drafted 1.1 tokens a forward on edits).
DISTILL_TASKS = (
    "Explain what the following does, then continue it:",
    "Copy the following out again with any spelling mistakes corrected and nothing else changed:",
    "Summarise the following in plain words for a newcomer:",
    "Write three questions a reader might ask about the following, each with its answer:",
    "Describe the following step by step, quoting the lines you describe:",
)


def distill_prompt(snippet: str) -> str:
    """The chat prompt of a self-distilled answer, from a file's opening text; the task is picked by a checksum of
    the snippet (the same prompt on every run)."""
    task = DISTILL_TASKS[zlib.crc32(snippet.encode()) % len(DISTILL_TASKS)]
    return f"{task}\n\n```\n{snippet.strip()}\n```"


def self_distilled(target, snippets: Sequence[str], new_tokens: int,
                   progress: Callable[[int, int], None] | None = None, batch_size: int = 1) -> list[Tensor]:
    """prompt + the target's greedy answer (ids) for each snippet (a LoadedModel target, chat template if any).
    batch_size 1: sparrow's own plain decoding, one prompt at a time; more: transformers' batched greedy
    `generate` over left-padded prompts (a GPU's way: the same answers up to near-ties, much faster)."""
    if batch_size < 1:
        raise UserError(f"--distill-batch must be an integer >= 1, got {batch_size}")
    plain = Pipeline(target, None)
    prompts = [plain.encode(distill_prompt(snippet), chat=True).input_ids for snippet in snippets]
    out: list[Tensor] = []
    for start in range(0, len(prompts), batch_size):
        group = prompts[start : start + batch_size]
        if batch_size == 1:
            answers = [torch.tensor(plain.generate_plain(group[0], max_new_tokens=new_tokens).token_ids,
                                    dtype=torch.long)]
        else:
            answers = _batched_answers(plain, group, new_tokens)
        out.extend(torch.cat([p, a]) for p, a in zip(group, answers))
        if progress is not None:
            progress(len(out), len(prompts))
    return out


def _batched_answers(plain, prompts: Sequence[Tensor], new_tokens: int) -> list[Tensor]:
    """The greedy answers ([<= new_tokens] ids each, through the first EOS) to `prompts` ([n_i] ids) in one
    transformers `generate` over left-padded rows."""
    model = plain.target.model
    eos = sorted(plain.eos_token_ids())
    pad = plain.tokenizer.pad_token_id if plain.tokenizer.pad_token_id is not None else eos[0]
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel():] = p
        mask[row, width - p.numel():] = 1
    device = next(model.parameters()).device
    with torch.no_grad():
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=1, pad_token_id=pad, eos_token_id=eos,
                                   temperature=None, top_p=None, top_k=None)[:, width:].cpu()
    answers = []
    for row in generated:
        ends = torch.isin(row, torch.tensor(eos)).nonzero()
        answers.append(row[: int(ends[0]) + 1] if ends.numel() else row)
    return answers


def build_corpus(spec: CorpusSpec, target, progress: Callable[[str, int, int], None] | None = None,
                 distill_batch: int = 1) -> Corpus:
    """The corpus of `spec` for `target` (a LoadedModel: its tokenizer, and its answers when spec.distill, made
    `distill_batch` prompts at a time: `self_distilled`)."""
    generator = torch.Generator().manual_seed(spec.seed)
    train, held_out, files, snippets = file_sequences(spec, target.tokenizer, generator)
    for split, count, sequences in (("train", spec.distill, train), ("held_out", spec.held_out_distill, held_out)):
        chosen = snippets[split][:count]
        if chosen:
            report = None if progress is None else (lambda d, t, s=split: progress(f"self-distil {s}", d, t))
            sequences.extend(self_distilled(target, chosen, spec.distill_tokens, report, distill_batch))
    return Corpus(train, held_out, files)


def save_corpus(corpus: Corpus, spec: CorpusSpec, directory: Path) -> None:
    """Write `corpus` as directory/corpus.safetensors and corpus.json (its spec and files)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"train.{i}": t for i, t in enumerate(corpus.train)}
    tensors.update({f"held_out.{i}": t for i, t in enumerate(corpus.held_out)})
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / "corpus.safetensors"))
    (directory / "corpus.json").write_text(json.dumps({"spec": asdict(spec), "files": corpus.files,
                                                       "train": len(corpus.train),
                                                       "held_out": len(corpus.held_out)}, indent=1) + "\n")


def load_corpus(spec: CorpusSpec, directory: Path) -> Corpus | None:
    """The corpus saved in `directory` if it was built from `spec`, else None."""
    meta, weights = directory / "corpus.json", directory / "corpus.safetensors"
    if not (meta.is_file() and weights.is_file()):
        return None
    record = json.loads(meta.read_text())
    if record.get("spec") != json.loads(json.dumps(asdict(spec))):
        return None
    tensors = load_file(str(weights))
    return Corpus([tensors[f"train.{i}"] for i in range(record["train"])],
                  [tensors[f"held_out.{i}"] for i in range(record["held_out"])], record["files"])


__all__ = ["Corpus", "CorpusSpec", "build_corpus", "default_roots", "distill_prompt", "is_held_out", "load_corpus",
           "save_corpus", "self_distilled", "source_files"]

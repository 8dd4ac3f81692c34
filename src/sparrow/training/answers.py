"""The target's own answers kept as compressed token ids, so a later run trains on them without generating them again.

An answers file (`np.savez_compressed`, `.npz`) holds, for the training and the held-out split, every sequence
(prompt + the target's greedy answer) concatenated as uint32 token ids (`train_ids`, `held_out_ids`), where each
ends (`train_ends`, `held_out_ends`: int64 cumulative lengths) and how long its prompt is (`train_prompts`,
`held_out_prompts`: int32, so a later run answers only prompts not answered yet), plus `meta`: a JSON string with the
format, the target vocabulary's size and a sha256 of the tokenizer's vocabulary (token -> id), which `read_answers`
checks so answers of another tokenizer are refused.

Imports: numpy and torch only (the GPU recipe runs on bare machines).
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sparrow.errors import UserError

FORMAT = "sparrow-answers"
VERSION = 1
SPLITS = ("train", "held_out")


def tokenizer_fingerprint(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """What an answers file records of the tokenizer that made its ids: the model's vocabulary size and a sha256 of
    the tokenizer's token -> id map."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(vocabulary, ensure_ascii=False).encode()).hexdigest()
    return {"vocab_size": int(vocab_size), "tokenizer_sha256": digest}


@dataclass(frozen=True)
class Answers:
    """The target's answers by split ("train", "held_out"): each a prompt + answer token sequence and the length of
    its prompt."""

    sequences: dict[str, tuple[Tensor, ...]] = field(default_factory=lambda: {split: () for split in SPLITS})
    prompt_lengths: dict[str, tuple[int, ...]] = field(default_factory=lambda: {split: () for split in SPLITS})

    def __post_init__(self) -> None:
        for split in SPLITS:
            assert len(self.sequences[split]) == len(self.prompt_lengths[split]), split

    def plus(self, other: Answers) -> Answers:
        """These answers, then `other`'s."""
        return Answers({s: self.sequences[s] + other.sequences[s] for s in SPLITS},
                       {s: self.prompt_lengths[s] + other.prompt_lengths[s] for s in SPLITS})

    def prompts(self) -> set[tuple[int, ...]]:
        """The prompts answered (token ids), of both splits."""
        return {tuple(seq[:n].tolist()) for s in SPLITS for seq, n in zip(self.sequences[s], self.prompt_lengths[s])}

    def count(self, split: str) -> int:
        return len(self.sequences[split])


def write_answers(path: str | Path, answers: Answers, fingerprint: dict[str, Any]) -> Path:
    """Write `answers` to `path` (an .npz, replaced whole); returns the path."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    for split in SPLITS:
        ids = [s.reshape(-1).to(torch.int64).numpy() for s in answers.sequences[split]]
        joined = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        if joined.size and (joined.min() < 0 or joined.max() >= 2**32):
            raise UserError(f"answers for {path}: a token id outside 0..2**32 - 1")
        arrays[f"{split}_ids"] = joined.astype(np.uint32)
        arrays[f"{split}_ends"] = np.cumsum([len(i) for i in ids], dtype=np.int64)
        arrays[f"{split}_prompts"] = np.array(answers.prompt_lengths[split], dtype=np.int32)
    meta = {"format": FORMAT, "version": VERSION, **fingerprint,
            "sequences": {split: answers.count(split) for split in SPLITS}}
    arrays["meta"] = np.array(json.dumps(meta))
    partial = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(partial, **arrays)
    os.replace(partial, path)
    return path


def read_answers(path: str | Path, fingerprint: dict[str, Any]) -> Answers:
    """The answers in a file made with the tokenizer of `fingerprint`; UserError (one line) for a missing, damaged
    or foreign file."""
    path = Path(path)
    where = f"--answers {str(path)!r}"
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise UserError(f"{where}: no such file") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as error:
        raise UserError(f"{where} is not a readable answers file ({type(error).__name__}: {error})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise UserError(f"{where} is not a {FORMAT} version {VERSION} file")
    for key in ("vocab_size", "tokenizer_sha256"):
        if meta.get(key) != fingerprint[key]:
            raise UserError(f"{where} was made with another tokenizer ({key} {meta.get(key)!r}, the target's is "
                            f"{fingerprint[key]!r}): its token ids mean other text")
    sequences, prompts = {}, {}
    for split in SPLITS:
        ids, ends, lengths = (arrays.get(f"{split}_{name}") for name in ("ids", "ends", "prompts"))
        if ids is None or ends is None or lengths is None or lengths.size != ends.size or (
                ends.size and int(ends[-1]) != ids.size):
            raise UserError(f"{where}: its {split} ids, their ends and prompt lengths disagree (damaged)")
        tensor = torch.from_numpy(ids.astype(np.int64))
        sequences[split] = tuple(torch.tensor_split(tensor, torch.from_numpy(ends[:-1]))) if ends.size else ()
        prompts[split] = tuple(int(n) for n in lengths)
    return Answers(sequences, prompts)


__all__ = ["Answers", "read_answers", "tokenizer_fingerprint", "write_answers"]

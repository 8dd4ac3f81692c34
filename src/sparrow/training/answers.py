"""The target's own answers kept as compressed token ids, so a later run trains on them without generating them again.

An answers file (`np.savez_compressed`, `.npz`) holds, for the training and the held-out split, every sequence
(prompt + the target's greedy answer) concatenated as uint32 token ids (`train_ids`, `held_out_ids`) and where each
ends (`train_ends`, `held_out_ends`: int64 cumulative lengths), plus `meta`: a JSON string with the format, the
target vocabulary's size and a sha256 of the tokenizer's vocabulary (token -> id), which `read_answers` checks so
answers of another tokenizer are refused. Token ids of a 152k vocabulary compress to about 2 bytes each.

Imports: numpy and torch only (the GPU recipe runs on bare machines).
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Sequence
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


def write_answers(path: str | Path, train: Sequence[Tensor], held_out: Sequence[Tensor],
                  fingerprint: dict[str, Any]) -> Path:
    """Write the answer sequences of both splits to `path` (an .npz, replaced whole); returns the path."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    for split, sequences in zip(SPLITS, (train, held_out)):
        ids = [s.reshape(-1).to(torch.int64).numpy() for s in sequences]
        joined = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        if joined.size and (joined.min() < 0 or joined.max() >= 2**32):
            raise UserError(f"answers for {path}: a token id outside 0..2**32 - 1")
        arrays[f"{split}_ids"] = joined.astype(np.uint32)
        arrays[f"{split}_ends"] = np.cumsum([len(i) for i in ids], dtype=np.int64)
    meta = {"format": FORMAT, "version": VERSION, **fingerprint,
            "sequences": {split: len(seqs) for split, seqs in zip(SPLITS, (train, held_out))}}
    arrays["meta"] = np.array(json.dumps(meta))
    partial = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(partial, **arrays)
    os.replace(partial, path)
    return path


def read_answers(path: str | Path, fingerprint: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
    """(training, held-out) answer sequences (int64 tensors) of an answers file made with the tokenizer of
    `fingerprint`; UserError (one line) for a missing, damaged or foreign file."""
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
    splits = []
    for split in SPLITS:
        ids, ends = arrays.get(f"{split}_ids"), arrays.get(f"{split}_ends")
        if ids is None or ends is None or (ends.size and int(ends[-1]) != ids.size):
            raise UserError(f"{where}: its {split} ids and their ends disagree (damaged)")
        tensor = torch.from_numpy(ids.astype(np.int64))
        splits.append(list(torch.tensor_split(tensor, torch.from_numpy(ends[:-1]))) if ends.size else [])
    return splits[0], splits[1]


__all__ = ["read_answers", "tokenizer_fingerprint", "write_answers"]

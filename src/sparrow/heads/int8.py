"""A head small enough to ship: per-channel int8 weights in checksummed safetensors shards with a manifest.

An int8 export is a directory holding `manifest.json` and shards `int8-00001-of-0000N.safetensors`:
* every floating-point matrix of the head (fc, the attention and MLP projections, lm_head) as int8 with one
  float32 scale per output row, symmetric: w[r, :] ~= q[r, :] * scale[r], scale[r] = max|w[r, :]| / 127 (a zero
  row gets scale 1); the scale is stored as `<name>.scale`;
* every other tensor as it is (norms in float32, d2t int64, t2d bool);
* the shards are filled in turn, a tensor cut along its rows into pieces `<name>.part<i>` where a shard ends, so
  each shard stays within `shard_bytes` (15 MB by default) and the whole within `total_bytes` (60 MB);
* each shard's safetensors metadata names the head (`head_id`) and its place (`shard`: "i/N").

`manifest.json`: {"format": "sparrow-head-int8", "version": 1, "head_id", "config" (the head's config.json record,
`sparrow.heads.layout`), "shards": [{"file", "bytes", "sha256"}], "tensors": {name: {"dtype", "shape",
"pieces": [[shard index, key], ...], "scale": [shard index, key] | null}}}. `read_int8` checks every shard against
the manifest (present, size, header, head_id, sha256) before it reads a tensor, refuses any other `.safetensors`
file in the directory, and returns the dequantized float32 tensors; `load_head` then places them in the target's
dtype. `write_int8` writes a new directory (it refuses to write into one that holds files); `replace_int8`
swaps a fresh export in for an old one (the old one stays whole until the new one is).

This module imports only torch and safetensors (the GPU recipe runs on bare machines).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from sparrow.errors import UserError

MANIFEST = "manifest.json"
FORMAT = "sparrow-head-int8"
VERSION = 1
SHARD_BYTES = 15_000_000
TOTAL_BYTES = 60_000_000


def _header_room(shard_bytes: int) -> int:
    """Bytes kept free in each shard for its safetensors header."""
    return min(64_000, shard_bytes // 8)


def is_int8_dir(directory: str | Path) -> bool:
    """Whether `directory` holds an int8 export (its manifest)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[rows, cols] float -> (int8 [rows, cols], float32 scales [rows]), symmetric per row."""
    w = weight.detach().float()
    peak = w.abs().amax(1)
    scale = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak))
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    """The float32 matrix of int8 rows `q` [rows, cols] and their scales [rows]."""
    return q.float() * scale.float()[:, None]


def _quantizable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() and tensor.ndim == 2


@dataclass(frozen=True)
class Int8Export:
    """What `write_int8` wrote."""

    directory: Path
    head_id: str
    shard_bytes: tuple[int, ...]  # file sizes

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_bytes)


def write_int8(tensors: dict[str, Tensor], config: dict[str, Any], directory: str | Path,
               shard_bytes: int = SHARD_BYTES, total_bytes: int = TOTAL_BYTES) -> Int8Export:
    """Quantize a head's dense `tensors` (its state dict) and write them with `config` (its config.json record) as
    an int8 export into `directory` (new or empty). Refuses (UserError) an export over `total_bytes`."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise UserError(f"--out {str(directory)!r} is not empty: give a new directory for the int8 export")
    stored: dict[str, Tensor] = {}
    scales: dict[str, str] = {}
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        if _quantizable(tensor):
            stored[name], stored[name + ".scale"] = quantize_rows(tensor)
            scales[name] = name + ".scale"
        else:
            stored[name] = tensor
    size = sum(t.numel() * t.element_size() for t in stored.values())
    if size > total_bytes - _header_room(total_bytes):
        raise UserError(f"the int8 head would take {size / 1e6:.1f} MB, over the {total_bytes / 1e6:.0f} MB limit: "
                        "train a smaller head (--draft-vocab, --intermediate-size)")
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name, tensor in stored.items():
        digest.update(name.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    head_id = digest.hexdigest()[:16]
    room = shard_bytes - _header_room(shard_bytes)
    shards: list[dict[str, Tensor]] = [{}]
    used = [0]
    places: dict[str, list[tuple[int, str]]] = {}
    for name, tensor in stored.items():  # each shard filled up, a tensor cut along its rows where one ends
        count = tensor.shape[0] if tensor.ndim else 1
        row_bytes = max(tensor.numel() * tensor.element_size() // max(count, 1), 1)
        start = 0
        while start < count:
            free = room - used[-1]
            take = min(count - start, free // row_bytes) if tensor.ndim else int(row_bytes <= free)
            if take == 0:
                if not shards[-1]:
                    raise UserError(f"tensor {name} has rows of {row_bytes} bytes, over a shard's {room}")
                shards.append({})
                used.append(0)
                continue
            whole = start == 0 and take == count
            key = name if whole else f"{name}.part{len(places.get(name, []))}"
            piece = tensor if whole else tensor[start : start + take]
            shards[-1][key] = piece.contiguous()
            used[-1] += take * row_bytes
            places.setdefault(name, []).append((len(shards) - 1, key))
            start += take
    directory.mkdir(parents=True, exist_ok=True)
    records = []
    for index, shard in enumerate(shards):
        file = f"int8-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        path = directory / file
        metadata = {"format": FORMAT, "head_id": head_id, "shard": f"{index + 1}/{len(shards)}"}
        save_file(shard, str(path), metadata=metadata)
        records.append({"file": file, "bytes": path.stat().st_size, "sha256": _sha256(path)})
        if records[-1]["bytes"] > shard_bytes:
            raise AssertionError(f"shard {file} is {records[-1]['bytes']} bytes, over {shard_bytes}")
    manifest = {
        "format": FORMAT, "version": VERSION, "head_id": head_id, "config": config, "shards": records,
        "tensors": {name: {"dtype": str(tensors[name].dtype).removeprefix("torch."), "shape": list(tensors[name].shape),
                           "pieces": [list(p) for p in places[name]],
                           "scale": list(places[scales[name]][0]) if name in scales else None}
                    for name in sorted(tensors)},
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    written = tuple(r["bytes"] for r in records)
    if sum(written) > total_bytes:
        raise UserError(f"the int8 head takes {sum(written) / 1e6:.1f} MB, over the {total_bytes / 1e6:.0f} MB limit")
    return Int8Export(directory, head_id, written)


def replace_int8(tensors: dict[str, Tensor], config: dict[str, Any], directory: str | Path, **limits: int
                 ) -> Int8Export:
    """`write_int8` into `directory`, replacing the export there: written beside it first, then swapped in (a
    process killed meanwhile leaves the old export whole, in `directory` or, mid-swap, in `<directory>.old`)."""
    directory = Path(directory)
    fresh, old = directory.with_name(directory.name + ".tmp"), directory.with_name(directory.name + ".old")
    for stale in (fresh, old):
        if stale.exists():
            shutil.rmtree(stale)
    export = write_int8(tensors, config, fresh, **limits)
    if directory.exists():
        os.replace(directory, old)
    os.replace(fresh, directory)
    if old.exists():
        shutil.rmtree(old)
    return Int8Export(directory, export.head_id, export.shard_bytes)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of an int8 export (UserError when missing, unreadable or of another format/version)."""
    directory = Path(directory)
    where = f"int8 head {str(directory)!r}"
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise UserError(f"{where}: no {MANIFEST}") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{where}: {MANIFEST} is not readable JSON ({error})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{where}: {MANIFEST} is not a {FORMAT} version {VERSION} manifest "
                        f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})")
    return manifest


def verify_int8(directory: str | Path) -> dict[str, Any]:
    """Check every shard of an int8 export against its manifest; returns the manifest. Refuses (UserError, one
    line) a missing, truncated, damaged or foreign shard, and any .safetensors file the manifest does not list."""
    directory = Path(directory)
    where = f"int8 head {str(directory)!r}"
    manifest = read_manifest(directory)
    listed = {r["file"] for r in manifest["shards"]}
    for path in sorted(directory.glob("*.safetensors")):
        if path.name not in listed:
            raise UserError(f"{where}: {path.name} is not in its {MANIFEST} (a shard of another export?); remove it")
    for record in manifest["shards"]:
        path = directory / record["file"]
        if not path.is_file():
            raise UserError(f"{where}: shard {record['file']} is missing")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise UserError(f"{where}: shard {record['file']} has {size} bytes, its manifest says {record['bytes']} "
                            "(truncated or damaged): copy the export again")
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
        except (OSError, SafetensorError) as error:
            raise UserError(f"{where}: shard {record['file']} is not a readable safetensors file ({error})") from None
        if metadata.get("head_id") != manifest["head_id"]:
            raise UserError(f"{where}: shard {record['file']} belongs to another head (head_id "
                            f"{metadata.get('head_id')!r}, the manifest's is {manifest['head_id']!r})")
        if _sha256(path) != record["sha256"]:
            raise UserError(f"{where}: shard {record['file']} fails its sha256 check (damaged): copy the export again")
    return manifest


def read_int8(directory: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(the head's config.json record, its tensors: matrices dequantized to float32, the rest as stored) of a
    verified int8 export."""
    directory = Path(directory)
    manifest = verify_int8(directory)
    handles = [safe_open(str(directory / r["file"]), framework="pt") for r in manifest["shards"]]

    def joined(pieces: list[list[Any]]) -> Tensor:
        parts = [handles[int(shard)].get_tensor(key) for shard, key in pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    tensors = {}
    for name, entry in manifest["tensors"].items():
        value = joined(entry["pieces"])
        if entry["scale"] is not None:
            value = dequantize_rows(value, joined([entry["scale"]]))
        if list(value.shape) != entry["shape"]:
            raise UserError(f"int8 head {str(directory)!r}: tensor {name} reads back as {tuple(value.shape)}, "
                            f"its manifest says {tuple(entry['shape'])}")
        tensors[name] = value
    return manifest["config"], tensors


__all__ = ["FORMAT", "MANIFEST", "SHARD_BYTES", "TOTAL_BYTES", "Int8Export", "dequantize_rows", "is_int8_dir",
           "quantize_rows", "read_int8", "read_manifest", "replace_int8", "verify_int8", "write_int8"]

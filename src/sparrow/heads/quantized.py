"""A head small enough to ship: int8 or int4 weights in checksummed safetensors shards with a manifest.

A quantized export is a directory holding `manifest.json` and shards `int<bits>-00001-of-0000N.safetensors`:
* every floating-point matrix of the head (fc, the attention and MLP projections, lm_head when stored) quantized,
  symmetric, its scales stored as `<name>.scale`:
  - int8 (`bits=8`): one float32 scale per output row, w[r, :] ~= q[r, :] * scale[r], scale[r] = max|w[r, :]| / 127;
  - int4 (`bits=4`): one float16 scale per group of `group` (64) inputs of a row, w[r, g] ~= q[r, g] * scale[r, g],
    scale = max|w[r, g]| / 7, q in -7..7 stored as q + 8, two to a byte (the even input in the low nibble) in a
    uint8 [rows, ceil(cols / group) * group / 2] (a last, partial group is zero-padded);
  a zero row or group gets scale 1. Symmetric: trained weights are centred on zero within a group, so a zero point
  would buy little for its bytes (+2 per group: 6 % of the int4 export) and dequantizing stays one multiply;
* every other tensor as it is (norms in float32, d2t int64, t2d bool);
* the shards are filled in turn, a tensor cut along its rows into pieces `<name>.part<i>` where a shard ends (a scale
  is never cut), so each shard stays within `shard_bytes` (15 MB) and the whole within `total_bytes` (int8: 60 MB,
  int4: 16 MB, what a device call can carry beside the tree);
* each shard's safetensors metadata names the head (`head_id`) and its place (`shard`: "i/N").

`manifest.json`: {"format": "sparrow-head-int8" | "sparrow-head-int4", "version": 1, "head_id", "config" (the
head's config.json record, `sparrow.heads.layout`), "shards": [{"file", "bytes", "sha256"}], "tensors": {name:
{"dtype", "shape", "pieces": [[shard index, key], ...], "scale": [shard index, key] | null, int4: "group"}}}.
`read_quantized` checks every shard against the manifest (present, size, header, head_id, sha256) before it reads a
tensor, refuses any other `.safetensors` file in the directory, and returns the dequantized float32 tensors;
`load_head` then places them in the target's dtype. `write_quantized` writes a new directory (it refuses to write
into one that holds files); `replace_quantized` swaps a fresh export in for an old one (the old one stays whole
until the new one is).

This module imports only torch and safetensors (the GPU recipe runs on bare machines).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from sparrow.errors import UserError
from sparrow.paths import atomic_dir

MANIFEST = "manifest.json"
VERSION = 1
FORMATS = {8: "sparrow-head-int8", 4: "sparrow-head-int4"}
SHARD_BYTES = 15_000_000
TOTAL_BYTES = {8: 60_000_000, 4: 16_000_000}
GROUP = 64


def _header_room(shard_bytes: int) -> int:
    """Bytes kept free in each shard for its safetensors header."""
    return min(64_000, shard_bytes // 8)


def _format(directory: str | Path) -> str | None:
    try:
        return json.loads((Path(directory) / MANIFEST).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def is_quantized_dir(directory: str | Path) -> bool:
    """Whether `directory` holds a quantized export (its manifest, int8 or int4)."""
    return _format(directory) in FORMATS.values()


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[rows, cols] float -> (int8 [rows, cols], float32 scales [rows]), symmetric per row."""
    w = weight.detach().float()
    peak = w.abs().amax(1)
    scale = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak))
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    """The float32 matrix of int8 rows `q` [rows, cols] and their scales [rows]."""
    return q.float() * scale.float()[:, None]


def quantize_groups(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor]:
    """[rows, cols] float -> (packed uint8 [rows, padded / 2], float16 scales [rows, padded / group]): symmetric int4
    per group of `group` inputs (see the module docstring), padded = cols rounded up to a multiple of `group`."""
    if group < 2 or group % 2:
        raise UserError(f"an int4 group must be an even number >= 2, got {group}")
    w = weight.detach().float()
    rows, cols = w.shape
    padded = -(-cols // group) * group
    grouped = torch.nn.functional.pad(w, (0, padded - cols)).view(rows, padded // group, group)
    peak = grouped.abs().amax(-1)
    scale = torch.where(peak > 0, peak / 7.0, torch.ones_like(peak)).half()  # the stored scale quantizes
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))  # a peak below float16's range
    q = (grouped / scale.float()[..., None]).round().clamp(-7, 7).to(torch.int16).view(rows, padded) + 8
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8), scale


def dequantize_groups(packed: Tensor, scale: Tensor, cols: int) -> Tensor:
    """The float32 [rows, cols] matrix of int4 groups packed by `quantize_groups`."""
    rows, groups = scale.shape
    nibbles = torch.stack([packed & 0xF, packed >> 4], -1).view(rows, groups, -1).float() - 8
    return (nibbles * scale.float()[..., None]).view(rows, -1)[:, :cols]


def _quantizable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() and tensor.ndim == 2


def _bits(bits: int) -> int:
    if bits not in FORMATS:
        raise UserError(f"a quantized head export has 8 or 4 bits, got {bits}")
    return bits


@dataclass(frozen=True)
class QuantizedExport:
    """What `write_quantized` wrote."""

    directory: Path
    head_id: str
    bits: int
    shard_bytes: tuple[int, ...]  # file sizes

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_bytes)


def stored_bytes(tensors: dict[str, Tensor], bits: int, group: int = GROUP) -> int:
    """The bytes `tensors` take quantized to `bits` (their scales included; shard headers and the manifest not),
    computed from their shapes alone."""
    total = 0
    for tensor in tensors.values():
        if not _quantizable(tensor):
            total += tensor.numel() * tensor.element_size()
        elif _bits(bits) == 8:
            total += tensor.shape[0] * (tensor.shape[1] + 4)
        else:
            groups = -(-tensor.shape[1] // group)
            total += tensor.shape[0] * groups * (group // 2 + 2)
    return total


def check_size(tensors: dict[str, Tensor], bits: int, group: int = GROUP, total_bytes: int | None = None) -> int:
    """The bytes `tensors` take quantized to `bits` (`stored_bytes`); UserError when they leave no room for the
    shards' headers within `total_bytes` (default: the limit for `bits`)."""
    total_bytes = TOTAL_BYTES[_bits(bits)] if total_bytes is None else total_bytes
    size = stored_bytes(tensors, bits, group)
    if size > total_bytes - _header_room(total_bytes):
        raise UserError(f"the int{bits} head would take {size / 1e6:.1f} MB, over the {total_bytes / 1e6:.0f} MB "
                        "limit: train a smaller head (--draft-vocab, --intermediate-size, the LM head the target's)")
    return size


def _stored(tensors: dict[str, Tensor], bits: int, group: int) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(the tensors as stored: matrices quantized, their scales beside them; matrix name -> its scale's name)."""
    stored: dict[str, Tensor] = {}
    scales: dict[str, str] = {}
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        if _quantizable(tensor):
            quantize = quantize_rows if bits == 8 else lambda w: quantize_groups(w, group)
            stored[name], stored[name + ".scale"] = quantize(tensor)
            scales[name] = name + ".scale"
        else:
            stored[name] = tensor
    return stored, scales


def _sharded(stored: dict[str, Tensor], uncut: set[str], room: int
             ) -> tuple[list[dict[str, Tensor]], dict[str, list[tuple[int, str]]]]:
    """The stored tensors laid into shards of `room` bytes each, filled in turn (a tensor not in `uncut` cut along
    its rows where a shard ends); and where each tensor's pieces lie."""
    shards: list[dict[str, Tensor]] = [{}]
    used = [0]
    places: dict[str, list[tuple[int, str]]] = {}
    for name, tensor in stored.items():
        count = tensor.shape[0] if tensor.ndim else 1
        row_bytes = max(tensor.numel() * tensor.element_size() // max(count, 1), 1)
        start = 0
        while start < count:
            free = room - used[-1]
            take = min(count - start, free // row_bytes) if tensor.ndim else int(row_bytes <= free)
            if name in uncut and take < count:  # a scale goes whole into the next shard
                if not shards[-1]:
                    raise UserError(f"tensor {name} takes {count * row_bytes} bytes, over a shard's {room}")
                take = 0
            if take == 0:
                if not shards[-1]:
                    raise UserError(f"tensor {name} has rows of {row_bytes} bytes, over a shard's {room}")
                shards.append({})
                used.append(0)
                continue
            whole = start == 0 and take == count
            key = name if whole else f"{name}.part{len(places.get(name, []))}"
            shards[-1][key] = (tensor if whole else tensor[start : start + take]).contiguous()
            used[-1] += take * row_bytes
            places.setdefault(name, []).append((len(shards) - 1, key))
            start += take
    return shards, places


def write_quantized(tensors: dict[str, Tensor], config: dict[str, Any], directory: str | Path, bits: int = 8,
                    group: int = GROUP, shard_bytes: int = SHARD_BYTES, total_bytes: int | None = None
                    ) -> QuantizedExport:
    """Quantize a head's dense `tensors` (its state dict) to `bits` (8 or 4; int4 in groups of `group` inputs) and
    write them with `config` (its config.json record) as an export into `directory` (new or empty). Refuses
    (UserError) an export over `total_bytes` (default: 60 MB int8, 16 MB int4)."""
    bits = _bits(bits)
    total_bytes = TOTAL_BYTES[bits] if total_bytes is None else total_bytes
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise UserError(f"--out {str(directory)!r} is not empty: give a new directory for the int{bits} export")
    size = check_size(tensors, bits, group, total_bytes)
    stored, scales = _stored(tensors, bits, group)
    assert sum(t.numel() * t.element_size() for t in stored.values()) == size
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name, tensor in stored.items():
        digest.update(name.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    head_id = digest.hexdigest()[:16]
    shards, places = _sharded(stored, set(scales.values()), shard_bytes - _header_room(shard_bytes))
    directory.mkdir(parents=True, exist_ok=True)
    records = []
    for index, shard in enumerate(shards):
        file = f"int{bits}-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        path = directory / file
        metadata = {"format": FORMATS[bits], "head_id": head_id, "shard": f"{index + 1}/{len(shards)}"}
        save_file(shard, str(path), metadata=metadata)
        records.append({"file": file, "bytes": path.stat().st_size, "sha256": _sha256(path)})
        if records[-1]["bytes"] > shard_bytes:
            raise AssertionError(f"shard {file} is {records[-1]['bytes']} bytes, over {shard_bytes}")

    def entry(name: str) -> dict[str, Any]:
        record = {"dtype": str(tensors[name].dtype).removeprefix("torch."), "shape": list(tensors[name].shape),
                  "pieces": [list(p) for p in places[name]],
                  "scale": list(places[scales[name]][0]) if name in scales else None}
        return {**record, "group": group} if bits == 4 and name in scales else record

    manifest = {"format": FORMATS[bits], "version": VERSION, "head_id": head_id, "config": config, "shards": records,
                "tensors": {name: entry(name) for name in sorted(tensors)}}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    written = tuple(r["bytes"] for r in records)
    if sum(written) > total_bytes:
        raise UserError(f"the int{bits} head takes {sum(written) / 1e6:.1f} MB, over the {total_bytes / 1e6:.0f} MB "
                        "limit")
    return QuantizedExport(directory, head_id, bits, written)


def replace_quantized(tensors: dict[str, Tensor], config: dict[str, Any], directory: str | Path, **options: Any
                      ) -> QuantizedExport:
    """`write_quantized` into `directory`, replacing the export there: written beside it first, then swapped in (a
    process killed meanwhile leaves the old export whole, in `directory` or, mid-swap, in `<directory>.old`)."""
    directory = Path(directory)
    with atomic_dir(directory) as fresh:
        export = write_quantized(tensors, config, fresh, **options)
    return QuantizedExport(directory, export.head_id, export.bits, export.shard_bytes)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a quantized export (UserError when missing, unreadable or of another format/version)."""
    directory = Path(directory)
    where = f"quantized head {str(directory)!r}"
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise UserError(f"{where}: no {MANIFEST}") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{where}: {MANIFEST} is not readable JSON ({error})") from None
    if manifest.get("format") not in FORMATS.values() or manifest.get("version") != VERSION:
        raise UserError(f"{where}: {MANIFEST} is not a {' or '.join(FORMATS.values())} version {VERSION} manifest "
                        f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})")
    return manifest


def verify_quantized(directory: str | Path) -> dict[str, Any]:
    """Check every shard of a quantized export against its manifest; returns the manifest. Refuses (UserError, one
    line) a missing, truncated, damaged or foreign shard, and any .safetensors file the manifest does not list."""
    directory = Path(directory)
    where = f"quantized head {str(directory)!r}"
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


def read_quantized(directory: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(the head's config.json record, its tensors: matrices dequantized to float32, the rest as stored) of a
    verified quantized export."""
    directory = Path(directory)
    manifest = verify_quantized(directory)
    handles = [safe_open(str(directory / r["file"]), framework="pt") for r in manifest["shards"]]

    def joined(pieces: list[list[Any]]) -> Tensor:
        parts = [handles[int(shard)].get_tensor(key) for shard, key in pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    tensors = {}
    for name, entry in manifest["tensors"].items():
        value = joined(entry["pieces"])
        if entry["scale"] is not None:
            scale = joined([entry["scale"]])
            if "group" in entry:
                value = dequantize_groups(value, scale, int(entry["shape"][-1]))
            else:
                value = dequantize_rows(value, scale)
        if list(value.shape) != entry["shape"]:
            raise UserError(f"quantized head {str(directory)!r}: tensor {name} reads back as {tuple(value.shape)}, "
                            f"its manifest says {tuple(entry['shape'])}")
        tensors[name] = value
    return manifest["config"], tensors


__all__ = ["FORMATS", "GROUP", "MANIFEST", "SHARD_BYTES", "TOTAL_BYTES", "QuantizedExport", "check_size",
           "dequantize_groups", "dequantize_rows", "is_quantized_dir", "quantize_groups", "quantize_rows",
           "read_manifest", "read_quantized", "replace_quantized", "stored_bytes", "verify_quantized",
           "write_quantized"]

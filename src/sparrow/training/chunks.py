"""A large file carried to a bare machine in pieces: numbered chunks and a checksum list, joined and verified there.

`split_file` streams one file (or the concatenation of several parts: a multi-part preset's GGUF) into
`<name>.part-01`, `<name>.part-02`, ... of at most `chunk_bytes` each, and writes `SHA256SUMS` beside them: one
line per chunk and a last line for the whole file (`sha256sum -c` reads it). `join_chunks` checks each chunk
against the list (one clear UserError for a missing, short or damaged chunk) and writes the whole file, whose
sha256 it checks too. Only the standard library is used.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from sparrow.errors import UserError

SUMS = "SHA256SUMS"
CHUNK_BYTES = 56 * 1024 * 1024  # with the ~5 MiB working tree, under the 64 MiB a device call carries
_BLOCK = 1 << 22


def split_file(parts: Sequence[str | Path], name: str, directory: str | Path, chunk_bytes: int = CHUNK_BYTES,
               expected_sha256: str | None = None) -> list[Path]:
    """Cut the concatenation of `parts` into chunks `directory/<name>.part-NN`; returns their paths. Refuses
    (UserError) a whole whose sha256 is not `expected_sha256` (when given); chunks of an earlier split are
    replaced."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{name}.part-*"):
        stale.unlink()
    whole = hashlib.sha256()
    chunks: list[tuple[Path, str, int]] = []
    out, digest, size = None, None, 0

    def close() -> None:
        if out is not None:
            out.close()
            chunks.append((Path(out.name), digest.hexdigest(), size))

    for part in parts:
        with open(part, "rb") as source:
            while block := source.read(_BLOCK):
                view = memoryview(block)
                while view:
                    if out is None or size == chunk_bytes:
                        close()
                        out = open(directory / f"{name}.part-{len(chunks) + 1:02d}", "wb")  # noqa: SIM115
                        digest, size = hashlib.sha256(), 0
                    piece = view[: chunk_bytes - size]
                    out.write(piece)
                    digest.update(piece)
                    whole.update(piece)
                    size += len(piece)
                    view = view[len(piece):]
    close()
    if expected_sha256 is not None and whole.hexdigest() != expected_sha256:
        raise UserError(f"{name}: the parts join to sha256 {whole.hexdigest()}, not the expected {expected_sha256}")
    lines = [f"{d}  {p.name}" for p, d, _ in chunks] + [f"{whole.hexdigest()}  {name}"]
    (directory / SUMS).write_text("\n".join(lines) + "\n")
    return [p for p, _, _ in chunks]


def _read_sums(directory: Path) -> list[tuple[str, str]]:
    path = directory / SUMS
    if not path.is_file():
        raise UserError(f"{str(directory)!r} has no {SUMS} (run the prepare step and carry it over)")
    rows = [line.split(maxsplit=1) for line in path.read_text().splitlines() if line.strip()]
    if not rows or any(len(r) != 2 for r in rows):
        raise UserError(f"{path} is not a sha256sum list")
    return [(digest, file.strip()) for digest, file in rows]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def join_chunks(directory: str | Path, out: str | Path | None = None) -> Path:
    """The whole file of the chunks in `directory` (its SHA256SUMS: chunks first, the whole last), written to
    `out` (default: directory/<name>) and verified; a whole already there with the right sha256 is kept."""
    directory = Path(directory)
    rows = _read_sums(directory)
    *chunk_rows, (whole_digest, name) = rows
    target = Path(out) if out is not None else directory / name
    if target.is_file() and _sha256(target) == whole_digest:
        return target
    for digest, file in chunk_rows:
        path = directory / file
        if not path.is_file():
            raise UserError(f"chunk {file} is missing from {str(directory)!r}: carry it over")
        if _sha256(path) != digest:
            raise UserError(f"chunk {file} in {str(directory)!r} fails its sha256 check: carry it over again")
    partial = target.with_name(target.name + ".partial")
    whole = hashlib.sha256()
    with partial.open("wb") as sink:
        for _, file in chunk_rows:
            with (directory / file).open("rb") as source:
                while block := source.read(_BLOCK):
                    sink.write(block)
                    whole.update(block)
    if whole.hexdigest() != whole_digest:
        partial.unlink()
        raise UserError(f"the chunks in {str(directory)!r} join to sha256 {whole.hexdigest()}, not {whole_digest}")
    os.replace(partial, target)
    return target


__all__ = ["CHUNK_BYTES", "SUMS", "join_chunks", "split_file"]

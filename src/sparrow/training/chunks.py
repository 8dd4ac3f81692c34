"""A large file carried to a bare machine in pieces: numbered chunks and a checksum list, joined and verified there.

`split_file` streams one file (or the concatenation of several parts: a multi-part preset's GGUF) into
`<name>.part-01`, `<name>.part-02`, ... of at most `chunk_bytes` each, and writes `SHA256SUMS` beside them: one
line per chunk and a last line for the whole file (`sha256sum -c` reads it). `join_chunks` checks each chunk
against the list (one clear UserError for a missing, short or damaged chunk) and writes the whole file, whose
sha256 it checks too. `chunk_bytes_beside` sizes the chunks so that one chunk and the working tree (which travels
with every device call, a shipped head included) fit the 64 MiB a call carries. Only the standard library is used.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from sparrow.errors import UserError

SUMS = "SHA256SUMS"
CARRY_BYTES = 64 * 1024 * 1024  # what one device call carries: the working tree and its carried paths
MARGIN_BYTES = 2 * 1024 * 1024  # room for the tree to grow between `prepare` and the calls
CHUNK_BYTES = 40 * 1024 * 1024  # when the tree's size is unknown: a ~8 MiB tree plus a 15 MiB shipped head
_BLOCK = 1 << 22


def chunk_bytes_beside(tree_bytes: int) -> int:
    """The largest whole-MiB chunk that fits one device call beside a working tree of `tree_bytes` (and a 2 MiB
    margin); UserError when under 8 MiB are left."""
    room = (CARRY_BYTES - MARGIN_BYTES - tree_bytes) // (1 << 20) * (1 << 20)
    if room < 8 << 20:
        raise UserError(f"the working tree takes {tree_bytes / 2**20:.1f} MiB of the {CARRY_BYTES >> 20} MiB a device "
                        "call carries: too little is left for GGUF chunks")
    return room


def tree_bytes(root: str | Path = ".") -> int | None:
    """The bytes of the files git tracks or would add under `root` (what a device call copies), or None outside a
    git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = [Path(root) / name for name in listed.decode().split("\0") if name]
    return sum(p.stat().st_size for p in paths if p.is_file())


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


__all__ = ["CHUNK_BYTES", "SUMS", "chunk_bytes_beside", "join_chunks", "split_file", "tree_bytes"]

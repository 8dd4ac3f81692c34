"""The on-disk model cache: entries built once, committed atomically, verified before they are used.

An entry is a directory ``<dir>/<key>/`` holding its files and ``manifest.json`` (what it was built
for, and every file's size and checksum). The protocol, for any number of processes:

* Build: a writer takes ``flock`` on ``<dir>/.<key>.lock`` (a second builder waits, then reuses what
  the first built), writes into ``<dir>/.<key>.<pid>.tmp/``, fsyncs every file, writes the manifest,
  fsyncs the directory, renames it to ``<key>`` (a damaged entry is first renamed aside to
  ``.<key>.<pid>.old``) and fsyncs ``<dir>``. A reader sees no entry or a complete one, also after
  SIGKILL or a power cut: a half-written entry is never reused.
* Read: sizes are checked on every open; the checksums whenever the files' identity (device, inode,
  size, mtime, ctime) or the boot differs from what the last full check recorded in ``.verified``
  (any write to a file changes its ctime, which no process can set back). An entry that fails is
  rebuilt, with a message, and never loaded.
* Clean up: temporaries of dead writers (the entry's lock free, and the pid gone or the temporary
  older than ``STALE_AFTER_S``) are removed on every open.
* A cache directory that cannot be written (read-only, full) is reported and the caller builds in
  memory instead.

Checksum: SHA-256 of the SHA-256 digests of the file's ``CHUNK_BYTES`` chunks, so chunks hash in
parallel threads (hashlib releases the GIL); ~1.5 GB/s per core with SHA-NI.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import mmap
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sparrow.paths import atomic_file, fsync, remove

try:
    import fcntl
except ImportError:  # no flock (Windows): atomic renames still keep readers safe
    fcntl = None

Reporter = Callable[[str], None]

FORMAT = 1  # bump when the manifest's layout changes
MANIFEST = "manifest.json"
STAMP = ".verified"  # identity of the files when their checksums last matched (an optimisation only)
CHUNK_BYTES = 64 << 20
STALE_AFTER_S = 6 * 3600  # a temporary this old is removed even if its pid runs (pids are reused)
_TEMP = re.compile(r"^\.(?P<key>.+)\.(?P<pid>\d+)\.(?:tmp|old)$")

_verified: set[tuple] = set()  # (entry, identity) whose checksums matched in this process
_failed: dict[tuple, str] = {}  # (entry, identity) -> why its checksums did not match


@dataclass(frozen=True)
class Status:
    """What a cheap look (manifest and sizes, no checksums) says about an entry."""

    state: str  # "complete", "damaged" or "missing"
    reason: str = ""  # why it is damaged


def _read_manifest(entry: Path) -> dict | None:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)
    return manifest if ok else None


def _check_sizes(entry: Path, manifest: dict) -> str | None:
    for name, record in manifest["files"].items():
        try:
            size = (entry / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != record.get("bytes"):
            return f"{name} has {size} bytes, expected {record.get('bytes')} (truncated or overwritten)"
    return None


def status(entry: Path) -> Status:
    """Whether ``entry`` is complete, by its manifest and file sizes only (cheap: no checksums)."""
    if not entry.exists():
        return Status("missing")
    manifest = _read_manifest(entry)
    if manifest is None:
        return Status("damaged", "no readable manifest (half-written, or written by an older sparrow)")
    problem = _check_sizes(entry, manifest)
    return Status("damaged", problem) if problem else Status("complete")


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _identity(entry: Path, names: list[str]) -> tuple:
    """What changes whenever any of the files is written or replaced, or the machine reboots."""
    stats = [(name, (entry / name).stat()) for name in names]
    return (_boot_id(), *((n, s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for n, s in stats))


def _chunk_digest(path: Path, offset: int, length: int) -> bytes:
    if length == 0:
        return hashlib.sha256(b"").digest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), length, offset=offset, access=mmap.ACCESS_READ) as m:
        return hashlib.sha256(m).digest()


def checksums(paths: list[Path]) -> list[str]:
    """One hex checksum per file: sha256 of its CHUNK_BYTES chunks' sha256 digests (chunks in parallel)."""
    jobs = [(i, path, offset, min(CHUNK_BYTES, size - offset))
            for i, path in enumerate(paths) for size in [path.stat().st_size]
            for offset in range(0, max(size, 1), CHUNK_BYTES)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(1, min(len(jobs), cores, 8))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda job: _chunk_digest(*job[1:]), jobs))
    files = [hashlib.sha256() for _ in paths]
    for (i, *_), digest in zip(jobs, digests):
        files[i].update(digest)
    return [h.hexdigest() for h in files]


def verify(entry: Path, meta: Mapping[str, str], say: Reporter | None = None) -> str | None:
    """None when ``entry`` is complete, built for ``meta`` and its checksums match; else why not.

    The checksums are computed only when the files changed (or the machine rebooted) since they last
    matched; ``say`` is told when that happens (it takes ~1 s per 1.5 GB and core)."""
    if not entry.exists():
        return "missing"
    manifest = _read_manifest(entry)
    if manifest is None:
        return "damaged: no readable manifest (half-written, or written by an older sparrow)"
    built = manifest.get("meta") if isinstance(manifest.get("meta"), dict) else {}
    if built != dict(meta):
        differ = [f"{k}={built.get(k)!r}, needed {v!r}" for k, v in meta.items() if built.get(k) != v]
        return f"stale: built for {'; '.join(differ) or built}"
    if problem := _check_sizes(entry, manifest):
        return f"damaged: {problem}"
    names = sorted(manifest["files"])
    try:
        key = (str(entry), _identity(entry, [*names, MANIFEST]))
        if key in _verified or _read_stamp(entry) == _stamp_form(key[1]):
            return None
        if key not in _failed:
            if say is not None:
                say(f"verifying the checksums of {entry} (once after any change) …")
            sums = checksums([entry / name for name in names])
            bad = [n for n, s in zip(names, sums) if s != manifest["files"][n].get("sha256")]
            if not bad:
                _verified.add(key)
                _write_stamp(entry, key[1])
                return None
            _failed[key] = f"damaged: checksum mismatch in {', '.join(bad)}"
    except (OSError, ValueError) as exc:  # a file vanished, shrank or cannot be read (EIO)
        return f"damaged: {' '.join(str(exc).split())}"
    return _failed[key]


def _stamp_form(identity: tuple) -> list:
    return json.loads(json.dumps(identity))  # tuples as lists, as read back from the file


def _read_stamp(entry: Path) -> object:
    try:
        return json.loads((entry / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(entry: Path, identity: tuple) -> None:
    """Best effort, not atomic: a torn stamp does not parse, and only costs one more full check."""
    with contextlib.suppress(OSError):
        (entry / STAMP).write_text(json.dumps(identity))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def sweep(parent: Path) -> None:
    """Remove temporaries of dead writers in ``parent``: the entry's lock is free (so no writer of it
    runs) and the pid in the name is gone or the temporary older than STALE_AFTER_S. Best effort."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = _TEMP.match(name)
        if match is None or int(match["pid"]) == os.getpid():
            continue
        path = parent / name
        with contextlib.suppress(OSError):
            stale = not _pid_alive(int(match["pid"])) or time.time() - path.lstat().st_mtime > STALE_AFTER_S
            if stale:
                with _try_lock(parent / f".{match['key']}.lock") as free:
                    if free:
                        remove(path)


@contextlib.contextmanager
def _try_lock(lock_path: Path) -> Iterator[bool]:
    """Hold the lock if it is free (True), else False; a missing lock file is free (writers never delete it)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        yield True
        return
    try:
        free = True
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                free = False
        yield free
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _lock(entry: Path, say: Reporter) -> Iterator[None]:
    """Exclusive right to build ``entry``; waits (with a message) while another process builds it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(entry.parent / f".{entry.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(f"waiting for another process to finish building {entry} …")
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _reason(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(text.split())


class Slot:
    """What ``open_entry`` yields: a verified entry to load (``ready``), or the right to build one."""

    def __init__(self, path: Path, meta: Mapping[str, str], say: Reporter, ready: bool, writable: bool) -> None:
        self.path, self.meta, self.say = path, dict(meta), say
        self.ready = ready  # a verified entry is at `path`: load it
        self.writable = writable  # not ready, and this process holds the lock: build, then `commit`

    def commit(self, save: Callable[[Path], None]) -> bool:
        """``save(directory)`` writes the entry's files; they are checksummed, synced and renamed into
        place. False (with a message) when that fails: the caller keeps what it built in memory."""
        if not self.writable:
            return False
        parent, key = self.path.parent, self.path.name
        tmp, old = parent / f".{key}.{os.getpid()}.tmp", parent / f".{key}.{os.getpid()}.old"
        remove(tmp)
        try:
            tmp.mkdir()
            save(tmp)
            _write_manifest(tmp, self.meta)
            _replace(tmp, self.path, old)
        except Exception as exc:  # noqa: BLE001 - OSError, or safetensors' / tokenizers' own I/O errors (a full disk)
            self.say(f"could not write the cache entry {self.path} ({_reason(exc)}); continuing without caching it")
            return False
        finally:
            remove(tmp)
            remove(old)
        self.ready, self.writable = True, False
        return True


def _write_manifest(tmp: Path, meta: Mapping[str, str]) -> None:
    """Fsync the files, then write the manifest (and the stamp: the files were just checksummed)."""
    names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name not in (MANIFEST, STAMP))
    for name in names:
        fsync(tmp / name)
    sums = checksums([tmp / name for name in names])
    files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": s} for name, s in zip(names, sums)}
    manifest = {"format": FORMAT, "checksum": f"sha256 of the sha256 digests of {CHUNK_BYTES}-byte chunks",
                "meta": dict(meta), "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _write_stamp(tmp, _identity(tmp, [*names, MANIFEST]))  # renaming the directory keeps the files' identity
    fsync(tmp)


def _replace(tmp: Path, entry: Path, old: Path) -> None:
    """Rename the complete ``tmp`` to ``entry`` (an existing, damaged entry renamed aside first)."""
    if entry.exists() or entry.is_symlink():
        os.rename(entry, old)
    os.rename(tmp, entry)
    fsync(entry.parent)


def file_identity(path: Path) -> list:
    """What changes whenever the file at ``path`` is written or replaced, or the machine reboots (as JSON
    reads it back): a record of a file's checksum holds while its identity is unchanged."""
    return _stamp_form(_identity(path.parent, [path.name]))


@contextlib.contextmanager
def open_entry(entry: Path, meta: Mapping[str, str], say: Reporter) -> Iterator[Slot]:
    """A verified ``entry`` to load, or (missing or damaged) the lock to build it, held until the block ends.

    A cache directory that cannot be written gives a Slot that is neither ready nor writable: the
    caller builds in memory, after a clear message, with no exception.
    """
    sweep(entry.parent)
    problem = verify(entry, meta, say)
    if problem is None:
        yield Slot(entry, meta, say, ready=True, writable=False)
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_lock(entry, say))
        except OSError as exc:
            unwritable = _reason(exc)
        else:
            unwritable = None
            problem = verify(entry, meta, say)  # another process may have built it while this one waited
        if problem not in (None, "missing"):
            say(f"cache entry {entry} is {problem}" + ("" if unwritable else ": rebuilding it"))
        if unwritable:
            say(f"cache directory {entry.parent} is not writable ({unwritable}): building in memory, not caching")
        yield Slot(entry, meta, say, ready=problem is None, writable=problem is not None and not unwritable)


__all__ = ["CHUNK_BYTES", "FORMAT", "MANIFEST", "Slot", "Status", "atomic_file", "checksums", "file_identity",
           "open_entry", "status", "sweep", "verify"]

"""Where sparrow keeps its files, and how it writes one so that readers never see half of it."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def default_cache_dir() -> Path:
    """``$SPARROW_CACHE`` if set, else ``~/.cache/sparrow``."""
    env = os.environ.get("SPARROW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparrow"


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()



@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; when the block ends without an exception it is fsynced
    and renamed over ``path`` (readers see the old file or the whole new one, also after a power cut),
    else removed. Its name is the one ``sweep`` removes once this process is gone."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    remove(tmp)
    try:
        yield tmp
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    finally:
        remove(tmp)



@contextlib.contextmanager
def atomic_dir(directory: Path) -> Iterator[Path]:
    """A fresh directory beside ``directory`` (``<name>.tmp``) to write; when the block ends without an exception
    it replaces ``directory`` whole (a process killed meanwhile leaves the old one, in ``directory`` or, mid-swap,
    in ``<name>.old``)."""
    fresh, old = directory.with_name(directory.name + ".tmp"), directory.with_name(directory.name + ".old")
    for stale in (fresh, old):
        remove(stale)
    yield fresh
    if directory.exists():
        os.replace(directory, old)
    os.replace(fresh, directory)
    remove(old)

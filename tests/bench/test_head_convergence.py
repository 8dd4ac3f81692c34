"""benchmarks/head_convergence.py's CPU dry run: every variant trains and is evaluated on a tiny random target, and
the rows (gzip, no name or time) and the table come out, so the study cannot break unnoticed (issue #42)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import CORPUS, tiny_model, tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "head_convergence.py"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("head_convergence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["head_convergence"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("convergence")
    tiny_model("llama", seed=0).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    (root / "data").mkdir()
    for i in range(24):
        (root / "data" / f"m{i}.py").write_text("\n".join(CORPUS[(i + j) % len(CORPUS)] for j in range(12)))
    return root


def test_the_study_runs_every_variant_on_a_tiny_target_and_writes_rows_and_a_table(study, files, tmp_path):
    out = tmp_path / "convergence-test"
    argv = ["--target", str(files / "target"), "--data", str(files / "data"), "--out", str(out), "--tokens", "1200",
            "--held-out-tokens", "200", "--seq-len", "32", "--distill", "2", "--distill-tokens", "8",
            "--draft-vocab", "100", "--steps", "2", "--eval-sequences", "3", "--eval-depth", "4",
            "--cache", str(tmp_path / "cache")]
    assert study.main(argv) == 0
    packed = (out.parent / f"{out.name}.jsonl.gz").read_bytes()
    assert packed[4:8] == b"\0\0\0\0" and packed[3] & 0x08 == 0  # gzip -9n: no time, no name
    rows = [json.loads(line) for line in gzip.decompress(packed).decode().splitlines()]
    names = [r["variant"] for r in rows]
    assert names[:4] == ["baseline seed 0", "baseline seed 1", "init: + last layer", "Muon"]
    assert len(names) == len(set(names)) == 15
    assert {r["axis"] for r in rows} == {"baseline", "init", "ttt", "decay", "optimizer", "lr", "batch"}
    for r in rows:
        assert len(r["agreement"]) == 4 and all(0 <= a <= 1 for a in r["agreement"])
        assert r["expected_tokens"] >= r["expected_tokens_3"] >= 1 and r["positions_per_second"] > 0
        assert r["machine"]["threads"] == 1 and r["machine"]["flags"] is not None
    batch = next(r for r in rows if r["axis"] == "batch")
    base = rows[0]
    assert batch["steps"] == 1 and base["steps"] == 2  # the same positions: half the steps at twice the batch
    assert rows[0]["setup"]["command"].startswith("python benchmarks/head_convergence.py --target")
    table = (out.parent / f"{out.name}.md").read_text()
    assert table.count("\n| ") == 1 + 15 and "| baseline seed 1 |" in table and "CPU: " in table
    assert study.render(study.read(out.parent / f"{out.name}.jsonl.gz")) == table


def test_the_study_runs_the_variants_asked_for(study, files, tmp_path):
    out = tmp_path / "some"
    argv = ["--target", str(files / "target"), "--data", str(files / "data"), "--out", str(out), "--tokens", "600",
            "--held-out-tokens", "200", "--seq-len", "32", "--distill", "0", "--draft-vocab", "100", "--steps", "1",
            "--eval-sequences", "2", "--eval-depth", "2", "--seeds", "1", "--cache", str(tmp_path / "cache")]
    import torch.optim._muon as muon

    original = muon._zeropower_via_newtonschulz
    assert study.main([*argv, "--variants", "ttt,Muon"]) == 0
    assert muon._zeropower_via_newtonschulz is original  # float32 orthogonalisation only inside the study
    rows = study.read(out.parent / f"{out.name}.jsonl.gz")
    assert [r["variant"] for r in rows] == ["Muon", "TTT 1", "TTT 5"]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the features, kept for a rerun
    assert study.main([*argv, "--variants", "ttt,decay", "--resume"]) == 0  # the variants it lacks, features reused
    rows = study.read(out.parent / f"{out.name}.jsonl.gz")
    assert [r["variant"] for r in rows] == ["Muon", "TTT 1", "TTT 5", "decay 1.0", "decay 0.6"]
    assert rows[-1]["setup"]["feature_seconds"] < rows[0]["setup"]["feature_seconds"] + 1
    assert study.cpu_slug().split("-")[-1] in ("amxtile", "avx512f", "avx2", "sve", "asimd", "x8664", "aarch64")

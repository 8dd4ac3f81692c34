"""benchmarks/gpu_run.py's CPU dry run: the GPU run's one command, on a tiny target and draft, with the packages a
bare device machine lacks made unimportable, brings back every file it promises (issue #41)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import perturbed, tiny_model, tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_run.py"
BARE = ("typer", "rich", "av", "accelerate", "PIL", "torchvision", "sentencepiece", "fastapi", "uvicorn",
        "matplotlib", "prometheus_client", "ray", "openai")
"""What the device machine does not have (it has torch, transformers, safetensors, numpy)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu_run")
    target = tiny_model("llama", seed=0)
    for name, model in (("target", target), ("draft", perturbed(target, 0.05, seed=1))):
        model.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return root


def dry_run(models: Path, out: Path, *extra: str, bare: bool = True) -> subprocess.CompletedProcess:
    argv = ["run", "--device", "cpu", "--target", str(models / "target"), "--draft", str(models / "draft"),
            "--out", str(out), "--work", str(out.parent / "work"), "--dtype", "float32", "--no-chat",
            "--sets", "spec-bench-quick", "--prompts-per-set", "2", "--max-new-tokens", "12", "--lossless-prompts",
            "1", "--lossless-tokens", "16", "--budget", "240", *extra]
    blocked = f"import sys\nfor name in {BARE!r}:\n    sys.modules[name] = None\n" if bare else "import sys\n"
    code = blocked + f"sys.path.insert(0, {str(SCRIPT.parent)!r})\nimport gpu_run\nsys.exit(gpu_run.main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=600)


def test_the_dry_run_on_a_bare_machine_writes_every_stage_and_skips_the_server_saying_why(models, tmp_path):
    out = tmp_path / "out"
    done = dry_run(models, out, "--methods", "hf-plain,hf-assisted,hf-prompt-lookup,plain,draft-model,"
                   "prompt-lookup,suffix,eagle,auto", "--lossless", "draft-model,prompt-lookup,suffix")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["batch1.jsonl", "cuda_tests.txt", "lossless.jsonl", "profile.txt", "report.md"]
    assert len(files) <= 8  # what one device call brings back
    assert "skipped" in (out / "cuda_tests.txt").read_text()  # no CUDA device here: the tests skip, and say so
    lossless = [json.loads(line) for line in (out / "lossless.jsonl").read_text().splitlines()]
    assert [r["drafter"] for r in lossless] == ["draft-model", "prompt-lookup", "suffix"]
    assert all(r["lossless"] and r["identical"] == 1 and r["accepted_tokens"] > 0 for r in lossless)
    rows = [json.loads(line) for line in (out / "batch1.jsonl").read_text().splitlines()]
    methods = {r["method"] for r in rows}
    assert methods == {"hf-plain", "hf-assisted", "hf-prompt-lookup", "plain", "draft-model", "prompt-lookup",
                       "suffix", "auto"}  # eagle: no head for a directory target, said in the report
    assert len(rows) == 2 * len(methods)
    assert all(r["identical_to_plain"] for r in rows if not r["method"].startswith("hf-"))
    assert all(r["identical_to_baseline"] for r in rows if r["method"].startswith("hf-"))  # float32: exact too
    report = (out / "report.md").read_text()
    assert "no head" in report and "packages missing" in report and "| spec-bench-quick | draft-model |" in report
    profile = (out / "profile.txt").read_text()
    summary = json.loads(profile.splitlines()[0])
    assert summary["rounds"] > 0 and summary["host_syncs_per_round"] >= 0 and "Self CPU" in profile


def test_a_stage_that_fails_is_reported_and_the_run_goes_on(models, tmp_path):
    out = tmp_path / "out"
    done = dry_run(models, out, "--stages", "lossless,profile", "--lossless", "no-such-drafter")
    assert done.returncode == 0, done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "unknown drafter 'no-such-drafter'" in report and '"rounds"' in report  # profile still ran


def test_the_server_stage_runs_the_load_test_when_its_packages_are_there(models, tmp_path):
    out = tmp_path / "out"
    done = dry_run(models, out, "--stages", "server", "--streams", "1,2", "--server-requests", "2",
                   "--server-tokens", "8", bare=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "load_test.jsonl").read_text().splitlines()]
    ok = [r for r in rows if "concurrency" in r]
    assert {(r["config"], r["concurrency"]) for r in ok} == {("speculative", 1), ("speculative", 2), ("plain", 1),
                                                              ("plain", 2)}
    assert all(r["failed"] == 0 and r["ok"] == 2 for r in ok)


def test_the_plan_carries_every_chunk_once_within_a_calls_room_and_runs_last(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_run

    root = tmp_path / ".gpu"
    sizes = {"wheels/a-1.0-py3-none-any.whl": 30, "prompts/humaneval.jsonl": 1, "target/SHA256SUMS": 1,
             "draft/SHA256SUMS": 1, **{f"target/t.gguf.part-0{i}": 50 for i in range(1, 5)},
             "target/t.gguf.part-05": 9, "draft/d.gguf.part-01": 50, "draft/d.gguf.part-02": 20}
    for name, mib in sizes.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"\0" * mib * 2**18)  # a quarter of the MiB count: fits the real room / 4
    from sparrow.training import chunks

    monkeypatch.setattr(chunks, "CARRY_BYTES", 17 * 2**20 + chunks.tree_bytes(SCRIPT.parents[1]))
    assert gpu_run.main(["plan", "--dir", str(root)]) == 0
    calls = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    carried = [p for c in calls for p in c["carry"]]
    chunks = sorted(str(p) for p in root.glob("*/*.part-*"))
    assert sorted(p for p in carried if ".part-" in p) == chunks  # each once
    assert all(len(c["carry"]) <= 8 for c in calls)
    for call in calls:  # each call's carry within the room (2 MiB of margin are kept)
        size = sum(f.stat().st_size for p in call["carry"] for f in ([Path(p)] if Path(p).is_file()
                                                                      else Path(p).iterdir()))
        assert size <= 15 * 2**20
    assert "install" in calls[0]["command"] and str(root / "wheels") in calls[0]["carry"]
    assert "gpu_run.py run" in calls[-1]["command"] and len(calls) == 6  # 4 x 12.5 MiB alone; 5 + 2 ride along


def test_wheel_names_and_versions():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_run

    assert gpu_run.wheel_name(Path("typing_extensions-4.16.0-py3-none-any.whl")) == ("typing-extensions", "4.16.0")
    assert gpu_run.version_key("5.24.0") > gpu_run.version_key("5.17.0") > gpu_run.version_key("4.57.6")

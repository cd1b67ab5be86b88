"""`upstream-tests`: config checks, sdist extraction, and a whole run on a synthetic sdist whose
tests run against a fake `vllm` installed in a throw-away venv."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import site
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from hdtest import SCRIPTS  # noqa: F401  (puts scripts/ on sys.path)

from hdtool import upstream_tests
from hdtool.pin import HdError, Pin

PYPROJECT = b"""
[project]
name = "vllm"

[tool.pytest.ini_options]
markers = ["slow_test", "cpu_test: mark test as CPU-only test"]
"""

TESTS = {
    "tests/__init__.py": b"",
    "tests/conftest.py": b"import vllm\n",
    "tests/test_ok.py": b"def test_one():\n    assert 1\n\n\ndef test_two():\n    assert 2\n",
    "tests/test_mixed.py": (
        b"import pytest\n\n\ndef test_good():\n    assert True\n\n\n"
        b"@pytest.mark.parametrize('x', [1, 2, 3])\ndef test_param(x):\n    assert x != 3\n"
    ),
    "tests/test_hub.py": b"def test_needs_hub():\n    raise OSError('no hub')\n",
    "tests/sub/test_deep.py": b"def test_deep():\n    pass\n",
}

CONFIG = """
extract: [tests]
cpu:
  account_all: true
  min_passed: 4
  timeout: 60
  env: {CUDA_VISIBLE_DEVICES: ""}
  include: [tests/test_ok.py, tests/test_mixed.py, tests/sub]
  exclude:
    - path: tests/test_mixed.py::test_param
      k: "3"
      reason: the third case fails on purpose
    - path: tests/test_hub.py
      reason: needs the HF hub
"""


def _sdist(dest: Path, files: dict[str, bytes]) -> Path:
    path = dest / "vllm-0.1.0.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for rel, data in files.items():
            info = tarfile.TarInfo(f"vllm-0.1.0/{rel}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def pin(tmp_path: Path) -> Pin:
    root = tmp_path / "proj"
    cache = root / ".cache" / "upstream"
    cache.mkdir(parents=True)
    files = {
        **TESTS,
        "pyproject.toml": PYPROJECT,
        "vllm/__init__.py": b"raise ImportError('the sdist vllm must never be imported')\n",
    }
    sdist = _sdist(cache, files)
    (root / "ci").mkdir()
    (root / "ci" / "upstream_tests.yaml").write_text(CONFIG)
    return Pin(
        root=root,
        patchset_version="0.0.1",
        local_label="hd.1",
        upstream_name="vllm",
        upstream_version="0.1.0",
        sdist=sdist.name,
        sdist_sha256=hashlib.sha256(sdist.read_bytes()).hexdigest(),
        wheel="unused.whl",
        wheel_sha256="0" * 64,
        torch="2.11.0",
        cutlass_dsl="4.6.0",
        kernels_dest="vllm/x",
        build_info_module="vllm/_hopper_decode_build.py",
    )


@pytest.fixture(scope="module")
def fake_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with a fake installed vllm; pytest and pytest-timeout come from this one."""
    return _make_fake_venv(tmp_path_factory.mktemp("venv") / "v", installed=True)


def _make_fake_venv(venv: Path, installed: bool) -> Path:
    """A venv whose site-packages holds a fake vllm package, with the dist-info pip writes
    when ``installed`` (without it, a copied source tree)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    package = Path(purelib) / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0.1.0+hd.1"\n')
    (package / "_hopper_decode_build.py").write_text('FINGERPRINT = "ab" * 32\n')
    if installed:
        dist_info = Path(purelib) / "vllm-0.1.0+hd.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: vllm\nVersion: 0.1.0+hd.1\n"
        )
        (dist_info / "RECORD").write_text("vllm/__init__.py,,\n")
    (Path(purelib) / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _args(**kw: object) -> argparse.Namespace:
    base = dict(
        python=None,
        subset="cpu",
        config=None,
        timeout=None,
        session_timeout=None,
        list=False,
        pytest_arg=None,
        extracted=False,
        only=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_every_exclusion_needs_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cpu:\n  include: [tests/a.py]\n  exclude:\n    - path: tests/a.py\n")
    with pytest.raises(HdError, match="needs a reason"):
        upstream_tests.load_config(path)


def test_paths_outside_tests_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cpu:\n  include: [vllm/model.py]\n")
    with pytest.raises(HdError, match="inside tests/"):
        upstream_tests.load_config(path)
    path.write_text("cpu:\n  include: [tests/a.py]\n  mins_passed: 3\n")
    with pytest.raises(HdError, match="unknown keys"):
        upstream_tests.load_config(path)
    path.write_text("extract: [tests, vllm]\ncpu:\n  include: [tests/a.py]\n")
    with pytest.raises(HdError, match="never the vllm/ package"):
        upstream_tests.load_config(path)


def test_paths_list_shares_one_reason(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "cpu:\n  include: [tests]\n  exclude:\n"
        "    - paths: [tests/a.py, tests/b]\n      reason: needs a CUDA GPU\n"
    )
    subset = upstream_tests.load_config(path).subsets["cpu"]
    assert [(e.path, e.reason, e.ignores_path) for e in subset.exclude] == [
        ("tests/a.py", "needs a CUDA GPU", True),
        ("tests/b", "needs a CUDA GPU", True),
    ]


def test_sha256_mismatch_unpacks_nothing(pin: Pin) -> None:
    bad = replace(pin, sdist_sha256="f" * 64)
    dest = pin.root / "build" / "upstream-tests"
    with pytest.raises(HdError, match="does not match the pin"):
        upstream_tests.extract_tests(bad, ["tests"], dest)
    assert not dest.exists()


def test_extract_takes_tests_but_never_vllm(pin: Pin) -> None:
    dest = pin.root / "build" / "upstream-tests"
    upstream_tests.extract_tests(pin, ["tests"], dest)
    assert (dest / "tests" / "test_ok.py").is_file()
    assert not (dest / "vllm").exists()
    ini = (dest / "pytest.ini").read_text()
    assert "[pytest]" in ini and "    cpu_test: mark test as CPU-only test" in ini


def test_unaccounted_test_file_is_an_error(pin: Pin) -> None:
    config = pin.root / "ci" / "upstream_tests.yaml"
    config.write_text(CONFIG.replace("tests/test_ok.py, ", ""))
    with pytest.raises(HdError, match=r"1 upstream test files.*\n  tests/test_ok.py"):
        upstream_tests.run(_args(python=sys.executable), pin)


def test_run_counts_and_reports(pin: Pin, fake_venv: Path, capsys: pytest.CaptureFixture) -> None:
    rc = upstream_tests.run(_args(python=str(fake_venv)), pin)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "upstream-tests cpu: 6 passed, 0 failed, 0 skipped, 0 errors, 1 deselected" in out
    report = json.loads((pin.root / "build" / "upstream-tests-cpu.json").read_text())
    assert report["counts"]["passed"] == 6
    assert report["vllm"]["version"] == "0.1.0+hd.1"
    assert report["vllm"]["fingerprint"] == "ab" * 32
    assert "site-packages" in report["vllm"]["location"]
    assert report["deselected"] == [
        {
            "path": "tests/test_mixed.py::test_param",
            "k": "3",
            "reason": "the third case fails on purpose",
            "count": 1,
        }
    ]
    assert (pin.root / "build" / "upstream-tests-cpu.junit.xml").is_file()
    # pytest's tmp_path root is short and outside the checkout (AF_UNIX paths are limited to
    # 107 bytes), and removed after the run.
    basetemp = Path(re.search(r"--basetemp=(\S+)", out)[1])
    assert not basetemp.is_relative_to(pin.root) and not basetemp.exists()
    assert len(str(basetemp)) < 50


def test_run_fails_on_a_failure_and_below_min_passed(
    pin: Pin, fake_venv: Path, capsys: pytest.CaptureFixture
) -> None:
    config = pin.root / "ci" / "upstream_tests.yaml"
    config.write_text(CONFIG.replace('k: "3"', 'k: "nothing_matches"'))
    assert upstream_tests.run(_args(python=str(fake_venv)), pin) == 1
    out = capsys.readouterr().out
    assert "6 passed, 1 failed" in out and "FAILED (failures or errors)" in out
    assert "exclusion tests/test_mixed.py::test_param -k 'nothing_matches' matched no test" in out

    config.write_text(CONFIG.replace("min_passed: 4", "min_passed: 50"))
    assert upstream_tests.run(_args(python=str(fake_venv)), pin) == 1
    assert "fewer than min_passed=50 passed" in capsys.readouterr().out


def test_a_run_stopped_early_says_its_counts_are_partial(
    pin: Pin, fake_venv: Path, capsys: pytest.CaptureFixture
) -> None:
    """A session timeout (or -x) stops pytest with tests left: the summary counts them and the
    run fails, so a partial run never reads as a complete one."""
    config = pin.root / "ci" / "upstream_tests.yaml"
    config.write_text(CONFIG.replace('k: "3"', 'k: "nothing_matches"'))
    rc = upstream_tests.run(_args(python=str(fake_venv), pytest_arg=["-x"]), pin)
    out = capsys.readouterr().out
    assert rc == 1
    assert "5 passed, 1 failed, 0 skipped, 0 errors, 1 not run" in out
    assert "1 of 7 selected tests did not run" in out and "the counts are partial" in out
    report = json.loads((pin.root / "build" / "upstream-tests-cpu.json").read_text())
    assert (report["selected"], report["not_run"]) == (7, 1)
    assert report["stopped"]


def test_a_vllm_that_is_no_installed_distribution_is_refused(
    pin: Pin, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """A vllm package without its dist-info (a copied source tree) is not the wheel under
    test: the session stops before any test runs."""
    python = _make_fake_venv(tmp_path / "v", installed=False)
    assert upstream_tests.run(_args(python=str(python)), pin) != 0
    assert "which is not an installed vllm distribution" in capfd.readouterr().out


def test_session_timeout_option_overrides_the_yaml(
    pin: Pin, fake_venv: Path, capsys: pytest.CaptureFixture
) -> None:
    """--session-timeout: a part of the GPU subset ends itself inside the device call."""
    upstream_tests.run(_args(python=str(fake_venv), list=True, session_timeout=77), pin)
    assert "--session-timeout=77" in capsys.readouterr().out


def test_extracted_runs_without_the_sdist(pin: Pin, fake_venv: Path, capsys) -> None:
    """--extracted: the unpacked tests travel to a host without the sdist (the GPU host)."""
    assert upstream_tests.run(_args(python=str(fake_venv)), pin) == 0
    (pin.cache_dir / pin.sdist).unlink()
    capsys.readouterr()
    assert upstream_tests.run(_args(python=str(fake_venv), extracted=True), pin) == 0
    assert "6 passed, 0 failed" in capsys.readouterr().out


def test_extracted_refuses_tests_of_another_sdist_or_none(pin: Pin) -> None:
    run_dir = pin.root / "build" / "upstream-tests"
    with pytest.raises(HdError, match="no tests unpacked"):
        upstream_tests.run(_args(python=sys.executable, extracted=True), pin)
    upstream_tests.extract_tests(pin, ["tests"], run_dir)
    (run_dir / upstream_tests.SDIST_STAMP).write_text("0" * 64 + "\n")
    with pytest.raises(HdError, match="not the pinned"):
        upstream_tests.run(_args(python=sys.executable, extracted=True), pin)


def test_only_runs_a_part_of_the_allow_list_with_its_own_reports(
    pin: Pin, fake_venv: Path, capsys: pytest.CaptureFixture
) -> None:
    """--only: a long selection in pieces (the GPU host's calls last at most 600 s)."""
    rc = upstream_tests.run(_args(python=str(fake_venv), only=["tests/sub/test_deep.py"]), pin)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "1 passed, 0 failed" in out
    part = pin.root / "build" / "upstream-tests-cpu.test_deep.json"
    assert json.loads(part.read_text())["counts"]["passed"] == 1
    assert not (pin.root / "build" / "upstream-tests-cpu.json").exists()


def test_only_refuses_a_path_outside_the_allow_list(pin: Pin) -> None:
    with pytest.raises(HdError, match="--only tests/test_hub.py: not in the cpu allow-list"):
        upstream_tests.run(_args(python=sys.executable, only=["tests/test_hub.py"]), pin)


def test_restrict_to_keeps_listed_entries_and_narrows_directories() -> None:
    subset = upstream_tests.Subset(
        name="gpu",
        include=["tests/a/test_x.py", "tests/b", "tests/c/test_y.py::test_one"],
        exclude=[],
        min_passed=1,
        timeout=60,
        session_timeout=None,
        require_gpu=True,
        account_all=True,
    )
    assert upstream_tests.restrict_to(subset, ["tests/b/test_z.py"]).include == [
        "tests/b/test_z.py"
    ]
    both = upstream_tests.restrict_to(subset, ["tests/a", "tests/c/test_y.py"])
    assert both.include == ["tests/a/test_x.py", "tests/c/test_y.py::test_one"]
    assert not both.account_all
    assert upstream_tests.part_name(["tests/a", "tests/c/test_y.py"]) == "a+test_y"


def test_long_part_names_stay_valid_file_names():
    only = [f"tests/kernels/moe/test_some_long_module_name_{i}.py" for i in range(12)]
    name = upstream_tests.part_name(only)
    assert len(f"upstream-tests-gpu.{name}.junit.xml".encode()) < 255
    assert name.startswith("test_some_long_module_name_0+") and "12-paths-" in name
    # Distinct selections get distinct reports; the same one the same name.
    assert name == upstream_tests.part_name(list(only))
    assert name != upstream_tests.part_name(only[:-1] + ["tests/other.py"])


def test_a_bare_interpreter_name_is_looked_up_on_path(
    pin: Pin, fake_venv: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("PATH", f"{fake_venv.parent}:/usr/bin:/bin")
    assert upstream_tests.run(_args(python=fake_venv.name), pin) == 0
    out = capsys.readouterr().out
    assert f"in build/upstream-tests: CUDA_VISIBLE_DEVICES='' {fake_venv} " in out

"""The real pin: the built vllm-0.26.0+hd.N wheel, installed with its dependencies.

Needs `make build-wheel` and `make venv` (the venv path comes from HD_VENV, default
build/venv-wheel). Without that venv these tests skip, unless HD_REQUIRE_REAL_PIN is set (as
`make test` and CI do): then they fail, so the real pin can never be skipped silently.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hdtool.buildinfo import build_info_source
from hdtool.overlay import overlay_plan
from hdtool.patchfile import read_series
from hdtool.pin import Pin, fingerprint, sha256_file
from hdtool.venv import STAMP
from hdtool.wheel import output_wheel_name

# HD_ROOT: another project root to check, e.g. the staged root of `hd.py rebase --with-tests`
# (build/rebase/<X>/stage: the new tag's VERSION, the rebased series, overlay and kernels).
ROOT = Path(os.environ.get("HD_ROOT") or Path(__file__).resolve().parents[1])
pytestmark = pytest.mark.real_pin

OVERLAY_PACKAGE = "vllm.models.kimi_linear.sm90.specialized_decode"
_PROBE = f"""
import json, sys
import vllm, vllm._hopper_decode_build as build_info
import {OVERLAY_PACKAGE} as overlay
print(json.dumps({{
    "version": vllm.__version__,
    "version_tuple": list(vllm.__version_tuple__),
    "vllm_file": vllm.__file__,
    "overlay_file": overlay.__file__,
    "fingerprint": build_info.FINGERPRINT,
    "local_label": build_info.LOCAL_LABEL,
    "series": list(build_info.SERIES),
    "prefix": sys.prefix,
}}))
"""


@pytest.fixture(scope="module")
def pin() -> Pin:
    return Pin.load(ROOT)


@pytest.fixture(scope="module")
def venv() -> Path:
    path = Path(os.environ.get("HD_VENV", "build/venv-wheel"))
    path = path if path.is_absolute() else ROOT / path
    if not (path / "bin" / "python").exists():
        reason = f"no wheel venv at {path}: run `make venv` (or set HD_VENV)"
        if os.environ.get("HD_REQUIRE_REAL_PIN"):
            pytest.fail(f"HD_REQUIRE_REAL_PIN is set but there is {reason}")
        pytest.skip(f"{reason}; set HD_REQUIRE_REAL_PIN=1 to make this a failure")
    return path


@pytest.fixture(scope="module")
def probe(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Import vllm and the overlay in the wheel venv, from a directory outside the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _PROBE],
        cwd=tmp_path_factory.mktemp("probe"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"importing vllm in {venv} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_venv_holds_the_current_wheel(pin: Pin, venv: Path) -> None:
    wheel = pin.dist_dir / output_wheel_name(pin)
    assert wheel.is_file(), f"{wheel} is missing: run `make build-wheel`"
    stamp = json.loads((venv / STAMP).read_text())
    assert stamp["wheel"] == wheel.name
    assert stamp["wheel_sha256"] == sha256_file(wheel), "venv is stale: run `make venv`"


def test_import_vllm_reports_the_local_version(pin: Pin, venv: Path, probe: dict) -> None:
    assert probe["version"] == pin.local_version == f"{pin.upstream_version}+{pin.local_label}"
    release = [int(p) for p in pin.upstream_version.split(".")]
    assert probe["version_tuple"] == [*release, pin.local_label]
    assert Path(probe["vllm_file"]).is_relative_to(venv), "vllm imported from outside the venv"


def test_build_info_matches_this_checkout(pin: Pin, probe: dict) -> None:
    assert probe["fingerprint"] == fingerprint(pin)
    assert probe["local_label"] == pin.local_label
    assert probe["series"] == read_series(pin)


def test_overlay_and_kernels_are_installed_byte_identical(
    pin: Pin, venv: Path, probe: dict
) -> None:
    site = Path(probe["vllm_file"]).parent.parent
    overlay_init = pin.overlay_dir / (OVERLAY_PACKAGE.replace(".", "/") + "/__init__.py")
    assert Path(probe["overlay_file"]) == site / overlay_init.relative_to(pin.overlay_dir)
    plan = overlay_plan(pin)
    assert plan, "the overlay is empty"
    for dest, src in plan.items():
        installed = site / dest
        assert installed.is_file(), f"{dest} (from {src.relative_to(ROOT)}) is not installed"
        assert installed.read_bytes() == src.read_bytes(), f"{dest} differs from its source"
    assert (site / pin.build_info_module).read_text() == build_info_source(pin)

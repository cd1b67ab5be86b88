"""The GPU-host package profiles of ci/gpu/serve_wheels.py (no download here)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("serve_wheels", ROOT / "ci/gpu/serve_wheels.py")
serve_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_wheels)


def test_upstream_test_profile_is_the_ci_requirements_file():
    pins = serve_wheels.upstream_test_pins(ROOT / "ci/requirements-upstream-tests.txt")
    names = {p.split("==")[0] for p in pins}
    # tests/conftest.py imports tblib; the asyncio tests need pytest-asyncio.
    assert {"tblib", "pytest-asyncio"} <= names
    assert all(p.count("==") == 1 for p in pins)


def test_unpinned_requirements_are_refused(tmp_path):
    req = tmp_path / "req.txt"
    req.write_text("# comment\ntblib==3.1.0  # why\n\npytest-asyncio>=1.0\n")
    with pytest.raises(ValueError, match="pytest-asyncio>=1.0"):
        serve_wheels.upstream_test_pins(req)
    req.write_text("tblib==3.1.0  # why\n")
    assert serve_wheels.upstream_test_pins(req) == ["tblib==3.1.0"]


def test_gpu_host_test_pins_bring_anthropic_and_do_not_repeat_the_ci_file():
    """tests/utils.py imports anthropic (a vLLM dependency the gpu-bundle leaves out)."""
    extra = serve_wheels.GPU_HOST_TEST_PINS
    names = [p.split("==")[0] for p in extra]
    assert "anthropic" in names and all(p.count("==") == 1 for p in extra)
    ci = {p.split("==")[0] for p in serve_wheels.upstream_test_pins()}
    assert not ci & set(names)
    assert "anthropic" in serve_wheels.PROFILE_IMPORTS["upstream-tests"]

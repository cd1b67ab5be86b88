"""Fixtures of the decode_backend tests; engine_configs.py installs the stand-in H200 platform
and must be imported before anything else imports vllm."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_configs import BASE_ENGINE_ARGS, write_model_dir

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config: pytest.Config) -> None:
    """These tests import the installed vllm (the overlay as the wheel placed it): stop
    before they test another tree's code (an edit since the last `make venv`)."""
    from hdtool.pin import Pin
    from hdtool.wheel import stale_install

    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return  # the imports fail on their own, naming vllm
    package = Path(next(iter(spec.submodule_search_locations)))
    reason = stale_install(Pin.load(ROOT), package)
    if reason:
        pytest.exit(f"{reason}: run `make venv` (or `make test-runtime`)", returncode=4)


@pytest.fixture
def engine_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """engine_config(model_changes=None, **engine_args) -> VllmConfig, built the way
    `vllm serve` builds it, for the 48B config with `model_changes` applied."""
    from vllm.engine.arg_utils import EngineArgs

    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_BREAKABLE_CUDAGRAPH"):
        monkeypatch.delenv(name, raising=False)
    built = 0

    def build(model_changes: dict[str, Any] | None = None, **engine_args: Any) -> Any:
        nonlocal built
        built += 1
        model = write_model_dir(tmp_path / f"model{built}", **(model_changes or {}))
        args = {**BASE_ENGINE_ARGS, "model": str(model), **engine_args}
        return EngineArgs(**args).create_engine_config()

    return build


@pytest.fixture(autouse=True)
def kernel_cache_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor keeps compiled kernels under VLLM_CACHE_ROOT by default: off here, so
    that no test writes into the user's cache; the kernel cache's own tests turn it on."""
    monkeypatch.setenv("VLLM_HD_KERNEL_CACHE", "0")

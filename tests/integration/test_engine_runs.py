"""engine_runs.py on the CPU: reuse of finished runs and the status of failed ones."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import engine_runs
import pytest


def _finished(root: Path, kind: str, status: str = "ok", forced_from: str | None = None) -> None:
    out = root / kind
    out.mkdir(parents=True, exist_ok=True)
    (out / "session.json").write_text(
        json.dumps({"kind": kind, "status": status, "forced_from": forced_from})
    )


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Replace the engine subprocess: record the command, leave a crashed session."""
    commands: list[list[str]] = []

    def fake_run(command, **kwargs):
        commands.append(command)
        assert kwargs["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert kwargs["env"]["HD_TRITON_CACHE_DIR"].endswith("triton_cache")
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(engine_runs.subprocess, "run", fake_run)
    return commands


def test_reuse_returns_a_finished_run_without_starting_an_engine(tmp_path, launches):
    _finished(tmp_path, "stock")
    run = engine_runs.run_engine("stock", tmp_path, reuse=True)
    assert run.ok and launches == []


def test_reuse_needs_the_same_teacher_forcing(tmp_path, launches):
    stock = tmp_path / "stock"
    _finished(tmp_path, "specialized", forced_from=str(tmp_path / "elsewhere"))
    run = engine_runs.run_engine("specialized", tmp_path, forced_from=stock, reuse=True)
    assert len(launches) == 1 and launches[0][-2:] == ["--forced-from", str(stock)]
    # The stale session.json was removed before the launch: the crash is reported as such.
    assert run.status["status"] == "crashed (exit code 1)"


def test_without_reuse_a_finished_run_is_run_again(tmp_path, launches):
    _finished(tmp_path, "stock")
    run = engine_runs.run_engine("stock", tmp_path)
    assert len(launches) == 1 and not run.ok


def test_a_failed_run_is_never_reused(tmp_path, launches):
    _finished(tmp_path, "stock", status="run_failed")
    engine_runs.run_engine("stock", tmp_path, reuse=True)
    assert len(launches) == 1

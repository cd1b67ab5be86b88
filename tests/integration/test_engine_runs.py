"""engine_runs.py on the CPU: reuse of finished runs and the status of failed ones."""

from __future__ import annotations

import json
from pathlib import Path

import engine_runs
import pytest


def _finished(root: Path, kind: str, status: str = "ok", forced_from: str | None = None) -> None:
    out = root / kind
    out.mkdir(parents=True, exist_ok=True)
    (out / "session.json").write_text(
        json.dumps({"kind": kind, "status": status, "forced_from": forced_from})
    )


class _CrashedEngine:
    """Stands in for an engine subprocess: records its command, exits 1, writes nothing."""

    def __init__(self, command, **kwargs):
        assert kwargs["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert kwargs["env"]["HD_TRITON_CACHE_DIR"].endswith("triton_cache")
        self.command = command

    def wait(self, timeout=None):
        return 1


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Replace the engine subprocess: record the command, leave a crashed session."""
    commands: list[list[str]] = []

    def fake_popen(command, **kwargs):
        commands.append(command)
        return _CrashedEngine(command, **kwargs)

    monkeypatch.setattr(engine_runs.subprocess, "Popen", fake_popen)
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


def test_kinds_named_together_start_together(tmp_path, launches):
    _finished(tmp_path, "stock")
    (tmp_path / "stock" / "compare_b1.tokens.json").write_text("{}")  # from an older run
    stock, special = engine_runs.run_engines(
        [("stock", None), ("specialized", tmp_path / "stock")], tmp_path
    )
    assert [c[c.index("--kind") + 1] for c in launches] == ["stock", "specialized"]
    # The forced run must wait for this run's tokens, not read the old ones.
    assert not (tmp_path / "stock" / "compare_b1.tokens.json").exists()
    assert stock.status["status"] == special.status["status"] == "crashed (exit code 1)"


def test_a_forced_run_waits_for_the_stock_tokens_and_stops_if_stock_failed(tmp_path):
    import engine_session

    tokens = tmp_path / "stock" / "compare_b1.tokens.json"
    _finished(tmp_path, "stock", status="starting")
    with pytest.raises(RuntimeError, match="no stock tokens"):
        engine_session.wait_for_forced_tokens(tokens, timeout_s=0)
    _finished(tmp_path, "stock", status="start_failed")
    with pytest.raises(RuntimeError, match="ended \\(start_failed\\)"):
        engine_session.wait_for_forced_tokens(tokens)
    engine_session.write_atomically(tokens, json.dumps({"r0": [1, 2]}))
    assert engine_session.wait_for_forced_tokens(tokens) == {"r0": [1, 2]}
    assert {p.name for p in tokens.parent.iterdir()} == {"session.json", tokens.name}


def test_the_correctness_record_counts_outcomes_and_keeps_what_each_test_measured():
    from correctness import correctness_record

    outcomes = {
        "test_logits_and_greedy_tokens_match_stock[1]": {
            "outcome": "passed",
            "measured": "b1r0: min cos 0.999912, greedy 100.00%",
        },
        "test_states_after_256_steps_match_stock[4]": {"outcome": "failed", "measured": ""},
        "test_auto_is_the_stock_decode": {"outcome": "passed", "measured": ""},
    }
    record = correctness_record(outcomes, {"gpu": "NVIDIA H200", "fingerprint": "df91"})
    assert record["result"] == "1 failed, 2 passed"
    assert record["gpu"] == "NVIDIA H200" and record["fingerprint"] == "df91"
    assert record["checks"] == [
        "test_logits_and_greedy_tokens_match_stock[1]: passed "
        "(b1r0: min cos 0.999912, greedy 100.00%)",
        "test_states_after_256_steps_match_stock[4]: failed",
        "test_auto_is_the_stock_decode: passed",
    ]

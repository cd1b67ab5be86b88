"""The long-context decode benchmark's report (scripts/bench_decode_context.py): the
engines need the H200; merging the role results into the summary and the table is here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import bench_decode_context as bench
import pytest

SCRIPT = Path(bench.__file__)


def role_result(role: str, ms: dict[str, dict[str, float]], vllm: str = "0.26.0+hd.9") -> dict:
    host = {"gpu": "NVIDIA H200", "vllm": vllm, "date": "2026-12-02", "command": "x"}
    host["fingerprint"] = vllm
    runs = {c: {n: [v, v] for n, v in per_n.items()} for c, per_n in ms.items()}
    return {"step_ms": ms, "step_ms_runs": runs, "runs": 2, "output_tokens": 128, "host": host}


def write(out: Path, role: str, result: dict) -> None:
    bench.result_path(out, role).write_text(json.dumps(result))


def test_both_roles_give_a_speedup_per_context_and_n(tmp_path):
    write(tmp_path, "auto", role_result("auto", {"32768": {"1": 4.0, "16": 8.0}}))
    write(
        tmp_path,
        "latency_specialized",
        role_result("latency_specialized", {"32768": {"1": 2.0, "16": 10.0}}),
    )
    md = bench.write_report(tmp_path).read_text()
    data = json.loads((tmp_path / "decode_context.json").read_text())
    rows = data["summary"]["32768"]
    assert rows["1"]["speedup"] == pytest.approx(2.0)
    assert rows["16"]["speedup"] == pytest.approx(0.8)  # slower than stock shows as < 1
    assert "| 32768 | 1 | 4.000 | 2.000 | 2.00x |" in md
    assert "| 32768 | 16 | 8.000 | 10.000 | 0.80x |" in md
    assert "different builds" not in md and "different shapes" not in md


def test_one_role_alone_reports_without_ratios_and_mixed_wheels_are_flagged(tmp_path):
    write(tmp_path, "auto", role_result("auto", {"8192": {"2": 4.5}}, vllm="0.26.0+hd.8"))
    md = bench.write_report(tmp_path).read_text()
    assert "| 8192 | 2 | 4.500 | - | - |" in md
    write(
        tmp_path,
        "latency_specialized",
        role_result("latency_specialized", {"8192": {"2": 3.0}}),
    )
    assert "different builds" in bench.write_report(tmp_path).read_text()
    other = role_result("latency_specialized", {"8192": {"2": 3.0}}, vllm="0.26.0+hd.8")
    other["output_tokens"] = 256
    write(tmp_path, "latency_specialized", other)
    md = bench.write_report(tmp_path).read_text()
    assert "different shapes" in md and "different builds" not in md


def steady(first: float, count: int, dt: float) -> list[tuple[float, int]]:
    """One request's chunks: its first token at ``first``, then one token every dt."""
    return [(first + i * dt, 1) for i in range(count)]


def test_only_the_window_where_every_request_decodes_is_timed():
    # Request 0 decodes beside request 1's prefill (slow steps, 0.05 s) until request 1's
    # first token at t = 1.0; from then on both decode at 0.01 s a step; request 0 ends
    # first. Only the steps inside [1.0, end of request 0] count.
    fast = 0.01
    r0 = steady(0.0, 21, 0.05)[:-1] + steady(1.0, 41, fast)
    r1 = steady(1.0, 60, fast)
    samples = bench.decode_window_samples([r0, r1])
    assert samples and all(s == pytest.approx(fast) for s in samples)
    assert len(samples) == 2 * 40  # each request's 40 intervals inside [1.0, 1.4]
    # A chunk of k tokens gives k samples.
    r1_chunked = [(1.0, 1)] + [(1.0 + 2 * fast * i, 2) for i in range(1, 30)]
    assert bench.decode_window_samples([r0, r1_chunked]).count(pytest.approx(fast)) == 80


def test_a_window_too_short_to_time_fails_the_run():
    r0 = steady(0.0, 40, 0.01)
    r1 = steady(0.35, 40, 0.01)  # overlaps request 0 for only 4 steps
    with pytest.raises(RuntimeError, match="raise --output-tokens"):
        bench.decode_window_samples([r0, r1])
    with pytest.raises(RuntimeError, match="fewer than two chunks"):
        bench.decode_window_samples([r0, [(0.1, 1)]])


def test_no_results_write_no_report(tmp_path):
    assert bench.write_report(tmp_path) is None
    assert not (tmp_path / "decode_context.json").exists()


@pytest.mark.parametrize(
    "argv",
    [[], ["--roles", "stock"], ["--roles", "auto", "--context", "0"]],
)
def test_bad_command_lines_are_refused_before_any_engine_starts(tmp_path, argv):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out-dir", str(tmp_path), *argv],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "error:" in done.stderr
    assert list(tmp_path.iterdir()) == []

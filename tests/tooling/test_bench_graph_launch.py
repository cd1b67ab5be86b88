"""CPU tests of scripts/bench_graph_launch.py's fit and report (the timing needs a GPU)."""

from __future__ import annotations

from pathlib import Path

import bench_graph_launch as bench
import pytest


def _rows() -> list[dict]:
    rows = []
    for nodes in (1, 64, 256):
        rows.append(
            {"nodes": nodes, "pdl": False, "host_us_per_replay": 5 + 0.1 * nodes,
             "gpu_us_per_replay": 2.0 * nodes}
        )  # fmt: skip
        rows.append(
            {"nodes": nodes, "pdl": True, "host_us_per_replay": 6 + 0.4 * nodes,
             "gpu_us_per_replay": 1.5 * nodes}
        )  # fmt: skip
    return rows


def test_the_fit_recovers_the_cost_per_node_of_each_mode():
    summary = bench.summarize(_rows())
    assert summary["triton, plain"]["host_us_per_node"] == pytest.approx(0.1)
    assert summary["triton, plain"]["host_us_fixed"] == pytest.approx(5.0)
    assert summary["triton, pdl"]["host_us_per_node"] == pytest.approx(0.4)
    assert summary["triton, pdl"]["gpu_us_per_node"] == pytest.approx(1.5)


def test_each_kind_gets_its_own_fit():
    cute_rows = [
        dict(r, kind="cute", host_us_per_replay=r["host_us_per_replay"] + r["nodes"])
        for r in _rows()
    ]
    summary = bench.summarize(_rows() + cute_rows)
    assert sorted(summary) == ["cute, pdl", "cute, plain", "triton, pdl", "triton, plain"]
    assert summary["cute, plain"]["host_us_per_node"] == pytest.approx(1.1)
    assert summary["cute, pdl"]["host_us_fixed"] == pytest.approx(6.0)
    assert summary["triton, plain"]["host_us_per_node"] == pytest.approx(0.1)


def test_a_fit_needs_two_distinct_node_counts():
    with pytest.raises(ValueError, match="two distinct"):
        bench.linear_fit([4.0, 4.0], [1.0, 2.0])
    only_one = [r for r in _rows() if r["nodes"] == 64]
    assert bench.summarize(only_one) == {}


def _report(tmp_path: Path, rows: list[dict], **extra) -> str:
    data = {
        "summary": bench.summarize(rows),
        "rows": rows,
        "method": "m",
        "gpu": "NVIDIA H200",
        "torch": "2.11.0",
        "triton": "3.6.0",
        "date": "2026-12-04T00:00:00+00:00",
        "command": "python3 scripts/bench_graph_launch.py --out-dir x",
        **extra,
    }
    bench.write_markdown(data, tmp_path / "graph_launch.md")
    return (tmp_path / "graph_launch.md").read_text()


def test_report_lists_every_row_and_both_fits(tmp_path: Path):
    rows = _rows()
    text = _report(tmp_path, rows)
    assert "| triton | 256 | on | 108.4 | 384.0 |" in text
    assert "- triton, pdl: host 6.0 us + 0.400 us per node; GPU 1.500 us per node" in text
    assert text.count("\n| ") == 1 + len(rows)  # the header and one line per row


def test_report_names_a_skipped_kind_and_why(tmp_path: Path):
    skipped = {"cute": "cutlass (nvidia-cutlass-dsl) does not import: no module"}
    text = _report(tmp_path, _rows(), skipped=skipped)
    assert "`cute` not measured: cutlass (nvidia-cutlass-dsl) does not import" in text


def test_unknown_kinds_are_refused_before_any_gpu_work(monkeypatch, capsys):
    monkeypatch.setattr(
        "sys.argv", ["bench_graph_launch.py", "--out-dir", "x", "--kinds", "triton,cuda_c"]
    )
    with pytest.raises(SystemExit):
        bench.main()
    assert "unknown kinds ['cuda_c']" in capsys.readouterr().err

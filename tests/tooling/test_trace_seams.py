"""scripts/trace_seams.py: a kernel's start and end against its predecessor's end."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "trace_seams.py"
sys.path.insert(0, str(ROOT / "scripts"))

import trace_seams  # noqa: E402


def kernel(name, ts, dur, grid=(1, 1, 1)):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"grid": list(grid)}}  # fmt: skip


# Two steps: in_proj (786 tiles) then the KDA step, which starts 2 µs before the
# GEMM ends in the first step and 1 µs after it in the second; a third KDA step
# follows another GEMM shape, and a CPU event is not a kernel.
EVENTS = [
    kernel("SkinnyGemmKernel", 0.0, 20.0, (786, 1, 1)),
    kernel("KdaDecodeKernel", 18.0, 12.0),
    {"ph": "X", "cat": "cpu_op", "name": "KdaDecodeKernel", "ts": 19.0, "dur": 1.0},
    kernel("SkinnyGemmKernel", 100.0, 20.0, (786, 1, 1)),
    kernel("KdaDecodeKernel", 121.0, 8.0),
    kernel("SkinnyGemmKernel", 200.0, 10.0, (144, 4, 1)),
    kernel("KdaDecodeKernel", 205.0, 10.0),
]


def test_offsets_against_the_predecessors_end():
    result = trace_seams.seams(EVENTS, "KdaDecode", "SkinnyGemm", [786, 1, 1])
    assert result["count"] == 2
    assert result["start_us"]["median"] == pytest.approx(-0.5)
    assert result["end_us"]["median"] == pytest.approx(9.5)
    everything = trace_seams.seams(EVENTS, "KdaDecode")
    assert everything["count"] == 3
    assert everything["start_us"]["median"] == pytest.approx(-2.0)
    assert trace_seams.seams(EVENTS, "MoeRouter")["count"] == 0


def test_command_line_reads_gzipped_traces_and_refuses_bad_input(tmp_path):
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    out = tmp_path / "seams.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(trace), "--after", "Kda", "--before", "Skinny",
         "--before-grid", "786,1,1", "--json", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "count: 2" in done.stdout
    assert json.loads(out.read_text())["end_us"]["median"] == pytest.approx(9.5)
    for args, message in (
        (["--after", "Kda", "--before-grid", "786x1"], "--before-grid must be integers"),
        (["--after", "Router"], "no 'Router' kernel"),
    ):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), str(trace), *args], capture_output=True, text=True
        )
        assert done.returncode != 0 and message in done.stderr
    missing = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "none.json"), "--after", "Kda"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 2 and "no trace at" in missing.stderr

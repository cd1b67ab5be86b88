"""scripts/trace_step_budget.py: a decode step's busy time by seam."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "trace_step_budget.py"
sys.path.insert(0, str(ROOT / "scripts"))

import trace_step_budget as budget  # noqa: E402

END = budget.DEFAULT_STEP_END
CUTE = "kernel_cutlass_kernel_vllmmodelskimi_linearsm90specialized_decodecutedsl{}kernel{}_object_at__ptrbf16_0"  # noqa: E501


def kernel(name, ts, dur, grid=(1, 1, 1)):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"grid": list(grid)}}  # fmt: skip


def step(t0, gap=0.0):
    """One decode step from t0: in_proj (0-20), the KDA step started under it (PDL,
    18-24), an idle gap, then the lm_head (ends the step)."""
    return [
        kernel(CUTE.format("gemm", "SkinnyGemmKernel"), t0, 20.0, (786, 1, 1)),
        kernel(CUTE.format("kda", "KdaDecodeKernel"), t0 + 18.0, 6.0, (32, 1, 1)),
        kernel(END + "_x", t0 + 24.0 + gap, 10.0, (2, 66, 1)),
    ]


# Before the first lm_head nothing counts; three decode steps (one with a 4 µs gap for
# the host); a prefill step whose kernels differ is left out.
EVENTS = (
    [kernel("warm", 0.0, 5.0), kernel(END, 5.0, 5.0, (2, 66, 1))]
    + step(10.0)
    + step(50.0, gap=4.0)
    + [kernel("chunk_kda_fwd", 100.0, 300.0), kernel(END, 400.0, 10.0, (2, 66, 1))]
    + step(500.0)
)


def test_labels_name_the_cute_class_or_the_kernel_and_the_grid():
    assert budget.kernel_label(EVENTS[2]) == "SkinnyGemmKernel 786x1x1"
    assert budget.kernel_label(kernel("x" * 60, 0, 1, (4, 16, 1))) == "x" * 40 + " 4x16x1"
    assert budget.kernel_label({"name": "memcpy", "args": {}}) == "memcpy"


def test_steps_are_cut_at_the_step_end_and_only_the_common_kind_counts():
    steps = budget.decode_steps(EVENTS, END)
    # The prefill step (other kernels) is out; so is what came before the first lm_head.
    assert [s[0]["ts"] for s in steps] == [10.0, 50.0, 500.0]


def test_advances_add_up_to_the_busy_time_and_leave_idle_out():
    got = budget.budget(budget.decode_steps(EVENTS, END))
    seams = {(s["after"], s["kernel"]): s for s in got["seams"]}
    kda = seams[("SkinnyGemmKernel 786x1x1", "KdaDecodeKernel 32x1x1")]
    assert kda["us_per_step"] == pytest.approx(4.0)  # 18 + 6 - 20
    assert kda["per_step"] == 1.0
    lm_head = budget.kernel_label(kernel(END + "_x", 0, 1, (2, 66, 1)))
    head = seams[("KdaDecodeKernel 32x1x1", lm_head)]
    assert head["us_per_step"] == pytest.approx(10.0)
    assert got["busy_us_per_step"] == pytest.approx(34.0)
    assert got["idle_us_per_step"] == pytest.approx(4.0 / 3)


def test_command_line_prints_the_table_and_writes_json(tmp_path: Path):
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    out = tmp_path / "budget.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(trace), "--json", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("3 steps: GPU busy 34.0 us and idle 1.3 us per step")
    assert "| SkinnyGemmKernel 786x1x1 | KdaDecodeKernel 32x1x1 | 4.0 | 1.0 | 4.00 |" in done.stdout
    assert json.loads(out.read_text())["steps"] == 3
    none = subprocess.run(
        [sys.executable, str(SCRIPT), str(trace), "--step-end", "nothing"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert none.returncode == 1 and "no whole step ends in a 'nothing' kernel" in none.stderr

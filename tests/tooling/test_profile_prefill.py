"""scripts/profile_prefill.py's arithmetic and comparison (the engine runs need the H200)."""

from __future__ import annotations

import cProfile
import json
import marshal
import pstats
import subprocess
import sys
from pathlib import Path

import profile_prefill as prefill
import pytest

SCRIPT = Path(prefill.__file__)


def _result(backend: str, busy: list[float], steps: int, forward_s: float) -> dict:
    return {
        "backend": backend,
        "batch": {"requests": 16, "prompt_tokens": 1024},
        "missing_phases": [],
        "tokens_per_s": [16384 / (b * 1.1) for b in busy],
        "engine_batches": [
            {
                "wall_s": b * 1.1,
                "engine_busy_s": b,
                "steps": steps,
                "phases_s": {"runner.execute_model": forward_s * 1.05, "_model_forward": forward_s},
            }
            for b in busy
        ],
        "allocator": {"num_device_alloc": 0 if backend == "auto" else 4},
        "profile": {"batches": 3, "steps": 30},
    }


def test_summary_takes_medians_and_ms_per_step():
    got = prefill.summary(_result("auto", [0.8, 1.0, 0.9], steps=10, forward_s=0.76))
    assert got["wall_tokens_per_s"] == pytest.approx(16384 / 0.99)
    assert got["engine_tokens_per_s"] == pytest.approx(16384 / 0.9)
    assert got["steps_per_batch"] == 10
    # Three batches of 10 steps, 0.76 s of forward each: 76 ms a step.
    assert got["phase_ms_per_step"]["_model_forward"] == pytest.approx(76.0)


@pytest.mark.parametrize(
    ("key", "label"),
    [
        (("~", 0, "<method 'item' of 'torch._C.TensorBase' objects>"),
         "<method 'item' of 'torch._C.TensorBase' objects>"),
        (("/venv/lib/python3.12/site-packages/vllm/v1/worker/gpu_model_runner.py", 12, "f"),
         "vllm/v1/worker/gpu_model_runner.py:12(f)"),
        (("/usr/lib/python3.12/asyncio/events.py", 80, "_run"),
         "3.12/asyncio/events.py:80(_run)"),
        (("scripts/x.py", 3, "g"), "scripts/x.py:3(g)"),
    ],
)  # fmt: skip
def test_function_labels_drop_the_install_prefix(key, label):
    assert prefill.function_label(key) == label


def _stats(entries: dict[tuple, tuple[float, float]]) -> dict:
    return {key: (1, 1, own, cum, {}) for key, (own, cum) in entries.items()}


def test_the_comparison_lists_the_largest_differences_first_per_step():
    fwd = ("/x/site-packages/vllm/model.py", 10, "forward")
    item = ("~", 0, "item")
    hook = ("/x/site-packages/vllm/models/kimi_linear/hook.py", 5, "maybe_run")
    base = _stats({fwd: (0.300, 0.900), item: (0.100, 0.100)})
    new = _stats({fwd: (0.330, 0.960), item: (0.101, 0.101), hook: (0.012, 0.012)})
    lines = prefill.compare_profiles(base, 10, new, 12, rows=3)
    own = lines[lines.index("|---|---|---|---|") + 1 :][:3]
    # Per step: forward 30.0 -> 27.5 ms own (10 vs 12 steps), hook 0 -> 1.0, item 10 -> 8.4.
    assert own[0] == "| `vllm/model.py:10(forward)` | 30.000 | 27.500 | -2.500 |"
    assert own[1] == "| `item` | 10.000 | 8.417 | -1.583 |"
    assert own[2] == "| `vllm/models/kimi_linear/hook.py:5(maybe_run)` | 0.000 | 1.000 | +1.000 |"
    assert "all own time: base 40.00, new 36.92 ms per step" in lines[0]
    assert any(line.startswith("Functions by cumulative ms") for line in lines)


def _busy(n: int) -> int:
    return sum(i * i for i in range(n))


def _write(out: Path, result: dict, work: int) -> Path:
    profile = cProfile.Profile()
    profile.enable()
    _busy(work)
    profile.disable()
    path = out / f"prefill-{result['backend']}.json"
    path.write_text(json.dumps(result))
    raw = marshal.dumps(pstats.Stats(profile).stats)
    (out / f"prefill-{result['backend']}-cprofile.prof").write_bytes(raw)
    return path


def test_compare_reads_two_results_and_their_profiles(tmp_path: Path):
    base = _write(tmp_path, _result("auto", [0.80, 0.82, 0.84], 10, 0.760), 10)
    new = _write(tmp_path, _result("latency_specialized", [0.82, 0.84, 0.86], 10, 0.784), 10)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--compare", str(base), str(new)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    text = done.stdout
    assert text.startswith("Prefill host time, auto (base) -> latency_specialized (new)")
    assert "| `_model_forward` | 76.00 | 78.40 | +2.40 |" in text
    assert "steps per batch: 10 -> 10" in text
    assert "allocator `num_device_alloc` over the timed batches: 0 -> 4" in text
    assert "allocator `num_alloc_retries` over the timed batches: ? -> ?" in text
    assert "_busy)" in text  # the profiled function, by own time


def test_compare_says_so_when_a_profile_counted_no_step(tmp_path: Path):
    empty = _result("auto", [0.8], 10, 0.76)
    empty["profile"]["steps"] = 0
    base = _write(tmp_path, empty, 1)
    new = _write(tmp_path, _result("latency_specialized", [0.8], 10, 0.76), 1)
    lines = prefill.compare(base, new)
    assert lines[-1] == "A profile counted no prefill step: no function comparison."


def test_allocator_counters_are_differences_and_gauges_are_the_last_value():
    before = dict.fromkeys(prefill.ALLOCATOR_COUNTERS, 5) | dict.fromkeys(
        prefill.ALLOCATOR_GAUGES, 100
    )
    after = dict.fromkeys(prefill.ALLOCATOR_COUNTERS, 7) | dict.fromkeys(
        prefill.ALLOCATOR_GAUGES, 300
    )
    change = prefill.allocator_change(before, after)
    assert change["num_device_alloc"] == 2 and change["num_alloc_retries"] == 2
    assert change["reserved_bytes.all.current"] == 300

"""Keeps what the end-to-end GPU tests found as a record for the reports.

With HD_INTEGRATION_DIR set, a run that executed any test of test_specialized_decode.py writes
<HD_INTEGRATION_DIR>/correctness.json: the command, GPU, date, the installed wheel's patch-set
fingerprint, the outcome counts and one line per test (outcome and what it measured, from the
tests' ``record_property("measured", ...)``). `scripts/bench_decode.py --correctness FILE`
puts it into docs/perf/decode.json, which `make upstream-pr` reads.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import pytest
from correctness import correctness_record

RECORDED_MODULE = "test_specialized_decode.py"
_outcomes: dict[str, dict[str, str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if RECORDED_MODULE not in report.nodeid:
        return
    # A test's outcome is its call phase's, or its setup's when setup failed or skipped.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        measured = dict(report.user_properties).get("measured", "")
        _outcomes[report.nodeid.split("::", 1)[1]] = {
            "outcome": report.outcome,
            "measured": str(measured),
        }


def _facts() -> dict[str, str]:
    import torch

    try:
        from vllm import _hopper_decode_build as build

        fingerprint = build.FINGERPRINT
    except ImportError:
        fingerprint = ""
    return {
        "command": "python3 -m pytest " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "fingerprint": fingerprint,
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kept = os.environ.get("HD_INTEGRATION_DIR")
    ran = [e for e in _outcomes.values() if e["outcome"] != "skipped"]
    if not kept or not ran:
        return
    record = correctness_record(_outcomes, _facts())
    (Path(kept) / "correctness.json").write_text(json.dumps(record, indent=2) + "\n")

"""The end-to-end tests' correctness record (written by conftest.py, read by
scripts/bench_decode.py --correctness): outcome counts and one line per test."""

from __future__ import annotations


def correctness_record(outcomes: dict[str, dict[str, str]], facts: dict[str, str]) -> dict:
    counts: dict[str, int] = {}
    for entry in outcomes.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    checks = [
        f"{name}: {entry['outcome']}" + (f" ({entry['measured']})" if entry["measured"] else "")
        for name, entry in outcomes.items()
    ]
    result = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    return {**facts, "result": result, "checks": checks}

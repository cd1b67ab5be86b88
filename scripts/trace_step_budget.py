#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a decode step's GPU time goes, seam by seam, from a torch-profiler trace.

    python3 scripts/trace_step_budget.py TRACE [--step-end NAME] [--rows 30] [--json OUT]

TRACE is a kernel-only trace of decode steps (``bench_decode.py --keep-traces`` writes
them). The kernels are cut into steps after each kernel whose name contains
``--step-end`` (default: the lm_head's cuBLAS GEMM, once per step in both engines' traces
of 2026-12-05), and only the steps whose kernels (name and grid, in any order) are the
most common set count: the decode steps of one batch size, without the batch's prefill.
Within a step each kernel's advance is how far it moved the end of the GPU's busy time,
idle time before it left out (with programmatic dependent launch a kernel starts while its
predecessor runs, so spans overlap and their sum exceeds the step). The table sums the
advances per step by seam, (the kernel launched before it, the kernel), with each kernel
named by its class (CuTe DSL) or name (others) and its grid: e.g. the KDA in_proj's
advance after the MoE combine, per layer (median) and per step. The advances add up to
the GPU's busy time per step; the idle time (the GPU waiting for the profiled host) is
given beside them.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace_seams import read_events  # noqa: E402

DEFAULT_STEP_END = "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT"
# CuTe DSL kernels as the profiler names them: kernel_cutlass_kernel_<module path>
# <Class>_object_at_<arguments>; the class is what the table shows.
CUTE_CLASS = re.compile(r"cutedsl\w*?kernel([A-Z]\w*?Kernel)_object_at_")
NAME_CHARS = 40


def kernel_label(event: dict) -> str:
    name = event["name"]
    match = CUTE_CLASS.search(name)
    short = match.group(1) if match else name[:NAME_CHARS]
    grid = event.get("args", {}).get("grid")
    return f"{short} {'x'.join(map(str, grid))}" if grid else short


def decode_steps(events: list[dict], step_end: str) -> list[list[dict]]:
    """The kernels of each whole step (after a ``step_end`` kernel, up to and including
    the next), in start order, for the steps whose set of kernels is the most common."""
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel"), key=lambda e: (e["ts"], e["dur"])
    )
    ends = [i for i, e in enumerate(kernels) if step_end in e["name"]]
    steps = [kernels[a + 1 : b + 1] for a, b in zip(ends, ends[1:])]
    if not steps:
        return []
    # The set of kernels, not their order: kernels that start together may swap places.
    kinds = [tuple(sorted(map(kernel_label, s))) for s in steps]
    common = Counter(kinds).most_common(1)[0][0]
    return [s for s, kind in zip(steps, kinds) if kind == common]


def budget(steps: list[list[dict]]) -> dict:
    """Per seam (predecessor label, kernel label): µs of advance per step, occurrences per
    step and the median advance of one occurrence; plus the busy µs per step."""
    advances: dict[tuple[str, str], list[float]] = defaultdict(list)
    idle = 0.0
    for step in steps:
        busy_end, previous = step[0]["ts"], "(step start)"
        for event in step:
            label = kernel_label(event)
            start, end = event["ts"], event["ts"] + event["dur"]
            idle += max(0.0, start - busy_end)
            advances[(previous, label)].append(max(0.0, end - max(start, busy_end)))
            busy_end, previous = max(busy_end, end), label
    count = len(steps)
    seams = [
        {
            "after": after,
            "kernel": kernel,
            "us_per_step": sum(values) / count,
            "per_step": len(values) / count,
            "median_us": statistics.median(values),
        }
        for (after, kernel), values in advances.items()
    ]
    seams.sort(key=lambda s: -s["us_per_step"])
    return {
        "steps": count,
        "busy_us_per_step": sum(s["us_per_step"] for s in seams),
        "idle_us_per_step": idle / count,
        "seams": seams,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--step-end", default=DEFAULT_STEP_END, help="part of a step's last kernel")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--json", type=Path, help="also write the whole table here")
    args = ap.parse_args()
    if not args.trace.is_file():
        ap.error(f"no trace at {args.trace}")
    steps = decode_steps(read_events(args.trace), args.step_end)
    if not steps:
        print(f"no whole step ends in a {args.step_end!r} kernel", file=sys.stderr)
        return 1
    result = budget(steps)
    result.update(trace=str(args.trace), step_end=args.step_end)
    print(
        f"{result['steps']} steps: GPU busy {result['busy_us_per_step']:.1f} us and idle "
        f"{result['idle_us_per_step']:.1f} us per step (traced)"
    )
    print("| after | kernel | us per step | per step | median us |")
    print("|---|---|---|---|---|")
    for s in result["seams"][: args.rows]:
        print(
            f"| {s['after']} | {s['kernel']} | {s['us_per_step']:.1f} | "
            f"{s['per_step']:.1f} | {s['median_us']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

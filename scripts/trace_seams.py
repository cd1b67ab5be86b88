#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""When a kernel starts and ends against the end of the kernel launched before it.

    python3 scripts/trace_seams.py TRACE --after KdaDecode [--before SkinnyGemm]
        [--before-grid 786,1,1] [--json OUT]

TRACE is a torch-profiler trace (``bench_decode.py --keep-traces`` writes them,
``.json`` or ``.json.gz``). For every kernel whose name contains ``--after`` and
whose predecessor in launch order (the kernel that started just before it) contains
``--before`` (any kernel if not given; ``--before-grid`` narrows it to one grid, e.g.
one GEMM shape), it takes ``start - predecessor end`` (negative: the kernel started,
programmatic dependent launch, while its predecessor still ran) and ``end -
predecessor end`` (how far it moved the step past its predecessor). Prints the count
and the median, 10th and 90th percentiles of both, in µs.

Session 24 (``docs/perf/moe_notes.md``): behind the normalising in_proj (168 registers,
3 CTAs per SM) the KDA step started a median 2.5 µs before in_proj's end and ended 9.2
µs after it; an A/B of two engines compares these numbers from their traces.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path


def seams(
    events: list[dict], after: str, before: str = "", before_grid: list[int] | None = None
) -> dict:
    """``start`` / ``end`` offsets (µs) of the ``after`` kernels against their
    predecessor's end, over the kernel events of a torch-profiler trace."""
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel"), key=lambda e: (e["ts"], e["dur"])
    )
    starts, ends = [], []
    for prev, event in zip(kernels, kernels[1:]):
        if after not in event["name"] or before not in prev["name"]:
            continue
        if before_grid is not None and prev.get("args", {}).get("grid") != before_grid:
            continue
        prev_end = prev["ts"] + prev["dur"]
        starts.append(event["ts"] - prev_end)
        ends.append(event["ts"] + event["dur"] - prev_end)
    return {"count": len(starts), "start_us": summary(starts), "end_us": summary(ends)}


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    if len(values) == 1:
        return {"median": values[0], "p10": values[0], "p90": values[0]}
    deciles = statistics.quantiles(values, n=10)
    return {"median": statistics.median(values), "p10": deciles[0], "p90": deciles[-1]}


def read_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--after", required=True, help="part of the kernel's name")
    ap.add_argument("--before", default="", help="part of the predecessor's name")
    ap.add_argument("--before-grid", help="the predecessor's grid, e.g. 786,1,1")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    grid = None
    if args.before_grid:
        try:
            grid = [int(v) for v in args.before_grid.split(",")]
        except ValueError:
            ap.error(f"--before-grid must be integers like 786,1,1, got {args.before_grid!r}")
    if not args.trace.is_file():
        ap.error(f"no trace at {args.trace}")
    result = seams(read_events(args.trace), args.after, args.before, grid)
    result.update(trace=str(args.trace), after=args.after, before=args.before, before_grid=grid)
    if result["count"] == 0:
        print(f"no {args.after!r} kernel follows a matching predecessor", file=sys.stderr)
        return 1
    for key in ("start_us", "end_us"):
        s = result[key]
        print(f"{key}: median {s['median']:.2f}  p10 {s['p10']:.2f}  p90 {s['p90']:.2f}")
    print(f"count: {result['count']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

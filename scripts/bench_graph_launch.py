#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host time of one CUDA graph replay against the graph's kernel-node count, with and
without programmatic dependent launch (PDL).

The specialized decode replays one FULL graph of ~245 kernel nodes per step, every one
launched with PDL, and at 1-2 requests vLLM's host loop, of which that replay() call is a
part (51-137 us per call on the hosts of 2026-12-01), bounds the step on most H200 hosts
(`docs/perf/host_loop.md`). This measures how the call's host time grows with the node count
and whether PDL edges cost more to launch than plain ones, on chains of a trivial one-CTA
Triton kernel (it waits for its predecessor and releases its successor like ours do when
PDL is on), so the numbers are the launch's, not any kernel's.

For each node count K and PDL off / on: one graph of K launches; the GPU's time per replay
(events around back-to-back replays) and the host's time of one replay() call, which only
enqueues the graph (median over calls), then the least-squares host microseconds per node.
Torch and Triton only (the GPU host's image, no vLLM):

    python3 scripts/bench_graph_launch.py --out-dir docs/perf
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_host_loop import time_replays  # noqa: E402

NODE_COUNTS = (1, 16, 64, 128, 256, 512)
# Replays per measurement (few enough that the launch queue never fills, so no replay() call
# waits for the GPU).
REPLAYS = 200
WARMUP_REPLAYS = 20


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    if len(set(xs)) < 2:
        raise ValueError("a fit needs two distinct node counts")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
    return mean_y - slope * mean_x, slope


def summarize(rows: list[dict]) -> dict:
    """Per PDL setting: the host us per replay at each K and the fitted us per node."""
    out = {}
    for pdl in (False, True):
        mine = sorted((r for r in rows if r["pdl"] is pdl), key=lambda r: r["nodes"])
        if len(mine) < 2:
            continue
        base, per_node = linear_fit(
            [r["nodes"] for r in mine], [r["host_us_per_replay"] for r in mine]
        )
        _, gpu_per_node = linear_fit(
            [r["nodes"] for r in mine], [r["gpu_us_per_replay"] for r in mine]
        )
        out["pdl" if pdl else "plain"] = {
            "host_us_per_node": per_node,
            "host_us_fixed": base,
            "gpu_us_per_node": gpu_per_node,
        }
    return out


def write_markdown(data: dict, path: Path) -> None:
    lines = [
        "# CUDA graph replay: host time against kernel-node count (H200)",
        "",
        f"{data['gpu']}, {data['date']}, torch {data['torch']}, triton {data['triton']}, "
        f"`{data['command']}`.",
        "",
        f"Method: {data['method']}",
        "",
        "| nodes | PDL | host us per replay() | GPU us per replay |",
        "|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['nodes']} | {'on' if r['pdl'] else 'off'} | {r['host_us_per_replay']:.1f} | "
            f"{r['gpu_us_per_replay']:.1f} |"
        )
    lines += ["", "Least-squares fit over the node counts:", ""]
    for name, fit in data["summary"].items():
        lines.append(
            f"- {name}: host {fit['host_us_fixed']:.1f} us + {fit['host_us_per_node']:.3f} us "
            f"per node; GPU {fit['gpu_us_per_node']:.3f} us per node"
        )
    path.write_text("\n".join(lines) + "\n")


_TICK: list = []


def _tick_kernel():
    """The one-CTA kernel, defined on first use (triton is not imported on CPU-only
    machines, where the report helpers above are tested) and compiled once per PDL mode."""
    if not _TICK:
        import triton
        import triton.language as tl
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        @triton.jit
        def tick(ptr, USE_PDL: tl.constexpr):
            if USE_PDL:
                gdc_wait()
            tl.store(ptr, tl.load(ptr) + 1)
            if USE_PDL:
                gdc_launch_dependents()

        _TICK.append(tick)
    return _TICK[0]


def _measure(nodes: int, pdl: bool) -> dict:
    import torch

    tick = _tick_kernel()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tick[(1,)](counter, USE_PDL=pdl, launch_pdl=pdl)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(nodes):
                tick[(1,)](counter, USE_PDL=pdl, launch_pdl=pdl)
        counter.zero_()
        for _ in range(WARMUP_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        gpu_ms, host_us = time_replays(graph, REPLAYS)
    replays = WARMUP_REPLAYS + REPLAYS
    if int(counter.item()) != nodes * replays:  # every node ran, in order, every replay
        raise RuntimeError(f"{nodes} nodes, PDL {pdl}: counter {counter.item()}")
    return {
        "nodes": nodes,
        "pdl": pdl,
        "host_us_per_replay": host_us,
        "gpu_us_per_replay": gpu_ms * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--nodes", default=",".join(map(str, NODE_COUNTS)))
    args = ap.parse_args()

    import torch
    import triton

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", flush=True)
        return 2
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for pdl in (False, True):
            rows.append(_measure(nodes, pdl))
            r = rows[-1]
            print(
                f"nodes {nodes:4d} PDL {'on ' if pdl else 'off'}: host "
                f"{r['host_us_per_replay']:7.1f} us per replay(), GPU "
                f"{r['gpu_us_per_replay']:8.1f} us per replay",
                flush=True,
            )
    data = {
        "summary": summarize(rows),
        "rows": rows,
        "method": (
            f"one graph of K launches of a one-CTA Triton kernel (load, add, store; with PDL "
            f"it waits for its predecessor and releases its successor), {WARMUP_REPLAYS} "
            f"warm-up then {REPLAYS} back-to-back replays; host = median perf_counter time "
            "of one replay() call, GPU = events around the replays / count"
        ),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python3 scripts/bench_graph_launch.py --out-dir {args.out_dir}",
    }
    print(json.dumps(data["summary"], indent=2), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "graph_launch.json").write_text(json.dumps(data, indent=2) + "\n")
    write_markdown(data, args.out_dir / "graph_launch.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the small-batch MoE block (kernels/moe) on the H200.

Kimi-Linear-48B-A3B MoE layer (256 experts, top-8, H = 2304, I = 1024, one
shared expert), M in {1, 2, 4, 8, 16}, two routing regimes:
  * dummy: router weight and score-correction bias ~ U(-1e-3, 1e-3), as
    vLLM's dummy weight loader initialises them;
  * balanced: router weight ~ N(0, 1/sqrt(2304)) (logits ~ N(0, 1)), so tokens
    spread over experts.
In one process:
  * ours: PreparedMoe.run (4 launches, PDL on), plain output;
  * stock: vLLM 0.26.0's own ops in the order KimiMoE runs them (bf16 gate
    GEMM, ops.grouped_topk, the Triton fused_experts path, shared expert
    gate_up GEMM + silu_and_mul + down GEMM, add) -- only when vLLM is
    importable; otherwise the stock column is absent and the report says so.
Timing: L layers with distinct weights (each >= 3.6 GB of experts, so every
layer step streams its experts from HBM) are captured R times in one CUDA
graph; time per layer = median over replays / (L * R).
Effective bandwidth = bytes of the distinct experts touched (counted from the
routing table) + shared expert + router weight, / time; fraction of 4.25 TB/s
(the measured read ceiling, KERNEL_NOTES.md).

Writes <out-dir>/moe.json (top-level "summary": min_bw_frac, speedup_m1, gpu,
date, command, baseline) and moe.md.

    python3 scripts/bench_moe.py --out-dir docs/perf
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.moe.prepared import MoeConfig, PreparedMoe  # noqa: E402

HBM_TBPS = 4.25
HIDDEN, INTER, EXPERTS, TOP_K, SCALE = 2304, 1024, 256, 8, 2.446
M_VALUES = (1, 2, 4, 8, 16)
REGIMES = ("dummy", "balanced")
EXPERT_BYTES = 3 * INTER * HIDDEN * 2
SHARED_BYTES = EXPERT_BYTES
ROUTER_BYTES = EXPERTS * HIDDEN * 2


def _stock_ops():
    """vLLM 0.26.0's MoE ops, or (None, reason) when vLLM is not importable."""
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import (
            fused_grouped_topk,
        )
    except Exception as exc:  # noqa: BLE001 - report any import failure
        return None, f"vLLM not importable on this host ({type(exc).__name__}: {exc})"
    return (fused_grouped_topk, fused_experts), None


class Layer:
    def __init__(self, regime: str, gen: torch.Generator, stock_ops):
        dev, bf16 = "cuda", torch.bfloat16

        def randn(*shape, std):
            return (torch.randn(*shape, generator=gen, device=dev) * std).to(bf16)

        self.w13 = randn(EXPERTS, 2 * INTER, HIDDEN, std=HIDDEN**-0.5)
        self.w2 = randn(EXPERTS, HIDDEN, INTER, std=INTER**-0.5)
        self.shared_gate_up = randn(2 * INTER, HIDDEN, std=HIDDEN**-0.5)
        self.shared_down = randn(HIDDEN, INTER, std=INTER**-0.5)
        if regime == "dummy":
            self.gate = ((torch.rand(EXPERTS, HIDDEN, generator=gen, device=dev) - 0.5)
                         * 2e-3).to(bf16)  # fmt: skip
            bias = (torch.rand(EXPERTS, generator=gen, device=dev) - 0.5) * 2e-3
        else:
            self.gate = randn(EXPERTS, HIDDEN, std=HIDDEN**-0.5)
            bias = torch.zeros(EXPERTS, device=dev)
        # vLLM creates the bias under the model dtype.
        self.bias = bias.to(bf16)
        self.moe = PreparedMoe(
            self.gate, self.bias, self.w13, self.w2, self.shared_gate_up,
            self.shared_down, TOP_K, SCALE,
        )  # fmt: skip
        self.stock_ops = stock_ops
        self.shared_h = None

    def stock(self, x: torch.Tensor) -> torch.Tensor:
        fused_grouped_topk, fused_experts = self.stock_ops
        logits = F.linear(x, self.gate)
        weights, ids = fused_grouped_topk(x, logits, TOP_K, True, self.bias, 1, 1, "sigmoid", SCALE)
        routed = fused_experts(x, self.w13, self.w2, weights, ids)
        gate_up = F.linear(x, self.shared_gate_up)
        h = torch.empty(x.shape[0], INTER, dtype=x.dtype, device=x.device)
        torch.ops._C.silu_and_mul(h, gate_up)
        return routed + F.linear(h, self.shared_down)


def time_graph(fn, layers, reps: int, replays: int, warmup: int = 3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in layers:
            fn(layer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for layer in layers:
                fn(layer)
    for _ in range(warmup):
        graph.replay()
    times = []
    calls = reps * len(layers)
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times), min(times)


def bench(regime, layers, m, reps, replays, gen, with_stock):
    x = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
    distinct = []
    for layer in layers:
        layer.moe.run(x, out)
        distinct.append(layer.moe.distinct_experts())
    row = {"regime": regime, "m": m, "distinct_experts": distinct}
    if with_stock:
        ref = layers[0].stock(x)
        layers[0].moe.run(x, out)
        torch.cuda.synchronize()
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        row["check_rel_err_vs_stock"] = rel
        if not rel < 2e-2:
            raise SystemExit(
                f"{regime} M={m}: ours disagrees with the stock ops (rel {rel:.2e});"
                " not timing a wrong kernel"
            )
    ours = time_graph(lambda lay: lay.moe.run(x, out), layers, reps, replays)
    row["ours_us"], row["ours_us_min"] = ours
    bytes_ = statistics.mean(distinct) * EXPERT_BYTES + SHARED_BYTES + ROUTER_BYTES
    row["bytes"] = bytes_
    row["bw_tbps"] = bytes_ / ours[0] / 1e6
    row["bw_frac"] = row["bw_tbps"] / HBM_TBPS
    if with_stock:
        stock = time_graph(lambda lay: lay.stock(x), layers, reps, replays)
        row["stock_us"], row["stock_us_min"] = stock
        row["speedup"] = stock[0] / ours[0]
    return row


LAUNCH_NAMES = ("router", "gate_up", "down", "combine")
SWEEP_CONFIGS = [MoeConfig(warps=w, max_slot_lanes=lanes) for w in (4, 8) for lanes in (8, 16, 32)]


def breakdown(layers, m, reps, replays, gen):
    """Per-launch cost, two ways: chained (time of the first k launches minus the first
    k - 1, so overlap shows up in the later launch) and alone (a graph of only that
    launch, the routing table left by a full run)."""
    x = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
    for lay in layers:
        lay.moe.run(x, out)
    result, previous = {}, 0.0
    for k, name in enumerate(LAUNCH_NAMES, start=1):

        def prefix(lay, k=k):
            # Bound here, inside the capture: launches() binds the stream.
            for launch in lay.moe.launches(x, out)[:k]:
                launch()

        def alone(lay, k=k):
            lay.moe.launches(x, out)[k - 1]()

        t = time_graph(prefix, layers, reps, replays)[0]
        result[name] = round(t - previous, 2)
        result[f"{name}_alone"] = round(time_graph(alone, layers, reps, replays)[0], 2)
        previous = t
    result["total"] = round(previous, 2)
    return result


def sweep(layers, m, reps, replays, gen):
    """Time the default and alternative CTA shapes on the same weights."""
    x = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
    result = {}
    for config in SWEEP_CONFIGS:
        variants = {
            id(lay): PreparedMoe(
                lay.gate,
                lay.bias,
                lay.w13,
                lay.w2,
                lay.shared_gate_up,
                lay.shared_down,
                TOP_K,
                SCALE,
                config=config,
            )  # fmt: skip
            for lay in layers
        }
        t = time_graph(lambda lay, v=variants: v[id(lay)].run(x, out), layers, reps, replays)
        result[f"warps={config.warps},lanes={config.max_slot_lanes}"] = round(t[0], 2)
    return result


def write_markdown(summary: dict, rows: list[dict], path: Path) -> None:
    has_stock = any("stock_us" in r for r in rows)
    lines = [
        "# Small-batch MoE block (kernels/moe) on the H200",
        "",
        f"{summary['gpu']}, {summary['date']}, `{summary['command']}`.",
        "",
        f"Baseline: {summary['baseline']}.",
        "",
        "Per-layer time: median over CUDA-graph replays of L layers x R repetitions "
        "(distinct weights per layer), divided by L x R.  Bytes = distinct experts "
        "touched x 14.2 MB + shared expert 14.2 MB + router 1.2 MB.  "
        f"Compile time per M-bucket (4 kernels): {summary['compile_s']}.",
        "",
        "| regime | M | distinct experts | ours us | TB/s | % of 4.25 |"
        + (" stock us | speedup |" if has_stock else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if has_stock else ""),
    ]
    for r in rows:
        d = statistics.mean(r["distinct_experts"])
        line = (
            f"| {r['regime']} | {r['m']} | {d:.1f} | {r['ours_us']:.2f} | "
            f"{r['bw_tbps']:.2f} | {100 * r['bw_frac']:.0f}% |"
        )
        if has_stock:
            line += f" {r.get('stock_us', float('nan')):.2f} | {r.get('speedup', 0):.2f}x |"
        lines.append(line)
    s = summary
    lines += [
        "",
        f"min_bw_frac = {s['min_bw_frac']:.3f} (target >= 0.85); speedup_m1 = "
        + (f"{s['speedup_m1']:.2f}x" if s["speedup_m1"] else "n/a (no stock ops)")
        + " (target >= 1.5x, dummy routing).",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "perf")
    ap.add_argument("--m", default=",".join(map(str, M_VALUES)))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="also time each launch separately and sweep CTA shapes (M = 1, 16)",
    )
    args = ap.parse_args()
    if args.render_only:
        data = json.loads((args.out_dir / "moe.json").read_text())
        write_markdown(data["summary"], data["rows"], args.out_dir / "moe.md")
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("error: needs an SM90 GPU", file=sys.stderr)
        return 2
    stock_ops, why_no_stock = _stock_ops()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    diagnostics = []
    compile_s = {}
    for regime in REGIMES:
        layers = [Layer(regime, gen, stock_ops) for _ in range(args.layers)]
        start = time.perf_counter()
        for b, s in layers[0].moe.compile().items():
            compile_s[b] = round(s, 2)
        print(f"compiled in {time.perf_counter() - start:.1f} s: {compile_s}", flush=True)
        for m in (int(v) for v in args.m.split(",")):
            row = bench(regime, layers, m, args.reps, args.replays, gen, stock_ops is not None)
            rows.append(row)
            print(
                f"{regime:8s} M={m:2d} experts {statistics.mean(row['distinct_experts']):5.1f} "
                f"ours {row['ours_us']:7.2f} us {row['bw_tbps']:.2f} TB/s "
                f"({100 * row['bw_frac']:.0f}%)"
                + (
                    f"  stock {row['stock_us']:7.2f} us  x{row['speedup']:.2f}"
                    if "stock_us" in row
                    else ""
                ),
                flush=True,
            )
        if args.diagnose and regime == "balanced":
            for m in (1, 16):
                diag = {
                    "m": m,
                    "breakdown_us": breakdown(layers, m, args.reps, args.replays, gen),
                    "sweep_us": sweep(layers, m, args.reps, args.replays, gen),
                }
                diagnostics.append(diag)
                print(json.dumps(diag), flush=True)
        del layers
        torch.cuda.empty_cache()
    m1 = next((r for r in rows if r["regime"] == "dummy" and r["m"] == 1), None)
    baseline = (
        "vLLM 0.26.0 ops in KimiMoE order: bf16 gate GEMM (cuBLAS), ops.grouped_topk, "
        "Triton fused_experts (2 fused_moe GEMMs + silu_and_mul + moe_sum), shared "
        "expert gate_up GEMM + silu_and_mul + down GEMM, add; same CUDA-graph method"
        if stock_ops is not None
        else f"none: {why_no_stock}"
    )
    summary = {
        "min_bw_frac": min(r["bw_frac"] for r in rows),
        "speedup_m1": m1.get("speedup") if m1 else None,
        "compile_s": {str(k): v for k, v in compile_s.items()},
        "launches_per_layer": 4,
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "baseline": baseline,
        "targets": {"min_bw_frac": 0.85, "speedup_m1": 1.5},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "moe.json").write_text(
        json.dumps({"summary": summary, "rows": rows, "diagnostics": diagnostics}, indent=2) + "\n"
    )
    write_markdown(summary, rows, args.out_dir / "moe.md")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the skinny CuTe DSL GEMM (kernels/gemm) against cuBLAS on the H200.

For every Kimi-Linear-48B-A3B decode projection x M in {1,2,4,8,16}, in one
process, times
  * ours: PreparedGemm with the epilogue the decode uses (and plain),
  * cublas: torch.mm into a preallocated output,
  * cublas+epilogue: torch.mm then the stock-style separate epilogue kernel
    (SiLU-and-mul / add+RMSNorm, each one fused kernel made by torch.compile,
    as vLLM's Inductor path does; falls back to eager torch ops if Inductor is
    unavailable, which the report then says).
Timing: each measured call is captured L times in one CUDA graph, each capture
reading a different copy of the weight (copies rotate through >= 2x the 60 MB
L2, so weights come from HBM like in a decode step); the graph is replayed
with CUDA events around it; per-call time = median replay time / L.

Writes <out-dir>/gemm.json (top-level "summary" with min_bw_frac_m1_large,
mix_speedup_m1, shapes_slower_than_cublas, gpu, date, command) and gemm.md.
Ours carries the launch bounds the executor gives that weight
(``EXECUTOR_LAUNCH_BOUNDS``; ``--unbounded``: none), so the table is the kernels as the
decode launches them. ``--min-ctas 4,6,8`` also times ours (plain, PDL) with launch
bounds of that many CTAs an SM at every M-bucket (``GemmConfig.min_ctas_per_sm``), in
the same graphs' method, checked bit for bit against the unbounded launch first; rows
"min_ctas" in the JSON. Ours also streams the weights the executor stages through shared
memory that way (``EXECUTOR_WEIGHT_STAGES``; ``--unstaged``: the register stream);
``--weight-stages 2,3,5`` also times every shape (plain, PDL) with that many stages at
every M-bucket, checked against the fp32 product; rows "weight_stages" in the JSON.

    python3 scripts/bench_gemm.py --out-dir docs/perf
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.gemm import prepared as pg  # noqa: E402

HBM_READ_TBPS = 4.25  # measured bf16 read ceiling on this H200 (KERNEL_NOTES.md)
L2_BYTES = 60 * 2**20
M_VALUES = (1, 2, 4, 8, 16)
EPS = 1e-5
MAX_COPIES = 128

# name: (N, K, epilogue in the decode, calls per decode step at batch 1)
SHAPES = {
    "kda_in_qkv_b_fa_ga": (12576, 2304, "plain", 20),
    "kda_f_b_g_b": (4096, 128, "plain", 40),
    "kda_o_proj": (2304, 4096, "residual_rmsnorm", 20),
    "mla_q_proj": (6144, 2304, "plain", 7),
    "mla_kv_a_proj": (576, 2304, "plain", 7),
    "mla_o_proj": (2304, 4096, "residual_rmsnorm", 7),
    "shared_gate_up": (2048, 2304, "silu_mul", 26),
    # The MoE shared expert's output is summed with the routed experts before
    # the next norm, so its down projection is counted with a plain epilogue.
    "shared_down": (2304, 1024, "plain", 26),
    "dense_gate_up": (18432, 2304, "silu_mul", 1),
    "dense_down": (2304, 9216, "residual_rmsnorm", 1),
    "lm_head": (163840, 2304, "plain", 1),
}

# {M-bucket: CTAs an SM} the executor's launch bounds promise ptxas for these weights: the
# runtime's GEMM_MIN_CTAS_BUCKET_16 (runtime/decode.py), given to the KDA in_proj, the MLA
# q / kv_a projection (one fused 6720 x 2304 weight there, two shapes here) and the dense
# gate_up. The executor's other per-GEMM choice, the in_proj's 3 pre-wait K-steps, is left
# out: it pays beside the KDA step in the engine, not in a chain of in_proj launches.
EXECUTOR_LAUNCH_BOUNDS = {
    "kda_in_qkv_b_fa_ga": {16: 4},
    "mla_q_proj": {16: 4},
    "mla_kv_a_proj": {16: 4},
    "dense_gate_up": {16: 4},
}
# {M-bucket: stages} of the weights the executor streams through shared memory
# (runtime/decode.py's KDA_IN_PROJ_WEIGHT_STAGES).
EXECUTOR_WEIGHT_STAGES = {"kda_in_qkv_b_fa_ga": {8: 2}}


def _silu_mul(y):
    inter = y.shape[1] // 2
    return torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]


def _add_rmsnorm(y, residual, gamma):
    hidden = y + residual
    var = hidden.float().pow(2).mean(dim=-1, keepdim=True)
    return (hidden.float() * torch.rsqrt(var + EPS)).to(y.dtype) * gamma, hidden


def _time_graph(fn_list, replays=15):
    """fn_list: callables, each one launch; captured in order in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fn_list[: min(len(fn_list), 4)]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fn_list:
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fn_list))
    del graph
    return statistics.median(times), statistics.pstdev(times)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out-dir", type=Path, default=Path("docs/perf"))
    ap.add_argument("--calls", type=int, default=40, help="launches per graph (>= copies)")
    ap.add_argument("--shapes", default="all", help="comma list of shape names")
    ap.add_argument(
        "--min-ctas",
        default="",
        help="comma list of launch bounds (CTAs an SM) to time ours plain with",
    )
    ap.add_argument(
        "--unbounded",
        action="store_true",
        help="time ours without the executor's launch bounds (EXECUTOR_LAUNCH_BOUNDS)",
    )
    ap.add_argument(
        "--unstaged",
        action="store_true",
        help="time ours with the register stream only (no EXECUTOR_WEIGHT_STAGES)",
    )
    ap.add_argument(
        "--weight-stages",
        default="",
        help="comma list of shared-memory stage counts to time ours plain with",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time alternative (warps_k, split_k, unroll) configs, all without launch "
        "bounds (at M = 16 the bounded shapes' base config then differs from ours)",
    )
    args = ap.parse_args()
    args.min_ctas = [int(c) for c in args.min_ctas.split(",") if c]
    args.weight_stages = [int(c) for c in args.weight_stages.split(",") if c]
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (SM90)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    num_sms = props.multi_processor_count
    command = "python3 " + " ".join(sys.argv)
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")

    epilogue_impl = "torch.compile (Inductor, one fused kernel each)"
    try:
        silu_mul_k = torch.compile(_silu_mul, dynamic=True)
        add_rmsnorm_k = torch.compile(_add_rmsnorm, dynamic=True)
        for m in (1, 2, 16):  # M=1 is specialised apart from the dynamic M
            y = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
            silu_mul_k(y)
            add_rmsnorm_k(y[:, :2304], y[:, :2304], y[0, :2304])
    except Exception as exc:  # noqa: BLE001 - report and fall back
        epilogue_impl = f"eager torch ops (torch.compile failed: {type(exc).__name__})"
        silu_mul_k, add_rmsnorm_k = _silu_mul, _add_rmsnorm

    rows = []
    sweep_rows = []
    bound_rows = []
    staged_rows = []
    compile_log = {}
    gen = torch.Generator(device=dev).manual_seed(0)
    for name in names:
        n, k, epilogue, per_step = SHAPES[name]
        wbytes = n * k * 2
        copies = max(1, min(MAX_COPIES, math.ceil(2 * L2_BYTES / wbytes)))
        calls = max(args.calls, copies) if copies > 1 else max(8, args.calls // 4)
        weights = [
            (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
            for _ in range(copies)
        ]
        gamma = (1 + 0.1 * torch.randn(n, device=dev, generator=gen)).to(torch.bfloat16)
        variants = ["plain"] + ([epilogue] if epilogue != "plain" else [])
        bounds = None if args.unbounded else EXECUTOR_LAUNCH_BOUNDS.get(name)
        stages = None if args.unstaged else EXECUTOR_WEIGHT_STAGES.get(name)
        prepared = {}
        for ep in variants:
            kw = {"rmsnorm_weight": gamma, "eps": EPS} if ep == "residual_rmsnorm" else {}
            if stages:
                kw["weight_stages"] = stages
            for pdl in (True, False):
                key = ep if pdl else ep + "_nopdl"
                prepared[key] = [
                    pg.PreparedGemm(w, ep, use_pdl=pdl, min_ctas_per_sm=bounds, **kw)
                    for w in weights
                ]
                secs = prepared[key][0].compile()
                compile_log[f"{name}/{key}"] = {str(b): round(v, 3) for b, v in secs.items()}
        # The --min-ctas rows compare against ours without any bound.
        prepared["plain_unbounded"] = prepared["plain"]
        if args.min_ctas and bounds:
            prepared["plain_unbounded"] = [pg.PreparedGemm(w, "plain") for w in weights]
            prepared["plain_unbounded"][0].compile()
        for ctas in args.min_ctas:
            key = f"plain_ctas{ctas}"
            prepared[key] = [pg.PreparedGemm(w, "plain", min_ctas_per_sm=ctas) for w in weights]
            secs = prepared[key][0].compile()
            compile_log[f"{name}/{key}"] = {str(b): round(v, 3) for b, v in secs.items()}
        for count in args.weight_stages:
            key = f"plain_stages{count}"
            try:
                prepared[key] = [pg.PreparedGemm(w, "plain", weight_stages=count) for w in weights]
                secs = prepared[key][0].compile()
            except ValueError as exc:  # e.g. the stages do not fit a CTA's shared memory
                prepared.pop(key, None)
                staged_rows.append({"shape": name, "weight_stages": count, "error": str(exc)})
                print(f"   {name} weight_stages {count}: {exc}", flush=True)
                continue
            compile_log[f"{name}/{key}"] = {str(b): round(v, 3) for b, v in secs.items()}
        ctx = (
            n, k, epilogue, weights, prepared, gamma, copies, calls, dev, gen,
            silu_mul_k, add_rmsnorm_k, args, sweep_rows, bound_rows, staged_rows,
        )  # fmt: skip
        for m in M_VALUES:
            row = _measure(ctx, name, m)
            if row is None:
                return 1
            rows.append(row)
        del weights, prepared
        torch.cuda.empty_cache()

    by = {(r["shape"], r["M"]): r for r in rows}
    large = [r for r in rows if r["M"] == 1 and r["N"] * r["K"] >= 4 * 2**20]
    mix_ours = sum(SHAPES[s][3] * by[(s, 1)]["ours_fused_us"] for s in names)
    mix_base = sum(SHAPES[s][3] * by[(s, 1)]["cublas_epilogue_us"] for s in names)
    slower = [r for r in rows if r["ours_plain_us"] > r["cublas_us"]]
    slower_fused = [
        r for r in rows if r["epilogue"] != "plain" and r["ours_fused_us"] > r["cublas_epilogue_us"]
    ]
    summary = {
        "min_bw_frac_m1_large": min((r["ours_bw_frac"] for r in large), default=None),
        "mix_speedup_m1": mix_base / mix_ours if names == list(SHAPES) else None,
        "shapes_slower_than_cublas": len(slower) + len(slower_fused),
        "without_pdl": {
            "min_bw_frac_m1_large": min(
                (r["weight_bytes"] / r["ours_plain_nopdl_us"] / 1e6 / HBM_READ_TBPS for r in large),
                default=None,
            ),
            "mix_speedup_m1": mix_base
            / sum(SHAPES[s][3] * by[(s, 1)]["ours_fused_nopdl_us"] for s in names),
            "shapes_slower_than_cublas": sum(
                r["ours_plain_nopdl_us"] > r["cublas_us"] for r in rows
            )
            + sum(
                r["epilogue"] != "plain" and r["ours_fused_nopdl_us"] > r["cublas_epilogue_us"]
                for r in rows
            ),
        },
        "mix_us_m1": {"ours": mix_ours, "cublas_plus_epilogues": mix_base},
        "gpu": torch.cuda.get_device_name(dev),
        "num_sms": num_sms,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "torch": torch.__version__,
        "cutlass_dsl": __import__("cutlass").__version__,
        "epilogue_baseline": epilogue_impl,
        "hbm_read_tbps_reference": HBM_READ_TBPS,
        "launch_bounds": {}
        if args.unbounded
        else {s: {str(b): c for b, c in v.items()} for s, v in EXECUTOR_LAUNCH_BOUNDS.items()},
        "weight_stages": {}
        if args.unstaged
        else {s: {str(b): c for b, c in v.items()} for s, v in EXECUTOR_WEIGHT_STAGES.items()},
        "large_means": "N*K >= 4*2**20 (4M elements)",
    }
    configs = {}
    for name in names:
        n, k, ep, _ = SHAPES[name]
        for b in (8, 16):
            c = pg.choose_config(n if ep != "silu_mul" else n, k, b, num_sms)
            configs[f"{name}/m{b}"] = [c.warps_k, c.split_k, c.unroll]
    result = {
        "summary": summary,
        "rows": rows,
        "configs": configs,
        "compile_seconds": compile_log,
        "sweep": sweep_rows,
        "min_ctas": bound_rows,
        "weight_stages": staged_rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gemm.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "gemm.md").write_text(_markdown(result))
    print(json.dumps(summary, indent=1))
    return 0


def _measure(ctx, name, m):
    """Time ours (PDL / no PDL), cuBLAS and cuBLAS+epilogue for one (shape, M);
    returns the row (or None after a failed correctness guard)."""
    (n, k, epilogue, weights, prepared, gamma, copies, calls, dev, gen,
     silu_mul_k, add_rmsnorm_k, args, sweep_rows, bound_rows, staged_rows) = ctx  # fmt: skip
    wbytes = n * k * 2
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    y_half = torch.empty(m, n // 2, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(m, n, device=dev, generator=gen).to(torch.bfloat16)
    res_out = torch.empty_like(residual)
    normed = torch.empty_like(residual)
    # correctness guard: ours vs cuBLAS on copy 0
    prepared["plain"][0].run(x, y)
    ref = x.float() @ weights[0].float().t()
    err = float((y.float() - ref).norm() / ref.norm())
    if err > 5e-3:
        print(f"error: {name} M={m} relative error {err:.2e}", file=sys.stderr)
        return None

    def ours(ep, i, pdl=True):
        p = prepared[ep if pdl else ep + "_nopdl"][i % copies]
        if ep == "plain":
            return lambda: p.run(x, y)
        if ep == "silu_mul":
            return lambda: p.run(x, y_half)
        return lambda: p.run(x, normed, residual=residual, residual_out=res_out)

    def cublas(i, with_epilogue):
        w = weights[i % copies]
        if not with_epilogue or epilogue == "plain":
            return lambda: torch.mm(x, w.t(), out=y)
        if epilogue == "silu_mul":
            return lambda: (torch.mm(x, w.t(), out=y), silu_mul_k(y))
        return lambda: (
            torch.mm(x, w.t(), out=y),
            add_rmsnorm_k(y, residual, gamma),
        )

    row = {
        "shape": name,
        "N": n,
        "K": k,
        "M": m,
        "epilogue": epilogue,
        "weight_bytes": wbytes,
        "copies": copies,
        "calls_per_graph": calls,
    }
    t, sd = _time_graph([ours("plain", i) for i in range(calls)])
    row["ours_plain_us"], row["ours_plain_sd_us"] = t, sd
    t, _ = _time_graph([ours("plain", i, False) for i in range(calls)])
    row["ours_plain_nopdl_us"] = t
    t, sd = _time_graph([cublas(i, False) for i in range(calls)])
    row["cublas_us"], row["cublas_sd_us"] = t, sd
    if epilogue != "plain":
        t, sd = _time_graph([ours(epilogue, i) for i in range(calls)])
        row["ours_fused_us"], row["ours_fused_sd_us"] = t, sd
        t, _ = _time_graph([ours(epilogue, i, False) for i in range(calls)])
        row["ours_fused_nopdl_us"] = t
        t, sd = _time_graph([cublas(i, True) for i in range(calls)])
        row["cublas_epilogue_us"], row["cublas_epilogue_sd_us"] = t, sd
    else:
        row["ours_fused_us"] = row["ours_plain_us"]
        row["ours_fused_nopdl_us"] = row["ours_plain_nopdl_us"]
        row["cublas_epilogue_us"] = row["cublas_us"]
    row["ours_bw_tbps"] = wbytes / row["ours_plain_us"] / 1e6
    row["ours_bw_frac"] = row["ours_bw_tbps"] / HBM_READ_TBPS
    row["cublas_bw_tbps"] = wbytes / row["cublas_us"] / 1e6
    row["speedup_vs_cublas"] = row["cublas_us"] / row["ours_plain_us"]
    row["speedup_fused_vs_cublas_epilogue"] = row["cublas_epilogue_us"] / row["ours_fused_us"]
    print(
        f"{name:20s} M={m:2d} ours {row['ours_plain_us']:8.2f} us "
        f"(no PDL {row['ours_plain_nopdl_us']:7.2f}) "
        f"({row['ours_bw_frac'] * 100:5.1f}% BW)  cublas {row['cublas_us']:8.2f} us  "
        f"fused {row['ours_fused_us']:8.2f} vs {row['cublas_epilogue_us']:8.2f} us",
        flush=True,
    )
    unbounded = prepared["plain_unbounded"]
    if args.min_ctas and unbounded is not prepared["plain"]:
        unbounded_us, _ = _time_graph(
            [(lambda p=unbounded[i % copies]: p.run(x, y)) for i in range(calls)]
        )
    else:
        unbounded_us = row["ours_plain_us"]
    for ctas in args.min_ctas:
        bounded = prepared[f"plain_ctas{ctas}"]
        want, got = torch.empty_like(y), torch.empty_like(y)
        unbounded[0].run(x, want)
        bounded[0].run(x, got)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            print(f"error: {name} M={m} min_ctas {ctas} differs from unbounded", file=sys.stderr)
            return None
        t, sd = _time_graph([(lambda p=bounded[i % copies]: p.run(x, y)) for i in range(calls)])
        bound_rows.append(
            {
                "shape": name,
                "M": m,
                "min_ctas_per_sm": ctas,
                "us": t,
                "sd_us": sd,
                "unbounded_us": unbounded_us,
                "bw_frac": wbytes / t / 1e6 / HBM_READ_TBPS,
            }
        )
        print(
            f"   {name} M={m} min_ctas {ctas}: {t:.2f} us (unbounded {unbounded_us:.2f})",
            flush=True,
        )
    for count in args.weight_stages:
        staged = prepared.get(f"plain_stages{count}")
        if staged is None:
            continue
        staged[0].run(x, y)
        err = float((y.float() - ref).norm() / ref.norm())
        if err > 5e-3:
            print(f"error: {name} M={m} {count} stages: relative error {err:.2e}", file=sys.stderr)
            return None
        t, sd = _time_graph([(lambda p=staged[i % copies]: p.run(x, y)) for i in range(calls)])
        staged_rows.append(
            {
                "shape": name,
                "M": m,
                "weight_stages": count,
                "us": t,
                "sd_us": sd,
                "ours_us": row["ours_plain_us"],
                "cublas_us": row["cublas_us"],
                "bw_frac": wbytes / t / 1e6 / HBM_READ_TBPS,
            }
        )
        print(
            f"   {name} M={m} weight_stages {count}: {t:.2f} us "
            f"(ours {row['ours_plain_us']:.2f}, cublas {row['cublas_us']:.2f})",
            flush=True,
        )
    if args.sweep and m in (1, 16):
        bucket = pg.m_bucket_for(m)
        base = prepared["plain"][0].configs[bucket]
        cands = {
            (base.warps_k, base.split_k, base.unroll),
            (min(8, base.warps_k * 2), base.split_k, base.unroll),
            (max(1, base.warps_k // 2), base.split_k, base.unroll),
            (base.warps_k, base.split_k * 2, base.unroll),
            (base.warps_k, max(1, base.split_k // 2), base.unroll),
            (max(1, base.warps_k // 2), base.split_k * 2, base.unroll),
        }
        for wk, sk, un in sorted(cands):
            cfg = pg.GemmConfig(wk, sk, un)
            try:
                ps = [pg.PreparedGemm(w, "plain", config={bucket: cfg}) for w in weights]
                ps[0].compile((bucket,))
            except ValueError as exc:
                sweep_rows.append(
                    {
                        "shape": name,
                        "M": m,
                        "config": [wk, sk, un],
                        "error": str(exc),
                    }
                )
                continue
            t, _ = _time_graph([(lambda p=ps[i % copies]: p.run(x, y)) for i in range(calls)])
            sweep_rows.append(
                {
                    "shape": name,
                    "M": m,
                    "config": [wk, sk, un],
                    "us": t,
                    "bw_frac": wbytes / t / 1e6 / HBM_READ_TBPS,
                }
            )
            print(
                f"   sweep {name} M={m} cfg={wk, sk, un}: {t:.2f} us",
                flush=True,
            )
    return row


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _markdown(result) -> str:
    s = result["summary"]
    out = [
        "# Skinny CuTe DSL GEMM vs cuBLAS (kernels/gemm)",
        "",
        f"- GPU: {s['gpu']} ({s['num_sms']} SMs); torch {s['torch']}, "
        f"nvidia-cutlass-dsl {s['cutlass_dsl']}",
        f"- Date: {s['date']}",
        f"- Command: `{s['command']}`",
        "- Method: each call captured N times in one CUDA graph, every capture reading "
        "another copy of the weight (copies span >= 2x the 60 MB L2), graph replayed "
        "between CUDA events; per-call time = median replay / N (includes the in-graph "
        "launch gap, as in a decode step). Bandwidth = weight bytes / time, fraction of "
        f"{s['hbm_read_tbps_reference']} TB/s (measured read ceiling).",
        f"- Epilogue baseline: torch.mm then {s['epilogue_baseline']}.",
        "- Launch bounds of ours, as the executor sets them ({M-bucket: CTAs an SM}): "
        + (
            ", ".join(f"{k} {v}" for k, v in s["launch_bounds"].items())
            if s.get("launch_bounds")
            else "none"
        )
        + ".",
        "- Weight stages of ours, as the executor sets them ({M-bucket: stages}): "
        + (
            ", ".join(f"{k} {v}" for k, v in s["weight_stages"].items())
            if s.get("weight_stages")
            else "none (the register stream)"
        )
        + ".",
        "",
        "## Summary",
        "",
        f"- min_bw_frac_m1_large (M=1, N*K >= 4M): **{_f(s['min_bw_frac_m1_large'])}** "
        "(target >= 0.85)",
        f"- mix_speedup_m1 (per-step shape mix at M=1 vs torch.mm + epilogues): "
        f"**{_f(s['mix_speedup_m1'])}x** (target >= 1.8x); ours "
        f"{s['mix_us_m1']['ours']:.1f} us vs {s['mix_us_m1']['cublas_plus_epilogues']:.1f} us",
        f"- shapes_slower_than_cublas (all shapes x M, plain vs torch.mm and fused vs "
        f"torch.mm+epilogue): **{s['shapes_slower_than_cublas']}** (target 0)",
        "- Ours is launched with programmatic dependent launch (PDL), as the decode "
        "chains its kernels: each kernel starts streaming its weights while the previous "
        "one drains. cuBLAS/Inductor kernels are launched as torch launches them. Without "
        f"PDL: min_bw_frac_m1_large {_f(s['without_pdl']['min_bw_frac_m1_large'])}, "
        f"mix_speedup_m1 {_f(s['without_pdl']['mix_speedup_m1'])}x, "
        f"shapes_slower_than_cublas {s['without_pdl']['shapes_slower_than_cublas']}.",
        "",
        "## Per shape (us per call)",
        "",
        "| shape | N | K | M | ours plain | no PDL | BW % | cuBLAS | ratio | epilogue "
        "| ours fused | no PDL | cuBLAS+epi | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        fused = r["epilogue"] != "plain"
        out.append(
            f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {r['ours_plain_us']:.2f} | "
            f"{r['ours_plain_nopdl_us']:.2f} | "
            f"{r['ours_bw_frac'] * 100:.1f} | {r['cublas_us']:.2f} | "
            f"{r['speedup_vs_cublas']:.2f}x | {r['epilogue']} | "
            + (
                f"{r['ours_fused_us']:.2f} | {r['ours_fused_nopdl_us']:.2f} | "
                f"{r['cublas_epilogue_us']:.2f} | "
                f"{r['speedup_fused_vs_cublas_epilogue']:.2f}x |"
                if fused
                else "- | - | - | - |"
            )
        )
    out += ["", "## Compile time per variant (s, M-bucket 8 / 16)", ""]
    for key, secs in result["compile_seconds"].items():
        out.append(f"- {key}: " + ", ".join(f"m{b}: {v}" for b, v in secs.items()))
    out += ["", "## Launch configs (warps_k, split_k, unroll)", ""]
    for key, cfg in result["configs"].items():
        out.append(f"- {key}: {tuple(cfg)}")
    if result["sweep"]:
        out += ["", "## Config sweep (plain, us)", ""]
        for r in result["sweep"]:
            out.append(
                f"- {r['shape']} M={r['M']} {tuple(r['config'])}: "
                + (f"{r['us']:.2f} us ({r['bw_frac'] * 100:.1f}% BW)" if "us" in r else r["error"])
            )
    if result["min_ctas"]:
        out += ["", "## Launch bounds (plain, PDL, us; bit-identical to unbounded)", ""]
        out += [
            "| shape | M | CTAs an SM | bounded | unbounded | ratio |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["min_ctas"]:
            out.append(
                f"| {r['shape']} | {r['M']} | {r['min_ctas_per_sm']} | {r['us']:.2f} | "
                f"{r['unbounded_us']:.2f} | {r['unbounded_us'] / r['us']:.3f}x |"
            )
    if result.get("weight_stages"):
        out += ["", "## Weight stages at every M-bucket (plain, PDL, us)", ""]
        out += [
            "| shape | M | stages | staged | ours | cuBLAS | staged BW % |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["weight_stages"]:
            if "error" in r:
                out.append(f"| {r['shape']} | - | {r['weight_stages']} | {r['error']} | | | |")
                continue
            out.append(
                f"| {r['shape']} | {r['M']} | {r['weight_stages']} | {r['us']:.2f} | "
                f"{r['ours_us']:.2f} | {r['cublas_us']:.2f} | {r['bw_frac'] * 100:.1f} |"
            )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())

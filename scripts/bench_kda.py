#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the fused KDA decode step (kernels/kda) on the H200.

For batch in {1,2,4,8,16,32,64} (Kimi-Linear: 32 heads x 128), in one process:
  * ours: PreparedKda.run, one launch per layer-step (PDL on);
  * stock: vLLM 0.26.0's own decode kernels in the order its KDA layer runs
    them (three causal_conv1d_update, fused_kda_gate, beta sigmoid,
    fused_recurrent_kda, rms_norm_gated), when vLLM is importable;
  * torch ops: the same sequence as batched torch ops
    (tests/kernels/kda_reference.vectorized_step), always.
The summary's speedup_b1 is against the stock kernels when they ran, else
against the torch ops; the report says which.
Timing: L layer-steps, each on its own layer's caches (L chosen so the
touched state is >= 3x the 60 MB L2, so state comes from HBM as in a decode
step), are captured in one CUDA graph; the graph is replayed with CUDA events
around each replay; time per layer-step = median replay / L.
Bytes per layer-step: state read + write (B x 32 x 128 x 128 x 4 B x 2), conv
state read + write, inputs (q, k, v, g1, g2, beta) and output, and the layer's
weights.  state_bw_frac = state bytes / time / 4.25 TB/s (the measured read
ceiling, KERNEL_NOTES.md).

Writes <out-dir>/kda.json (top-level "summary": speedup_b1,
state_bw_frac_b16plus, gpu, date, command, baseline) and kda.md.

    python3 scripts/bench_kda.py --out-dir docs/perf
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
from kda_reference import gate_projection, vectorized_step  # noqa: E402

from kernels.kda.kernel import GATE_RANK, HEAD_DIM  # noqa: E402
from kernels.kda.prepared import PreparedKda  # noqa: E402

HBM_TBPS = 4.25
L2_BYTES = 60 * 2**20
HEADS = 32
PROJ = HEADS * HEAD_DIM
BATCHES = (1, 2, 4, 8, 16, 32, 64)
MAX_LAYERS = 96
# Stock vLLM 0.26.0 at batch 1 on this H200 (baselines/stock_vllm_0.26.0_h200.md,
# torch profiler, 20 KDA layers): causal_conv1d_update 0.14 ms, fused_recurrent
# 0.08, kda_gate 0.04 per step -- 13 us per layer before the gated RMSNorm and
# the memsets/copies, which the profile does not break out per layer.
STOCK_PROFILE_US_B1 = (0.14 + 0.08 + 0.04) * 1000 / 20


def _vllm_kda_ops():
    """vLLM 0.26.0's KDA decode kernels, or (None, reason) without vLLM."""
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
            causal_conv1d_update,
        )
        from vllm.third_party.flash_linear_attention.ops.kda import (
            fused_kda_gate,
            fused_recurrent_kda,
            rms_norm_gated,
        )
    except Exception as exc:  # noqa: BLE001 - any import failure means no vLLM here
        return None, f"vLLM not importable on this host ({type(exc).__name__}: {exc})"
    return (causal_conv1d_update, fused_kda_gate, fused_recurrent_kda, rms_norm_gated), None


VLLM_OPS, NO_VLLM_REASON = None, None


class Layer:
    def __init__(self, batch, gen, warps=8):
        dev = "cuda"
        self.conv_weight = torch.randn(3, PROJ, 4, device=dev, generator=gen) * 0.5
        self.a_log = torch.rand(HEADS, device=dev, generator=gen) * 2 - 1.5
        self.dt_bias = torch.randn(PROJ, device=dev, generator=gen) * 0.2 - 2.0
        self.norm_weight = (1 + 0.1 * torch.randn(HEAD_DIM, device=dev, generator=gen)).to(
            torch.bfloat16
        )
        slots = batch + 1  # slot 0 is the null block
        self.conv_state = torch.randn(slots, 3, 3 * PROJ, device=dev, generator=gen).to(
            torch.bfloat16
        )
        self.state = torch.randn(slots, HEADS, HEAD_DIM, HEAD_DIM, device=dev, generator=gen) * 0.1
        self.prepared = PreparedKda(
            tuple(w.view(PROJ, 1, 4) for w in self.conv_weight),
            self.a_log, self.dt_bias, self.norm_weight, self.conv_state, self.state,
            num_heads=HEADS,
        )  # fmt: skip
        # The decode executor's variant: the slot, state and conv history are
        # loaded before the PDL wait (here the previous layer's step drains
        # meanwhile; its caches are other tensors, so nothing races).
        self.prepared_early = PreparedKda(
            tuple(w.view(PROJ, 1, 4) for w in self.conv_weight),
            self.a_log, self.dt_bias, self.norm_weight, self.conv_state, self.state,
            num_heads=HEADS, state_loads_before_wait=True,
        )  # fmt: skip
        # The decode executor's kernel since hd.5: also f_b / g_b applied inside
        # (inputs f_a(x), g_a(x)), on the same caches.
        self.gate_weights = tuple(
            (torch.randn(PROJ, GATE_RANK, device=dev, generator=gen) * GATE_RANK**-0.5).to(
                torch.bfloat16
            )
            for _ in range(2)
        )
        self.prepared_low_rank = PreparedKda(
            tuple(w.view(PROJ, 1, 4) for w in self.conv_weight),
            self.a_log, self.dt_bias, self.norm_weight, self.conv_state, self.state,
            num_heads=HEADS, state_loads_before_wait=True, gate_weights=self.gate_weights,
        )  # fmt: skip
        # The same caches bound to the 16-warp variant of the kernel.
        self.prepared16 = PreparedKda(
            tuple(w.view(PROJ, 1, 4) for w in self.conv_weight),
            self.a_log, self.dt_bias, self.norm_weight, self.conv_state, self.state,
            num_heads=HEADS, warps=16,
        )  # fmt: skip
        self.copy_dst = torch.empty_like(self.state[1:])
        self.cu_seqlens = torch.arange(batch + 1, device=dev, dtype=torch.int32)

    def stock_vllm(self, q, k, v, g1, beta, g2, slots, out):
        """vLLM 0.26.0's decode kernels on this layer's caches (its layouts: the
        conv state seen as (slots, channels, 3), the recurrent state as is)."""
        conv_update, kda_gate, recurrent, norm_gated = VLLM_OPS
        batch = q.shape[0]
        conv_states = self.conv_state.transpose(-1, -2).chunk(3, dim=-2)
        convs = [
            conv_update(x, cs, w, None, activation="silu", conv_state_indices=slots)
            for x, cs, w in zip((q, k, v), conv_states, self.conv_weight)
        ]
        qs, ks, vs = (t.view(1, batch, HEADS, HEAD_DIM) for t in convs)
        g = kda_gate(g1, self.a_log.view(1, 1, HEADS, 1), HEAD_DIM, g_bias=self.dt_bias).unsqueeze(
            0
        )
        o, _ = recurrent(
            q=qs, k=ks, v=vs, g=g, beta=beta.float().sigmoid().unsqueeze(0),
            initial_state=self.state, use_qk_l2norm_in_kernel=True,
            cu_seqlens=self.cu_seqlens, ssm_state_indices=slots,
        )  # fmt: skip
        normed = norm_gated(
            o[0], g2.view(batch, HEADS, HEAD_DIM), self.norm_weight, None,
            activation="sigmoid", eps=1e-5,
        )  # fmt: skip
        out.copy_(normed.reshape(batch, PROJ))

    def baseline(self, q, k, v, g1, beta, g2, slots, out):
        vectorized_step(
            q, k, v, g1, beta, g2, slots, self.conv_state, self.state,
            self.conv_weight, self.a_log, self.dt_bias, self.norm_weight, HEADS, out,
        )  # fmt: skip


def layer_bytes(batch):
    state = batch * HEADS * HEAD_DIM * HEAD_DIM * 4 * 2
    conv = batch * 3 * 3 * PROJ * 2 * 2
    inputs = batch * (5 * PROJ + HEADS + PROJ) * 2  # q k v g1 g2, beta, out
    weights = 3 * PROJ * 4 * 4 + PROJ * 4 + HEADS * 4 + HEAD_DIM * 4
    return state, state + conv + inputs + weights


def time_graph(fn, layers, replays, warmup=3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in layers:
            fn(layer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in layers:
            fn(layer)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(layers))  # us per layer-step
    return statistics.median(times), min(times), max(times)


def bench_batch(batch, replays, gen):
    state_b, total_b = layer_bytes(batch)
    n_layers = min(MAX_LAYERS, max(2, math.ceil(3 * L2_BYTES / state_b)))
    layers = [Layer(batch, gen) for _ in range(n_layers)]
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    q, k, v, g1, g2 = (rnd(batch, PROJ) for _ in range(5))
    beta = rnd(batch, HEADS)
    slots = torch.arange(1, batch + 1, device="cuda", dtype=torch.int32)
    out = torch.empty(batch, PROJ, device="cuda", dtype=torch.bfloat16)
    out_ref = torch.empty_like(out)

    f_a, g_a = (rnd(batch, GATE_RANK) for _ in range(2))
    # Sanity: one step of ours against each baseline from the same caches.
    layer = layers[0]
    conv0, state0 = layer.conv_state.clone(), layer.state.clone()
    layer.prepared.run(q, k, v, g1, beta, g2, slots, out)
    got_state = layer.state.clone()
    checks = {}
    baselines = {"torch": Layer.baseline}
    if VLLM_OPS is not None:
        baselines["vllm"] = Layer.stock_vllm
    for name, fn in baselines.items():
        layer.conv_state.copy_(conv0)
        layer.state.copy_(state0)
        fn(layer, q, k, v, g1, beta, g2, slots, out_ref)
        torch.cuda.synchronize()
        out_err = float((out.float() - out_ref.float()).norm() / out_ref.float().norm())
        state_err = float((got_state - layer.state).norm() / layer.state.norm())
        checks[name] = (out_err, state_err)
        if not (out_err < 5e-3 and state_err < 1e-4):
            raise SystemExit(
                f"batch {batch}: kernel disagrees with the {name} baseline (out "
                f"{out_err:.2e}, state {state_err:.2e}); not timing a wrong kernel"
            )
    # The low-rank variant against the full-gate kernel fed f_b f_a(x), g_b g_a(x).
    full_g1, full_g2 = (gate_projection(x, w) for x, w in zip((f_a, g_a), layer.gate_weights))
    for name, run in (
        ("full_gates", lambda o: layer.prepared.run(q, k, v, full_g1, beta, full_g2, slots, o)),
        ("low_rank", lambda o: layer.prepared_low_rank.run(q, k, v, f_a, beta, g_a, slots, o)),
    ):
        layer.conv_state.copy_(conv0)
        layer.state.copy_(state0)
        run(out_ref if name == "full_gates" else out)
        torch.cuda.synchronize()
        if name == "full_gates":
            full_state = layer.state.clone()
    out_err = float((out.float() - out_ref.float()).norm() / out_ref.float().norm())
    state_err = float((layer.state - full_state).norm() / full_state.norm())
    checks["low_rank_vs_full_gates"] = (out_err, state_err)
    if not (out_err < 5e-3 and state_err < 1e-4):
        raise SystemExit(
            f"batch {batch}: the low-rank-gate kernel disagrees with the full-gate one "
            f"(out {out_err:.2e}, state {state_err:.2e}); not timing a wrong kernel"
        )

    ours = time_graph(
        lambda lay: lay.prepared.run(q, k, v, g1, beta, g2, slots, out), layers, replays
    )
    early = time_graph(
        lambda lay: lay.prepared_early.run(q, k, v, g1, beta, g2, slots, out),
        layers,
        replays,
    )
    low_rank = time_graph(
        lambda lay: lay.prepared_low_rank.run(q, k, v, f_a, beta, g_a, slots, out),
        layers,
        replays,
    )
    ours16 = time_graph(
        lambda lay: lay.prepared16.run(q, k, v, g1, beta, g2, slots, out), layers, replays
    )
    # Ceiling for this size: a device copy of the same state bytes (read +
    # write), captured and rotated the same way.
    copy = time_graph(lambda lay: lay.copy_dst.copy_(lay.state[1:]), layers, replays)
    base = time_graph(
        lambda lay: lay.baseline(q, k, v, g1, beta, g2, slots, out_ref), layers, replays
    )
    stock = None
    if VLLM_OPS is not None:
        stock = time_graph(
            lambda lay: lay.stock_vllm(q, k, v, g1, beta, g2, slots, out_ref),
            layers,
            replays,
        )
    stock_fields = (
        {"stock_vllm_us": stock[0], "stock_vllm_us_min": stock[1],
         "speedup_vs_stock_vllm": stock[0] / ours[0]}
        if stock
        else {}
    )  # fmt: skip
    return {
        "batch": batch,
        "layers_in_graph": n_layers,
        "ours_us": ours[0],
        "ours_us_min": ours[1],
        "ours_us_max": ours[2],
        "ours_early_us": early[0],
        "ours_early_us_min": early[1],
        "ours_low_rank_us": low_rank[0],
        "ours_low_rank_us_min": low_rank[1],
        "ours_w16_us": ours16[0],
        "ours_w16_us_min": ours16[1],
        "state_copy_us": copy[0],
        "baseline_us": base[0],
        "baseline_us_min": base[1],
        "speedup": base[0] / ours[0],
        "state_bytes": state_b,
        "total_bytes": total_b,
        "state_bw_tbps": state_b / ours[0] / 1e6,
        "total_bw_tbps": total_b / ours[0] / 1e6,
        "state_bw_frac": state_b / ours[0] / 1e6 / HBM_TBPS,
        "state_bw_frac_w16": state_b / ours16[0] / 1e6 / HBM_TBPS,
        "state_bw_frac_early": state_b / early[0] / 1e6 / HBM_TBPS,
        "state_bw_frac_low_rank": state_b / low_rank[0] / 1e6 / HBM_TBPS,
        "state_copy_bw_frac": state_b / copy[0] / 1e6 / HBM_TBPS,
        **stock_fields,
        "check_rel_err": {k: {"out": o, "state": st} for k, (o, st) in checks.items()},
    }


def write_markdown(summary: dict, rows: list[dict], path: Path) -> None:
    """kda.md from the measured numbers (also: --render-only from kda.json)."""
    lines = [
        "# Fused KDA decode step (kernels/kda) on the H200",
        "",
        f"{summary['gpu']}, {summary['date']}, `{summary['command']}`.",
        "",
        f"Baseline: {summary['baseline']}.",
        f"Stock reference from the engine profile: {summary['stock_profile_us_b1']:.1f} "
        "us per layer at batch 1 (conv + recurrence + gate kernels only; "
        "baselines/stock_vllm_0.26.0_h200.md).",
        "",
        "Time per layer-step: median over CUDA-graph replays of L layer-steps on "
        "distinct caches (>= 3x L2), divided by L.  'ours' is the PreparedKda default "
        "(8 warps per CTA), 'state early' the decode executor's variant (slot, state "
        "and conv history loaded before the PDL wait, overlapping the previous "
        "layer-step), 'low-rank' that variant also applying f_b / g_b to f_a(x) / "
        "g_a(x) itself (the executor's kernel since hd.5; it replaces a separate "
        "f_b|g_b GEMM launch), '16-warp' the alternative CTA shape on the same caches; "
        "'state copy' is a device copy of the same state bytes (read + write), the "
        "bandwidth ceiling for this size.",
        "",
        "| batch | ours us | state early us | low-rank us | 16-warp us | state copy us | "
        "stock vLLM us | speedup | torch ops us | speedup | state TB/s | "
        "state % of 4.25 | state early % | total TB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stock = (
            f"{r['stock_vllm_us']:.2f} | {r['speedup_vs_stock_vllm']:.2f}"
            if "stock_vllm_us" in r
            else "- | -"
        )
        early = (
            f"{r['ours_early_us']:.2f}", f"{100 * r['state_bw_frac_early']:.0f}%"
        ) if "ours_early_us" in r else ("-", "-")  # fmt: skip
        low_rank = f"{r['ours_low_rank_us']:.2f}" if "ours_low_rank_us" in r else "-"
        lines.append(
            f"| {r['batch']} | {r['ours_us']:.2f} | {early[0]} | {low_rank} | "
            f"{r['ours_w16_us']:.2f} | "
            f"{r['state_copy_us']:.2f} | {stock} | {r['baseline_us']:.2f} | "
            f"{r['speedup']:.2f} | {r['state_bw_tbps']:.2f} | "
            f"{100 * r['state_bw_frac']:.0f}% | {early[1]} | {r['total_bw_tbps']:.2f} |"
        )
    sb = summary["speedup_b1"]
    bw = summary["state_bw_frac_b16plus"]
    lines += [
        "",
        f"speedup_b1 = {sb:.2f} (target >= 3), vs the stock profile "
        f"{summary['speedup_b1_vs_stock_profile']:.2f}; state_bw_frac_b16plus = "
        f"{bw:.2f} (target >= 0.80)."
        if sb is not None and bw is not None
        else "summary incomplete: batch 1 or batch >= 16 not run",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "perf")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite kda.md from <out-dir>/kda.json without measuring",
    )
    args = ap.parse_args()
    if args.render_only:
        data = json.loads((args.out_dir / "kda.json").read_text())
        write_markdown(data["summary"], data["rows"], args.out_dir / "kda.md")
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("error: needs an SM90 GPU", file=sys.stderr)
        return 2
    global VLLM_OPS, NO_VLLM_REASON
    VLLM_OPS, NO_VLLM_REASON = _vllm_kda_ops()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = bench_batch(batch, args.replays, gen)
        rows.append(row)
        # Rows so far, in case the run is cut short (the summary comes at the end).
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "kda_rows.partial.json").write_text(json.dumps(rows, indent=2))
        print(
            f"B={batch:3d} L={row['layers_in_graph']:3d} ours {row['ours_us']:7.2f} us  "
            f"early {row['ours_early_us']:7.2f} us  "
            f"w16 {row['ours_w16_us']:7.2f} us  copy {row['state_copy_us']:7.2f} us  "
            f"torch ops {row['baseline_us']:8.2f} us  x{row['speedup']:5.2f}  "
            + (
                f"stock {row['stock_vllm_us']:7.2f} us  x{row['speedup_vs_stock_vllm']:5.2f}  "
                if "stock_vllm_us" in row
                else ""
            )
            + f"state {row['state_bw_tbps']:.2f} TB/s ({100 * row['state_bw_frac']:.0f}%)  "
            f"total {row['total_bw_tbps']:.2f} TB/s",
            flush=True,
        )
        torch.cuda.empty_cache()
    b1 = next((r for r in rows if r["batch"] == 1), None)
    big = [r["state_bw_frac"] for r in rows if r["batch"] >= 16]
    torch_ops = (
        "batched torch ops of the stock sequence (tests/kernels/kda_reference."
        "vectorized_step: 3 conv updates, gate, recurrence, gated RMSNorm; "
        "gather/scatter of the slots' states) in a CUDA graph"
    )
    if VLLM_OPS is not None:
        baseline = (
            "vLLM 0.26.0's own decode kernels in its KDA layer's order "
            "(3x causal_conv1d_update, fused_kda_gate, beta sigmoid, "
            "fused_recurrent_kda, rms_norm_gated) in a CUDA graph, same process; "
            f"also {torch_ops}"
        )
        speedup_b1 = b1["speedup_vs_stock_vllm"] if b1 else None
    else:
        baseline = f"{torch_ops}; {NO_VLLM_REASON}"
        speedup_b1 = b1["speedup"] if b1 else None
    summary = {
        "speedup_b1": speedup_b1,
        "speedup_b1_vs_torch_ops": b1["speedup"] if b1 else None,
        "state_bw_frac_b16plus": min(big) if big else None,
        "speedup_b1_vs_stock_profile": STOCK_PROFILE_US_B1 / b1["ours_us"] if b1 else None,
        "early_speedup_b1": (
            b1.get("stock_vllm_us", b1["baseline_us"]) / b1["ours_early_us"] if b1 else None
        ),
        "early_state_bw_frac_b16plus": min(
            (r["state_bw_frac_early"] for r in rows if r["batch"] >= 16), default=None
        ),
        "w16_speedup_b1": b1["baseline_us"] / b1["ours_w16_us"] if b1 else None,
        "w16_state_bw_frac_b16plus": min(
            (r["state_bw_frac_w16"] for r in rows if r["batch"] >= 16), default=None
        ),
        "kernel_config": (
            "PreparedKda default (8 warps per CTA); early_* = the decode executor's "
            "variant (state_loads_before_wait); w16_* = 16 warps"
        ),
        "stock_profile_us_b1": STOCK_PROFILE_US_B1,
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "baseline": baseline,
        "targets": {"speedup_b1": 3.0, "state_bw_frac_b16plus": 0.8},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kda.json").write_text(
        json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n"
    )
    write_markdown(summary, rows, args.out_dir / "kda.md")
    (args.out_dir / "kda_rows.partial.json").unlink()
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

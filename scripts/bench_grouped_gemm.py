#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the grouped skinny GEMM (MLA's per-head absorptions) on the H200.

For M in {1, 2, 4, 8, 16}, in one process, the two absorptions of a Kimi-Linear
MLA layer (32 heads, P = V = 128, L = 512) as the decode executor runs them
(``PreparedGroupedGemm``: W_UV read in place from a kv_b_proj-shaped matrix,
W_UK from its [N, L, P] copy, x strided as in the step) against what vLLM 0.26.0
runs (``torch.bmm`` with ``W_UK_T`` [N, P, L] and ``W_UV`` [N, L, V], i.e. cuBLAS).
Each timed graph chains copies of the launch on distinct weights (> 3x the 60 MB
L2), so weights come from HBM; time = median replay / copies.  Effective
bandwidth = weight bytes (4 MiB per absorption) / time.

    python3 scripts/bench_grouped_gemm.py --out-dir docs/perf
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench_gemm  # noqa: E402
from kernels.gemm.prepared import PreparedGroupedGemm  # noqa: E402

HBM_TBPS = 4.25
HEADS, NOPE, ROPE, V_HEAD, LORA = 32, 128, 64, 128, 512
Q_ROW = HEADS * (NOPE + ROPE) + LORA + ROPE
M_VALUES = (1, 2, 4, 8, 16)
COPIES = 64  # 64 x 4 MiB = 256 MiB of weights per graph, > 3x L2
WEIGHT_BYTES = HEADS * LORA * NOPE * 2  # per absorption (W_UK and W_UV alike)


def _time_graph(fns, replays=20):
    """µs per launch of ``fns`` captured in one graph (bench_gemm's method, median)."""
    return bench_gemm._time_graph(fns, replays)[0]


def _measure(m, layers, rnd):
    """One row: both absorptions, ours and torch.bmm, at M = m."""
    bf16 = torch.bfloat16
    q_rows = rnd(m, Q_ROW)
    q_nope = q_rows[:, : HEADS * (NOPE + ROPE)].view(m, HEADS, NOPE + ROPE)[..., :NOPE]
    latent = rnd(m, HEADS, LORA)
    ql = torch.empty(m, HEADS * LORA, device="cuda", dtype=bf16)
    up = torch.empty(m, HEADS * V_HEAD, device="cuda", dtype=bf16)
    ql_bmm = torch.empty(HEADS, m, LORA, device="cuda", dtype=bf16)
    up_bmm = torch.empty(m, HEADS, V_HEAD, device="cuda", dtype=bf16)
    # Same numbers both ways first (not timing a wrong kernel).
    lay = layers[0]
    lay["uk"].run(q_nope, ql)
    lay["uv"].run(latent, up)
    torch.bmm(q_nope.transpose(0, 1), lay["w_uk_t"], out=ql_bmm)
    torch.bmm(latent.transpose(0, 1), lay["w_uv"], out=up_bmm.transpose(0, 1))
    for name, ours, ref in (
        ("w_uk", ql.view(m, HEADS, LORA), ql_bmm.transpose(0, 1)),
        ("w_uv", up.view(m, HEADS, V_HEAD), up_bmm),
    ):
        err = float((ours.float() - ref.float()).norm() / ref.float().norm())
        if err > 5e-3:
            raise SystemExit(f"M={m} {name}: ours vs torch.bmm rel err {err:.2e}")
    t = {
        "w_uk_ours_us": _time_graph([lambda lay=lay: lay["uk"].run(q_nope, ql) for lay in layers]),
        "w_uk_bmm_us": _time_graph(
            [
                lambda lay=lay: torch.bmm(q_nope.transpose(0, 1), lay["w_uk_t"], out=ql_bmm)
                for lay in layers
            ]
        ),
        "w_uv_ours_us": _time_graph([lambda lay=lay: lay["uv"].run(latent, up) for lay in layers]),
        "w_uv_bmm_us": _time_graph(
            [
                lambda lay=lay: torch.bmm(
                    latent.transpose(0, 1), lay["w_uv"], out=up_bmm.transpose(0, 1)
                )
                for lay in layers
            ]
        ),
    }
    row = {"m": m, **t}
    for op in ("w_uk", "w_uv"):
        row[f"{op}_speedup"] = t[f"{op}_bmm_us"] / t[f"{op}_ours_us"]
        row[f"{op}_bw_frac"] = WEIGHT_BYTES / t[f"{op}_ours_us"] / 1e6 / HBM_TBPS
    print(
        f"M={m:2d}  W_UK {t['w_uk_ours_us']:.2f} us vs bmm {t['w_uk_bmm_us']:.2f}  "
        f"W_UV {t['w_uv_ours_us']:.2f} us vs bmm {t['w_uv_bmm_us']:.2f}",
        flush=True,
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "perf")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(bf16)

    # Per copy: kv_b_proj [N*(P+V), L] and the tensors vLLM derives from it.
    layers = []
    for _ in range(COPIES):
        kv_b = rnd(HEADS * (NOPE + V_HEAD), LORA, scale=LORA**-0.5)
        w_uk_l, w_uv_l = kv_b.T.view(LORA, HEADS, NOPE + V_HEAD).split([NOPE, V_HEAD], -1)
        w_uk_t = w_uk_l.permute(1, 2, 0).contiguous()  # vLLM's W_UK_T [N, P, L]
        w_uv = w_uv_l.transpose(0, 1).contiguous()  # vLLM's W_UV [N, L, V]
        layers.append(
            {
                "w_uk_t": w_uk_t,
                "w_uv": w_uv,
                "uk": PreparedGroupedGemm(w_uk_t.transpose(1, 2).contiguous()),
                "uv": PreparedGroupedGemm(kv_b.view(HEADS, NOPE + V_HEAD, LORA)[:, NOPE:]),
            }
        )
    rows = [_measure(m, layers, rnd) for m in M_VALUES]
    result = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 scripts/bench_grouped_gemm.py " + " ".join(sys.argv[1:]),
        "baseline": "torch.bmm (cuBLAS) with vLLM 0.26.0's W_UK_T [N, P, L] / W_UV [N, L, V]",
        "weight_bytes_per_absorption": WEIGHT_BYTES,
        "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gemm_grouped.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Grouped skinny GEMM: MLA's W_UK / W_UV absorptions (32 heads) on the H200",
        "",
        f"{result['gpu']}, {result['date']}, `{result['command']}`; baseline "
        f"{result['baseline']}. Median per launch over CUDA-graph replays of {COPIES} "
        "launches on distinct weights (4 MiB each, from HBM).",
        "",
        "| M | W_UK ours us | W_UK bmm us | speedup | % of 4.25 TB/s | "
        "W_UV ours us | W_UV bmm us | speedup | % of 4.25 TB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['m']} | {r['w_uk_ours_us']:.2f} | {r['w_uk_bmm_us']:.2f} | "
            f"{r['w_uk_speedup']:.2f}x | {100 * r['w_uk_bw_frac']:.0f}% | "
            f"{r['w_uv_ours_us']:.2f} | {r['w_uv_bmm_us']:.2f} | "
            f"{r['w_uv_speedup']:.2f}x | {100 * r['w_uv_bw_frac']:.0f}% |"
        )
    (args.out_dir / "gemm_grouped.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

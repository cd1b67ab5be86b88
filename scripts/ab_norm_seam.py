#!/usr/bin/env python3
"""A/B of the attention -> MoE seam: where the post-attention RMSNorm runs.

    python3 scripts/ab_norm_seam.py --out DIR [--m 1,2,4,8,16]     # on the H200

Per layer, o_proj (2304 x 4096, a weight of its own per layer) then the MoE block
(bench_moe's layers: 4 distinct weight sets, both routing regimes), chained in one
CUDA graph as the decode executor chains them:

* ``gemm_norm``: o_proj with the residual + RMSNorm epilogue (grid ticket, then the
  last tile's whole-row pass or the grid barrier), the MoE on its normed output;
* ``router_norm``: o_proj with ``residual_sumsq`` (residual add, sums of squares into
  the MoE's ``input_sums``), the MoE's router normalising the residual itself.

Both variants run on the same weights and buffers in one process, interleaved
(``ab_kernels._interleaved``: median of 3 graphs each); outputs are compared first.
Prints one JSON line per case and writes DIR/ab_norm_seam.json. Our kernels against
our kernels: no stock sequence in this comparison.
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
sys.path.insert(0, str(ROOT / "scripts"))

import ab_kernels  # noqa: E402
import bench_moe as bm  # noqa: E402
from kernels.gemm.prepared import PreparedGemm  # noqa: E402
from kernels.moe.prepared import PreparedMoe  # noqa: E402

ATTN_WIDTH = 4096
EPS = 1e-5


class Seam:
    """One layer's o_proj weight and both variants of o_proj + MoE on it."""

    def __init__(self, layer: bm.Layer, gen: torch.Generator):
        bf16 = torch.bfloat16
        hidden = bm.HIDDEN
        self.w_o = (
            torch.randn(hidden, ATTN_WIDTH, generator=gen, device="cuda") / ATTN_WIDTH**0.5
        ).to(bf16)
        post_norm = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(bf16)
        next_norm = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(bf16)
        weights = (
            layer.gate, layer.bias, layer.w13, layer.w2, layer.shared_gate_up,
            layer.shared_down, bm.TOP_K, bm.SCALE,
        )  # fmt: skip
        self.o_norm = PreparedGemm(self.w_o, "residual_rmsnorm", rmsnorm_weight=post_norm)
        self.moe = PreparedMoe(*weights, rmsnorm_weight=next_norm, eps=EPS)
        self.o_sums = PreparedGemm(self.w_o, "residual_sumsq")
        self.moe_norm = PreparedMoe(
            *weights, rmsnorm_weight=next_norm, eps=EPS,
            input_norm_weight=post_norm, input_eps=EPS,
        )  # fmt: skip

    def gemm_norm(self, bufs: dict) -> None:
        self.o_norm.run(bufs["attn"], bufs["x"], bufs["residual"], bufs["mid"])
        self.moe.run(bufs["x"], bufs["out"], bufs["mid"], bufs["residual_out"])

    def router_norm(self, bufs: dict) -> None:
        self.o_sums.run(
            bufs["attn"], None, bufs["residual"], bufs["mid"], sums=self.moe_norm.input_sums
        )
        self.moe_norm.run(bufs["x"], bufs["out"], bufs["mid"], bufs["residual_out"])


def buffers(m: int, gen: torch.Generator) -> dict:
    bf16 = torch.bfloat16
    bufs = {
        "attn": torch.randn(m, ATTN_WIDTH, generator=gen, device="cuda").to(bf16),
        "residual": torch.randn(m, bm.HIDDEN, generator=gen, device="cuda").to(bf16),
    }
    for name in ("x", "mid", "out", "residual_out"):
        bufs[name] = torch.empty(m, bm.HIDDEN, dtype=bf16, device="cuda")
    return bufs


def run(m_values, gen) -> list[dict]:
    rows = []
    for regime in bm.REGIMES:
        seams = [Seam(bm.Layer(regime, gen, None), gen) for _ in range(4)]
        for m in m_values:
            bufs_a, bufs_b = buffers(m, gen), buffers(m, gen)
            for name in ("attn", "residual"):
                bufs_b[name].copy_(bufs_a[name])
            seams[0].gemm_norm(bufs_a)
            seams[0].router_norm(bufs_b)
            torch.cuda.synchronize()
            row = {
                "regime": regime,
                "m": m,
                "residual_equal": bool(torch.equal(bufs_a["mid"], bufs_b["mid"])),
                "x_rel_diff": ab_kernels._agree("x", bufs_b["x"], bufs_a["x"], 1e-2),
                "out_rel_diff": ab_kernels._agree(
                    f"seam {regime} M={m}", bufs_b["out"], bufs_a["out"], 2e-2
                ),
            }
            timed = ab_kernels._interleaved(
                lambda launch, seams=seams: bm.time_graph(launch, seams, 4, 20)[0],
                lambda s, b=bufs_a: s.gemm_norm(b),
                lambda s, b=bufs_b: s.router_norm(b),
            )
            row |= {
                "gemm_norm_us": timed["base_us"],
                "router_norm_us": timed["new_us"],
                "router_over_gemm": timed["new_over_base"],
                "runs_us": timed["runs_us"],
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
        del seams
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--m", default="1,2,4,8,16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (SM90)", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = run([int(m) for m in args.m.split(",")], gen)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "what": "o_proj (2304 x 4096) + MoE per layer, µs per layer, chained in one "
        "graph over 4 layers x 4 repetitions; gemm_norm = residual_rmsnorm epilogue, "
        "router_norm = residual_sumsq + the router's own norm",
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 scripts/ab_norm_seam.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    (args.out / "ab_norm_seam.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

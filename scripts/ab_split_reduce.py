#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A/B of the skinny GEMM's split-K reduction: thread-block cluster vs global tickets.

    python3 scripts/ab_split_reduce.py --out DIR [--m 1,2,4,8,16] [--cases ...]  # on the H200

For the decode shapes whose launch splits K across CTAs (bench_gemm's SHAPES: o_proj
2304 x 4096 with residual_sumsq and plain, kv_a 576 x 2304 plain, dense down
2304 x 9216 with residual_rmsnorm), the same PreparedGemm twice on the same weights:

* ``cluster``: ``cluster_split_k=True`` (the default): the split CTAs of a tile form
  a cluster and reduce through distributed shared memory;
* ``ticket``: ``cluster_split_k=False``: partials through a global workspace, a
  GPU-scope fence and an atomic ticket per tile, the last CTA re-reading them.

Outputs are compared first: what the split reduction alone determines (out of plain,
residual_out of the residual epilogues) must be bit-identical, or nothing is timed;
the sums of squares and the RMSNorm's out, which also add the tiles' squares with
float atomics in arrival order, are reported (bit-equal or not, normwise difference).
Timing is bench_gemm's method (``bench_gemm._time_graph``: chained launches in one
CUDA graph, rotating over weight copies spanning >= 2x the L2 so weights stream from
HBM), the two variants interleaved (``ab_kernels._interleaved``: median of 3 graphs
each). Prints a table and writes DIR/ab_split_reduce.json. Our kernel against our
kernel: no stock sequence in this comparison.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import ab_kernels  # noqa: E402

# (bench_gemm shape, epilogue): every split launch of the decode step.
CASES = {
    "o_proj_sumsq": ("kda_o_proj", "residual_sumsq"),
    "o_proj_plain": ("kda_o_proj", "plain"),
    "kv_a_plain": ("mla_kv_a_proj", "plain"),
    "dense_down_rmsnorm": ("dense_down", "residual_rmsnorm"),
}
M_VALUES = "1,2,4,8,16"
# Launches per graph (at least one per weight copy), as bench_gemm's --calls.
CALLS = 40
# Normwise agreement of the outputs that are not bit-exact by construction (atomics).
SUMS_REL_LIMIT = 1e-5
NORMED_REL_LIMIT = 1e-2
JSON_NAME = "ab_split_reduce.json"


class Case:
    """Weight copies of one shape and both reductions bound to each copy."""

    def __init__(self, shape: str, epilogue: str, use_pdl: bool, gen):
        import torch

        import bench_gemm as bg
        from kernels.gemm.prepared import PreparedGemm

        n, k, _, _ = bg.SHAPES[shape]
        self.n, self.k, self.epilogue = n, k, epilogue
        self.copies = max(2, min(bg.MAX_COPIES, math.ceil(2 * bg.L2_BYTES / (n * k * 2))))
        weights = [
            (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
            for _ in range(self.copies)
        ]
        extra = {}
        if epilogue == "residual_rmsnorm":
            gamma = 1 + 0.1 * torch.randn(n, device="cuda", generator=gen)
            extra = {"rmsnorm_weight": gamma.to(torch.bfloat16), "eps": bg.EPS}
        self.variants = {
            name: [
                PreparedGemm(w, epilogue, use_pdl=use_pdl, cluster_split_k=flag, **extra)
                for w in weights
            ]
            for name, flag in (("cluster", True), ("ticket", False))
        }
        for prepared in self.variants.values():
            prepared[0].compile()  # the process cache serves every copy

    def configs(self) -> dict:
        from kernels.gemm.kernel import uses_cluster_split_k

        first = self.variants["cluster"][0]
        return {
            f"m{b}": {
                "warps_k": c.warps_k,
                "split_k": c.split_k,
                "cluster": uses_cluster_split_k(c.split_k, True),
            }
            for b, c in first.configs.items()
        }

    def buffers(self, m: int, gen) -> dict:
        """Inputs shared by both variants, outputs of their own."""
        import torch

        bf16 = torch.bfloat16
        bufs = {
            "x": torch.randn(m, self.k, device="cuda", generator=gen).to(bf16),
            "residual": torch.randn(m, self.n, device="cuda", generator=gen).to(bf16),
        }
        for name in self.variants:
            bufs[name] = {
                "out": torch.empty(m, self.n, device="cuda", dtype=bf16),
                "residual_out": torch.empty(m, self.n, device="cuda", dtype=bf16),
                "sums": torch.zeros(16, device="cuda", dtype=torch.float32),
            }
        return bufs

    def launch(self, variant: str, copy: int, bufs: dict) -> None:
        prepared = self.variants[variant][copy]
        own = bufs[variant]
        if self.epilogue == "plain":
            prepared.run(bufs["x"], own["out"])
        elif self.epilogue == "residual_sumsq":
            prepared.run(bufs["x"], None, bufs["residual"], own["residual_out"], sums=own["sums"])
        else:
            prepared.run(bufs["x"], own["out"], bufs["residual"], own["residual_out"])


def _compare(case: Case, bufs: dict, what: str) -> dict:
    """One launch of each variant on copy 0; refuses to time on a mismatch of what
    the split reduction alone determines."""
    import torch

    for name in case.variants:
        for t in bufs[name].values():
            t.fill_(0.0 if t.dtype == torch.float32 else float("nan"))
        case.launch(name, 0, bufs)
    torch.cuda.synchronize()
    got, ref = bufs["cluster"], bufs["ticket"]
    exact = "out" if case.epilogue == "plain" else "residual_out"
    row = {f"{exact}_bit_equal": ab_kernels.bits_equal(got[exact], ref[exact])}
    if got[exact].isnan().any() or not row[f"{exact}_bit_equal"]:
        raise SystemExit(f"{what}: cluster and ticket {exact} differ; not timing")
    if case.epilogue == "residual_sumsq":
        row["sums_bit_equal"] = ab_kernels.bits_equal(got["sums"], ref["sums"])
        row["sums_rel_diff"] = ab_kernels._agree(
            what + " sums", got["sums"], ref["sums"], SUMS_REL_LIMIT
        )
    if case.epilogue == "residual_rmsnorm":
        row["normed_bit_equal"] = ab_kernels.bits_equal(got["out"], ref["out"])
        row["normed_rel_diff"] = ab_kernels._agree(
            what + " normed", got["out"], ref["out"], NORMED_REL_LIMIT
        )
    return row


def run(case_names: list[str], m_values: list[int], use_pdl: bool, calls: int) -> list[dict]:
    import torch

    import bench_gemm as bg

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for case_name in case_names:
        shape, epilogue = CASES[case_name]
        case = Case(shape, epilogue, use_pdl, gen)
        per_graph = max(calls, case.copies)
        for m in m_values:
            what = f"{case_name} M={m}"
            bufs = case.buffers(m, gen)
            row = {
                "case": case_name,
                "shape": shape,
                "N": case.n,
                "K": case.k,
                "epilogue": epilogue,
                "m": m,
                "configs": case.configs(),
                "copies": case.copies,
                "launches_per_graph": per_graph,
            }
            row |= _compare(case, bufs, what)

            def timer(launch, copies=case.copies, per_graph=per_graph):
                fns = [lambda i=i: launch(i % copies) for i in range(per_graph)]
                return bg._time_graph(fns)[0]

            timed = ab_kernels._interleaved(
                timer,
                lambda c, b=bufs, ab=case: ab.launch("ticket", c, b),
                lambda c, b=bufs, ab=case: ab.launch("cluster", c, b),
            )
            row |= {
                "ticket_us": timed["base_us"],
                "cluster_us": timed["new_us"],
                "cluster_over_ticket": timed["new_over_base"],
                "saving_us": timed["base_us"] - timed["new_us"],
                "runs_us": {"ticket": timed["runs_us"]["base"], "cluster": timed["runs_us"]["new"]},
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
        del case, bufs
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"{'case':20s} {'M':>3s} {'split':>5s} {'ticket us':>10s} {'cluster us':>11s} "
        f"{'saving us':>10s} {'ratio':>6s}  bit-equal",
    ]
    for r in rows:
        bucket = "m8" if r["m"] <= 8 else "m16"
        equal = ", ".join(k.removesuffix("_bit_equal") + ("=yes" if v else "=no")
                          for k, v in r.items() if k.endswith("_bit_equal"))  # fmt: skip
        lines.append(
            f"{r['case']:20s} {r['m']:3d} {r['configs'][bucket]['split_k']:5d} "
            f"{r['ticket_us']:10.2f} {r['cluster_us']:11.2f} {r['saving_us']:10.2f} "
            f"{r['cluster_over_ticket']:6.3f}  {equal}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = ab_kernels.ab_parser(__doc__, JSON_NAME, M_VALUES)
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated subset of {', '.join(CASES)} (default: all)",
    )
    parser.add_argument("--calls", type=int, default=CALLS, help="launches per graph")
    parser.add_argument(
        "--no-pdl", action="store_true", help="launch without programmatic dependent launch"
    )
    args = parser.parse_args()
    case_names = ab_kernels.parsed_subset(parser, args.cases, CASES, "case")
    m_values = ab_kernels.parsed_token_counts(parser, args.m)
    missing = ab_kernels.sm90_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    rows = run(case_names, m_values, not args.no_pdl, args.calls)
    print(table(rows))
    what = (
        "skinny GEMM split-K reduction, µs per launch: cluster (distributed "
        "shared memory, cluster_split_k=True) vs ticket (global partials + atomic "
        "ticket, cluster_split_k=False), chained launches in one CUDA graph over "
        "weight copies spanning >= 2x L2, interleaved, median of 3 graphs each"
    )
    ab_kernels.write_report(
        args.out, JSON_NAME, "ab_split_reduce.py",
        {"what": what, "use_pdl": not args.no_pdl}, rows,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

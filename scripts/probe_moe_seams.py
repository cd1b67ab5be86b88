#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upper bounds of what reworking the MoE router or folding away the combine can save.

    python3 scripts/probe_moe_seams.py --out DIR [--m 1,2] [--variants ...]   # H200

At N = 1 the router and the combine take ~127 and ~91 µs of a 2.13 ms decode step
(advance in the kernel trace, wheel hd.14) while moving almost no bytes: they are latency
on the critical path between the weight streams. Before either is rebuilt, this probe
measures how much of that latency the surrounding launches would actually give back.

Per layer, chained in one CUDA graph as the decode executor chains them (bench_moe's
layers: 4 distinct weight sets, both routing regimes; ``ab_norm_seam.Seam``'s o_proj):
o_proj (2304 x 4096, ``residual_sumsq``) -> the MoE normalising its own input (router,
gate_up, down, combine with the next layer's RMSNorm) -> the next layer's KDA in_proj
(12576 x 2304, plain), reading the MoE's normed output. Variants:

* ``full``: every launch (the executor's chain);
* ``no_combine``: the combine left out, in_proj chained straight behind ``down``;
* ``no_router``: the router left out, gate_up chained straight behind o_proj and
  reading the routing table and normed x a full run left (o_proj then adds its
  squares into a scratch buffer: nothing re-arms the MoE's own sums);
* ``no_router_no_combine``: both left out.
* ``engine`` (the executor's MoE configuration), ``engine_prewaitS`` (its in_proj with S
  weight steps before its wait), ``engine_expert_regs128`` (its expert launches with
  launch bounds that let ptxas use 128 registers a thread) and ``engine_prewait3_ctasC``
  (in_proj with 3 pre-wait steps and launch bounds of C CTAs an SM): full chains, their
  outputs checked against ``full``'s.

A variant without a launch computes garbage on purpose (stale tables and inputs): it is
a timing bound, never a kernel. ``full`` minus a variant is the most a rework of the
missing launch could save per layer *in this chain*; a real rework keeps part of the
work, so it saves less. Each variant is timed in each of 3 rounds (interleaved), the
median per variant reported. Prints a table and writes DIR/probe_moe_seams.json. Our
kernels only: no stock sequence in this probe.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import ab_kernels  # noqa: E402

JSON_NAME = "probe_moe_seams.json"
M_VALUES = "1,2"
# The in_proj launch bounds the probe tries (786 CTAs of 4 warps: at most 6 an SM
# keeps them all resident at once on 132 SMs).
IN_PROJ_MIN_CTAS = (4, 6, 8)
# Which of the MoE's four launches (router, gate_up, down, combine) each variant runs.
VARIANTS = {
    "full": (0, 1, 2, 3),
    "no_combine": (0, 1, 2),
    "no_router": (1, 2, 3),
    "no_router_no_combine": (1, 2),
    # The executor's MoE configuration (8-warp gate_up / 4-warp down at M-bucket 1,
    # evict_first expert loads up to M-bucket 4; hd.31's, without the early shared
    # down at M-bucket 2 or launch bounds) instead of MoeConfig()'s defaults:
    "engine": (0, 1, 2, 3),
    # ... with in_proj loading 0-7 weight steps a warp before its wait (its
    # default: one batch of `unroll` = 8 steps; the executor's is 3):
    **{f"engine_prewait{steps}": (0, 1, 2, 3) for steps in range(8)},
    # ... with launch bounds on its expert launches at every M-bucket (ptxas may use
    # 128 registers a thread, MoeConfig.expert_max_registers; the executor's default
    # at M-buckets 2-8 in hd.32-33 only: slower in the engine):
    "engine_expert_regs128": (0, 1, 2, 3),
    # ... with in_proj loading the executor's 3 weight steps before its wait and
    # launch bounds promising C CTAs an SM (GemmConfig.min_ctas_per_sm; compare
    # with engine_prewait3):
    **{f"engine_prewait3_ctas{ctas}": (0, 1, 2, 3) for ctas in IN_PROJ_MIN_CTAS},
}
ROUTER = 0
ENGINE = "engine"
PREWAIT = "engine_prewait"
EXPERT_REGS = "engine_expert_regs128"
BOUNDED_IN_PROJ = "engine_prewait3_ctas"
# The executor's MoE down first weight batch (decode.MOE_DOWN_PREWAIT_STEPS).
ENGINE_DOWN_PREWAIT_STEPS = 6
# The KDA layer's fused input projection (q, k, v, b, f_a, g_a) that follows most MoEs.
IN_PROJ_ROWS = 3 * 4096 + 32 + 128 + 128
ROUNDS = 3
LAYERS, REPS, REPLAYS = 4, 4, 20


class Chain:
    """One layer: o_proj, the input-normalising MoE and the next in_proj, on weights
    of its own."""

    def __init__(self, layer, gen):
        import torch

        import ab_norm_seam
        import bench_moe as bm
        from kernels.gemm.prepared import GemmConfig, PreparedGemm, choose_config
        from kernels.moe.prepared import MoeConfig, PreparedMoe

        self.seam = ab_norm_seam.Seam(layer, gen)
        w_in = torch.randn(IN_PROJ_ROWS, bm.HIDDEN, generator=gen, device="cuda")
        w_in = (w_in / bm.HIDDEN**0.5).to(torch.bfloat16)
        self.in_proj = PreparedGemm(w_in, "plain")
        moe = self.seam.moe_norm
        # o_proj's squares when no router consumes and re-arms the MoE's own sums.
        self.scratch_sums = torch.zeros_like(moe.input_sums)

        def engine_moe(**fields):
            return PreparedMoe(
                moe.gate_weight,
                moe.bias,
                moe.w13,
                moe.w2,
                moe.shared_gate_up,
                moe.shared_down,
                moe.top_k,
                moe.scale,
                moe.renormalize,
                rmsnorm_weight=moe.gamma,
                eps=moe.eps,
                input_norm_weight=moe.input_gamma,
                input_eps=moe.input_eps,
                config=MoeConfig(
                    warps=8,
                    down_warps=4,
                    warps_max_bucket=1,
                    down_prewait_steps=ENGINE_DOWN_PREWAIT_STEPS,
                    **fields,
                ),
                expert_weight_l2_policy="evict_first",
                expert_weight_l2_policy_max_bucket=4,
            )

        self.moe_engine = engine_moe()
        self.moe_expert_regs = engine_moe(expert_max_registers=128)
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.in_proj_prewait = {}
        for steps in range(8):
            config = {}
            for bucket in (8, 16):
                c = choose_config(IN_PROJ_ROWS, bm.HIDDEN, bucket, num_sms)
                config[bucket] = GemmConfig(c.warps_k, c.split_k, c.unroll, steps)
            self.in_proj_prewait[steps] = PreparedGemm(w_in, "plain", config=config)
        self.in_proj_bounded = {
            ctas: PreparedGemm(
                w_in, "plain", config=self.in_proj_prewait[3].configs, min_ctas_per_sm=ctas
            )
            for ctas in IN_PROJ_MIN_CTAS
        }

    def run(self, bufs: dict, variant: str) -> None:
        launches = VARIANTS[variant]
        moe, in_proj = self.seam.moe_norm, self.in_proj
        if variant == EXPERT_REGS:
            moe = self.moe_expert_regs
        elif variant.startswith(ENGINE):
            moe = self.moe_engine
        if variant.startswith(BOUNDED_IN_PROJ):
            in_proj = self.in_proj_bounded[int(variant.removeprefix(BOUNDED_IN_PROJ))]
        elif variant.startswith(PREWAIT):
            in_proj = self.in_proj_prewait[int(variant.removeprefix(PREWAIT))]
        sums = moe.input_sums if ROUTER in launches else self.scratch_sums
        self.seam.o_sums.run(bufs["attn"], None, bufs["residual"], bufs["mid"], sums=sums)
        # Bound inside the capture: launches() binds the current stream.
        moe_launches = moe.launches(bufs["x"], bufs["out"], bufs["mid"], bufs["residual_out"])
        for index in launches:
            moe_launches[index]()
        in_proj.run(bufs["out"], bufs["y"])


def _buffers(m: int, gen) -> dict:
    import torch

    import ab_norm_seam

    bufs = ab_norm_seam.buffers(m, gen)
    # NaN until written: the full chain's check below sees an unwritten output.
    bufs["y"] = torch.full((m, IN_PROJ_ROWS), float("nan"), dtype=torch.bfloat16, device="cuda")
    return bufs


def run(m_values, variants, layers_n, reps, replays) -> list[dict]:
    import torch

    import bench_moe as bm

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for regime in bm.REGIMES:
        chains = [Chain(bm.Layer(regime, gen, None), gen) for _ in range(layers_n)]
        for m in m_values:
            bufs = _buffers(m, gen)
            for chain in chains:  # routing tables and normed x for the partial variants
                chain.run(bufs, "full")
            torch.cuda.synchronize()
            if bufs["y"].isnan().any():
                raise SystemExit(f"{regime} M={m}: the full chain left NaN; not timing")
            want = bufs["y"].clone()
            for v in variants:  # the engine variants compute the full chain's output
                if v.startswith(ENGINE):
                    # Its first launch: a variant that hangs is named before it does.
                    print(f"{regime} M={m}: {v} vs full", file=sys.stderr, flush=True)
                    bufs["y"].fill_(float("nan"))
                    chains[-1].run(bufs, v)
                    torch.cuda.synchronize()
                    ab_kernels._agree(f"{v} vs full (in_proj output)", bufs["y"], want, 1e-2)
            runs = {v: [] for v in variants}
            for _ in range(ROUNDS):
                for v in variants:
                    runs[v].append(
                        bm.time_graph(
                            lambda chain, v=v, bufs=bufs: chain.run(bufs, v),
                            chains, reps, replays,
                        )[0]
                    )  # fmt: skip
            us = {v: statistics.median(runs[v]) for v in variants}
            row = {"regime": regime, "m": m, "us": us, "runs_us": runs}
            if "full" in us:
                row["bound_us"] = {v: us["full"] - t for v, t in us.items() if v != "full"}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
        del chains
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], variants) -> str:
    legend = "µs per layer; in brackets: full minus the variant (the bound)"
    lead = (("regime", 9), ("m", 3))
    return ab_kernels.variant_table(rows, variants, lead, "bound_us", legend, 21)


def main() -> int:
    what = (
        "o_proj (residual_sumsq) -> MoE (input norm; router, gate_up, down, combine) -> "
        "next KDA in_proj per layer, µs per layer in bench_moe's CUDA-graph method over "
        "layers with distinct weights; variants leave the router and/or the combine out "
        "(timing bounds, outputs not meaningful); median of 3 interleaved rounds"
    )
    return ab_kernels.layered_probe_main(
        __doc__, JSON_NAME, "probe_moe_seams.py", M_VALUES, VARIANTS, LAYERS, REPS, REPLAYS, run,
        table, what,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

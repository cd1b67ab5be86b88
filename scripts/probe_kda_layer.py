#!/usr/bin/env python3
"""Whole KDA + MoE layers as the decode executor chains them, for kernel A/Bs.

    python3 scripts/probe_kda_layer.py --out DIR [--m 1,2] [--variants ...]   # H200

Per layer, on weights and caches of its own: the fused KDA input projection
(12576 x 2304) on the previous layer's MoE output, the KDA step (states loaded
before its wait, f_b / g_b applied inside), o_proj with the residual and the
sums of squares (``residual_sumsq``), the MoE with the post-attention norm in its
router, the executor's expert CTAs (8-warp gate_up, 4-warp down at M-bucket 1)
and evict_first expert loads, and its combine writing the next layer's normed
input. Every launch PDL-chained, as in the decode graph; bench_moe's CUDA-graph
method over ``--layers`` distinct layers (dummy routing: the engine's dummy
weights route this way).

``probe_moe_seams.py`` stops at in_proj: what a change does to the KDA step's
start behind in_proj (its CTAs need SM room while in_proj runs) it cannot see,
and the engine A/Bs of 2026-12-03 and 2026-12-04 lost exactly there. Variants:

* ``base``: the executor's kernels (in_proj's warps load 3 of their 18 weight
  K-steps before the PDL wait, the MoE down launches' first weight batch is 6
  K-steps: ``decode.KDA_IN_PROJ_PREWAIT_STEPS`` / ``MOE_DOWN_PREWAIT_STEPS``);
* ``prewaitS``: in_proj's warps load S K-steps before the wait
  (``GemmConfig.prewait_steps``; ``VLLM_HD_GEMM_PREWAIT=12576x2304:S`` in the
  engine); 8, one batch of ``unroll``, is hd.17's;
* ``oproj_prewaitS``: the same for o_proj (8 K-steps a warp, all before the wait
  by default; ``VLLM_HD_GEMM_PREWAIT=2304x4096:S``);
* ``gate_up_prewaitS`` / ``down_prewaitS``: the MoE expert launches' first weight
  batch of S K-steps (``MoeConfig``; ``VLLM_HD_MOE_PREWAIT=G,D`` in the engine;
  gate_up: 9 steps a warp at M-bucket 1 and ``unroll`` = 8 by default, down: 8,
  of which 8 is hd.17's);
* ``early_shared_down``: gate_up's shared-expert CTAs also run the shared
  expert's down, its weights staged before their PDL wait
  (``MoeConfig.early_shared_down_max_bucket``; ``VLLM_HD_MOE_EARLY_SHARED_DOWN=8``
  in the engine);
* ``expert_regs128``: the MoE expert launches of M-buckets 2-8 with launch bounds
  of 128 registers a thread (``MoeConfig.expert_max_registers``; the executor's
  default in hd.32-33 only, ``VLLM_HD_MOE_EXPERT_REGISTERS=128:2-8``);
  ``early2`` / ``early2_expert_regs128``: the early shared down at M-bucket 2 only
  (the executor's default since hd.29), without and with those bounds;
* ``in_proj_ctasC``: in_proj with launch bounds of C CTAs an SM
  (``GemmConfig.min_ctas_per_sm``; ``VLLM_HD_GEMM_MIN_CTAS=12576x2304:C``): more
  registers for its loads, fewer for the KDA step's CTAs that start beside it;
* ``in_proj_stagesS``: in_proj's weight through S shared-memory stages of 8 rows,
  filled by bulk copies before the PDL wait, one 8-warp CTA an SM
  (``PreparedGemm(weight_stages=S)``; ``VLLM_HD_GEMM_WEIGHT_STAGES=12576x2304:S``
  in the engine): up to S x 8 rows an SM in flight before the wait, and a ring of
  S x 37 KB that the KDA step's CTAs must find room beside.

Before timing, each variant's last layer output and KDA states after one chain
from the same caches must agree with ``base``'s (``_check``).
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

JSON_NAME = "probe_kda_layer.json"
M_VALUES = "1,2"
# The executor's choices (runtime/decode.py), the probe's base.
IN_PROJ_PREWAIT_STEPS, DOWN_PREWAIT_STEPS = 3, 6
PREWAIT_STEPS = (4, 5, 6, 7, 8)
O_PROJ_PREWAIT_STEPS = (4, 6)
# The executor's MoE expert launch bounds (hd.32) and early shared down (hd.29).
EXPERT_BOUNDS = {
    "expert_max_registers": 128,
    "expert_registers_min_bucket": 2,
    "expert_registers_max_bucket": 8,
}
EARLY_AT_2 = {"early_shared_down_min_bucket": 2, "early_shared_down_max_bucket": 2}
# The MoE variants: MoeConfig fields in place of the executor's.
MOE_VARIANTS = {
    "gate_up_prewait4": {"gate_up_prewait_steps": 4},
    "gate_up_prewait6": {"gate_up_prewait_steps": 6},
    "down_prewait4": {"down_prewait_steps": 4},
    "down_prewait8": {"down_prewait_steps": 8},
    "early_shared_down": {"early_shared_down_max_bucket": 8},
    "expert_regs128": EXPERT_BOUNDS,
    "early2": EARLY_AT_2,
    "early2_expert_regs128": {**EARLY_AT_2, **EXPERT_BOUNDS},
}
IN_PROJ_MIN_CTAS = (4, 6, 8)
IN_PROJ_STAGES = (2, 3, 4, 5)
VARIANTS = (
    "base",
    *(f"prewait{s}" for s in PREWAIT_STEPS),
    *(f"oproj_prewait{s}" for s in O_PROJ_PREWAIT_STEPS),
    *MOE_VARIANTS,
    *(f"in_proj_ctas{c}" for c in IN_PROJ_MIN_CTAS),
    *(f"in_proj_stages{s}" for s in IN_PROJ_STAGES),
)
ROUNDS = 3
LAYERS, REPS, REPLAYS = 4, 2, 20
HEADS, HEAD_DIM, GATE_RANK = 32, 128, 128
PROJ = HEADS * HEAD_DIM
# The fused input projection's rows: q | k | v | b | f_a | g_a.
IN_ROWS = 3 * PROJ + HEADS + 2 * GATE_RANK
B_COL, F_A_COL, G_A_COL = 3 * PROJ, 3 * PROJ + HEADS, 3 * PROJ + HEADS + GATE_RANK
EPS = 1e-5
# The check before timing (normwise relative difference from base, see _check).
OUT_LIMIT, STATE_LIMIT = 1e-2, 1e-3


class KdaMoeLayer:
    """One decoder layer's weights, caches and prepared kernels, per variant."""

    def __init__(self, gen, max_m: int):
        import torch

        import bench_moe as bm
        from kernels.gemm.prepared import PreparedGemm
        from kernels.kda.prepared import PreparedKda
        from kernels.moe.prepared import MoeConfig, PreparedMoe

        dev, bf16, hidden = "cuda", torch.bfloat16, bm.HIDDEN

        def randn(*shape, std=1.0):
            return torch.randn(*shape, generator=gen, device=dev) * std

        w_in = randn(IN_ROWS, hidden, std=hidden**-0.5).to(bf16)
        self.in_proj = {
            "base": PreparedGemm(w_in, "plain", prewait_steps=IN_PROJ_PREWAIT_STEPS),
            **{
                f"prewait{steps}": PreparedGemm(w_in, "plain", prewait_steps=steps)
                for steps in PREWAIT_STEPS
            },
            **{
                f"in_proj_ctas{ctas}": PreparedGemm(
                    w_in, "plain", prewait_steps=IN_PROJ_PREWAIT_STEPS, min_ctas_per_sm=ctas
                )
                for ctas in IN_PROJ_MIN_CTAS
            },
            **{
                f"in_proj_stages{stages}": PreparedGemm(w_in, "plain", weight_stages=stages)
                for stages in IN_PROJ_STAGES
            },
        }

        conv = randn(3, PROJ, 4, std=0.5)
        slots = max_m + 1  # slot 0 is the null block
        self.conv_state = randn(slots, 3, 3 * PROJ).to(bf16)
        self.state = randn(slots, HEADS, HEAD_DIM, HEAD_DIM, std=0.1)
        gate_weights = tuple(randn(PROJ, GATE_RANK, std=GATE_RANK**-0.5).to(bf16) for _ in range(2))
        self.kda = PreparedKda(
            tuple(w.view(PROJ, 1, 4) for w in conv),
            torch.rand(HEADS, generator=gen, device=dev) * 2 - 1.5,
            randn(PROJ, std=0.2) - 2.0,
            (1 + 0.1 * randn(HEAD_DIM)).to(bf16),
            self.conv_state, self.state, num_heads=HEADS, state_loads_before_wait=True,
            gate_weights=gate_weights,
        )  # fmt: skip

        w_o = randn(hidden, PROJ, std=PROJ**-0.5).to(bf16)
        self.o_proj = {"base": PreparedGemm(w_o, "residual_sumsq")}
        for steps in O_PROJ_PREWAIT_STEPS:
            self.o_proj[f"oproj_prewait{steps}"] = PreparedGemm(
                w_o, "residual_sumsq", prewait_steps=steps
            )
        post_norm, next_norm = ((1 + 0.1 * randn(hidden)).to(bf16) for _ in range(2))
        moe_weights = bm.Layer("dummy", gen, None)
        self.moe = {
            name: PreparedMoe(
                moe_weights.gate,
                moe_weights.bias,
                moe_weights.w13,
                moe_weights.w2,
                moe_weights.shared_gate_up,
                moe_weights.shared_down,
                bm.TOP_K,
                bm.SCALE,
                rmsnorm_weight=next_norm,
                eps=EPS,
                input_norm_weight=post_norm,
                input_eps=EPS,
                config=MoeConfig(
                    warps=8,
                    down_warps=4,
                    warps_max_bucket=1,
                    **{"down_prewait_steps": DOWN_PREWAIT_STEPS, **fields},
                ),
                expert_weight_l2_policy="evict_first",
                expert_weight_l2_policy_max_bucket=4,
            )  # fmt: skip
            for name, fields in {"base": {}, **MOE_VARIANTS}.items()
        }

    def run(self, bufs: dict, variant: str) -> None:
        m = bufs["x"].shape[0]
        in_proj = self.in_proj.get(variant, self.in_proj["base"])
        moe = self.moe.get(variant, self.moe["base"])
        proj = bufs["proj"]
        in_proj.run(bufs["x"], proj)
        self.kda.run(
            proj[:, :PROJ], proj[:, PROJ : 2 * PROJ], proj[:, 2 * PROJ : B_COL],
            proj[:, F_A_COL:G_A_COL], proj[:, B_COL:F_A_COL], proj[:, G_A_COL:],
            bufs["slots"][:m], bufs["attn"],
        )  # fmt: skip
        o_proj = self.o_proj.get(variant, self.o_proj["base"])
        o_proj.run(bufs["attn"], None, bufs["residual"], bufs["mid"], sums=moe.input_sums)
        # The next layer's in_proj reads bufs["x"]: the chain's data dependency.
        moe.run(bufs["moe_x"], bufs["x"], bufs["mid"], bufs["residual_out"])


def _buffers(m: int, gen) -> dict:
    import torch

    import bench_moe as bm

    bf16, dev = torch.bfloat16, "cuda"
    bufs = {
        "x": torch.randn(m, bm.HIDDEN, generator=gen, device=dev).to(bf16),
        "residual": torch.randn(m, bm.HIDDEN, generator=gen, device=dev).to(bf16),
        "proj": torch.empty(m, IN_ROWS, dtype=bf16, device=dev),
        "attn": torch.empty(m, PROJ, dtype=bf16, device=dev),
        "slots": torch.arange(1, 17, dtype=torch.int32, device=dev),
    }
    for name in ("mid", "moe_x", "residual_out"):
        bufs[name] = torch.empty(m, bm.HIDDEN, dtype=bf16, device=dev)
    return bufs


def _check(layers, bufs, variants) -> dict:
    """Every variant's output and KDA states after one chain from the same caches
    and input against ``base``'s (normwise relative difference, refused above
    ``OUT_LIMIT`` / ``STATE_LIMIT``). Not bit for bit: o_proj adds its per-token
    sums of squares with float atomics in arrival order, so even two ``base`` runs
    may differ in the last bits of the norm (the variants themselves move loads and
    launch points, never arithmetic; ``test_gemm.py -k prewait`` checks that bit
    for bit)."""
    import torch

    saved = [(lay.conv_state.clone(), lay.state.clone()) for lay in layers]
    x0 = bufs["x"].clone()
    results = {}
    for v in variants:
        for lay, (conv, state) in zip(layers, saved):
            lay.conv_state.copy_(conv)
            lay.state.copy_(state)
        bufs["x"].copy_(x0)
        for lay in layers:
            lay.run(bufs, v)
        torch.cuda.synchronize()
        results[v] = (bufs["x"].clone(), torch.cat([lay.state.flatten() for lay in layers]))
    base_x, base_state = results["base"]
    if base_x.isnan().any() or base_state.isnan().any():
        raise SystemExit("base chain produced NaN; not timing")
    checks = {}
    for v, (x, state) in results.items():
        checks[v] = {
            "out_rel": ab_kernels._agree(f"{v} vs base (output)", x, base_x, OUT_LIMIT),
            "state_rel": ab_kernels._agree(
                f"{v} vs base (KDA state)", state, base_state, STATE_LIMIT
            ),
        }
    bufs["x"].copy_(x0)
    return checks


def run(m_values, variants, layers_n, reps, replays) -> list[dict]:
    import torch

    import bench_moe as bm

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [KdaMoeLayer(gen, max(m_values)) for _ in range(layers_n)]
    rows = []
    for m in m_values:
        bufs = _buffers(m, gen)
        checks = _check(layers, bufs, ["base", *[v for v in variants if v != "base"]])
        runs = {v: [] for v in variants}
        for _ in range(ROUNDS):
            for v in variants:
                runs[v].append(
                    bm.time_graph(
                        lambda lay, v=v, bufs=bufs: lay.run(bufs, v), layers, reps, replays
                    )[0]
                )
        us = {v: statistics.median(runs[v]) for v in variants}
        row = {"m": m, "us": us, "runs_us": runs, "checks": checks}
        if "base" in us:
            row["vs_base_us"] = {v: t - us["base"] for v, t in us.items() if v != "base"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
    return rows


def table(rows: list[dict], variants) -> str:
    legend = "µs per layer; in brackets: the variant minus base"
    return ab_kernels.variant_table(rows, variants, (("m", 3),), "vs_base_us", legend, 16)


def main() -> int:
    what = (
        "KDA in_proj -> KDA step -> o_proj (residual_sumsq) -> MoE (input norm, the "
        "executor's expert CTAs and L2 policy) per layer, PDL-chained, dummy routing; "
        "µs per layer in bench_moe's CUDA-graph method over layers with distinct weights "
        "and caches; median of 3 interleaved rounds; variants checked against base first"
    )
    return ab_kernels.layered_probe_main(
        __doc__, JSON_NAME, "probe_kda_layer.py", M_VALUES, VARIANTS, LAYERS, REPS, REPLAYS, run,
        table, what,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A/B of the MoE router's logits: thread-block cluster vs global logits and a ticket.

    python3 scripts/ab_router_cluster.py --out DIR [--m 1,2,4,8,16] [--parts ...]  # H200

The same PreparedMoe twice on the same weights (bench_moe's layers: 4 distinct weight
sets, so every layer step streams its experts from HBM; dummy and balanced routing):

* ``cluster``: ``router_cluster=True`` (the default): the router's 16 CTAs are one
  thread-block cluster (16 > 8: a non-portable cluster size), each stores its logits
  into CTA 0's shared memory through DSMEM, one cluster barrier, CTA 0 routes;
* ``ticket``: ``router_cluster=False``: logits to global memory, a GPU-scope fence and
  an atomic ticket, the last CTA re-reading them from L2.

Parts (``--parts``, default all):

* ``layer``: the whole MoE layer (4 launches, PDL-chained), bench_moe's graph method
  (``bench_moe.time_graph``: L layers x R repetitions in one CUDA graph, median over
  replays);
* ``router``: the router launch alone, as ``bench_moe.breakdown``'s "alone" column (a
  graph of only router launches, the routing table left by a full run);
* ``seam``: o_proj (2304 x 4096, ``residual_sumsq``) then the MoE normalising its input
  (``input_norm_weight``, the decode executor's configuration), as
  ``ab_norm_seam.py`` chains them: here the router's PDL predecessor is o_proj's 576
  CTAs, which the 16-CTA cluster must find room beside (the risk this A/B decides).

Outputs are compared first: routing table, route weights, output (and for the seam x
and residual_out, both MoEs fed the same sums of squares) must be bit-identical, or
nothing is timed. The two variants are timed interleaved (``ab_kernels._interleaved``:
median of 3 graphs each). Prints a table and writes DIR/ab_router_cluster.json. Our
kernels against our kernels: no stock sequence in this comparison.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import ab_kernels  # noqa: E402

PARTS = ("layer", "router", "seam")
M_VALUES = "1,2,4,8,16"
# bench_moe's defaults: layers with distinct weights, repetitions per graph, replays.
LAYERS, REPS, REPLAYS = 4, 4, 20
JSON_NAME = "ab_router_cluster.json"
VARIANTS = {"cluster": True, "ticket": False}
# The cluster the router launches (E = 256: 16 tiles of 16 experts).
CLUSTER_CTAS = 16


def _twin(moe, router_cluster: bool):
    """The same binding (weights, norms, config) on one router path at every
    M-bucket (the default binding takes the cluster only up to
    ROUTER_CLUSTER_MAX_BUCKET)."""
    from kernels.moe.prepared import M_BUCKETS, PreparedMoe

    return PreparedMoe(
        moe.gate_weight, moe.bias, moe.w13, moe.w2, moe.shared_gate_up, moe.shared_down,
        moe.top_k, moe.scale, moe.renormalize, rmsnorm_weight=moe.gamma, eps=moe.eps,
        use_pdl=moe.use_pdl, config=moe.config, input_norm_weight=moe.input_gamma,
        input_eps=moe.input_eps, router_cluster=router_cluster,
        router_cluster_max_bucket=max(M_BUCKETS),
    )  # fmt: skip


def _require_identical(what: str, pairs: dict) -> dict:
    """``pairs``: name -> (cluster tensor, ticket tensor); refuses to time on any
    difference (or an unwritten NaN output)."""
    row = {}
    for name, (got, want) in pairs.items():
        if got.is_floating_point() and got.isnan().any():
            raise SystemExit(f"{what}: cluster {name} has NaN (unwritten?); not timing")
        row[f"{name}_bit_equal"] = ab_kernels.bits_equal(got, want)
        if not row[f"{name}_bit_equal"]:
            raise SystemExit(f"{what}: cluster and ticket {name} differ; not timing")
    return row


def _routing_pairs(variants: dict, m: int) -> dict:
    cluster, ticket = variants["cluster"], variants["ticket"]
    k = cluster.top_k
    return {
        "table": (cluster.table, ticket.table),
        "route_weights": (cluster.route_weights[: m * k], ticket.route_weights[: m * k]),
    }


def _interleaved_row(timer, launch) -> dict:
    """Times ``launch(variant, layer)`` for both variants, ticket first."""

    timed = ab_kernels._interleaved(
        timer, lambda lay: launch("ticket", lay), lambda lay: launch("cluster", lay)
    )
    return {
        "ticket_us": timed["base_us"],
        "cluster_us": timed["new_us"],
        "cluster_over_ticket": timed["new_over_base"],
        "saving_us": timed["base_us"] - timed["new_us"],
        "runs_us": {"ticket": timed["runs_us"]["base"], "cluster": timed["runs_us"]["new"]},
    }


def _layer_parts(regime, layers, m_values, parts, reps, replays, gen) -> list[dict]:
    """``layer`` and ``router`` parts on bench_moe's plain layers."""
    import torch

    import bench_moe as bm

    for lay in layers:
        lay.variants = {"cluster": _twin(lay.moe, True), "ticket": _twin(lay.moe, False)}
        if not lay.variants["cluster"].router_cluster or lay.variants["ticket"].router_cluster:
            raise SystemExit("this binding's shape does not take the cluster path")

    def timer(launch):
        return bm.time_graph(launch, layers, reps, replays)[0]

    rows = []
    for m in m_values:
        what = f"{regime} M={m}"
        x = torch.randn(m, bm.HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        outs = {
            v: torch.full((m, bm.HIDDEN), float("nan"), dtype=x.dtype, device="cuda")
            for v in VARIANTS
        }
        for lay in layers:  # each layer's table for the router-alone graphs
            for v, moe in lay.variants.items():
                moe.run(x, outs[v])
        torch.cuda.synchronize()
        base = {"regime": regime, "m": m}
        base |= _require_identical(
            what,
            _routing_pairs(layers[-1].variants, m) | {"out": (outs["cluster"], outs["ticket"])},
        )
        base["distinct_experts"] = layers[-1].variants["cluster"].distinct_experts()
        if "layer" in parts:

            def whole(v, lay, x=x, outs=outs):
                lay.variants[v].run(x, outs[v])

            row = base | {"part": "layer"} | _interleaved_row(timer, whole)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
        if "router" in parts:

            def router(v, lay, x=x, outs=outs):
                # Bound inside the capture: launches() binds the current stream.
                lay.variants[v].launches(x, outs[v])[0]()

            row = base | {"part": "router"} | _interleaved_row(timer, router)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
    return rows


def _seam_part(regime, layers, m_values, reps, replays, gen) -> list[dict]:
    """o_proj (residual_sumsq) + the input-normalising MoE, per layer."""
    import torch

    import ab_norm_seam
    import bench_moe as bm

    seams = [ab_norm_seam.Seam(lay, gen) for lay in layers]
    for seam in seams:
        seam.variants = {
            "cluster": _twin(seam.moe_norm, True),
            "ticket": _twin(seam.moe_norm, False),
        }
        if not seam.variants["cluster"].router_cluster:
            raise SystemExit("this binding's shape does not take the cluster path")

    def chain(v, seam, bufs):
        moe = seam.variants[v]
        own = bufs[v]
        seam.o_sums.run(bufs["attn"], None, bufs["residual"], own["mid"], sums=moe.input_sums)
        moe.run(own["x"], own["out"], own["mid"], own["residual_out"])

    rows = []
    for m in m_values:
        what = f"seam {regime} M={m}"
        shared = ab_norm_seam.buffers(m, gen)
        bufs = {"attn": shared["attn"], "residual": shared["residual"]}
        for v in VARIANTS:
            bufs[v] = {
                n: torch.full((m, bm.HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
                for n in ("x", "mid", "out", "residual_out")
            }
        # The check: o_proj once, then both MoEs from the same residual and the same
        # sums of squares (o_proj adds them with float atomics in arrival order, so
        # two o_proj launches may differ in the last bits; the router paths may not).
        seam = seams[-1]
        cluster, ticket = seam.variants["cluster"], seam.variants["ticket"]
        seam.o_sums.run(
            bufs["attn"], None, bufs["residual"], bufs["cluster"]["mid"], sums=cluster.input_sums
        )
        bufs["ticket"]["mid"].copy_(bufs["cluster"]["mid"])
        ticket.input_sums.copy_(cluster.input_sums)
        for v, moe in seam.variants.items():
            own = bufs[v]
            moe.run(own["x"], own["out"], own["mid"], own["residual_out"])
        torch.cuda.synchronize()
        pairs = _routing_pairs(seam.variants, m)
        for name in ("x", "out", "residual_out"):
            pairs[name] = (bufs["cluster"][name], bufs["ticket"][name])
        row = {"regime": regime, "m": m, "part": "seam"} | _require_identical(what, pairs)
        if float(cluster.input_sums.abs().sum()) or float(ticket.input_sums.abs().sum()):
            raise SystemExit(f"{what}: input sums not re-armed; not timing")
        row |= _interleaved_row(
            lambda launch, seams=seams: bm.time_graph(launch, seams, reps, replays)[0],
            lambda v, s, b=bufs: chain(v, s, b),
        )
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
    return rows


def _max_active_clusters() -> dict:
    """How many 16-CTA clusters (one CTA per SM) the GPU can hold at once, for the
    report: the cluster needs 16 CTAs' room in one GPC at the router's launch."""
    try:
        from cutlass.utils import HardwareInfo

        return {"max_active_clusters_16": HardwareInfo().get_max_active_clusters(CLUSTER_CTAS)}
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        return {"max_active_clusters_16_error": f"{type(exc).__name__}: {exc}"}


def run(m_values, parts, layers_n, reps, replays) -> list[dict]:
    import torch

    import bench_moe as bm

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for regime in bm.REGIMES:
        layers = [bm.Layer(regime, gen, None) for _ in range(layers_n)]
        if {"layer", "router"} & set(parts):
            rows += _layer_parts(regime, layers, m_values, parts, reps, replays, gen)
        if "seam" in parts:
            rows += _seam_part(regime, layers, m_values, reps, replays, gen)
        del layers
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"{'part':7s} {'regime':9s} {'M':>3s} {'ticket us':>10s} {'cluster us':>11s} "
        f"{'saving us':>10s} {'ratio':>6s}  bit-equal",
    ]
    for r in rows:
        equal = ", ".join(k.removesuffix("_bit_equal") for k, v in r.items()
                          if k.endswith("_bit_equal") and v)  # fmt: skip
        lines.append(
            f"{r['part']:7s} {r['regime']:9s} {r['m']:3d} {r['ticket_us']:10.2f} "
            f"{r['cluster_us']:11.2f} {r['saving_us']:10.2f} "
            f"{r['cluster_over_ticket']:6.3f}  {equal}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = ab_kernels.layered_ab_parser(
        __doc__, JSON_NAME, M_VALUES, "parts", PARTS, LAYERS, REPS, REPLAYS
    )
    args, parts, m_values = ab_kernels.parsed_layered_ab_args(parser, "parts", PARTS, "part")
    missing = ab_kernels.sm90_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    rows = run(m_values, parts, args.layers, args.reps, args.replays)
    print(table(rows))
    what = (
        "MoE router's logits, µs per layer (layer, seam) or per router launch "
        "(router): cluster (16-CTA thread-block cluster, logits in CTA 0's shared memory, "
        "router_cluster=True) vs ticket (global logits + atomic ticket, "
        "router_cluster=False), bench_moe's CUDA-graph method over layers with distinct "
        "weights, interleaved, median of 3 graphs each"
    )
    fields = {"what": what, **_max_active_clusters()}
    fields |= {"layers": args.layers, "reps": args.reps, "replays": args.replays}
    ab_kernels.write_report(args.out, JSON_NAME, "ab_router_cluster.py", fields, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

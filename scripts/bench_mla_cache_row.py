#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the MLA latent-cache row kernel (kernels/mla) against vLLM's two launches.

For M in {1, 2, 4, 8, 16}, in one process on an SM90 GPU with vLLM 0.26.0 installed: the
new cache row of each request of a Kimi-Linear MLA layer (512 latent columns normalised, 64
rope columns copied; rows taken from a [M, 6720] q | kv_a projection, bf16 cache [blocks,
16, 576]) written by ``PreparedMlaCacheRow`` against what the decode graph ran before it
(vLLM's RMSNorm kernel into a [M, 512] buffer, then ``concat_and_cache_mla``). Each timed
graph chains LAYERS copies (one cache per layer, as the model has); time = median replay /
copies. Checks first that both write the same cache rows (within one bf16 rounding: the two
sums of squares are reduced in different orders) and leave every other row alone.

    python3 scripts/bench_mla_cache_row.py --out-dir docs/perf
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
from kernels.mla.prepared import PreparedMlaCacheRow  # noqa: E402

LORA, ROPE, Q_WIDTH, EPS = 512, 64, 6144, 1e-6
WIDTH = LORA + ROPE
BLOCK_SIZE, BLOCKS = 16, 256
M_VALUES = (1, 2, 4, 8, 16)
LAYERS = 32


_K_SCALE: list[torch.Tensor] = []


def _stock(kv, gamma, cache, slots, kv_c):
    """What the decode graph ran before: vLLM's RMSNorm, then its cache write."""
    from vllm import _custom_ops as ops

    if not _K_SCALE:
        _K_SCALE.append(torch.ones(1, device="cuda"))
    torch.ops._C.rms_norm(kv_c, kv[:, :LORA], gamma, EPS)
    ops.concat_and_cache_mla(kv_c, kv[:, LORA:], cache, slots, "auto", _K_SCALE[0])


def _rows(m, layers, gen):
    proj = (torch.randn(m, Q_WIDTH + WIDTH, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    kv = proj[:, Q_WIDTH:]
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(m))
    slots = slots[:m].to("cuda")
    kv_c = torch.empty(m, LORA, device="cuda", dtype=torch.bfloat16)
    # Same rows both ways first (not timing a wrong kernel).
    lay = layers[0]
    ours, theirs = lay["cache"].clone(), lay["cache"].clone()
    PreparedMlaCacheRow(lay["gamma"], EPS, ours, rope=ROPE).run(kv, slots)
    _stock(kv, lay["gamma"], theirs, slots, kv_c)
    torch.cuda.synchronize()
    diff = (ours.float() - theirs.float()).abs()
    limit = 2**-7 * theirs.float().abs() + 1e-6
    if not bool((diff <= limit).all()):
        raise SystemExit(f"M={m}: ours and vLLM's cache rows differ by {float(diff.max()):.3g}")
    same_rows = int((ours == theirs).all(dim=-1).sum())
    ours_us = bench_gemm._time_graph(
        [lambda lay=lay: lay["ours"].run(kv, slots) for lay in layers]
    )[0]
    stock_us = bench_gemm._time_graph(
        [lambda lay=lay: _stock(kv, lay["gamma"], lay["cache"], slots, kv_c) for lay in layers]
    )[0]
    return {
        "m": m,
        "ours_us": ours_us,
        "stock_us": stock_us,
        "speedup": stock_us / ours_us,
        "bit_identical_rows": same_rows,
        "rows": BLOCKS * BLOCK_SIZE,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "perf")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("error: needs an SM90 GPU", file=sys.stderr)
        return 2
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError as exc:
        print(f"error: needs vLLM 0.26.0 for the stock ops ({exc})", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        cache = torch.zeros(BLOCKS, BLOCK_SIZE, WIDTH, device="cuda", dtype=torch.bfloat16)
        gamma = (1 + 0.1 * torch.randn(LORA, generator=gen, device="cuda")).to(torch.bfloat16)
        layers.append(
            {"cache": cache, "gamma": gamma, "ours": PreparedMlaCacheRow(gamma, EPS, cache)}
        )
    rows = []
    for m in M_VALUES:
        row = _rows(m, layers, gen)
        print(json.dumps(row), flush=True)
        rows.append(row)
    record = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "baseline": "vLLM 0.26.0: torch.ops._C.rms_norm, then _custom_ops.concat_and_cache_mla",
        "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "mla_cache_row.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# MLA latent-cache row: one PDL kernel vs vLLM's RMSNorm + concat_and_cache_mla",
        "",
        f"{record['gpu']}, {record['date']}, `{record['command']}`; µs per layer, "
        f"{LAYERS} layers chained in one CUDA graph, median of the replays.",
        "",
        "| M | ours µs | vLLM µs | speedup |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['m']} | {r['ours_us']:.2f} | {r['stock_us']:.2f} | {r['speedup']:.2f}x |"
        for r in rows
    ]
    (args.out_dir / "mla_cache_row.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the MLA decode attention (kernels/mla) against vLLM's FlashAttention-3 MLA.

In one process on an SM90 GPU with vLLM 0.26.0 installed: Kimi-Linear's MLA decode (32
heads, the absorbed query [ql_nope 512 | q_pe 64], the paged bf16 latent cache [blocks,
block_size, 576], softmax scale 192^-0.5) for B in {1, 2, 4, 8, 16} requests of SEQ tokens
each (SEQ in {512, 1024, 4096, 32768}), by ``PreparedMlaDecodeAttention`` (split pass +
merge) and by what the decode graph ran before it: ``flash_attn_varlen_func`` (fa_version
3) with the scheduler metadata and ``num_splits`` vLLM's FlashAttnMLA builder gives a
FULL-graph step (32 splits at most). Both outputs are checked against each other first.
Each timed graph chains one attention per layer over enough distinct caches (>= 7, the
model's MLA layers) that they exceed the H200's 50 MB L2, so the cache rows come from HBM
as in a decode step; time = median replay / layers. Roofline = cache bytes of the B
requests / 4.25 TB/s.

    python3 scripts/bench_mla_attention.py --out-dir docs/perf
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench_gemm  # noqa: E402
from kernels.mla.prepared import PreparedMlaDecodeAttention, attention_workspace  # noqa: E402

HEADS, LORA, ROPE, NOPE = 32, 512, 64, 128
WIDTH = LORA + ROPE
SCALE = (NOPE + ROPE) ** -0.5
B_VALUES = (1, 2, 4, 8, 16)
SEQ_VALUES = (512, 1024, 4096, 32768)
MIN_LAYERS, MAX_LAYERS = 7, 96
L2_FOOTPRINT = 120 << 20
HBM_BYTES_PER_US = 4.25e6
FA_MAX_SPLITS = 32  # vLLM 0.26.0 flash_attn_max_num_splits_for_cuda_graph


def _layer(b, seq, block_size, ws, gen):
    per_req = math.ceil(seq / block_size)
    blocks = b * per_req
    cache = torch.randn(blocks, block_size, WIDTH, generator=gen, device="cuda").to(torch.bfloat16)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks))
    table = order.view(b, per_req).int().cuda()
    return {
        "cache": cache,
        "block_table": table,
        "ours": PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE, workspace=ws),
    }


def _fa3(q_nope, q_pe, lay, seq_lens, cu_q, seq, sched):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    cache = lay["cache"]
    return flash_attn_varlen_func(
        q=q_pe,
        k=cache[..., LORA:].unsqueeze(-2),
        v=cache[..., :LORA].unsqueeze(-2),
        q_v=q_nope.view(-1, HEADS, LORA),
        max_seqlen_q=1,
        cu_seqlens_q=cu_q,
        max_seqlen_k=seq,
        seqused_k=seq_lens,
        block_table=lay["block_table"],
        softmax_scale=SCALE,
        causal=True,
        fa_version=3,
        scheduler_metadata=sched,
        num_splits=FA_MAX_SPLITS,
    )


def _row(b, seq, block_size, ws, gen):
    from vllm.vllm_flash_attn import get_scheduler_metadata

    layer_bytes = b * seq * WIDTH * 2
    count = max(MIN_LAYERS, min(MAX_LAYERS, math.ceil(L2_FOOTPRINT / layer_bytes)))
    layers = [_layer(b, seq, block_size, ws, gen) for _ in range(count)]
    q_nope = torch.randn(b, HEADS * LORA, generator=gen, device="cuda").to(torch.bfloat16)
    proj = torch.randn(b, HEADS * (NOPE + ROPE), generator=gen, device="cuda")
    q_pe = proj.to(torch.bfloat16).view(b, HEADS, NOPE + ROPE)[..., NOPE:]
    seq_lens = torch.full((b,), seq, dtype=torch.int32, device="cuda")
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    sched = get_scheduler_metadata(
        batch_size=b, max_seqlen_q=1, max_seqlen_k=seq, num_heads_q=HEADS, num_heads_kv=1,
        headdim=ROPE, cache_seqlens=seq_lens, qkv_dtype=torch.bfloat16, headdim_v=LORA,
        page_size=block_size, cu_seqlens_q=cu_q, causal=True, num_splits=FA_MAX_SPLITS,
    )  # fmt: skip
    ours_out = torch.empty(b, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
    lay = layers[0]
    lay["ours"].run(q_nope, q_pe, seq_lens, lay["block_table"], ours_out)
    fa_out = _fa3(q_nope, q_pe, lay, seq_lens, cu_q, seq, sched)
    torch.cuda.synchronize()
    diff = (ours_out.view(b, HEADS, LORA).float() - fa_out.float()).abs()
    scale = fa_out.float().abs().max().item()
    if not bool(torch.isfinite(ours_out).all()) or diff.max().item() > 2**-6 * scale + 1e-3:
        raise SystemExit(
            f"B={b} seq={seq}: ours and FlashAttention-3 differ by {diff.max().item():.3g} "
            f"(max |out| {scale:.3g}); not timing a wrong kernel"
        )
    ours_us = bench_gemm._time_graph(
        [
            lambda lay=lay: lay["ours"].run(q_nope, q_pe, seq_lens, lay["block_table"], ours_out)
            for lay in layers
        ]
    )[0]
    fa_us = bench_gemm._time_graph(
        [lambda lay=lay: _fa3(q_nope, q_pe, lay, seq_lens, cu_q, seq, sched) for lay in layers]
    )[0]
    floor_us = layer_bytes / HBM_BYTES_PER_US
    return {
        "b": b,
        "seq": seq,
        "layers": count,
        "ours_us": ours_us,
        "fa3_us": fa_us,
        "speedup": fa_us / ours_us,
        "floor_us": floor_us,
        "max_abs_diff": diff.max().item(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "perf")
    ap.add_argument("--block-size", type=int, default=64, help="kernel block size (tokens)")
    ap.add_argument("--seq", default=",".join(map(str, SEQ_VALUES)))
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("error: needs an SM90 GPU", file=sys.stderr)
        return 2
    try:
        import vllm.vllm_flash_attn  # noqa: F401
    except ImportError as exc:
        print(f"error: needs vLLM 0.26.0 for FlashAttention-3 ({exc})", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = attention_workspace(HEADS, LORA, torch.device("cuda"))
    rows = []
    for seq in (int(s) for s in args.seq.split(",")):
        for b in B_VALUES:
            row = _row(b, seq, args.block_size, ws, gen)
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    record = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "baseline": "vLLM 0.26.0 flash_attn_varlen_func (FA3, MLA: q_v + q_pe), scheduler "
        f"metadata and num_splits={FA_MAX_SPLITS} as FlashAttnMLA's FULL-graph decode",
        "block_size": args.block_size,
        "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "mla_attention.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# MLA decode attention: split pass + merge vs vLLM's FlashAttention-3 MLA",
        "",
        f"{record['gpu']}, {record['date']}, `{record['command']}`; µs per layer (CUDA "
        "graph of one attention per layer over distinct caches exceeding L2, median "
        f"replay), block size {args.block_size}; floor = the requests' cache bytes / "
        "4.25 TB/s.",
        "",
        "| seq | B | layers | ours µs | FA3 µs | speedup | floor µs |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['seq']} | {r['b']} | {r['layers']} | {r['ours_us']:.2f} | {r['fa3_us']:.2f} "
        f"| {r['speedup']:.2f}x | {r['floor_us']:.2f} |"
        for r in rows
    ]
    (args.out_dir / "mla_attention.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

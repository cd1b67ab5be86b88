#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Does a weight stream staged through shared memory by bulk copies beat the skinny GEMM's
register stream at one token?

Every skinny product of the decode (kernels/gemm, the MoE experts) streams its weight with
16-byte loads straight into registers. The bytes a SM keeps in flight are then bounded by its
registers, and so is what a launch can load before its PDL wait while the kernel before it
drains (`docs/perf/gemm_notes.md`: ~1 K-step ahead a warp in SASS, 3 pre-wait steps for the
KDA in_proj; the in_proj runs at ~82% of HBM alone). The one design not yet measured moves the
weight with `cp.async.bulk` into a ring of shared-memory stages, each completed on its own
mbarrier: one thread asks for up to S x R rows ahead, whatever the registers hold, and it can
fill the whole ring before the PDL wait.

`bulk`: a GEMV ``y = W x`` (bf16, M = 1, fp32 sums) on C CTAs an SM, 8 warps each. The rows go
to the CTAs in runs of whole chunks of R rows (N % R == 0); a CTA's warp 0 puts the first S
chunks in flight (before `griddepcontrol.wait`), every warp then takes one row of the chunk
whose mbarrier completed (x read once into shared memory as fp32 after the wait), and after a
barrier thread 0 refills the stage with the chunk S further on. `register`: PreparedGemm
(plain epilogue, the executor's config and PDL), the kernel the decode runs; `staged S`:
PreparedGemm(weight_stages=S), the decode GEMM's own staged mode (MMAs from S stages of 8
rows, one CTA an SM); `cublas`: torch.mm into the same output (no PDL), the stock baseline.

Two chains per variant and shape, each launch reading its own copy of the weight (copies
span >= 2x L2, so every byte comes from HBM), all launches with PDL, in one CUDA graph:
- `alone`: L GEMVs back to back (bench_gemm.py's method): us a call;
- `behind`: L pairs (a 32-CTA kernel that holds the GPU for SPIN_NS after its own wait, then
  the GEMV): us a pair minus us a spinner of the spinner-only chain, i.e. what the GEMV adds
  after a latency-bound kernel, as in the decode (the router, the KDA step, the combine).
Every variant is checked against the fp32 torch product first.

Measured on one H100 (2026-12-06, `docs/perf/gemm_notes.md`, "The weight through shared
memory by bulk copies"): the KDA in_proj 18.2 us behind a 3 us stage with R8 S5 C1 against
the register stream's 21.8 (our kernels only: the `cublas` column came after that run).
Torch and cutlass only (the kernels bundle):

    python3 scripts/probe_weight_stream.py --out-dir $OUT/stream
"""

# No `from __future__ import annotations`: CuTe DSL reads the kernels' annotations.
import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name: (N, K) of the decode's products at one token.
SHAPES = {
    "kda_in_proj": (12576, 2304),
    "mla_q_proj": (6144, 2304),
    "shared_gate_up": (2048, 2304),
    "kda_o_proj": (2304, 4096),
}
# bulk variants: (rows a chunk R, stages S, CTAs an SM C).
BULK_CONFIGS = ((8, 4, 1), (8, 5, 1), (4, 4, 1), (4, 4, 2), (8, 2, 2), (2, 4, 2))
# Shared-memory stages of 8 rows of PreparedGemm's staged mode (weight_stages).
STAGED_STAGES = (2, 3, 4, 5)
WARPS = 8
THREADS = WARPS * 32
L2_BYTES = 60 * 2**20
MAX_COPIES = 16
CALLS = 32
SPIN_CTAS = 32
SPIN_NS = 3000
ROUNDS = 7
# Shared memory an SM gives its CTAs (SM90: 228 KB, 1 KB of it reserved a CTA).
SMEM_PER_SM = 227 * 1024
HBM_READ_TBPS = 4.25


def make_bulk_gemv(n: int, k: int, rows: int, stages: int, ctas: int):
    """The bulk-staged GEMV for one shape and config, as a class taking ``pdl``."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int64, const_expr
    from cutlass.cute.nvgpu import cpasync

    if n % rows or rows > WARPS:
        raise ValueError(f"N={n} must split into chunks of R={rows} <= {WARPS} rows")
    if k % (32 * 8):
        raise ValueError(f"K={k} must be a multiple of 256 (a warp's 16-byte loads)")
    chunk_elems = rows * k
    chunk_bytes = chunk_elems * 2
    total_chunks = n // rows
    k_vectors = k // 8
    per_lane = k_vectors // 32
    smem_bytes = stages * chunk_bytes + k * 4 + stages * 8 + 256

    class BulkGemv:
        def __init__(self, pdl: bool):
            self.pdl = pdl

        @cute.jit
        def __call__(
            self, w: cute.Pointer, x: cute.Pointer, y: cute.Pointer, stream: cuda.CUstream
        ):
            self.kernel(w, x, y).launch(
                grid=[ctas, 1, 1],
                block=[THREADS, 1, 1],
                smem=smem_bytes,
                stream=stream,
                use_pdl=self.pdl,
            )

        @cute.kernel
        def kernel(self, w: cute.Pointer, x: cute.Pointer, y: cute.Pointer):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            warp = tidx // 32
            lane = tidx % 32
            smem = cutlass.utils.SmemAllocator()
            # ring[e, v, r, s]: element e of 16-byte vector v of row r of stage s; one stage
            # is R contiguous weight rows, the destination of one bulk copy.
            ring = smem.allocate_tensor(
                BFloat16, cute.make_layout((8, k_vectors, rows, stages)), 128
            )
            xs = smem.allocate_tensor(Float32, cute.make_layout((8, k_vectors)), 16)
            bars = smem.allocate_tensor(Int64, cute.make_layout((stages,)), 8)
            first = cta * total_chunks // ctas
            count = (cta + 1) * total_chunks // ctas - first
            atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), BFloat16)

            if tidx == 0:
                for s in cutlass.range_constexpr(stages):
                    cute.arch.mbarrier_init(bars.iterator + s, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            # The weights never depend on the kernel before: fill the ring before the wait.
            # Warp 0 issues the copies: the bulk copy elects its one thread with a whole-warp
            # elect.sync, and one elected thread arrives on the stage's mbarrier.
            if warp == 0:
                for s in cutlass.range_constexpr(stages):
                    if s < count:
                        src = cute.make_tensor(
                            w + (first + s) * chunk_elems, cute.make_layout((chunk_elems,))
                        )
                        dst = cute.make_tensor(
                            ring.iterator + s * chunk_elems, cute.make_layout((chunk_elems,))
                        )
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(bars.iterator + s, chunk_bytes)
                        cute.copy(atom, src, dst, mbar_ptr=bars.iterator + s)
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
                cute.arch.griddepcontrol_wait()
            xg = cute.make_tensor(x, cute.make_layout((8, k_vectors)))
            for i in cutlass.range(tidx, k_vectors, THREADS):
                v = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(xg[None, i], v)
                for e in cutlass.range_constexpr(8):
                    xs[e, i] = Float32(v[e])
            cute.arch.sync_threads()
            for c in cutlass.range(count):
                slot = c % stages
                cute.arch.mbarrier_wait(bars.iterator + slot, (c // stages) % 2)
                if warp < rows:
                    acc = Float32(0.0)
                    for j in cutlass.range_constexpr(per_lane):
                        vec = j * 32 + lane
                        wv = cute.make_rmem_tensor((8,), BFloat16)
                        xv = cute.make_rmem_tensor((8,), Float32)
                        cute.autovec_copy(ring[None, vec, warp, slot], wv)
                        cute.autovec_copy(xs[None, vec], xv)
                        for e in cutlass.range_constexpr(8):
                            acc = acc + Float32(wv[e]) * xv[e]
                    for step in cutlass.range_constexpr(5):
                        acc = acc + cute.arch.shuffle_sync_bfly(acc, 16 >> step)
                    if lane == 0:
                        out = cute.make_tensor(y, cute.make_layout((n,)))
                        out[(first + c) * rows + warp] = BFloat16(acc)
                # Every warp is done with the stage: refill it S chunks on.
                cute.arch.sync_threads()
                if warp == 0:  # noqa: SIM102 - run-time `and` does not lower
                    if c + stages < count:
                        cute.arch.fence_proxy("async.shared", space="cta")
                        src = cute.make_tensor(
                            w + (first + c + stages) * chunk_elems,
                            cute.make_layout((chunk_elems,)),
                        )
                        dst = cute.make_tensor(
                            ring.iterator + slot * chunk_elems, cute.make_layout((chunk_elems,))
                        )
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(
                                bars.iterator + slot, chunk_bytes
                            )
                        cute.copy(atom, src, dst, mbar_ptr=bars.iterator + slot)

    return BulkGemv, smem_bytes


def make_spinner(spin_ns: int):
    """A SPIN_CTAS-CTA kernel that releases its dependents, waits for the kernel before it,
    then holds its SMs ``spin_ns`` (globaltimer): a latency-bound stage of the decode."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int64

    class Spinner:
        @cute.jit
        def __call__(self, stream: cuda.CUstream):
            self.kernel().launch(
                grid=[SPIN_CTAS, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=True
            )

        @cute.kernel
        def kernel(self):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
            start = cute.arch.globaltimer()
            now = start
            while now - start < Int64(spin_ns):
                now = cute.arch.globaltimer()

    return Spinner


def _ptr(tensor, dtype):
    import cutlass.cute as cute

    return cute.runtime.make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


def _stream():
    import cuda.bindings.driver as cuda
    import torch

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def _time(launches, rounds: int = ROUNDS) -> float:
    """us of one replay of the graph of ``launches`` (median of rounds)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


def measure_shape(name: str, n: int, k: int, configs, calls: int, spin_ns: int) -> list[dict]:
    import cutlass
    import cutlass.cute as cute
    import torch

    sys.path.insert(0, str(REPO))
    from kernels.gemm import prepared as pg

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    wbytes = n * k * 2
    copies = max(2, min(MAX_COPIES, -(-2 * L2_BYTES // wbytes)))
    weights = [
        (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
        for _ in range(copies)
    ]
    x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    want = x.float() @ weights[0].float().t()
    spinner = cute.compile(make_spinner(spin_ns)(), _stream())

    def spin():
        spinner(_stream())

    t_spin = _time([spin] * calls) / calls
    variants = {}
    prepared = [pg.PreparedGemm(w, "plain") for w in weights]
    prepared[0].compile()
    variants["register"] = [lambda p=p: p.run(x, y) for p in prepared]
    meta = {"register": {}, "cublas": {}}
    # The decode GEMM's own staged mode (StagedSkinnyGemmKernel: MMAs from 8-row stages).
    for stages in STAGED_STAGES:
        key = f"staged S{stages}"
        try:
            staged = [pg.PreparedGemm(w, "plain", weight_stages=stages) for w in weights]
            staged[0].compile((8,))
        except ValueError as err:  # more stages than a CTA's shared memory holds
            print(f"{name:15s} skipped {key}: {err}", flush=True)
            continue
        variants[key] = [lambda p=p: p.run(x, y) for p in staged]
        meta[key] = {"stages": stages}
    # cuBLAS (torch.mm into the same output, launched as torch launches it: no PDL).
    variants["cublas"] = [lambda w=w: torch.mm(x, w.t(), out=y) for w in weights]
    skipped = []
    for rows, stages, per_sm in configs:
        key = f"bulk R{rows} S{stages} C{per_sm}"
        cls, smem = make_bulk_gemv(n, k, rows, stages, per_sm * sms)
        if smem * per_sm > SMEM_PER_SM:
            skipped.append(f"{key}: {smem} B of shared memory x {per_sm} CTAs an SM")
            continue
        ptrs = [(_ptr(w, cutlass.BFloat16), _ptr(x, cutlass.BFloat16)) for w in weights]
        out = _ptr(y, cutlass.BFloat16)
        compiled = cute.compile(cls(True), *ptrs[0], out, _stream())
        variants[key] = [lambda p=p, f=compiled, o=out: f(*p, o, _stream()) for p in ptrs]
        meta[key] = {"rows": rows, "stages": stages, "ctas_per_sm": per_sm, "smem_bytes": smem}
    rows_out = []
    for key, launches in variants.items():
        y.zero_()
        launches[0]()
        torch.cuda.synchronize()
        err = float((y.float() - want).norm() / want.norm())
        row = {"shape": name, "N": n, "K": k, "variant": key, **meta[key], "rel_err": err}
        if not err < 1e-2:
            row["error"] = f"relative error {err:.2e} against the fp32 product"
            rows_out.append(row)
            print(f"{name:15s} {key:18s} {row['error']}", flush=True)
            continue
        for fn in launches:  # every copy's launch once before a graph captures it
            fn()
        torch.cuda.synchronize()
        chain = [launches[i % copies] for i in range(calls)]
        alone = _time(chain) / calls
        pairs = []
        for fn in chain:
            pairs += [spin, fn]
        behind = _time(pairs) / calls - t_spin
        row.update(
            alone_us=alone,
            alone_bw_frac=wbytes / alone / 1e6 / HBM_READ_TBPS,
            behind_us=behind,
            spinner_us=t_spin,
        )
        rows_out.append(row)
        print(
            f"{name:15s} {key:18s} alone {alone:7.2f} us ({row['alone_bw_frac']:.0%}), "
            f"behind a {spin_ns / 1e3:.1f} us stage +{behind:7.2f} us",
            flush=True,
        )
    for reason in skipped:
        print(f"{name:15s} skipped {reason}", flush=True)
    del weights, prepared, variants
    torch.cuda.empty_cache()
    return rows_out


def write_markdown(data: dict, path: Path) -> None:
    lines = [
        "# Weight stream at one token: shared-memory bulk stages against the register stream",
        "",
        f"{data['gpu']}, {data['date']}, `{data['command']}`.",
        "",
        data["method"],
        "",
        "| shape | variant | alone us | alone % of 4.25 TB/s | behind a stage: + us |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['variant']} | {r['error']} | | |")
        else:
            lines.append(
                f"| {r['shape']} | {r['variant']} | {r['alone_us']:.2f} | "
                f"{100 * r['alone_bw_frac']:.1f} | {r['behind_us']:.2f} |"
            )
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--calls", type=int, default=CALLS)
    ap.add_argument("--spin-ns", type=int, default=SPIN_NS)
    args = ap.parse_args()
    names = args.shapes.split(",")
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shapes {unknown}: choose from {list(SHAPES)}")

    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (SM90)", flush=True)
        return 2
    rows = []
    for name in names:
        n, k = SHAPES[name]
        rows += measure_shape(name, n, k, BULK_CONFIGS, args.calls, args.spin_ns)
    data = {
        "rows": rows,
        "method": (
            f"GEMV y = W x at one token (bf16, fp32 sums). register: PreparedGemm (plain, "
            "PDL); staged S: PreparedGemm(weight_stages=S) (PDL); cublas: torch.mm (no "
            "PDL). bulk R S C: cp.async.bulk of R-row chunks "
            "into S shared-memory stages "
            f"(mbarrier each), the ring filled before griddepcontrol.wait, {WARPS} warps a "
            f"CTA, C CTAs an SM. alone: {args.calls} launches back to back in one CUDA graph, "
            "each on its own weight copy (copies >= 2x L2), us a call; behind a stage: "
            f"{args.calls} pairs of a {SPIN_CTAS}-CTA kernel holding the GPU {args.spin_ns} ns "
            "after its wait and the GEMV, us a pair minus us a spinner alone. Median of "
            f"{ROUNDS} replays; every variant checked against the fp32 product first"
        ),
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cutlass_dsl": __import__("cutlass").__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", "scripts/probe_weight_stream.py", *sys.argv[1:]]),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "weight_stream.json").write_text(json.dumps(data, indent=2) + "\n")
    write_markdown(data, args.out_dir / "weight_stream.md")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

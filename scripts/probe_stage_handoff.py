#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What one stage boundary of the decode costs: a grid boundary under programmatic dependent
launch (PDL) against a counter barrier inside one persistent launch.

Issue 6's N = 1 step is ~0.5 ms above its weight-read floor, and ~350 us of that are latency
seams: 7 kernel boundaries a KDA + MoE layer, ~13.5 us a layer (`docs/perf/decode_notes.md`,
"Where 2.0x at N = 1 could still come from"). The one design not yet measured is a persistent
layer kernel whose stages hand over through counters in global memory instead of grid
boundaries. Before anyone writes one, this measures the mechanism alone, with the decode's
data dependency:

every stage runs on G CTAs of T threads; each CTA reads the whole fp32 vector the stage before
wrote (D values: 9 KB from L2 at D = 2304, the model's hidden size), sums it, and writes its
slice of the next vector. So every CTA of a stage depends on every CTA of the one before, as a
GEMM's input depends on every tile of the GEMM before it. S stages in a row:

- `chain`: S launches in one CUDA graph, each CTA releasing its dependents first and waiting
  (griddepcontrol) before its reads: the executor's seams;
- `chain_nopdl`: the same launches without PDL;
- `persistent`: one launch of G CTAs, all resident, walking the S stages: after its writes a CTA
  adds 1 to that stage's counter (release, GPU scope), and before its reads its thread 0 polls
  the previous stage's counter (acquire) until it reads G (`persistent_sleep`: with a 32 ns
  pause between polls; `persistent_lean`: the release add without the GPU fence before it,
  whose release alone orders the CTA's stores after the barrier). The graph also holds a
  memset of the counters (one node for S stages).

Measured on one H100 (2026-12-06, `docs/perf/decode_notes.md`, "What a stage boundary
costs"): PDL 0.98-1.21 us a stage, the lean counter barrier 1.32-1.79 us (G = 32-264).

The time of a stage is the graph's replay time / S (CUDA events around back-to-back replays,
median of rounds). Every variant is first checked against an fp64 torch reference of the S
stages. A poll that waits too long (a grid that is not all resident) gives up and the probe
says so instead of hanging. Torch and cutlass (the kernels bundle or the vllm bundle):

    python3 scripts/probe_stage_handoff.py --out-dir docs/perf
"""

# No `from __future__ import annotations`: CuTe DSL reads the kernels' annotations.
import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

VARIANTS = ("chain", "chain_nopdl", "persistent", "persistent_sleep", "persistent_lean")
CTA_COUNTS = (32, 132, 264)
THREADS = 128
DIM = 2304  # the model's hidden size
STAGES = 64
ROUNDS = 7
REPLAYS_PER_ROUND = 20
# A thread 0 gives up on a counter after this many polls (~70 ms with the 32 ns pause; a
# wait in a resident grid takes a few us) and sets the error word.
MAX_POLLS = 1 << 21
SLEEP_NS = 32
# The stage's arithmetic: next[j] = prev[j] * DECAY + mean(prev) * MIX. Bounded, and every
# value depends on every CTA of the stage before.
DECAY = 0.5
MIX = 0.25


def stage_reference(x, stages: int):
    """The S stages in fp64 torch (x: the first vector)."""
    y = x.double()
    for _ in range(stages):
        y = y * DECAY + y.mean() * MIX
    return y


def make_kernels(num_ctas: int, threads: int, dim: int, stages: int):
    """The probe's two CuTe DSL kernels for one shape: ``Stage(pdl)`` (one stage, one launch)
    and ``Persistent(sleep_ns)`` (every stage in one launch). cutlass is imported here, so
    the helpers above need only the standard library and torch."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr
    from cutlass._mlir.dialects import nvvm

    if threads % 32:
        raise ValueError(f"threads ({threads}) must be whole warps")
    warps = threads // 32
    loads = -(-dim // threads)  # values of the whole vector a thread sums
    slice_len = -(-dim // num_ctas)  # values of the next vector a CTA writes
    stores = -(-slice_len // threads)

    @cute.jit
    def cta_sum(x, tidx, partials):
        acc = Float32(0.0)
        for i in cutlass.range_constexpr(loads):
            j = tidx + i * threads
            if j < dim:
                acc = acc + x[j]
        for step in cutlass.range_constexpr(5):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, 16 >> step)
        if tidx % 32 == 0:
            partials[tidx // 32] = acc
        cute.arch.sync_threads()
        total = Float32(0.0)
        for w in cutlass.range_constexpr(warps):
            total = total + partials[w]
        return total

    @cute.jit
    def write_slice(x, y, cta, tidx, total):
        mean_mix = total * Float32(MIX / dim)
        for i in cutlass.range_constexpr(stores):
            offset = tidx + i * threads
            j = cta * slice_len + offset
            if offset < slice_len:  # noqa: SIM102 - run-time `and` does not lower
                if j < dim:
                    y[j] = x[j] * Float32(DECAY) + mean_mix

    class Stage:
        def __init__(self, pdl: bool):
            self.pdl = pdl

        @cute.jit
        def __call__(self, src: cute.Pointer, dst: cute.Pointer, stream: cuda.CUstream):
            self.kernel(src, dst).launch(
                grid=[num_ctas, 1, 1],
                block=[threads, 1, 1],
                smem=4 * warps,
                stream=stream,
                use_pdl=self.pdl,
            )

        @cute.kernel
        def kernel(self, src: cute.Pointer, dst: cute.Pointer):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
                cute.arch.griddepcontrol_wait()
            smem = cutlass.utils.SmemAllocator()
            partials = smem.allocate_tensor(Float32, cute.make_layout((warps,)), 4)
            x = cute.make_tensor(src, cute.make_layout((dim,)))
            y = cute.make_tensor(dst, cute.make_layout((dim,)))
            total = cta_sum(x, tidx, partials)
            write_slice(x, y, cta, tidx, total)

    class Persistent:
        def __init__(self, sleep_ns: int, fence: bool = True):
            self.sleep_ns = sleep_ns
            self.fence = fence

        @cute.jit
        def __call__(
            self,
            buffers: cute.Pointer,
            counters: cute.Pointer,
            error: cute.Pointer,
            stream: cuda.CUstream,
        ):
            self.kernel(buffers, counters, error).launch(
                grid=[num_ctas, 1, 1],
                block=[threads, 1, 1],
                smem=4 * warps,
                stream=stream,
            )

        @cute.kernel
        def kernel(self, buffers: cute.Pointer, counters: cute.Pointer, error: cute.Pointer):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            smem = cutlass.utils.SmemAllocator()
            partials = smem.allocate_tensor(Float32, cute.make_layout((warps,)), 4)
            gave_up = cute.make_tensor(error, cute.make_layout((1,)))
            for stage in cutlass.range(stages):
                if stage > 0:
                    if tidx == 0:
                        word = counters + (stage - 1)
                        seen = cute.arch.load(word, Int32, sem="acquire", scope="gpu")
                        polls = Int32(0)
                        while seen < num_ctas:
                            if const_expr(self.sleep_ns > 0):
                                nvvm.nanosleep(Int32(self.sleep_ns).ir_value())
                            seen = cute.arch.load(word, Int32, sem="acquire", scope="gpu")
                            polls = polls + 1
                            if polls >= MAX_POLLS:
                                gave_up[0] = Int32(1)
                                seen = Int32(num_ctas)
                    # Thread 0's acquire, then the barrier: every thread reads after it.
                    cute.arch.sync_threads()
                parity = stage % 2
                x = cute.make_tensor(buffers + parity * dim, cute.make_layout((dim,)))
                y = cute.make_tensor(buffers + (1 - parity) * dim, cute.make_layout((dim,)))
                total = cta_sum(x, tidx, partials)
                write_slice(x, y, cta, tidx, total)
                # Every thread's stores, then thread 0's release of them: the pattern of a
                # cooperative grid barrier's arrival.
                cute.arch.sync_threads()
                if tidx == 0:
                    if const_expr(self.fence):
                        cute.arch.fence_acq_rel_gpu()
                    cute.arch.atomic_add(counters + stage, Int32(1), sem="release", scope="gpu")

    return Stage, Persistent


def _ptr(tensor, dtype):
    import cutlass.cute as cute

    return cute.runtime.make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


def _stream():
    import cuda.bindings.driver as cuda
    import torch

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def _variant(name: str, num_ctas: int, threads: int, dim: int, stages: int):
    """(launch the S stages, the vector they end on, both buffers, the error word or None)
    of one variant, compiled; the stages start from ``buffers[0]``."""
    import cutlass
    import cutlass.cute as cute
    import torch

    stage_kernel, persistent_kernel = make_kernels(num_ctas, threads, dim, stages)
    buffers = torch.zeros(2, dim, dtype=torch.float32, device="cuda")
    views = [_ptr(buffers[i], cutlass.Float32) for i in range(2)]
    stream = _stream()
    if name.startswith("chain"):
        compiled = cute.compile(stage_kernel(name == "chain"), views[0], views[1], stream)

        def launch():
            s = _stream()
            for stage in range(stages):
                compiled(views[stage % 2], views[1 - stage % 2], s)

        return launch, buffers[stages % 2], buffers, None
    counters = torch.zeros(stages, dtype=torch.int32, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    sleep_ns = SLEEP_NS if name == "persistent_sleep" else 0
    args = (
        _ptr(buffers, cutlass.Float32),
        _ptr(counters, cutlass.Int32),
        _ptr(error, cutlass.Int32),
    )
    kernel = persistent_kernel(sleep_ns, fence=name != "persistent_lean")
    compiled = cute.compile(kernel, *args, stream)

    def launch():
        counters.zero_()
        compiled(*args, _stream())

    return launch, buffers[stages % 2], buffers, error


def measure(name: str, num_ctas: int, threads: int, dim: int, stages: int) -> dict:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    start = torch.randn(dim, device="cuda", generator=gen)
    launch, result, buffers, error = _variant(name, num_ctas, threads, dim, stages)
    buffers[0].copy_(start)
    launch()
    torch.cuda.synchronize()
    if error is not None and int(error.item()):
        return {"variant": name, "ctas": num_ctas, "error": "a counter poll gave up"}
    want = stage_reference(start, stages)
    err = float((result.double() - want).abs().max() / want.abs().max())
    if not err < 1e-5:
        return {"variant": name, "ctas": num_ctas, "error": f"max relative error {err:.2e}"}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(ROUNDS):
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(REPLAYS_PER_ROUND):
            graph.replay()
        end.record()
        end.synchronize()
        rounds.append(begin.elapsed_time(end) * 1e3 / REPLAYS_PER_ROUND)
    if error is not None and int(error.item()):
        return {"variant": name, "ctas": num_ctas, "error": "a counter poll gave up (timed)"}
    replay_us = statistics.median(rounds)
    return {
        "variant": name,
        "ctas": num_ctas,
        "threads": threads,
        "dim": dim,
        "stages": stages,
        "replay_us": replay_us,
        "us_per_stage": replay_us / stages,
        "rounds_us": rounds,
        "max_rel_err": err,
    }


def write_markdown(data: dict, path: Path) -> None:
    rows = data["rows"]
    ctas = sorted({r["ctas"] for r in rows})
    lines = [
        "# A stage boundary: grid boundary under PDL against a counter barrier in one launch",
        "",
        f"{data['gpu']}, {data['date']}, `{data['command']}`.",
        "",
        data["method"],
        "",
        "| variant | " + " | ".join(f"G = {c}, us a stage" for c in ctas) + " |",
        "|---|" + "---|" * len(ctas),
    ]
    for name in dict.fromkeys(r["variant"] for r in rows):
        cells = []
        for c in ctas:
            r = next((r for r in rows if r["variant"] == name and r["ctas"] == c), None)
            cells.append("-" if r is None else r.get("error") or f"{r['us_per_stage']:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--ctas", default=",".join(map(str, CTA_COUNTS)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--dim", type=int, default=DIM)
    ap.add_argument("--stages", type=int, default=STAGES)
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}: choose from {list(VARIANTS)}")

    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", flush=True)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for num_ctas in (int(c) for c in args.ctas.split(",")):
        for name in variants:
            if name.startswith("persistent") and num_ctas > 2 * sms:
                # Resident for certain only up to two small CTAs an SM.
                rows.append({"variant": name, "ctas": num_ctas, "error": f"> 2 x {sms} SMs"})
                continue
            rows.append(measure(name, num_ctas, args.threads, args.dim, args.stages))
            r = rows[-1]
            print(
                f"{name:17s} G {num_ctas:4d}: "
                + (r["error"] if "error" in r else f"{r['us_per_stage']:.3f} us a stage"),
                flush=True,
            )
    data = {
        "rows": rows,
        "method": (
            f"{args.stages} stages of G CTAs x {args.threads} threads; a stage's CTA reads the "
            f"whole fp32 vector of {args.dim} values the stage before wrote (from L2), sums it "
            "and writes its slice of the next one. chain: one launch a stage in one CUDA graph, "
            "PDL (release first, wait before the reads); chain_nopdl: without PDL; persistent: "
            "one launch, a counter a stage (release add after the writes, thread 0 polls with "
            f"acquire loads; persistent_sleep: {SLEEP_NS} ns between polls), plus a memset of "
            f"the counters in the graph. us a stage = graph replay / stages, median of {ROUNDS} "
            f"rounds of {REPLAYS_PER_ROUND} replays; every variant checked against an fp64 "
            "reference first"
        ),
        "gpu": torch.cuda.get_device_name(),
        "sms": sms,
        "torch": torch.__version__,
        "cutlass_dsl": __import__("cutlass").__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", "scripts/probe_stage_handoff.py", *sys.argv[1:]]),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "stage_handoff.json").write_text(json.dumps(data, indent=2) + "\n")
    write_markdown(data, args.out_dir / "stage_handoff.md")
    return 0 if all("error" not in r or r["error"].startswith(">") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

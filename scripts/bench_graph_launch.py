#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host time of one CUDA graph replay against the graph's kernel-node count and the kind of
node, with and without programmatic dependent launch (PDL).

The specialized decode replays one FULL graph of ~241 kernel nodes per step, nearly all of
them CuTe DSL kernels launched with PDL, and its replay() call took 52-63 us of host time on
2026-12-04's host, while a graph of up to 512 one-CTA Triton nodes took 4-7 us whatever its
node count (`docs/perf/host_loop.md`). So the node count is not the cost; this measures which
kind of node is: chains of a trivial one-CTA kernel (it waits for its predecessor and
releases its successor when PDL is on, like ours), in three kinds:

- `triton`: a Triton kernel with one pointer argument;
- `triton_args`: a Triton kernel with 16 pointer arguments (a larger parameter block);
- `cute`: a CuTe DSL kernel (`cute.compile`, raw pointer and stream arguments, launched like
  `kernels/`'s), skipped with the reason where cutlass is not installed;
- `cute_cluster`: the same kernel launched as one thread-block cluster of 2 CTAs (the
  GEMMs' split-K and the router launch clusters; only CTA 0 adds).

For each kind, node count K and PDL off / on: one graph of K launches; the GPU's time per
replay (events around back-to-back replays) and the host's time of one replay() call, which
only enqueues the graph (median over calls), then the least-squares host microseconds per
node. Torch and Triton, plus cutlass for `cute` (the vllm bundle has it):

    python3 scripts/bench_graph_launch.py --out-dir docs/perf [--kinds triton,cute]
"""

# No `from __future__ import annotations`: CuTe DSL reads the kernel's annotations
# (cute.Pointer, cuda.CUstream) as objects, and cutlass is imported inside `cute_tick` only.
import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_host_loop import time_replays  # noqa: E402

NODE_COUNTS = (1, 16, 64, 128, 256, 512)
KINDS = ("triton", "triton_args", "cute", "cute_cluster")
# CTAs of the `cute_cluster` node's one cluster (the GEMMs' split-K clusters are 2-4 CTAs).
CLUSTER_CTAS = 2
# Replays per measurement (few enough that the launch queue never fills, so no replay() call
# waits for the GPU).
REPLAYS = 200
WARMUP_REPLAYS = 20


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    if len(set(xs)) < 2:
        raise ValueError("a fit needs two distinct node counts")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
    return mean_y - slope * mean_x, slope


def summarize(rows: list[dict]) -> dict:
    """Per kind and PDL setting ("triton, pdl"): the fitted host us per node and fixed host
    us per replay, and the GPU us per node."""
    out = {}
    for kind in dict.fromkeys(r.get("kind", "triton") for r in rows):
        for pdl in (False, True):
            mine = sorted(
                (r for r in rows if r.get("kind", "triton") == kind and r["pdl"] is pdl),
                key=lambda r: r["nodes"],
            )
            if len(mine) < 2:
                continue
            nodes = [r["nodes"] for r in mine]
            base, per_node = linear_fit(nodes, [r["host_us_per_replay"] for r in mine])
            _, gpu_per_node = linear_fit(nodes, [r["gpu_us_per_replay"] for r in mine])
            out[f"{kind}, {'pdl' if pdl else 'plain'}"] = {
                "host_us_per_node": per_node,
                "host_us_fixed": base,
                "gpu_us_per_node": gpu_per_node,
            }
    return out


def write_markdown(data: dict, path: Path) -> None:
    lines = [
        "# CUDA graph replay: host time against kernel-node count and kind (H200)",
        "",
        f"{data['gpu']}, {data['date']}, torch {data['torch']}, triton {data['triton']}, "
        f"`{data['command']}`.",
        "",
        f"Method: {data['method']}",
        "",
        "| kind | nodes | PDL | host us per replay() | GPU us per replay |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r.get('kind', 'triton')} | {r['nodes']} | {'on' if r['pdl'] else 'off'} | "
            f"{r['host_us_per_replay']:.1f} | {r['gpu_us_per_replay']:.1f} |"
        )
    for kind, reason in data.get("skipped", {}).items():
        lines.append(f"\n`{kind}` not measured: {reason}")
    lines += ["", "Least-squares fit over the node counts:", ""]
    for name, fit in data["summary"].items():
        lines.append(
            f"- {name}: host {fit['host_us_fixed']:.1f} us + {fit['host_us_per_node']:.3f} us "
            f"per node; GPU {fit['gpu_us_per_node']:.3f} us per node"
        )
    path.write_text("\n".join(lines) + "\n")


_KERNELS: dict = {}


def _triton_kernels() -> dict:
    """The one-CTA Triton kernels, defined on first use (triton is not imported on CPU-only
    machines, where the report helpers above are tested) and compiled once per PDL mode."""
    if "triton" not in _KERNELS:
        import triton
        import triton.language as tl
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        @triton.jit
        def tick(ptr, USE_PDL: tl.constexpr):
            if USE_PDL:
                gdc_wait()
            tl.store(ptr, tl.load(ptr) + 1)
            if USE_PDL:
                gdc_launch_dependents()

        # Sixteen pointers, each read, so that none is pruned from the parameter block.
        @triton.jit
        def tick_args(
            ptr, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
            USE_PDL: tl.constexpr,
        ):  # fmt: skip
            if USE_PDL:
                gdc_wait()
            zero = (
                tl.load(p0) + tl.load(p1) + tl.load(p2) + tl.load(p3) + tl.load(p4)
                + tl.load(p5) + tl.load(p6) + tl.load(p7) + tl.load(p8) + tl.load(p9)
                + tl.load(p10) + tl.load(p11) + tl.load(p12) + tl.load(p13) + tl.load(p14)
                + tl.load(p15)
            )  # fmt: skip
            tl.store(ptr, tl.load(ptr) + 1 + zero)
            if USE_PDL:
                gdc_launch_dependents()

        _KERNELS["triton"] = tick
        _KERNELS["triton_args"] = tick_args
    return _KERNELS


def cute_tick(pdl: bool, cluster_ctas: int = 1):
    """The CuTe DSL kernel whose CTA 0 adds 1 to ``count[0]``, launched as one CTA or as one
    cluster of ``cluster_ctas`` (``cute.compile`` it with a raw Int32 pointer and a stream,
    as `kernels/` launch theirs); cutlass is imported here so that the report helpers above
    need only the standard library."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    class CuteTick:
        @cute.jit
        def __call__(self, ptr: cute.Pointer, stream: cuda.CUstream):
            if cutlass.const_expr(cluster_ctas > 1):
                self.kernel(ptr).launch(
                    grid=[cluster_ctas, 1, 1],
                    block=[32, 1, 1],
                    cluster=[cluster_ctas, 1, 1],
                    stream=stream,
                    use_pdl=pdl,
                )
            else:
                self.kernel(ptr).launch(
                    grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=pdl
                )

        @cute.kernel
        def kernel(self, ptr: cute.Pointer):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            if cutlass.const_expr(pdl):
                cute.arch.griddepcontrol_wait()
            count = cute.make_tensor(ptr, cute.make_layout((1,)))
            if tidx + cta == 0:  # thread 0 of CTA 0 (both indices are >= 0)
                count[0] = count[0] + 1
            if cutlass.const_expr(pdl):
                cute.arch.griddepcontrol_launch_dependents()

    return CuteTick()


def _cute_launcher(counter, pdl: bool, cluster_ctas: int):
    """A launch of ``cute_tick`` for ``counter`` on the current stream (compiled once per PDL
    mode and cluster size: the pointer is a runtime argument)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import torch

    def stream():
        return cuda.CUstream(torch.cuda.current_stream().cuda_stream)

    ptr = cute.runtime.make_ptr(
        cutlass.Int32, counter.data_ptr(), cute.AddressSpace.gmem, assumed_align=4
    )
    key = ("cute", pdl, cluster_ctas)
    if key not in _KERNELS:
        _KERNELS[key] = cute.compile(cute_tick(pdl, cluster_ctas), ptr, stream())
    compiled = _KERNELS[key]
    return lambda: compiled(ptr, stream())


def _launcher(kind: str, counter, pdl: bool):
    """A function that launches one node of ``kind`` adding 1 to ``counter[0]``."""
    import torch

    if kind == "cute":
        return _cute_launcher(counter, pdl, 1)
    if kind == "cute_cluster":
        return _cute_launcher(counter, pdl, CLUSTER_CTAS)
    kernel = _triton_kernels()[kind]
    if kind == "triton":
        return lambda: kernel[(1,)](counter, USE_PDL=pdl, launch_pdl=pdl)
    zeros = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(16)]
    return lambda: kernel[(1,)](counter, *zeros, USE_PDL=pdl, launch_pdl=pdl)


def cute_unavailable() -> str | None:
    """Why the `cute` kinds cannot run here, or None."""
    try:
        import cutlass.cute  # noqa: F401
    except ImportError as exc:
        return f"cutlass (nvidia-cutlass-dsl) does not import: {exc}"
    return None


def _measure(kind: str, nodes: int, pdl: bool) -> dict:
    import torch

    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch = _launcher(kind, counter, pdl)
        launch()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(nodes):
                launch()
        counter.zero_()
        for _ in range(WARMUP_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        gpu_ms, host_us = time_replays(graph, REPLAYS)
    replays = WARMUP_REPLAYS + REPLAYS
    if int(counter.item()) != nodes * replays:  # every node ran, in order, every replay
        raise RuntimeError(f"{kind}, {nodes} nodes, PDL {pdl}: counter {counter.item()}")
    return {
        "kind": kind,
        "nodes": nodes,
        "pdl": pdl,
        "host_us_per_replay": host_us,
        "gpu_us_per_replay": gpu_ms * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--nodes", default=",".join(map(str, NODE_COUNTS)))
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        ap.error(f"unknown kinds {unknown}: choose from {list(KINDS)}")

    import torch
    import triton

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", flush=True)
        return 2
    skipped = {}
    cute_kinds = [kind for kind in kinds if kind.startswith("cute")]
    if cute_kinds and (reason := cute_unavailable()):
        for kind in cute_kinds:
            skipped[kind] = reason
            kinds.remove(kind)
            print(f"{kind}: skipped, {reason}", flush=True)
    rows = []
    for kind in kinds:
        for nodes in (int(n) for n in args.nodes.split(",")):
            for pdl in (False, True):
                rows.append(_measure(kind, nodes, pdl))
                r = rows[-1]
                print(
                    f"{kind:11s} nodes {nodes:4d} PDL {'on ' if pdl else 'off'}: host "
                    f"{r['host_us_per_replay']:7.1f} us per replay(), GPU "
                    f"{r['gpu_us_per_replay']:8.1f} us per replay",
                    flush=True,
                )
    data = {
        "summary": summarize(rows),
        "rows": rows,
        "skipped": skipped,
        "method": (
            f"one graph of K launches of a one-CTA kernel (load, add, store; with PDL it "
            f"waits for its predecessor and releases its successor) of each kind (triton: "
            f"one pointer argument; triton_args: 16; cute: a CuTe DSL kernel; cute_cluster: "
            f"the same as one cluster of {CLUSTER_CTAS} CTAs), "
            f"{WARMUP_REPLAYS} warm-up then {REPLAYS} back-to-back replays; host = median "
            "perf_counter time of one replay() call, GPU = events around the replays / count"
        ),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", "scripts/bench_graph_launch.py", *sys.argv[1:]]),
    }
    print(json.dumps(data["summary"], indent=2), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "graph_launch.json").write_text(json.dumps(data, indent=2) + "\n")
    write_markdown(data, args.out_dir / "graph_launch.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the host time of a decode step goes inside vLLM (one engine, one H200).

The torch profile of `make bench` (2026-12-01, wheel 0.26.0+hd.2) showed the specialized
engine at N = 1 host-bound: the GPU ran each decode graph in ~2.5 ms and then waited ~0.5 ms
for the next cudaGraphLaunch, which the engine-core thread issued ~2.4 ms after it began
preparing the step. A profiler slows the host it measures, so this script times the host
without one: it wraps the engine core's step and the model runner's and scheduler's phases
with perf_counter (in the engine-core process, through collective_rpc) while N requests
decode, records kernels only (no CPU activity) over another batch to get the share of the
step the GPU waits, replays each captured decode graph back to back (its GPU time with no host
in the way), then runs cProfile over one more request for the functions behind them.
Results of 2026-12-01: docs/perf/host_loop.md.

    python3 scripts/profile_host_loop.py --out-dir /tmp/hl [--backend auto] [--runner v2]
    sh ci/gpu/device_session.sh host-loop [BACKEND[:RUNNER]...]    # on the offline H200

Writes <out-dir>/host_loop-<backend>-<runner>.json (inter-token latency, the GPU's idle
share and, per wrapped phase, microseconds per decode step and per call, for each N; the
graph replay times and the kinds of node a replay runs) and
host_loop-<backend>-<runner>-cprofile.txt (cProfile of one N = 1 request, by cumulative and
by own time, and the callers of the functions of most own time) with the same profile in
pstats' format beside it (-cprofile.prof: `python3 -m pstats FILE`). Prints the table.
`--runner v2` runs vLLM's Model Runner V2, whose host loop is built to be leaner; stock
Kimi-Linear on it tells whether supporting it is worth it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from bench_decode import (  # noqa: E402
    CUTE_KERNEL_NAME,
    DEFAULT_MODEL_DIR,
    PROMPT_TOKENS,
    _engine_args,
    host_facts,
    itl_samples,
    stream_batch,
    worker_env,
)

TOKENS = 256
CPROFILE_TOKENS = 128
# A kernel-only trace of this many tokens per N: how much of the step the GPU waits unprofiled.
GPU_TRACE_TOKENS = 128
GPU_WINDOW_SKIP = 0.2
CPROFILE_ROWS = 70
# Functions of most own time whose callers the text lists.
CPROFILE_CALLER_ROWS = 25
# A Chrome trace's GPU activity categories, by the name the node census gives them.
GPU_ACTIVITY_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
# (owner, method): the engine core's loop iteration and step, the scheduler's two calls and
# the model runner's phases of a step (vLLM 0.26.0 names; a missing one is reported, not
# fatal, so the script survives a rebase).
RUNNER_PHASES = (
    "execute_model",
    "sample_tokens",
    # the V1 runner (vllm/v1/worker/gpu_model_runner.py)
    "_update_states",
    "_prepare_inputs",
    "_build_attention_metadata",
    "_determine_batch_execution_and_padding",
    "_preprocess",
    "_sample",
    "_bookkeeping_sync",
    # the series' hook for logits a model's graph computed (a patched V1 runner)
    "_logits_computed_by_model",
    # the V2 runner (vllm/v1/worker/gpu/model_runner.py)
    "add_requests",
    "update_requests",
    "prepare_inputs",
    "prepare_attn",
    "sample",
    "postprocess_sampled",
)
RUNNERS = ("v1", "v2")
SCHEDULER_PHASES = ("schedule", "update_from_output")
CORE_PHASES = ("_process_engine_step", "step_fn")
# (module, class, method): what the runner phases call, where the host time may sit
# (graph launch, the metadata builders of the KDA and MLA groups, logits, sampling).
CALLEE_PHASES = (
    ("vllm.compilation.cuda_graph", "CUDAGraphWrapper", "__call__"),
    ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder", "build"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLACommonMetadataBuilder", "build"),
    (
        "vllm.v1.attention.backends.mla.flashattn_mla",
        "FlashAttnMLAMetadataBuilder",
        "_build_decode",
    ),
    ("vllm.v1.sample.sampler", "Sampler", "forward"),
    ("vllm.v1.worker.gpu_model_runner", "AsyncGPUModelRunnerOutput", "get_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_get_slot_mappings"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
)
# Back-to-back replays of each captured decode graph, timed with events: the GPU time of
# a step's graph with no host in the way.
GRAPH_REPLAYS = 50
GRAPH_SIZES = (1, 2, 4, 8)


def install_timers(worker) -> list[str]:
    """In the engine-core process: wrap every phase with a perf_counter timer whose samples
    go to ``worker._hd_host`` (phase -> seconds). Returns the phases it could not find."""
    import functools
    import gc
    import time
    from collections import defaultdict

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    samples = worker._hd_host = defaultdict(list)

    def timed(key, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                samples[key].append(time.perf_counter() - start)

        return wrapper

    missing = []
    runner_cls = type(worker.model_runner)
    for name in RUNNER_PHASES:
        # Only the runner's own methods: each runner has about half of the names.
        if name in vars(runner_cls):
            setattr(runner_cls, name, timed(f"runner.{name}", getattr(runner_cls, name)))
        else:
            missing.append(f"runner.{name}")
    # The busy loop calls bound methods held by the engine-core object: wrap the instance.
    cores = [o for o in gc.get_objects() if isinstance(o, EngineCore)]
    # The scheduler actually in use (with async scheduling a subclass of Scheduler).
    scheduler_cls = type(cores[0].scheduler) if cores else Scheduler
    for name in SCHEDULER_PHASES:
        if hasattr(scheduler_cls, name):
            wrapped = timed(f"scheduler.{name}", getattr(scheduler_cls, name))
            setattr(scheduler_cls, name, wrapped)
        else:
            missing.append(f"scheduler.{name}")
    # EngineCore freezes the GC heap once built (gc.freeze), and gc.get_objects() leaves
    # frozen objects out: without the instance, wrap the method where the engine-core
    # process's class defines it (the busy loop looks it up on every iteration).
    from vllm.v1.engine.core import EngineCoreProc

    for name in CORE_PHASES:
        owner = next((c for c in (EngineCoreProc, EngineCore) if name in vars(c)), None)
        if cores and hasattr(cores[0], name):
            setattr(cores[0], name, timed(f"core.{name}", getattr(cores[0], name)))
        elif owner is not None:
            setattr(owner, name, timed(f"core.{name}", vars(owner)[name]))
        else:
            missing.append(f"core.{name}")
    import importlib

    for module, cls_name, name in CALLEE_PHASES:
        cls = getattr(importlib.import_module(module), cls_name, None)
        if cls is not None and name in vars(cls):
            setattr(cls, name, timed(f"{cls_name}.{name}", vars(cls)[name]))
        else:
            missing.append(f"{cls_name}.{name}")
    model_cls = type(worker.model_runner.get_model())
    if "compute_logits" in vars(model_cls):
        wrapped = timed("model.compute_logits", vars(model_cls)["compute_logits"])
        model_cls.compute_logits = wrapped
    else:
        missing.append("model.compute_logits")
    return missing


def time_graph_replays(worker) -> dict[str, dict]:
    """Per captured FULL decode graph of a size in GRAPH_SIZES: GPU milliseconds per replay
    over GRAPH_REPLAYS back-to-back replays (events), the host microseconds one
    replay() call takes when the GPU is busy, and the kinds of node one replay runs
    (``replay_census``). Run with no request in flight: the replays
    rewrite the last step's cache rows and states, which nothing reads any more."""
    import torch

    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    model = worker.model_runner.model
    if not isinstance(model, CUDAGraphWrapper):
        return {"error": f"runner.model is a {type(model).__name__}, not a CUDAGraphWrapper"}
    result = {}
    for descriptor, entry in model.concrete_cudagraph_entries.items():
        if entry.cudagraph is None or descriptor.num_tokens not in GRAPH_SIZES:
            continue
        if not descriptor.uniform:
            continue
        graph = entry.cudagraph
        graph.replay()
        torch.cuda.synchronize()
        gpu_ms, host_us = time_replays(graph, GRAPH_REPLAYS)
        result[str(descriptor.num_tokens)] = {
            "gpu_ms_per_replay": gpu_ms,
            "host_us_per_replay_call": host_us,
            "nodes": replay_census(graph),
        }
    return result


def replay_census(graph) -> dict[str, int]:
    """What one replay of ``graph`` runs, from a kernel-only trace of it: the replay() call
    costs the host ~50 µs for a decode graph against ~5 µs for a graph of 512 Triton nodes
    (`docs/perf/graph_launch.md`), so which kinds of node it holds is the question."""
    import torch

    trace = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with trace:
        graph.replay()
        torch.cuda.synchronize()
    return node_census(trace_events(trace))


def node_census(events: list[dict]) -> dict[str, int]:
    """Counts of a trace's GPU activities: kernels by who wrote them (CuTe DSL, cuBLAS,
    Triton, torch, other), memory copies and memsets."""
    counts: dict[str, int] = {}
    for event in events:
        kind = GPU_ACTIVITY_KINDS.get(event.get("cat", ""))
        if kind is None:
            continue
        if kind == "kernel":
            name = event.get("name", "")
            # As the profiler names them (bench_decode shortens them only for its tables).
            if CUTE_KERNEL_NAME.match(name):
                kind = "kernel: CuTe DSL"
            elif name.startswith("nvjet") or "cublas" in name.lower():
                kind = "kernel: cuBLAS"
            elif name.startswith("triton_") or name.startswith("_"):
                kind = "kernel: Triton"
            elif "at::native" in name:
                kind = "kernel: torch"
            else:
                kind = "kernel: other"
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def time_replays(graph, replays: int) -> tuple[float, float]:
    """Back-to-back replays of a captured graph: GPU ms per replay (events around them) and
    the median host µs of one replay() call, which returns without waiting as long as the GPU
    still works on the replays queued before it. Imports inside, like the functions run in
    the engine's worker (sent by value through collective_rpc), which call it."""
    import time

    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    start.record()
    for _ in range(replays):
        t0 = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t0)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, sorted(host)[len(host) // 2] * 1e6


def take_timers(worker) -> dict[str, list[float]]:
    samples = dict(worker._hd_host)
    worker._hd_host.clear()
    return samples


def start_cprofile(worker) -> None:
    import cProfile

    worker._hd_cprofile = cProfile.Profile()
    worker._hd_cprofile.enable()


def stop_cprofile(worker) -> tuple[str, bytes]:
    """The profile as text (by cumulative and by own time, then who called the functions
    of most own time: a builtin such as ``Tensor.to`` says nothing without its callers) and
    as pstats' own file format (``pstats.Stats(path)`` reads it back for any other view)."""
    import io
    import marshal
    import pstats

    worker._hd_cprofile.disable()
    text = io.StringIO()
    stats = pstats.Stats(worker._hd_cprofile, stream=text)
    stats.sort_stats("cumulative").print_stats(CPROFILE_ROWS)
    stats.sort_stats("tottime").print_stats(CPROFILE_ROWS)
    stats.print_callers(CPROFILE_CALLER_ROWS)
    return text.getvalue(), marshal.dumps(stats.stats)


def start_cuda_trace(worker) -> None:
    """Kernel activity only: no CPU-side recording, so the host runs at its own speed."""
    import torch

    worker._hd_trace = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    worker._hd_trace.__enter__()


def stop_cuda_trace(worker) -> list[tuple[float, float]]:
    """(start, duration) in microseconds of every kernel the trace saw."""
    worker._hd_trace.__exit__(None, None, None)
    events = trace_events(worker._hd_trace)
    return [(e["ts"], e["dur"]) for e in events if e.get("cat") == "kernel"]


def trace_events(trace) -> list[dict]:
    """The events of a finished torch profiler trace, as its Chrome trace lists them."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        trace.export_chrome_trace(f.name)
        with open(f.name) as exported:
            return json.load(exported)["traceEvents"]


def gpu_idle_share(kernels: list[tuple[float, float]], skip: float = GPU_WINDOW_SKIP) -> dict:
    """Share of time the GPU ran no kernel, over the middle of the trace (the first and last
    ``skip`` of its span left out: the prefill and the request's end)."""
    kernels = sorted(kernels)
    if not kernels:
        return {"idle_share": None, "window_us": 0.0}
    first, last = kernels[0][0], max(start + dur for start, dur in kernels)
    lo, hi = first + skip * (last - first), last - skip * (last - first)
    busy, busy_end = 0.0, lo
    for start, dur in kernels:
        start, end = max(start, busy_end), min(start + dur, hi)
        if end > start:
            busy += end - start
            busy_end = end
    return {"idle_share": 1.0 - busy / (hi - lo), "window_us": hi - lo}


def phase_table(samples: dict[str, list[float]], steps: int) -> dict[str, dict]:
    """Per phase: microseconds per decode step (all its calls), per call (median, mean)
    and calls per step (the engine core's loop runs more often than it executes the model
    under async scheduling, so per-call medians can mix two kinds of call)."""
    return {
        key: {
            "us_per_step": sum(values) * 1e6 / steps,
            "median_us": statistics.median(values) * 1e6,
            "mean_us": statistics.mean(values) * 1e6,
            "calls_per_step": len(values) / steps,
        }
        for key, values in sorted(samples.items())
    }


def run(
    model_dir: Path, backend: str, runner: str, ns: list[int], tokens: int = TOKENS
) -> tuple[dict, str, bytes]:
    import asyncio

    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(_engine_args(model_dir, backend, max(ns)))

    async def batch(tag: str, n: int, max_tokens: int) -> list:
        return await stream_batch(engine, tag, n, PROMPT_TOKENS, max_tokens)

    async def main() -> tuple[dict, str, bytes]:
        result = {"backend": backend, "runner": runner, "tokens": tokens, "per_n": {}}
        await batch("settle", 1, tokens)
        result["missing_phases"] = (await engine.collective_rpc(install_timers))[0]
        for n in ns:
            await batch(f"warm{n}", n, 16)
            await engine.collective_rpc(take_timers)
            chunks = await batch(f"n{n}", n, tokens)
            samples = (await engine.collective_rpc(take_timers))[0]
            itl = statistics.median(s for ch in chunks for s in itl_samples(ch)) * 1e3
            await engine.collective_rpc(start_cuda_trace)
            await batch(f"gpu{n}", n, GPU_TRACE_TOKENS)
            gpu = gpu_idle_share((await engine.collective_rpc(stop_cuda_trace))[0])
            result["per_n"][str(n)] = {
                "itl_ms": itl,
                "gpu": gpu,
                "phases": phase_table(samples, tokens),
            }
            print(f"{backend} N={n}: inter-token latency {itl:.3f} ms, GPU idle {gpu}", flush=True)
        result["graph_replays"] = (await engine.collective_rpc(time_graph_replays))[0]
        print(f"{backend} graph replays: {result['graph_replays']}", flush=True)
        await engine.collective_rpc(start_cprofile)
        await batch("cprofile", 1, CPROFILE_TOKENS)
        text, raw = (await engine.collective_rpc(stop_cprofile))[0]
        return result, text, raw

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def compare(base: dict, new: dict) -> list[str]:
    """Markdown lines: the median µs per call of every phase both runs timed (with the
    new run's calls per decode step: a phase called about once per step is one to compare),
    and the inter-token latency, per N, base against new (two wheels on one host)."""

    def label(run: dict) -> str:
        host = run.get("host") or {}
        return f"{host.get('vllm', '?')} ({str(host.get('fingerprint', '?'))[:8]})"

    lines = [f"Host loop, {label(base)} -> {label(new)}: median µs per call", ""]
    for n in sorted(set(base["per_n"]) & set(new["per_n"]), key=int):
        a, b = base["per_n"][n], new["per_n"][n]
        lines += [
            f"N = {n}: inter-token latency {a['itl_ms']:.3f} -> {b['itl_ms']:.3f} ms "
            f"({(b['itl_ms'] - a['itl_ms']) * 1e3:+.1f} µs)",
            "",
            "| phase | calls per step | base | new | new - base |",
            "|---|---|---|---|---|",
        ]
        for key in sorted(set(a["phases"]) & set(b["phases"])):
            was, now = a["phases"][key]["median_us"], b["phases"][key]["median_us"]
            calls = b["phases"][key].get("calls_per_step")
            shown = "?" if calls is None else f"{calls:.2f}"
            lines.append(f"| `{key}` | {shown} | {was:.1f} | {now:.1f} | {now - was:+.1f} |")
        only = sorted(set(a["phases"]) ^ set(b["phases"]))
        if only:
            lines.append(f"\nTimed in one run only: {', '.join(only)}.")
        lines.append("")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BASE", "NEW"),
        help="only compare two results of this script (e.g. two wheels on one host) and exit",
    )
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--backend", default="latency_specialized")
    ap.add_argument(
        "--runner",
        choices=RUNNERS,
        default="v1",
        help="vLLM's model runner (v2: VLLM_USE_V2_MODEL_RUNNER=1; the specialized decode "
        "refuses it)",
    )
    ap.add_argument("--n", default="1,2,4")
    ap.add_argument(
        "--tokens",
        type=int,
        default=TOKENS,
        help="output tokens per timed request (make bench uses 1024)",
    )
    ap.add_argument(
        "--triton-cache", type=Path, help="one Triton cache shared with make bench's engines"
    )
    args = ap.parse_args()
    if args.compare:
        base, new = (json.loads(path.read_text()) for path in args.compare)
        print("\n".join(compare(base, new)))
        return 0
    if args.out_dir is None:
        ap.error("--out-dir is required (unless --compare)")
    os.environ.update(worker_env(os.environ, args.triton_cache))
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    # collective_rpc with functions needs vLLM's pickle-based serialization.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    ns = [int(n) for n in args.n.split(",")]
    result, text, raw = run(args.model_dir, args.backend, args.runner, ns, args.tokens)
    # Which wheel and host: an A/B of two wheels on one host compares two of these files.
    result["host"] = host_facts(" ".join(sys.argv))
    name = f"host_loop-{args.backend}-{args.runner}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / f"{name}-cprofile.txt").write_text(text)
    # bytes() also takes what the engine's RPC encoding may hand back for bytes (a buffer).
    (args.out_dir / f"{name}-cprofile.prof").write_bytes(bytes(raw))
    for n, row in result["per_n"].items():
        idle = row["gpu"]["idle_share"]
        print(
            f"\nN = {n}: inter-token latency {row['itl_ms']:.3f} ms; GPU idle "
            + ("?" if idle is None else f"{idle:.1%} (~{idle * row['itl_ms']:.3f} ms per step)")
        )
        for key, phase in row["phases"].items():
            print(
                f"  {key:45s} {phase['us_per_step']:8.1f} us / step "
                f"{phase['median_us']:8.1f} us median {phase['calls_per_step']:5.2f} calls"
            )
    for n, row in sorted(result.get("graph_replays", {}).items()):
        if isinstance(row, dict):
            print(
                f"graph N = {n}: GPU {row['gpu_ms_per_replay']:.3f} ms per replay, "
                f"replay() call {row['host_us_per_replay_call']:.1f} us, "
                f"nodes {row.get('nodes')}"
            )
    if result["missing_phases"]:
        print(f"not wrapped (not found): {result['missing_phases']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

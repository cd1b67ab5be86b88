#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the host time of a prefill step goes inside vLLM, one engine at a time (one H200).

make bench's prefill batches (PREFILL_REQUESTS prompts of PREFILL_TOKENS tokens, one output
token each) are host-bound in both engines: on 2026-12-05 (hd.24's pair, decode_notes.md)
a batch took ~0.85 s of wall clock against ~0.27 s of GPU work, and the specialized
engine's model forward took 2.4 ms more host time per prefill step than stock's (82.2 vs
79.6 ms a step in all), the size of issue 6's 2% prefill band. Both engines run stock's
prefill code, so the difference is in the Python around it. This script builds one engine
as make bench does, runs the same warm-ups and timed batches with the engine core's phase
timers (profile_host_loop.install_timers), then cProfiles PROFILE_BATCHES more batches in
the engine-core process; --compare lines up two engines' profiles function by function,
in milliseconds per prefill step.

    python3 scripts/profile_prefill.py --out-dir DIR --backend auto
    python3 scripts/profile_prefill.py --out-dir DIR --backend latency_specialized
    python3 scripts/profile_prefill.py --compare DIR/prefill-auto.json \\
        DIR/prefill-latency_specialized.json
    sh ci/gpu/device_session.sh prefill-profile      # both engines and the comparison

Writes <out-dir>/prefill-<backend>.json (wall-clock tokens/s per batch, each batch's engine
busy time and phases, torch's allocator counters over them, the profiled batches' steps),
prefill-<backend>-cprofile.txt and prefill-<backend>-cprofile.prof (pstats' format:
`python3 -m pstats FILE`).
"""

from __future__ import annotations

import argparse
import json
import marshal
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from bench_decode import (  # noqa: E402
    DEFAULT_MODEL_DIR,
    N_VALUES,
    PREFILL_REQUESTS,
    PREFILL_RUNS,
    PREFILL_TOKENS,
    PREFILL_WARMUPS,
    PROMPT_TOKENS,
    _engine_args,
    host_facts,
    install_host_timers,
    prefill_engine_summary,
    stream_batch,
    time_prefill,
    worker_env,
)

# make bench's engines: max_num_seqs is its largest N, which sets the captured graphs.
MAX_NUM_SEQS = max(N_VALUES)
PROFILE_BATCHES = 3
# torch's caching allocator counters over the timed batches: a device malloc or free, or a
# retry (free every cached block, then malloc again) inside a forward is host time that
# synchronises, and the engines differ in memory (the executor's ~170 MiB, a smaller KV
# cache) though not in prefill code.
ALLOCATOR_COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
    "num_sync_all_streams",
)
ALLOCATOR_GAUGES = ("reserved_bytes.all.current", "allocated_bytes.all.peak")
# Rows of the comparison: the functions whose own (or cumulative) time differs most.
COMPARE_ROWS = 40


def allocator_stats(worker) -> dict[str, int]:
    """In the engine-core process: the caching allocator's counters and gauges."""
    import torch

    stats = torch.cuda.memory_stats()
    return {key: int(stats.get(key, 0)) for key in (*ALLOCATOR_COUNTERS, *ALLOCATOR_GAUGES)}


def allocator_change(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters' increase over the timed batches and the gauges after them."""
    change = {key: after[key] - before[key] for key in ALLOCATOR_COUNTERS}
    change.update({key: after[key] for key in ALLOCATOR_GAUGES})
    return change


def run(model_dir: Path, backend: str, batches: int) -> tuple[dict, str, bytes]:
    import asyncio

    import profile_host_loop as loop
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(_engine_args(model_dir, backend, MAX_NUM_SEQS))

    async def batch(tag: str, n: int, prompt_len: int, max_tokens: int) -> list:
        return await stream_batch(engine, tag, n, prompt_len, max_tokens)

    async def main() -> tuple[dict, str, bytes]:
        await batch("settle", 1, PROMPT_TOKENS, 64)
        for w in range(PREFILL_WARMUPS):
            await batch(f"pwarm{w}", PREFILL_REQUESTS, PREFILL_TOKENS, 1)
        timers = await install_host_timers(engine)
        before = (await engine.collective_rpc(allocator_stats))[0]
        rates, engine_batches = await time_prefill(engine, batch, timers, batches)
        after = (await engine.collective_rpc(allocator_stats))[0]
        await engine.collective_rpc(timers.take_timers)
        await engine.collective_rpc(loop.start_cprofile)
        for b in range(PROFILE_BATCHES):
            await batch(f"cprofile{b}", PREFILL_REQUESTS, PREFILL_TOKENS, 1)
        text, raw = (await engine.collective_rpc(loop.stop_cprofile))[0]
        samples = (await engine.collective_rpc(timers.take_timers))[0]
        result = {
            "backend": backend,
            "batch": {"requests": PREFILL_REQUESTS, "prompt_tokens": PREFILL_TOKENS},
            "missing_phases": timers.missing,
            "tokens_per_s": rates,
            "engine_batches": engine_batches,
            "allocator": allocator_change(before, after),
            "profile": {
                "batches": PROFILE_BATCHES,
                "steps": len(samples.get("runner.execute_model", [])),
            },
        }
        return result, text, raw

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def summary(result: dict) -> dict:
    """Median tokens/s by wall clock and by the engine's busy time, steps per batch and
    host ms per prefill step of every timed phase over the timed batches."""
    engine = prefill_engine_summary(result["engine_batches"], phases=None) or {}
    return {
        "wall_tokens_per_s": statistics.median(result["tokens_per_s"]),
        "engine_tokens_per_s": engine.get("median"),
        "steps_per_batch": engine.get("steps_per_batch"),
        "phase_ms_per_step": engine.get("phase_ms_per_step", {}),
    }


def function_label(key: tuple[str, int, str]) -> str:
    """pstats' (file, line, function) as a short label: the path from the package root
    (site-packages/ cut), builtins as pstats names them."""
    path, line, name = key
    if path == "~":
        return name
    for root in ("site-packages/", "dist-packages/", "lib/python"):
        if root in path:
            path = path.split(root, 1)[1]
            break
    return f"{path}:{line}({name})"


def per_step_ms(stats: dict, steps: int) -> dict[str, tuple[float, float]]:
    """Per function label: (own ms, cumulative ms) per prefill step."""
    out: dict[str, tuple[float, float]] = {}
    for key, (_, _, own, cumulative, _) in stats.items():
        label = function_label(key)
        was = out.get(label, (0.0, 0.0))
        out[label] = (was[0] + own * 1e3 / steps, was[1] + cumulative * 1e3 / steps)
    return out


def compare_profiles(
    base: dict, base_steps: int, new: dict, new_steps: int, rows: int = COMPARE_ROWS
) -> list[str]:
    """Markdown: the functions whose own time, then whose cumulative time, per prefill
    step differs most between two engines' profiles (new - base)."""
    a, b = per_step_ms(base, base_steps), per_step_ms(new, new_steps)
    labels = set(a) | set(b)
    lines = []
    for title, index in (("own", 0), ("cumulative", 1)):
        diffs = sorted(
            labels,
            key=lambda k: -abs(b.get(k, (0.0, 0.0))[index] - a.get(k, (0.0, 0.0))[index]),
        )[:rows]
        total_a = sum(v[0] for v in a.values())
        total_b = sum(v[0] for v in b.values())
        lines += [
            f"Functions by {title} ms per prefill step, largest differences first "
            f"(all own time: base {total_a:.2f}, new {total_b:.2f} ms per step)",
            "",
            "| function | base | new | new - base |",
            "|---|---|---|---|",
        ]
        for label in diffs:
            was = a.get(label, (0.0, 0.0))[index]
            now = b.get(label, (0.0, 0.0))[index]
            lines.append(f"| `{label}` | {was:.3f} | {now:.3f} | {now - was:+.3f} |")
        lines.append("")
    return lines


def compare(base_path: Path, new_path: Path) -> list[str]:
    """The comparison of two results of this script (their .prof files beside them)."""
    base, new = (json.loads(p.read_text()) for p in (base_path, new_path))
    lines = [f"Prefill host time, {base['backend']} (base) -> {new['backend']} (new)", ""]
    sa, sb = summary(base), summary(new)

    def both(key: str) -> str:
        return " -> ".join("?" if s[key] is None else f"{s[key]:.0f}" for s in (sa, sb))

    lines += [
        f"- tokens/s by wall clock (median): {both('wall_tokens_per_s')}",
        f"- tokens/s by the engine's busy time (median): {both('engine_tokens_per_s')}",
        f"- steps per batch: {both('steps_per_batch')}",
        *(
            f"- allocator `{key}` over the timed batches: "
            f"{base.get('allocator', {}).get(key, '?')} -> {new.get('allocator', {}).get(key, '?')}"
            for key in (*ALLOCATOR_COUNTERS, *ALLOCATOR_GAUGES)
        ),
        "",
        "| phase, ms per prefill step | base | new | new - base |",
        "|---|---|---|---|",
    ]
    for key in sorted(set(sa["phase_ms_per_step"]) & set(sb["phase_ms_per_step"])):
        was, now = sa["phase_ms_per_step"][key], sb["phase_ms_per_step"][key]
        lines.append(f"| `{key}` | {was:.2f} | {now:.2f} | {now - was:+.2f} |")
    lines.append("")
    stats = []
    for path, result in ((base_path, base), (new_path, new)):
        prof = path.with_name(path.name.replace(".json", "-cprofile.prof"))
        stats.append((marshal.loads(prof.read_bytes()), result["profile"]["steps"]))
    if not all(steps for _, steps in stats):
        return lines + ["A profile counted no prefill step: no function comparison."]
    return lines + compare_profiles(stats[0][0], stats[0][1], stats[1][0], stats[1][1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--compare", nargs=2, type=Path, metavar=("BASE", "NEW"),
        help="only compare two results of this script (their .prof files beside them)",
    )  # fmt: skip
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--backend", default="latency_specialized")
    ap.add_argument("--batches", type=int, default=PREFILL_RUNS, help="timed prefill batches")
    ap.add_argument(
        "--triton-cache", type=Path, help="one Triton cache shared with make bench's engines"
    )
    args = ap.parse_args()
    if args.compare:
        print("\n".join(compare(*args.compare)))
        return 0
    if args.out_dir is None:
        ap.error("--out-dir is required (unless --compare)")
    os.environ.update(worker_env(os.environ, args.triton_cache))
    # collective_rpc with functions needs vLLM's pickle-based serialization.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    result, text, raw = run(args.model_dir, args.backend, args.batches)
    result["host"] = host_facts(" ".join(sys.argv))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"prefill-{args.backend}"
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / f"{name}-cprofile.txt").write_text(text)
    # bytes() also takes what the engine's RPC encoding may hand back for bytes (a buffer).
    (args.out_dir / f"{name}-cprofile.prof").write_bytes(bytes(raw))
    brief = summary(result)
    print(
        f"{args.backend}: {brief['wall_tokens_per_s']:.0f} tokens/s by wall clock, "
        f"{brief['engine_tokens_per_s']} by the engine's busy time, "
        f"{brief['steps_per_batch']} steps per batch"
    )
    for key, ms in brief["phase_ms_per_step"].items():
        print(f"  {key:45s} {ms:8.2f} ms / step")
    print(f"allocator over the timed batches: {result['allocator']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decode step time inside vLLM on one H200: stock vs the latency-specialized decode.

Method (as vLLM PR #61867 reports it): decode step time = median inter-token
latency, prefill excluded, with exactly N requests in flight: N requests of
4-token prompts start together, generate OUTPUT_TOKENS tokens each (greedy,
ignore_eos), streamed through AsyncLLM; every streamed chunk of k tokens that
arrived dt after the previous one contributes k samples of dt / k.  Median over
all samples of a run, median of RUNS runs.  Each backend runs in its own
process (one engine per process): `decode_backend` "auto" (stock) and
"latency_specialized", same model directory, dummy weights, same seed.

Also measured:
  * prefill throughput per backend (PREFILL_REQUESTS prompts of PREFILL_TOKENS
    tokens, one output token each, after PREFILL_WARMUPS untimed batches of the same
    shape): prompt tokens per second, median of max(RUNS, PREFILL_RUNS) batches, ratio
    specialized / stock with a 95% bootstrap interval and issue 6's verdict on it
    (also of each engine's best batch, since a busy host only slows a batch), the
    same batches by the engine core's busy time (its steps only,
    with their host time per step by phase: the frontend and the requests' arrival left
    out) and the GPU time of one more batch under the profiler;
  * distinct routed experts per decode step at each N, from an eager stock
    engine with forward hooks on every MoE router (same weights and prompts);
  * where the GPU time of a step at N = 1 goes: every kernel's time per step from a
    torch-profiler trace of PROFILE_TOKENS tokens of one request, after the timed runs;
  * the host's CPU use during each timed run, from /proc: CPUs kept busy by the engine's
    own processes and by everything else (a run beside a busy neighbour is named);
  * the weight-read floor at each N: bytes a step must read (every non-routed
    weight, the distinct experts of every MoE layer, lm_head) plus each
    request's KDA/conv state read + write and MLA latent cache read, / 4.25 TB/s.

Writes <out-dir>/decode.json ("summary": step_ms {N: {stock, specialized}},
speedup {N}, floor_ms {N}, distinct_experts {N}, prefill_throughput_ratio;
"fingerprint" and "vllm" of the installed patched wheel; gpu, date, command),
decode.md and decode.png (step time vs N for both paths, with the floor).

    python3 scripts/bench_decode.py --out-dir docs/perf        # on the H200

`--routing spread`: the same with every MoE router re-drawn after the dummy load so that
tokens route apart (scripts/bench_routing.py; with dummy weights every token routes to the
same 8 experts, so the N > 1 steps read 8 experts' weights instead of up to N x 8); writes
decode_spread_routing.{json,md,png} and leaves decode.* (issue 6's method) alone.

Split over device calls (600 s each): run `--roles auto,experts` and `--roles
latency_specialized` with the same `--scratch DIR --runs R` (and `--triton-cache DIR` so the
prefill kernels autotune once); each role's result records the GPU, the wheel and the
command it ran with. Copy DIR back and `--assemble --scratch DIR` writes the report on any
host (refusing results of different GPUs or wheels).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = ROOT / "tests" / "runtime" / "kimi_linear_48b"
HBM_BYTES_PER_S = 4.25e12
N_VALUES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_TOKENS = 4
OUTPUT_TOKENS = 1024
RUNS = 3
PREFILL_REQUESTS = 16
PREFILL_TOKENS = 1024
PREFILL_WARMUPS = 2
# The batches are host-bound (chunked 2048-token steps outside CUDA graphs) and
# spread by 10-30% on a busy host (hd.24's pair: 16.6-29.5k tokens/s in one engine),
# so issue 6's 2% needs many of them: 24 per engine (~0.85 s each) and a bootstrap
# interval of the ratio of the medians (PREFILL_CI_*) to say whether it is shown.
PREFILL_RUNS = 24
# Issue 6: prefill throughput within 2% of stock.
PREFILL_TARGET_RATIO = 0.98
# The host's speed moves every phase of a prefill step together (hd.24's pair: one
# engine's batches up to ~1.8x apart in every phase, decode_notes.md), so each batch is
# also read against these phases: stock code doing the same work in both engines (the
# specialized engine builds all metadata for prefill steps), i.e. a gauge of how fast
# the host ran that batch. Rate = gauge seconds / engine-busy seconds. On hd.24's
# batches these six spread least (1.4% / 4.2% per engine) of the stock-code sets tried.
PREFILL_HOST_GAUGE_PHASES = (
    "runner._update_states",
    "runner._prepare_inputs",
    "runner._build_attention_metadata",
    "runner._preprocess",
    "scheduler.schedule",
    "scheduler.update_from_output",
)
# The ratio's 95% interval: the batches of each engine resampled with replacement
# (a fixed seed, so a report renders the same interval every time).
PREFILL_CI_RESAMPLES = 4000
PREFILL_CI_SEED = 0
EXPERT_COUNT_STEPS = 64
# Decode steps of one request traced with the torch profiler after the timed runs
# (GPU time per kernel name, CUDA-graph replays included): where a step's time goes.
PROFILE_TOKENS = 64
# N of the traced requests: a kernel table and the GPU busy time per N in decode.md, the
# traces kept with --keep-traces for the host side (traced_ns: an A/B may trace others).
PROFILE_NS = (1, 2)
PROFILE_N_ENV = "HD_BENCH_PROFILE_N"
# A timed run during which other processes kept more than this many of the host's CPUs busy
# is named in the report: the lent hosts are shared, and on 2026-12-07 a run with the GPU
# waiting 0.6 ms a step for the host could not be told apart from a slower engine.
BUSY_HOST_OTHER_CORES = 1.0


def traced_ns(environ: dict[str, str] | None = None) -> tuple[int, ...]:
    """The N an engine traces: PROFILE_NS, or those PROFILE_N_ENV lists (e.g. 1,2,4,8, for
    an engine A/B whose switch acts at larger N; the report keeps PROFILE_NS's)."""
    value = (os.environ if environ is None else environ).get(PROFILE_N_ENV)
    if not value:
        return PROFILE_NS
    if not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)*", value):
        raise SystemExit(f"{PROFILE_N_ENV}={value!r}: expected N[,N...], e.g. 1,2,4,8")
    return tuple(int(n) for n in value.split(","))


# Last in each engine (the timers stay installed): one batch of the timed shape per N
# with profile_host_loop.py's perf_counter wrappers on the engine core's phases, so the
# host's time per step by phase comes from the benchmark's own host and engine. N = 4 and 8
# too: whether the engine core waits for the GPU there tells a host-bound run from a
# GPU-bound one (2026-12-04: N = 4 and 8 spread by 10% over three runs, unexplained);
# one more batch each, ~20 s of device time per pair.
HOST_PHASE_NS = (1, 2, 4, 8)
# The engine core's loop iteration: its calls during a batch are the time the engine
# worked on it (scheduling, the steps' host work and waits for the GPU, outputs).
ENGINE_BUSY_PHASE = "core._process_engine_step"
# Phases of a prefill step listed per engine (host time, including what they wait for).
PREFILL_PHASE_ROWS = (
    "runner.execute_model",
    "runner._prepare_inputs",
    "runner._build_attention_metadata",
    "GPUModelRunner._model_forward",
    "GDNAttentionMetadataBuilder.build",
    "MLACommonMetadataBuilder.build",
    "runner.sample_tokens",
    "scheduler.schedule",
    "scheduler.update_from_output",
)
# The phases decode.md shows (all are in decode.json), in the order of a step.
HOST_PHASE_ROWS = (
    "runner.execute_model",
    "runner._update_states",
    "runner._prepare_inputs",
    "runner._build_attention_metadata",
    "CUDAGraphWrapper.__call__",
    "model.compute_logits",
    "runner._logits_computed_by_model",
    "runner.sample_tokens",
    "scheduler.schedule",
    "scheduler.update_from_output",
    "AsyncGPUModelRunnerOutput.get_output",
)
# Idle stretches of the GPU in the profile shorter than this are launch gaps inside a step;
# the longest boundaries (kernel before, kernel after) are listed.
IDLE_GAP_MIN_US = 5.0
IDLE_GAP_ROWS = 6
# Greedy sampling launches exactly one argmax per engine step, last among the step's
# kernels: it splits a trace into steps.
STEP_END_KERNEL = "ArgMaxOps"
PROFILE_TOP_KERNELS = 25
PROFILE_MD_ROWS = 15
# CuTe DSL kernel symbols start with their module path; the markdown shows the rest.
CUTE_KERNEL_NAME = re.compile(r"^kernel_cutlass_kernel_\w*?cutedsl")
CUTE_KERNEL_ARGS = re.compile(r"_object_at_.*$")  # the mangled argument list
BACKENDS = ("auto", "latency_specialized")
ROLES = (*BACKENDS, "experts")
# Routing regimes (--routing) and the name of each one's report. "dummy" is issue 6's method
# (load_format="dummy": every token routes to the same top-k experts, decode_notes.md);
# "spread" re-draws the MoE routers so that tokens route apart (scripts/bench_routing.py),
# for the N > 1 steps with the expert bytes real routing reads.
ROUTINGS = ("dummy", "spread")
REPORT_STEMS = {"dummy": "decode", "spread": "decode_spread_routing"}
# Issue 6's bars: the speedup at N = 1 and at N = 2, 4, 8 (there, or within
# FLOOR_SLACK of the weight-read floor where that speedup would be below it); no N slower
# than stock.
BAR_SPEEDUP_N1 = 2.0
BAR_SPEEDUP_SMALL_N = 1.8
BAR_SMALL_NS = (2, 4, 8)
FLOOR_SLACK = 1.15
# The benchmark's command line, handed to its workers for their host facts.
COMMAND_ENV = "HD_BENCH_DECODE_COMMAND"
BF16 = 2
FP32 = 4


# ---------------------------------------------------------------- pure parts
def itl_samples(chunks: list[tuple[float, int]]) -> list[float]:
    """Inter-token latencies of one request from its streamed chunks
    ``(arrival time s, new tokens)``: a chunk of k tokens that arrived dt after
    the previous tokens gives k samples of dt / k.  The first chunk (prefill) only
    starts the clock; chunks without tokens are ignored."""
    arrivals = [(t, count) for t, count in chunks if count > 0]
    samples = []
    for (t_prev, _), (t, count) in zip(arrivals, arrivals[1:]):
        samples += [(t - t_prev) / count] * count
    return samples


def kernel_table(events: list[dict], steps: int, top: int) -> dict:
    """GPU kernel time per step from torch-profiler trace events: the ``top`` kernel
    names by time and the totals. Per name: ``us_per_step`` sums the kernels' spans, which
    overlap under programmatic dependent launch (a kernel starts early and waits for its
    predecessor); ``advance_us_per_step`` sums only how far each kernel moved the end of
    the GPU's busy time (additive: the names' advances sum to ``busy_us_per_step``, the
    time at least one kernel ran).

    ``idle_us_per_step`` is the time between the first kernel's start and the last one's
    end with no kernel running; ``idle_gaps`` names where it falls: per (kernel before,
    kernel after) pair, the idle time per step in gaps of at least ``IDLE_GAP_MIN_US``
    (the host's turn between decode steps shows up as one such boundary).

    ``busy_us_median_step`` is the median of the busy time of single engine steps, each
    ending with a kernel named like ``STEP_END_KERNEL`` (None below 3 steps): the
    profiled batch's prefill steps, one or several as the scheduler took the requests
    in, weigh in ``busy_us_per_step`` in full, in this median only as a few samples of
    ``steps`` (at most a rank or two)."""
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel"), key=lambda e: (e["ts"], e["dur"])
    )
    totals: dict[str, list[float]] = {}
    gaps: dict[tuple[str, str], list[float]] = {}
    busy_end = float("-inf")
    busy = 0.0
    last_name = ""
    step_busy: list[float] = []
    this_step = 0.0
    for event in kernels:
        start, end = event["ts"], event["ts"] + event["dur"]
        if last_name and start - busy_end >= IDLE_GAP_MIN_US:
            gap = gaps.setdefault((last_name, event["name"]), [0.0, 0])
            gap[0] += start - busy_end
            gap[1] += 1
        advance = max(0.0, end - max(start, busy_end))
        busy += advance
        this_step += advance
        if STEP_END_KERNEL in event["name"]:
            step_busy.append(this_step)
            this_step = 0.0
        if end >= busy_end:
            last_name = event["name"]
        busy_end = max(busy_end, end)
        entry = totals.setdefault(event["name"], [0.0, 0.0, 0])
        entry[0] += event["dur"]
        entry[1] += advance
        entry[2] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    span = busy_end - kernels[0]["ts"] if kernels else 0.0
    return {
        "steps": steps,
        "gpu_us_per_step": sum(us for us, _, _ in totals.values()) / steps,
        "busy_us_per_step": busy / steps,
        "busy_us_median_step": statistics.median(step_busy) if len(step_busy) >= 3 else None,
        "idle_us_per_step": (span - busy) / steps,
        "launches_per_step": sum(n for _, _, n in totals.values()) / steps,
        "kernels": [
            {
                "name": name,
                "us_per_step": us / steps,
                "advance_us_per_step": advance / steps,
                "launches_per_step": n / steps,
            }
            for name, (us, advance, n) in ranked[:top]
        ],
        "idle_gaps": [
            {
                "before": before,
                "after": after,
                "idle_us_per_step": us / steps,
                "gaps_per_step": n / steps,
            }
            for (before, after), (us, n) in sorted(gaps.items(), key=lambda g: -g[1][0])[
                :IDLE_GAP_ROWS
            ]
        ],
    }


def weight_bytes(config: dict, distinct_experts: float) -> dict[str, float]:
    """Bytes of weights one decode step reads, by part, for ``distinct_experts``
    routed experts per MoE layer (embedding rows are negligible and left out)."""
    h = config["hidden_size"]
    lin = config["linear_attn_config"]
    heads, head_dim = lin["num_heads"], lin["head_dim"]
    proj = heads * head_dim
    conv = lin["short_conv_kernel_size"]
    layers = config["num_hidden_layers"]
    mla_layers = [i for i in lin["full_attn_layers"] if i <= layers]
    kda_layers = [i for i in lin["kda_layers"] if i <= layers]
    # q, k, v, b, f_a, g_a from h; f_b, g_b back to proj; o_proj; conv; norms.
    low_rank = head_dim
    kda = (
        (3 * proj + heads + 2 * low_rank) * h
        + 2 * proj * low_rank
        + proj * h
        + 3 * proj * conv
        + h
        + head_dim
    ) * BF16 + (heads + proj) * FP32
    n_heads = config["num_attention_heads"]
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    v_dim, rank = config["v_head_dim"], config["kv_lora_rank"]
    mla = (
        n_heads * (nope + rope) * h
        + (rank + rope) * h
        + n_heads * (nope + v_dim) * rank
        + h * n_heads * v_dim
        + rank
        + h
    ) * BF16
    dense_layers = min(config["first_k_dense_replace"], layers)
    dense = 3 * config["intermediate_size"] * h * BF16
    expert = 3 * config["moe_intermediate_size"] * h * BF16
    shared = config["num_shared_experts"] * expert
    router = config["num_experts"] * h * BF16
    moe_layers = layers - dense_layers
    return {
        "kda": len(kda_layers) * kda,
        "mla": len(mla_layers) * mla,
        "dense_mlp": dense_layers * dense,
        "moe_fixed": moe_layers * (shared + router + h * BF16),
        "moe_routed": moe_layers * distinct_experts * expert,
        "lm_head": config["vocab_size"] * h * BF16 + h * BF16,
    }


def per_request_bytes(config: dict, context_tokens: float) -> float:
    """State bytes one request adds to a decode step: KDA recurrent state and
    conv state read + written, MLA latent cache rows read."""
    lin = config["linear_attn_config"]
    layers = config["num_hidden_layers"]
    heads, head_dim = lin["num_heads"], lin["head_dim"]
    kda_layers = len([i for i in lin["kda_layers"] if i <= layers])
    mla_layers = len([i for i in lin["full_attn_layers"] if i <= layers])
    recurrent = heads * head_dim * head_dim * FP32
    conv = (lin["short_conv_kernel_size"] - 1) * 3 * heads * head_dim * BF16
    latent = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * BF16
    return kda_layers * 2 * (recurrent + conv) + mla_layers * context_tokens * latent


def floor_ms(config: dict, n: int, distinct_experts: float) -> float:
    # Mean context over a request's decode: the prompt plus half the output.
    context = PROMPT_TOKENS + OUTPUT_TOKENS / 2
    total = sum(weight_bytes(config, distinct_experts).values())
    total += n * per_request_bytes(config, context)
    return total / HBM_BYTES_PER_S * 1e3


def expected_uniform_experts(config: dict, n: int) -> float:
    """Distinct experts per MoE layer that n tokens routed independently and uniformly
    would pick: what the spread regime's expert count should come near."""
    experts, top_k = config["num_experts"], config["num_experts_per_token"]
    return experts * (1.0 - (1.0 - top_k / experts) ** n)


def issue_bar_ms(n: int, stock_ms: float, floor: float) -> float:
    """The specialized step time issue 6 asks for at ``n`` (``BAR_*`` above)."""
    if n == 1:
        return stock_ms / BAR_SPEEDUP_N1
    if n in BAR_SMALL_NS:
        bar = stock_ms / BAR_SPEEDUP_SMALL_N
        return bar if bar >= floor else FLOOR_SLACK * floor
    return stock_ms


def check_routing_summary(summary: dict | None) -> dict:
    """What the spread-routing loader reported from an engine's worker: refuses a run in
    which it did not run or did not change what it must (module docstring of
    bench_routing.py)."""
    if not summary:
        raise RuntimeError(
            "spread routing: the engine's worker reports no loader run (was the model "
            "loaded with load_format=hd_spread_routing?)"
        )
    problems = []
    if summary.get("moe_layers", 0) < 1:
        problems.append("no MoE layer re-drawn")
    if not summary.get("layers_differ"):
        problems.append("the layers' routers are the same matrix")
    if summary.get("bias_abs_max", 1.0) != 0.0:
        problems.append("a correction bias is not zero")
    std = summary.get("router_weight_std", 0.0)
    expected = summary.get("router_weight_expected_std", 1.0)
    if abs(std - expected) > 0.05 * expected:
        problems.append(f"router weight std {std:.4g}, expected {expected:.4g}")
    if problems:
        raise RuntimeError("spread routing: " + "; ".join(problems))
    return summary


def summarize(config: dict, results: dict, experts: dict[int, float]) -> dict:
    """The decode.json summary from per-backend results and expert counts."""
    stock, special = results["auto"], results["latency_specialized"]
    ns = sorted(int(n) for n in stock["step_ms"])
    step = {
        str(n): {
            "stock": stock["step_ms"][str(n)],
            "specialized": special["step_ms"][str(n)],
        }
        for n in ns
    }
    return {
        "step_ms": step,
        "speedup": {k: v["stock"] / v["specialized"] for k, v in step.items()},
        "floor_ms": {str(n): floor_ms(config, n, experts[n]) for n in ns},
        "distinct_experts": {str(n): experts[n] for n in ns},
        "prefill_throughput_ratio": special["prefill_tokens_per_s"] / stock["prefill_tokens_per_s"],
    }


def gpu_busy_ms(results: dict) -> dict:
    """GPU busy ms per step of both engines at the N both traced (beside the summary,
    whose N-keyed entries `make upstream-pr` turns into columns of every N)."""
    busy = {b: results[b].get("gpu_busy_us", {}) for b in BACKENDS}
    traced = sorted(set(busy["auto"]) & set(busy["latency_specialized"]), key=int)
    return {
        n: {"stock": busy["auto"][n] / 1e3, "specialized": busy["latency_specialized"][n] / 1e3}
        for n in traced
    }


def prefill_gpu_busy_ms(results: dict) -> dict:
    """GPU busy ms of one traced prefill batch per engine and their ratio (empty when
    either engine has none: older results, a failed trace)."""
    stock = results["auto"].get("prefill_gpu_busy_ms")
    special = results["latency_specialized"].get("prefill_gpu_busy_ms")
    if not stock or not special:
        return {}
    return {"stock": stock, "specialized": special, "ratio": special / stock}


def ratio_of_medians_interval(
    specialized: list[float],
    stock: list[float],
    resamples: int = PREFILL_CI_RESAMPLES,
    seed: int = PREFILL_CI_SEED,
) -> tuple[float, float]:
    """95% bootstrap interval of median(specialized) / median(stock): each engine's
    batches resampled with replacement, the 2.5th and 97.5th percentiles of the
    resampled ratios."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(specialized, k=len(specialized)))
        / statistics.median(rng.choices(stock, k=len(stock)))
        for _ in range(resamples)
    )
    return ratios[int(0.025 * (resamples - 1))], ratios[int(0.975 * (resamples - 1))]


def prefill_verdict(interval: tuple[float, float], target: float = PREFILL_TARGET_RATIO) -> str:
    """Issue 6's prefill target against a ratio's interval: "shown" if its lower end
    reaches the target, "refuted" if its upper end stays below, else "open"."""
    low, high = interval
    if low >= target:
        return "shown"
    if high < target:
        return "refuted"
    return "open"


def prefill_rates(results: dict) -> dict:
    """Each engine's prefill batches (tokens/s): their median, best and spread, the
    ratio of the best batches, and the ratio of the medians with its 95% bootstrap
    interval and issue 6's verdict (empty for results without per-batch rates)."""
    runs = {b: results[b].get("prefill_tokens_per_s_runs") for b in BACKENDS}
    if not all(runs.values()):
        return {}
    engines = {
        name: {
            "median": statistics.median(runs[b]),
            "best": max(runs[b]),
            "worst": min(runs[b]),
            "batches": len(runs[b]),
        }
        for name, b in (("stock", "auto"), ("specialized", "latency_specialized"))
    }
    interval = ratio_of_medians_interval(runs["latency_specialized"], runs["auto"])
    return {
        **engines,
        "ratio_best": engines["specialized"]["best"] / engines["stock"]["best"],
        "ratio_ci95": list(interval),
        "verdict": prefill_verdict(interval),
    }


def prefill_engine_summary(batches: list[dict], phases=PREFILL_PHASE_ROWS) -> dict | None:
    """One engine's prefill batches (``prefill_engine_batch``) by the engine core's busy
    time: tokens/s (median, best, worst), model-runner steps per batch, the share of each
    batch's wall clock the engine worked (median) and host ms per step of each of
    ``phases`` timed (None: every phase), over all batches; None if no batch was timed."""
    runs = [r for r in batches if r["engine_busy_s"] > 0]
    if not runs:
        return None
    tokens = PREFILL_REQUESTS * PREFILL_TOKENS
    rates = [tokens / r["engine_busy_s"] for r in runs]
    steps = sum(r["steps"] for r in runs)
    if phases is None:
        phases = sorted({key for r in runs for key in r["phases_s"]})
    return {
        "median": statistics.median(rates),
        "best": max(rates),
        "worst": min(rates),
        "batches": len(runs),
        "steps_per_batch": statistics.median(r["steps"] for r in runs),
        "busy_share": statistics.median(r["engine_busy_s"] / r["wall_s"] for r in runs),
        "phase_ms_per_step": {
            key: sum(r["phases_s"].get(key, 0.0) for r in runs) * 1e3 / steps
            for key in phases
            if steps and any(key in r["phases_s"] for r in runs)
        },
    }


def prefill_engine_rates(results: dict) -> dict:
    """Each engine's ``prefill_engine_summary`` (its ``PREFILL_PHASE_ROWS``) and the
    ratio of the medians; empty unless both engines timed them."""
    errors = [f"{b}: {results[b]['prefill_engine_error']}" for b in BACKENDS
              if results[b].get("prefill_engine_error")]  # fmt: skip
    if errors:
        return {"error": "; ".join(errors)}
    batches = {b: results[b].get("prefill_engine_batches") for b in BACKENDS}
    if not all(batches.values()):
        return {}
    engines = {}
    for name, b in (("stock", "auto"), ("specialized", "latency_specialized")):
        engine = prefill_engine_summary(batches[b])
        if engine is None:
            return {}
        engines[name] = engine
    tokens = PREFILL_REQUESTS * PREFILL_TOKENS
    rates = {
        b: [tokens / r["engine_busy_s"] for r in batches[b] if r["engine_busy_s"] > 0]
        for b in BACKENDS
    }
    interval = ratio_of_medians_interval(rates["latency_specialized"], rates["auto"])
    out = {
        **engines,
        "ratio": engines["specialized"]["median"] / engines["stock"]["median"],
        "ratio_ci95": list(interval),
        "verdict": prefill_verdict(interval),
    }
    gauged = {b: host_gauged_rates(batches[b]) for b in BACKENDS}
    if all(gauged.values()):
        special, stock = gauged["latency_specialized"], gauged["auto"]
        interval = ratio_of_medians_interval(special, stock)
        out["host_gauged"] = {
            "ratio": statistics.median(special) / statistics.median(stock),
            "ratio_ci95": list(interval),
            "verdict": prefill_verdict(interval),
            "phases": list(PREFILL_HOST_GAUGE_PHASES),
        }
    return out


def host_gauged_rates(batches: list[dict]) -> list[float]:
    """Per timed batch, the seconds of ``PREFILL_HOST_GAUGE_PHASES`` per second of the
    engine's busy time: its prefill rate at the host speed of that batch (empty if a
    batch lacks a gauge phase)."""
    runs = [r for r in batches if r["engine_busy_s"] > 0]
    if not runs or not all(k in r["phases_s"] for r in runs for k in PREFILL_HOST_GAUGE_PHASES):
        return []
    return [
        sum(r["phases_s"][k] for k in PREFILL_HOST_GAUGE_PHASES) / r["engine_busy_s"] for r in runs
    ]


def _interval_text(rates: dict) -> str:
    """The ratio's 95% interval and issue 6's verdict as a clause to append (", 95%
    bootstrap interval ... [a, b]: issue 6's 0.98 open"); empty for rates without one
    (reports measured before the interval existed)."""
    if "ratio_ci95" not in rates:
        return ""
    low, high = rates["ratio_ci95"]
    return (
        f", 95% bootstrap interval of the ratio of medians [{low:.3f}, {high:.3f}]: "
        f"issue 6's {PREFILL_TARGET_RATIO} {rates['verdict']}"
    )


def _prefill_engine_lines(rates: dict) -> list[str]:
    if not rates:
        return []
    if "error" in rates:
        return [f"Prefill by the engine core's busy time: not measured ({rates['error']}).", ""]
    stock, special = rates["stock"], rates["specialized"]

    def engine(e: dict) -> str:
        return (
            f"median {e['median']:.0f} tokens/s ({e['worst']:.0f}-{e['best']:.0f}, "
            f"{e['batches']} batches of {e['steps_per_batch']:g} steps; busy "
            f"{e['busy_share']:.0%} of the batch's wall clock)"
        )

    lines = [
        "Prefill by the engine core's busy time (the same batches; the engine's steps "
        "only, without the frontend and the requests' arrival): stock "
        f"{engine(stock)}, specialized {engine(special)}; specialized / stock "
        f"{rates['ratio']:.3f}{_interval_text(rates)}.",
        "",
    ]
    gauged = rates.get("host_gauged")
    if gauged:
        lines += [
            "At the host speed of each batch (its engine-busy time against "
            + " + ".join(f"`{k}`" for k in gauged["phases"])
            + ", stock code doing the same work in both engines): specialized / stock "
            f"{gauged['ratio']:.3f}{_interval_text(gauged)}.",
            "",
        ]
    phases = [k for k in PREFILL_PHASE_ROWS if k in stock["phase_ms_per_step"]
              or k in special["phase_ms_per_step"]]  # fmt: skip
    if phases:
        lines += ["| prefill step phase, ms per step | stock | specialized |", "|---|---|---|"]
        for key in phases:
            cells = [e["phase_ms_per_step"].get(key) for e in (stock, special)]
            lines.append(f"| `{key}` | " + " | ".join(
                "-" if c is None else f"{c:.2f}" for c in cells) + " |")  # fmt: skip
        lines.append("")
    return lines


def report_scope(data: dict) -> str:
    """The title's parenthesis: the GPU's short name ("NVIDIA H200" -> "H200"), then
    what sets the run apart from issue 6's method (spread routing, a cut model)."""
    parts = [data["gpu"].removeprefix("NVIDIA ")]
    if (data.get("routing") or {}).get("regime") == "spread":
        parts.append("spread routing")
    layers = data.get("layers")
    full = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["num_hidden_layers"]
    if layers is not None and layers != full:
        parts.append(f"the model cut to its first {layers} of {full} layers")
    return ", ".join(parts)


def write_markdown(data: dict, path: Path) -> None:
    s = data["summary"]
    routing = data.get("routing") or {"regime": "dummy"}
    spread = routing["regime"] == "spread"
    expected = routing.get("expected_uniform_experts") or {}
    lines = [
        f"# Decode step time inside vLLM: stock vs latency-specialized ({report_scope(data)})",
        "",
        f"{data['gpu']}, {data['date']}, vLLM `{data['vllm']}`, `{data['command']}`.",
        "",
        f"Method: {data['method']}",
        "",
        *_cpu_lines(data.get("cpu") or {}),
        *([f"Note: {data['notes']}.", ""] if data.get("notes") else []),
        "| N | stock ms | specialized ms | speedup | floor ms | specialized / floor | "
        "distinct experts |"
        + (" uniform expectation |" if spread else "")
        + " issue 6's bar ms | met |",
        "|---|---|---|---|---|---|---|" + ("---|" if spread else "") + "---|---|",
    ]
    for n, step in s["step_ms"].items():
        floor = s["floor_ms"][n]
        bar = issue_bar_ms(int(n), step["stock"], floor)
        lines.append(
            f"| {n} | {step['stock']:.3f} | {step['specialized']:.3f} | "
            f"{s['speedup'][n]:.2f}x | {floor:.3f} | "
            f"{step['specialized'] / floor:.2f} | {s['distinct_experts'][n]:.1f} |"
            + (f" {expected[n]:.1f} |" if spread else "")
            + f" {bar:.3f} | {'yes' if step['specialized'] <= bar else 'no'} |"
        )
    lines += [
        "",
        f"Issue 6's bar: {BAR_SPEEDUP_N1}x at N = 1; {BAR_SPEEDUP_SMALL_N}x at N = "
        f"{', '.join(map(str, BAR_SMALL_NS))}, or {FLOOR_SLACK}x the floor where that "
        "speedup would be below the floor; stock's time elsewhere.",
        "",
        f"Prefill throughput, specialized / stock: {s['prefill_throughput_ratio']:.3f}.",
        "",
    ]
    lines += _host_cpu_lines(data.get("runs") or {})
    rates = data.get("prefill_rates") or {}
    if rates:
        stock, special = rates["stock"], rates["specialized"]
        lines += [
            f"Prefill batches per engine: stock {stock['batches']} (median "
            f"{stock['median']:.0f} tokens/s, {stock['worst']:.0f}-{stock['best']:.0f}), "
            f"specialized {special['batches']} (median {special['median']:.0f}, "
            f"{special['worst']:.0f}-{special['best']:.0f}); best batch specialized / "
            f"stock: {rates['ratio_best']:.3f}"
            + (
                f"; the medians' ratio {special['median'] / stock['median']:.3f}"
                f"{_interval_text(rates)}."
                if "ratio_ci95" in rates
                else "."
            ),
            "",
        ]
    lines += _prefill_engine_lines(data.get("prefill_engine_rates") or {})
    prefill_busy = data.get("prefill_gpu_busy_ms") or {}
    if prefill_busy:
        lines += [
            f"Prefill GPU time of one batch of the same shape (kernel-only trace): stock "
            f"{prefill_busy['stock']:.2f} ms, specialized {prefill_busy['specialized']:.2f} "
            f"ms (specialized / stock {prefill_busy['ratio']:.3f}).",
            "",
        ]
    busy = data.get("gpu_busy_ms") or {}
    lines += _busy_lines(s, busy, {n: data.get(f"profile_n{n}") or {} for n in busy})
    lines += _host_phase_lines(data.get("host_phases") or {})
    for n in PROFILE_NS:
        for backend, table in (data.get(f"profile_n{n}") or {}).items():
            lines += _profile_lines(backend, table, n)
    path.write_text("\n".join(lines))


def _host_cpu_lines(runs: dict) -> list[str]:
    """The host's CPU use during each timed decode run (reports of earlier runs have none):
    a busy host slows vLLM's step loop, not the GPU, and shows here before it is guessed."""
    engines = (("stock", "auto"), ("specialized", "latency_specialized"))
    use = {name: (runs.get(b) or {}).get("host_cpu_runs") or {} for name, b in engines}
    if not any(use.values()):
        return []
    ns = sorted({n for per_n in use.values() for n in per_n}, key=int)
    lines = [
        "Host CPUs kept busy during each timed run (/proc, run by run): by the engine's own "
        "processes and by everything else on the host.",
        "",
        "| N | stock: engine | stock: others | specialized: engine | specialized: others |",
        "|---|---|---|---|---|",
    ]
    busy_runs = []
    for n in ns:
        cells = []
        for name, _ in engines:
            readings = use[name].get(n) or []
            for key in ("engine_cores", "other_cores"):
                cells.append(" / ".join(f"{u[key]:.1f}" for u in readings) or "-")
            busy_runs += [
                f"{name} N = {n} run {r}"
                for r, u in enumerate(readings, 1)
                if u["other_cores"] > BUSY_HOST_OTHER_CORES
            ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        (
            f"Runs beside other processes busy on more than {BUSY_HOST_OTHER_CORES:g} CPU: "
            + ", ".join(busy_runs)
            + "."
        )
        if busy_runs
        else f"No run had other processes busy on more than {BUSY_HOST_OTHER_CORES:g} CPU.",
        "",
    ]
    return lines


def _cpu_lines(cpus: dict) -> list[str]:
    """The host CPU each role ran on (reports of earlier runs have none)."""
    named = {role: cpu for role, cpu in cpus.items() if cpu}
    if not named:
        return []
    shown = {
        f"{cpu['model']}, {cpu['usable_cpus'] or cpu['logical_cpus']} CPUs usable"
        for cpu in named.values()
    }
    if len(shown) == 1:
        return [f"Host CPU (every role): {shown.pop()}.", ""]
    return [
        "Host CPU per role: "
        + "; ".join(
            f"{role}: {cpu['model']}, {cpu['usable_cpus'] or cpu['logical_cpus']} CPUs usable"
            for role, cpu in sorted(named.items())
        )
        + ".",
        "",
    ]


def _busy_lines(summary: dict, busy: dict, profiles: dict | None = None) -> list[str]:
    """``profiles`` maps N to ``profile_n{N}`` (each engine's trace table): where it holds
    the median decode step's busy time, the GPU's wait is read against that, since the
    traced window's prefill steps count in the per-step mean."""
    if not busy:
        return []
    lines = [
        "## How much of a step the GPU works",
        "",
        f"GPU busy time per step in a kernel-only torch trace of {PROFILE_TOKENS} tokens "
        "(the batch's prefill steps count in the mean, not in the median decode step), "
        "against the step time of the table above, measured without the profiler: the "
        "profiler slows the host, not the GPU, so the difference is the time the GPU waits "
        "for the host each step (read against the median decode step where traced).",
        "",
        "| N | stock step ms | stock GPU busy ms | specialized step ms | specialized GPU "
        "busy ms | specialized median decode step busy ms | specialized: GPU waits, ms per "
        "step |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, b in busy.items():
        step = summary["step_ms"][n]
        median_us = ((profiles or {}).get(n, {}).get("latency_specialized") or {}).get(
            "busy_us_median_step"
        )
        median = median_us / 1e3 if median_us else None
        shown = f"{median:.3f}" if median is not None else "-"
        wait = step["specialized"] - (median if median is not None else b["specialized"])
        lines.append(
            f"| {n} | {step['stock']:.3f} | {b['stock']:.3f} | {step['specialized']:.3f} | "
            f"{b['specialized']:.3f} | {shown} | {max(0.0, wait):.3f} |"
        )
    return [*lines, ""]


def _host_phase_lines(phases: dict) -> list[str]:
    """The host's time per decode step by phase, both engines side by side."""
    columns = [
        (b, n)
        for n in map(str, HOST_PHASE_NS)
        for b in BACKENDS
        if isinstance(phases.get(b), dict) and n in phases[b].get("per_n", {})
    ]
    errors = [f"{b}: {p['error']}" for b, p in phases.items() if p and "error" in p]
    if not columns:
        return ["## Host time per decode step", "", *[f"Not measured: {e}" for e in errors],
                ""] if errors else []  # fmt: skip
    short = {"auto": "stock", "latency_specialized": "specialized"}
    lines = [
        "## Host time per decode step",
        "",
        "After the timed runs and the profile, one more batch of the timed shape per N "
        "with perf_counter timers on the engine core's and the model runner's phases "
        "(`scripts/profile_host_loop.py`'s): µs per decode step. A phase's calls may "
        "nest in another's (`runner.execute_model` holds the runner phases above "
        "`compute_logits`).",
        "",
        "| phase | " + " | ".join(f"{short[b]}, N = {n}" for b, n in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    per = [phases[b]["per_n"][n] for b, n in columns]
    lines.append("| inter-token latency, ms | " + " | ".join(
        f"{p['itl_ms']:.3f}" for p in per) + " |")  # fmt: skip
    for key in HOST_PHASE_ROWS:
        cells = [p["phases"].get(key, {}).get("us_per_step") for p in per]
        if any(c is not None for c in cells):
            lines.append(f"| `{key}` | " + " | ".join(
                "-" if c is None else f"{c:.0f}" for c in cells) + " |")  # fmt: skip
    lines += [f"Not measured: {e}" for e in errors]
    return [*lines, ""]


def _profile_lines(backend: str, table: dict | None, n: int = 1) -> list[str]:
    if not table:
        return []
    title = f"## GPU kernels per step at N = {n}, `{backend}` (torch profiler)"
    if "error" in table:
        return [title, "", f"Not traced: {table['error']}", ""]
    lines = [
        title,
        "",
        f"{table['steps']} steps of {n} request{'s' if n > 1 else ''} (their prefill is "
        "one of them): "
        f"{table['gpu_us_per_step']:.0f} us of kernel spans and "
        f"{table['launches_per_step']:.0f} kernel launches per step. A kernel launched "
        "with programmatic dependent launch starts while its predecessor runs and waits "
        "for it, so those spans overlap: their sum exceeds the step."
        + (
            f" 'advance' counts only how far each kernel moved the end of the GPU's busy "
            f"time; it adds up to {table['busy_us_per_step']:.0f} us per step."
            if "busy_us_per_step" in table
            else ""
        ),
        "",
        "| kernel | span us / step | advance us / step | launches / step |",
        "|---|---|---|---|",
    ]
    for row in table["kernels"][:PROFILE_MD_ROWS]:
        name = _short_kernel_name(row["name"], 90)
        advance = row.get("advance_us_per_step")
        shown = "-" if advance is None else f"{advance:.1f}"
        lines.append(
            f"| `{name}` | {row['us_per_step']:.1f} | {shown} | {row['launches_per_step']:.1f} |"
        )
    if "idle_us_per_step" in table:
        lines += [
            "",
            f"GPU idle between the first and the last kernel: "
            f"{table['idle_us_per_step']:.0f} us per step; in gaps of at least "
            f"{IDLE_GAP_MIN_US:.0f} us, by the kernels around them:",
            "",
            "| before | after | idle us / step | gaps / step |",
            "|---|---|---|---|",
        ]
        for gap in table["idle_gaps"]:
            lines.append(
                f"| `{_short_kernel_name(gap['before'], 60)}` | "
                f"`{_short_kernel_name(gap['after'], 60)}` | "
                f"{gap['idle_us_per_step']:.1f} | {gap['gaps_per_step']:.2f} |"
            )
    return [*lines, ""]


def _short_kernel_name(name: str, width: int) -> str:
    """A kernel name for a markdown cell: CuTe DSL names without their mangled
    arguments, cut to ``width`` characters."""
    name = CUTE_KERNEL_NAME.sub("cutedsl/", name)
    name = CUTE_KERNEL_ARGS.sub("", name).replace("|", "\\|")
    return name if len(name) <= width else name[: width - 3] + "..."


def write_plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = data["summary"]
    ns = [int(n) for n in s["step_ms"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("stock", "stock vLLM 0.26.0"), ("specialized", "specialized")):
        ax.plot(ns, [s["step_ms"][str(n)][key] for n in ns], marker="o", label=label)
    ax.plot(ns, [s["floor_ms"][str(n)] for n in ns], "k--", label="weight-read floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight (N)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"Kimi-Linear-48B-A3B decode ({report_scope(data)})", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# ------------------------------------------------------------------ workers
def routing_engine_kwargs(routing: str) -> dict[str, str]:
    """The engine arguments of a routing regime. For "spread", vLLM imports
    bench_routing in the worker to resolve the extension, which registers the load
    format there: scripts/ goes on PYTHONPATH for the engine-core process."""
    if routing == "dummy":
        return {"load_format": "dummy"}
    if routing != "spread":
        raise ValueError(f"unknown routing {routing!r}; choose from {ROUTINGS}")
    import bench_routing  # registers the load format in this process too

    scripts = str(Path(__file__).resolve().parent)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if scripts not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([scripts, *filter(None, paths)])
    return {
        "load_format": bench_routing.SPREAD_LOAD_FORMAT,
        "worker_extension_cls": bench_routing.WORKER_EXTENSION,
    }


def _engine_args(model_dir: Path, backend: str, max_num_seqs: int, routing: str = "dummy", **extra):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=str(model_dir),
        **routing_engine_kwargs(routing),
        skip_tokenizer_init=True,
        max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS + PREFILL_TOKENS,
        gpu_memory_utilization=0.9,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        seed=0,
        additional_config={"decode_backend": backend},
        **extra,
    )


async def stream_batch(engine, tag: str, n: int, prompt_len: int, max_tokens: int) -> list:
    """N requests started together on an AsyncLLM (greedy, ignore_eos, streamed deltas):
    per request its chunks as (arrival time, tokens in the chunk)."""
    import asyncio
    import time

    from vllm.sampling_params import RequestOutputKind, SamplingParams

    async def request(rid: str, prompt: dict) -> list:
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        chunks = []
        async for out in engine.generate(prompt, params, rid):
            chunks.append((time.perf_counter(), len(out.outputs[0].token_ids)))
        return chunks

    return await asyncio.gather(*(request(f"{tag}-{i}", _prompt(i, prompt_len)) for i in range(n)))


def _prompt(i: int, length: int) -> dict:
    return {"prompt_token_ids": [1000 + 7 * i + j for j in range(length)]}


def run_backend(
    model_dir: Path,
    backend: str,
    ns: list[int],
    runs: int,
    keep_traces: Path | None = None,
    decode_only: bool = False,
    routing: str = "dummy",
) -> dict:
    """One engine with ``backend``: step times per N, prefill throughput and the kernel
    profile of a step at N = 1 (the raw traces kept in ``keep_traces`` when given).
    ``decode_only``: step times and kernel profiles only (no prefill, no host phases).
    ``routing``: the weights' routing regime (ROUTINGS)."""
    import asyncio

    # collective_rpc with functions (the host-phase timers) needs vLLM's pickle-based
    # serialization; it changes nothing for the request and output messages.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm.config import ProfilerConfig
    from vllm.v1.engine.async_llm import AsyncLLM

    trace_dir = Path(tempfile.mkdtemp(prefix=f"hd-trace-{backend}-"))
    # Inert until start_profile (the worker builds its profiler then).
    profiler = ProfilerConfig(
        profiler="torch",
        torch_profiler_dir=str(trace_dir),
        torch_profiler_with_stack=False,
        torch_profiler_dump_cuda_time_total=False,
        ignore_frontend=True,
    )
    engine = AsyncLLM.from_engine_args(
        _engine_args(model_dir, backend, max(ns), routing, profiler_config=profiler)
    )

    async def batch(tag: str, n: int, prompt_len: int, max_tokens: int) -> list:
        return await stream_batch(engine, tag, n, prompt_len, max_tokens)

    async def traced_batch(tag: str, n: int, prompt_len: int, max_tokens: int) -> Path:
        """One batch under the kernel-only profiler; the trace it wrote."""
        await engine.start_profile()
        await batch(tag, n, prompt_len, max_tokens)
        await engine.stop_profile()
        return wait_for_trace(trace_dir)

    async def profile_decode(result: dict) -> None:
        # Kept apart from the timed numbers: a failed trace is reported, not fatal.
        for n in traced_ns():
            try:
                trace = await traced_batch(f"profile{n}", n, PROMPT_TOKENS, PROFILE_TOKENS)
                table = read_trace(trace, PROFILE_TOKENS)
                # The profiler slows the host, not the GPU: busy time per step against
                # the unprofiled step time says how long the GPU waits for the host.
                result.setdefault("gpu_busy_us", {})[str(n)] = table["busy_us_per_step"]
                result[f"profile_n{n}"] = table
                keep_trace(trace, keep_traces, f"trace-{backend}-n{n}.json.gz")
            except Exception as exc:  # noqa: BLE001
                result[f"profile_n{n}"] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{backend}: profile at N={n} failed: {exc}", flush=True)

    async def main() -> dict:
        result = {"step_ms": {}, "step_ms_runs": {}, "runs": runs, "decode_only": decode_only}
        if routing == "spread":
            summary = (await engine.collective_rpc("hd_routing_summary"))[0]
            result["routing_summary"] = check_routing_summary(summary)
        # One untimed request of the timed length first: on 2026-12-01 (hd.2) the first
        # timed point, N = 1, came out at 2.98 ms against 2.67 ms at N = 2, whose GPU
        # work is larger; whatever the engine still does right after start-up must not
        # land in the first point.
        await batch("settle", 1, PROMPT_TOKENS, OUTPUT_TOKENS)
        for n in ns:
            await batch(f"warm{n}", n, PROMPT_TOKENS, 16)
            medians, cpu_use = [], []
            for r in range(runs):
                before = host_cpu_sample()
                chunks = await batch(f"n{n}r{r}", n, PROMPT_TOKENS, OUTPUT_TOKENS)
                cpu_use.append(host_cpu_use(before, host_cpu_sample()))
                if any(sum(c for _, c in ch) != OUTPUT_TOKENS for ch in chunks):
                    raise RuntimeError(f"N={n}: a request did not get {OUTPUT_TOKENS} tokens")
                samples = [s for ch in chunks for s in itl_samples(ch)]
                medians.append(statistics.median(samples) * 1e3)
            result["step_ms"][str(n)] = statistics.median(medians)
            result["step_ms_runs"][str(n)] = medians
            if all(cpu_use):
                result.setdefault("host_cpu_runs", {})[str(n)] = cpu_use
            others = [u["other_cores"] for u in cpu_use if u]
            print(
                f"{backend} N={n}: {medians} ms"
                + (f"; other processes' busy CPUs per run {others}" if others else ""),
                flush=True,
            )
        if decode_only:
            await profile_decode(result)
            return result
        # The warm-up batches have the timed batch's shape, so any first-use compile or
        # autotuning of the prefill kernels happens before the clock runs. Two, because
        # on 2026-12-01 the specialized engine alone, with a fresh Triton cache, measured
        # 12.6k prefill tokens/s (stock code) against 19.4k the day before, when the stock
        # engine had filled the same cache first; the cause is not established.
        for w in range(PREFILL_WARMUPS):
            await batch(f"pwarm{w}", PREFILL_REQUESTS, PREFILL_TOKENS, 1)
        # The host-phase timers, from here to the end: each prefill batch's engine-side
        # time (below) and the host phases of decode steps (host_phases).
        try:
            timers = await install_host_timers(engine)
        except Exception as exc:  # noqa: BLE001
            timers = None
            result["host_phases"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{backend}: host timers failed: {exc}", flush=True)
        # Prefill batches are ~1 s: always take several, whatever --runs is. One run
        # per engine gave ratios of 0.82-1.23 between pairs of the same prefill code
        # (decode_notes.md, 2026-12-01).
        if timers is not None and ENGINE_BUSY_PHASE in timers.missing:
            result["prefill_engine_error"] = f"the host timers found no {ENGINE_BUSY_PHASE}"
            print(f"{backend}: {result['prefill_engine_error']}", flush=True)
        rates, engine_batches = await time_prefill(engine, batch, timers, max(runs, PREFILL_RUNS))
        result["prefill_tokens_per_s"] = statistics.median(rates)
        result["prefill_tokens_per_s_runs"] = rates
        if engine_batches:
            result["prefill_engine_batches"] = engine_batches
        # The same batch once more under the kernel-only profiler: its GPU busy time.
        # Both engines run the same prefill code, so their GPU times say whether the
        # prefill itself differs, where the wall-clock rates above (host, scheduling and
        # the frontend included) spread by more than issue 6's 2% band (2026-12-01:
        # 3% and 15% across 5 batches).
        try:
            trace = await traced_batch("prefill-profile", PREFILL_REQUESTS, PREFILL_TOKENS, 1)
            result["prefill_gpu_busy_ms"] = read_trace(trace, 1)["busy_us_per_step"] / 1e3
            trace.unlink()
        except Exception as exc:  # noqa: BLE001
            print(f"{backend}: prefill profile failed: {exc}", flush=True)
        await profile_decode(result)
        if timers is not None:
            try:
                result["host_phases"] = await host_phases(engine, batch, timers)
            except Exception as exc:  # noqa: BLE001
                result["host_phases"] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{backend}: host phases failed: {exc}", flush=True)
        return result

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()
        shutil.rmtree(trace_dir, ignore_errors=True)


class HostTimers:
    """perf_counter timers installed in the engine-core process on the engine core's,
    the scheduler's and the model runner's phases (``profile_host_loop.install_timers``);
    ``missing`` names the phases this vLLM lacks."""

    def __init__(self, loop_module, missing: list[str]):
        self.take_timers = loop_module.take_timers
        self.phase_table = loop_module.phase_table
        self.missing = missing


async def install_host_timers(engine) -> HostTimers:
    """Install the timers once per engine (a second install would time every call twice)."""
    import cloudpickle

    import profile_host_loop as loop

    # The engine-core process cannot import scripts/: send the functions by value.
    cloudpickle.register_pickle_by_value(loop)
    return HostTimers(loop, (await engine.collective_rpc(loop.install_timers))[0])


async def time_prefill(engine, batch, timers: HostTimers | None, count: int):
    """``count`` prefill batches: each one's prompt tokens per second of wall clock and,
    with timers, what the engine did in it (``prefill_engine_batch``)."""
    import time

    rates, engine_batches = [], []
    for r in range(count):
        if timers is not None:
            await engine.collective_rpc(timers.take_timers)  # drop what came before
        start = time.perf_counter()
        await batch(f"prefill{r}", PREFILL_REQUESTS, PREFILL_TOKENS, 1)
        wall = time.perf_counter() - start
        rates.append(PREFILL_REQUESTS * PREFILL_TOKENS / wall)
        if timers is not None:
            samples = (await engine.collective_rpc(timers.take_timers))[0]
            engine_batches.append(prefill_engine_batch(samples, wall))
    return rates, engine_batches


def prefill_engine_batch(samples: dict[str, list[float]], wall_s: float) -> dict:
    """One prefill batch as the engine saw it, from the timer samples taken over it: the
    engine core's busy seconds, its model-runner steps and each phase's seconds."""
    return {
        "wall_s": wall_s,
        "engine_busy_s": sum(samples.get(ENGINE_BUSY_PHASE, [])),
        "steps": len(samples.get("runner.execute_model", [])),
        "phases_s": {key: sum(values) for key, values in sorted(samples.items())},
    }


async def host_phases(engine, batch, timers: HostTimers) -> dict:
    """Per N in HOST_PHASE_NS, one batch of the timed shape with the host timers: its
    inter-token latency and microseconds per decode step by phase."""
    out = {"missing": timers.missing, "per_n": {}}
    for n in HOST_PHASE_NS:
        await batch(f"hostwarm{n}", n, PROMPT_TOKENS, 16)
        await engine.collective_rpc(timers.take_timers)
        chunks = await batch(f"host{n}", n, PROMPT_TOKENS, OUTPUT_TOKENS)
        samples = (await engine.collective_rpc(timers.take_timers))[0]
        itl = statistics.median(s for ch in chunks for s in itl_samples(ch)) * 1e3
        out["per_n"][str(n)] = {
            "itl_ms": itl,
            "phases": timers.phase_table(samples, OUTPUT_TOKENS),
        }
    return out


def wait_for_trace(trace_dir: Path) -> Path:
    """The worker's torch-profiler trace once it is written completely (the worker
    writes it after stop_profile returns)."""
    import time

    deadline = time.monotonic() + 120
    size = -1
    while True:
        traces = sorted(trace_dir.glob("*.pt.trace.json*"))
        if traces and traces[-1].stat().st_size == size:
            return traces[-1]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no complete torch-profiler trace in {trace_dir}")
        size = traces[-1].stat().st_size if traces else -1
        time.sleep(1)


def read_trace(trace: Path, tokens: int) -> dict:
    """Kernel table of a torch-profiler trace of requests of ``tokens`` tokens (the
    prefill counted as one of the steps)."""
    import gzip

    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    return kernel_table(events, tokens, PROFILE_TOP_KERNELS)


def keep_trace(trace: Path, keep_dir: Path | None, name: str) -> None:
    """Move ``trace`` (gzipped) to ``keep_dir``/``name`` for a look at the host side of a
    step (the CPU activities are in it too), or delete it."""
    import gzip

    if keep_dir is not None:
        keep_dir.mkdir(parents=True, exist_ok=True)
        if trace.suffix == ".gz":
            shutil.copyfile(trace, keep_dir / name)
        else:
            with open(trace, "rb") as src, gzip.open(keep_dir / name, "wb") as dst:
                shutil.copyfileobj(src, dst)
    trace.unlink()


def count_experts(model_dir: Path, ns: list[int], routing: str = "dummy") -> dict:
    """Distinct routed experts per decode step and MoE layer (mean) by N, from an
    eager stock engine whose MoE routers are hooked (graph replays skip hooks); with
    spread routing also what its loader changed (``routing_summary``)."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams

    args = _engine_args(model_dir, "auto", max(ns), routing, enforce_eager=True)
    args.compilation_config = {"mode": 0}
    llm = LLM(**{k: getattr(args, k) for k in (
        "model", "load_format", "skip_tokenizer_init", "max_model_len",
        "gpu_memory_utilization", "max_num_seqs", "enable_prefix_caching", "seed",
        "enforce_eager", "compilation_config", "worker_extension_cls",
    )})  # fmt: skip
    out: dict = {"distinct": {}}
    if routing == "spread":
        out["routing_summary"] = check_routing_summary(llm.collective_rpc("hd_routing_summary")[0])

    def install(worker):
        import torch

        model = worker.model_runner.get_model()
        top_k = model.config.num_experts_per_token
        worker._hd_counts = []
        for module in model.modules():
            if type(module).__name__ != "KimiMoE":
                continue
            bias = module.gate.e_score_correction_bias

            def hook(_mod, _inp, output, bias=bias):
                logits = output[0] if isinstance(output, tuple) else output
                scores = torch.sigmoid(logits.float()) + bias.float()
                ids = scores.topk(top_k, dim=-1).indices
                worker._hd_counts.append((logits.shape[0], ids.unique().numel()))

            module.gate.register_forward_hook(hook)

    def take(worker):
        counts, worker._hd_counts = worker._hd_counts, []
        return counts

    llm.collective_rpc(install)
    params = SamplingParams(
        max_tokens=EXPERT_COUNT_STEPS, ignore_eos=True, temperature=0.0, detokenize=False
    )
    for n in ns:
        llm.collective_rpc(take)
        llm.generate([_prompt(i, PROMPT_TOKENS) for i in range(n)], params, use_tqdm=False)
        counts = llm.collective_rpc(take)[0]
        decode = [d for tokens, d in counts if tokens == n]
        out["distinct"][str(n)] = statistics.mean(decode)
        print(f"experts N={n}: {out['distinct'][str(n)]:.1f} distinct per layer-step", flush=True)
    return out


# --------------------------------------------------------------------- main
def run_roles(
    roles: list[str], scratch: Path, spawn: Callable[[str, Path], None]
) -> dict[str, dict] | None:
    """Run ``roles`` (each writes <scratch>/<role>.json through ``spawn``), then read every
    role's result; None (and a note) while some role has none yet, so one benchmark can be
    split over several device calls. Refuses unknown roles and backend runs of different
    ``--runs`` before anything is run / reported."""
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown roles {unknown}; choose from {ROLES}")
    scratch.mkdir(parents=True, exist_ok=True)
    for role in roles:
        spawn(role, scratch / f"{role}.json")
    missing = [r for r in ROLES if not (scratch / f"{r}.json").exists()]
    if missing:
        print(f"{scratch}: no result yet for {missing}; run them with --roles to finish")
        return None
    got = {r: json.loads((scratch / f"{r}.json").read_text()) for r in ROLES}
    partial = [b for b in BACKENDS if got[b].get("decode_only")]
    if partial:
        raise ValueError(
            f"the {partial} results in {scratch} ran with --decode-only (no prefill "
            "numbers): a report needs both backends run without it"
        )
    runs = {got[b].get("runs") for b in BACKENDS}
    if len(runs) != 1:
        raise ValueError(
            f"the backends in {scratch} ran with different --runs {sorted(map(str, runs))}; "
            "re-run one of them"
        )
    routings = {role: got[role].get("routing", "dummy") for role in ROLES}
    if len(set(routings.values())) != 1:
        raise ValueError(
            f"the roles in {scratch} ran with different --routing {routings}; re-run the odd ones"
        )
    return got


# Environment variables of the patch set's experiment switches.
SWITCH_PREFIX = "VLLM_HD_"
# Switches that choose no kernel (where compiled kernels are kept on disk; a loaded kernel
# gives the compiled one's results bit for bit, tests/kernels/test_compile_cache.py): roles
# may differ in them, and the record keeps each role's.
NON_KERNEL_SWITCHES = ("VLLM_HD_KERNEL_CACHE",)


def host_cpu_sample(proc: Path = Path("/proc"), root_pid: int | None = None) -> dict | None:
    """Host CPU counters at this instant, in clock ticks since boot: ``busy``, every CPU's
    non-idle time (/proc/stat); ``engine``, the CPU time of ``root_pid`` (this process) and
    its descendants (the engine core). None where /proc cannot be read."""
    import time

    root = os.getpid() if root_pid is None else root_pid
    try:
        fields = (proc / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    parents, cpu = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # the process exited while the table was read
            continue
        # pid (comm) state ppid ... utime stime: comm may hold spaces and parentheses
        rest = text[text.rindex(")") + 2 :].split()
        pid = int(entry.name)
        parents[pid] = int(rest[1])
        cpu[pid] = int(rest[11]) + int(rest[12])
    tree, frontier = {root}, [root]
    while frontier:
        frontier = [
            pid for pid, parent in parents.items() if parent in frontier and pid not in tree
        ]
        tree.update(frontier)
    engine = sum(cpu.get(pid, 0) for pid in tree)
    return {"time": time.perf_counter(), "busy": busy, "engine": engine}


def host_cpu_use(before: dict | None, after: dict | None, ticks_per_s: float | None = None):
    """CPUs kept busy between two ``host_cpu_sample``s: by the engine's processes
    (``engine_cores``) and by everything else on the host (``other_cores``); None without
    both samples."""
    if before is None or after is None or after["time"] <= before["time"]:
        return None
    ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
    elapsed_ticks = (after["time"] - before["time"]) * ticks_per_s
    engine = (after["engine"] - before["engine"]) / elapsed_ticks
    # The two counters are read a few ms apart: never report a negative rest.
    others = max(0.0, (after["busy"] - before["busy"]) / elapsed_ticks - engine)
    return {"engine_cores": round(engine, 2), "other_cores": round(others, 2)}


def host_cpu(cpuinfo: str | None = None) -> dict[str, object]:
    """The host's CPU model and the CPUs this process may run on: at 1-2 requests the
    specialized step can be bound by vLLM's host loop (the engine core's one thread), whose
    speed differs between hosts of the same GPU kind (2026-12-04: `execute_model` 1114 vs
    1401 us per step on two H200 hosts), so each report names the CPU it ran on."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    models = [
        line.split(":", 1)[1].strip()
        for line in cpuinfo.splitlines()
        if line.startswith("model name") and ":" in line
    ]
    return {
        "model": models[0] if models else platform.processor() or "unknown",
        "logical_cpus": len(models) or os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def host_facts(command: str) -> dict[str, object]:
    """Where and with what a role ran: the report is assembled from these, on any host."""
    import torch

    import vllm
    from vllm import _hopper_decode_build as build

    return {
        "gpu": torch.cuda.get_device_name(),
        "cpu": host_cpu(),
        "vllm": vllm.__version__,
        "fingerprint": build.FINGERPRINT,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        # The patch set's experiment switches (e.g. VLLM_HD_EXPERT_L2_POLICY) the
        # engine inherited: a result with one set is another build's.
        "switches": {k: v for k, v in os.environ.items() if k.startswith(SWITCH_PREFIX)},
    }


def _worker(args) -> int:
    ns = [int(n) for n in args.n.split(",")]
    if args.worker == "experts":
        out = count_experts(args.model_dir, ns, args.routing)
    else:
        out = run_backend(
            args.model_dir, args.worker, ns, args.runs, args.keep_traces, args.decode_only,
            args.routing,
        )  # fmt: skip
    out["routing"] = args.routing
    out["host"] = host_facts(os.environ.get(COMMAND_ENV, ""))
    Path(args.result).write_text(json.dumps(out))
    return 0


def worker_env(env, triton_cache: Path | None) -> dict[str, str]:
    """Environment of a worker. With ``triton_cache`` every engine shares one Triton
    cache, so the KDA prefill kernels are autotuned once per host instead of once per
    engine (~80 s each): vLLM points TRITON_CACHE_DIR at a folder named after the
    engine's compile hash unless its compile cache is off, and on a fresh host
    every engine compiles cold anyway."""
    env = dict(env)
    if triton_cache is not None:
        env.update(VLLM_DISABLE_COMPILE_CACHE="1", TRITON_CACHE_DIR=str(triton_cache))
    return env


def _spawn(args, role: str, result: Path) -> None:
    cmd = [
        sys.executable, __file__, "--worker", role, "--result", str(result),
        "--model-dir", str(args.model_dir), "--n", args.n, "--runs", str(args.runs),
        "--routing", args.routing,
    ]  # fmt: skip
    if args.keep_traces:
        cmd += ["--keep-traces", str(args.keep_traces)]
    if args.decode_only:
        cmd.append("--decode-only")
    env = worker_env(os.environ, args.triton_cache)
    env[COMMAND_ENV] = "python3 " + " ".join(sys.argv)
    returncode = run_worker(cmd, env, role)
    if returncode != 0:
        raise SystemExit(
            f"error: the {role} run failed (exit {returncode}); see its output above. "
            "Nothing was written."
        )


def run_worker(cmd: list[str], env: dict[str, str], role: str) -> int:
    """Run one role's worker in its own process group and wait for it. A SIGTERM
    or SIGINT to this process (``timeout``, Ctrl-C) kills the whole group first:
    left running, the worker's engine process kept the GPU busy beside the
    next role's engine (2026-12-03)."""
    worker = subprocess.Popen(cmd, env=env, start_new_session=True)
    stopped_by: list[int] = []

    def stop(signum, _frame):
        # Only kill here: the interrupted worker.wait() below holds Popen's lock
        # and returns once the group is gone.
        stopped_by.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = worker.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped_by:
        raise SystemExit(
            f"error: stopped by signal {stopped_by[0]} during the {role} run; its worker "
            "and engine processes were killed. Nothing was written."
        )
    return returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "perf")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--n", default=",".join(map(str, N_VALUES)))
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--worker", choices=(*BACKENDS, "experts"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument(
        "--roles",
        default=",".join(ROLES),
        help=f"run only these of {','.join(ROLES)}, keeping each result in --scratch; "
        "the report is written once every role has a result there (split a run over "
        "several calls)",
    )
    ap.add_argument(
        "--scratch", type=Path, help="per-role results (default <out-dir>/.bench_decode)"
    )
    ap.add_argument(
        "--triton-cache",
        type=Path,
        help="one Triton cache for every engine (autotune once); turns vLLM's "
        "compile cache off, which costs nothing on a fresh host",
    )
    ap.add_argument(
        "--correctness",
        type=Path,
        help="the end-to-end tests' correctness.json (HD_INTEGRATION_DIR) to record in the "
        "report; it must be of the same wheel (with --render-only: into --out-dir's "
        "decode.json, for an e2e run after the pair)",
    )
    ap.add_argument(
        "--keep-traces",
        type=Path,
        help="keep the torch-profiler traces (GPU kernels and host activities of "
        f"{PROFILE_TOKENS}-token requests at N = {', '.join(map(str, PROFILE_NS))}) here, "
        "gzipped, one per backend and N",
    )
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="the backends' decode step times and kernel profiles only (no prefill "
        "batches, no host phases), for A/Bs of the decode; such results make no report",
    )
    ap.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="dummy",
        help="the routers' weights: dummy (issue 6's method, writes decode.*: every token "
        "on the same experts) or spread (re-drawn so tokens route apart, writes "
        "decode_spread_routing.*; scripts/bench_routing.py)",
    )
    ap.add_argument(
        "--assemble",
        action="store_true",
        help="only write the report from the role results in --scratch (any host, e.g. "
        "after copying them back from the GPU host)",
    )
    args = ap.parse_args()
    traced_ns()  # a bad HD_BENCH_PROFILE_N fails here, before any engine starts
    if args.worker:
        return _worker(args)
    stem = REPORT_STEMS[args.routing]
    default_scratch = args.out_dir / f".bench_{stem}"
    if args.assemble:
        scratch = args.scratch or default_scratch
        try:
            got = run_roles([], scratch, lambda role, path: None)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if got is None:
            return 2
        config = json.loads((args.model_dir / "config.json").read_text())
        return _write_report(args, config, got, scratch)
    if args.render_only:
        data = json.loads((args.out_dir / f"{stem}.json").read_text())
        if refresh_prefill_statistics(data):
            (args.out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
        if args.correctness:
            try:
                attach_correctness(data, json.loads(args.correctness.read_text()))
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            (args.out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
            write_markdown(data, args.out_dir / f"{stem}.md")
            return 0
        write_markdown(data, args.out_dir / f"{stem}.md")
        write_plot(data, args.out_dir / f"{stem}.png")
        return 0

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("error: needs an SM90 GPU (H200)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None or (
        importlib.util.find_spec("vllm._hopper_decode_build") is None
    ):
        print("error: needs the patched vLLM wheel (make build-wheel)", file=sys.stderr)
        return 2
    config = json.loads((args.model_dir / "config.json").read_text())
    scratch = args.scratch or default_scratch
    try:
        got = run_roles(args.roles.split(","), scratch, lambda role, path: _spawn(args, role, path))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if got is None:
        return 0
    return _write_report(args, config, got, scratch)


def refresh_prefill_statistics(data: dict) -> bool:
    """Recompute a report's prefill statistics from the per-batch results it keeps
    (``runs``), so that statistics added since it was measured reach it; returns whether
    anything changed."""
    results = data.get("runs") or {}
    if not all(b in results for b in BACKENDS):
        return False
    fresh = {
        "prefill_rates": prefill_rates(results),
        "prefill_engine_rates": prefill_engine_rates(results),
    }
    changed = any(data.get(k) != v for k, v in fresh.items())
    data.update(fresh)
    return changed


def kernel_switches(switches: dict[str, str]) -> dict[str, str]:
    """The switches that choose the kernels (the roles must agree on these)."""
    return {k: v for k, v in switches.items() if k not in NON_KERNEL_SWITCHES}


def assemble(config: dict, got: dict[str, dict], model_dir: str) -> dict:
    """decode.json from every role's result. The roles may have run in separate calls, even
    on separate hosts of the same kind: refuses results of different GPUs or builds."""
    hosts = {role: got[role].get("host") for role in ROLES}
    missing = sorted(role for role, host in hosts.items() if not host)
    if missing:
        raise ValueError(f"no host facts in the results of {missing}; run them again")
    for key in ("gpu", "vllm", "fingerprint"):
        values = {host[key] for host in hosts.values()}
        if len(values) != 1:
            raise ValueError(f"the roles ran with different {key}: {sorted(values)}")
    switches = {
        json.dumps(kernel_switches(host.get("switches", {})), sort_keys=True)
        for host in hosts.values()
    }
    if len(switches) != 1:
        raise ValueError(
            f"the roles ran with different {SWITCH_PREFIX}* switches: {sorted(switches)}"
        )
    non_kernel = {}
    for role, host in hosts.items():
        kept = {k: v for k, v in host.get("switches", {}).items() if k in NON_KERNEL_SWITCHES}
        if kept:
            non_kernel[role] = kept
    routing = got[BACKENDS[0]].get("routing", "dummy")
    results = {
        b: {k: v for k, v in got[b].items() if k not in ("host", "routing", "routing_summary")}
        for b in BACKENDS
    }
    experts = {int(k): v for k, v in got["experts"]["distinct"].items()}
    runs = results[BACKENDS[0]]["runs"]
    first = hosts[BACKENDS[0]]
    summary = summarize(config, results, experts)
    return {
        "summary": summary,
        "routing": routing_record(config, routing, got, summary),
        "gpu_busy_ms": gpu_busy_ms(results),
        "prefill_gpu_busy_ms": prefill_gpu_busy_ms(results),
        "prefill_rates": prefill_rates(results),
        "prefill_engine_rates": prefill_engine_rates(results),
        "runs": results,
        **{
            f"profile_n{n}": {b: results[b].pop(f"profile_n{n}", None) for b in BACKENDS}
            for n in PROFILE_NS
        },
        "host_phases": {b: results[b].pop("host_phases", None) for b in BACKENDS},
        "method": method_text(runs, routing),
        "model_dir": model_dir,
        "layers": config["num_hidden_layers"],
        "fingerprint": first["fingerprint"],
        "switches": kernel_switches(first.get("switches", {})),
        **({"non_kernel_switches": non_kernel} if non_kernel else {}),
        "vllm": first["vllm"],
        "gpu": first["gpu"],
        # Per role: the roles may run on different hosts (separate device calls).
        "cpu": {role: host.get("cpu") for role, host in hosts.items()},
        "date": max(host["date"] for host in hosts.values()),
        "command": " ; ".join(dict.fromkeys(host["command"] for host in hosts.values())),
    }


def method_text(runs: int, routing: str) -> str:
    common = (
        f"median inter-token latency (prefill excluded) of N requests in flight, "
        f"{PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, ignore_eos, "
        f"greedy, median of {runs} runs; AsyncLLM streaming, one engine per "
        "process, dummy weights, seed 0; floor = weights a step reads (distinct "
        "experts measured on an eager stock engine) + per-request KDA/conv state "
        "read+write + MLA latent cache read, / 4.25 TB/s. "
    )
    if routing == "spread":
        return common + (
            "Spread routing (scripts/bench_routing.py): after the dummy load, every MoE "
            "router's weight drawn from N(0, 1/hidden_size) (seeded by its name), its "
            "correction bias zeroed and the norm in front of it at 1, in every engine "
            "(each engine's worker confirmed it), so a token's experts follow the token "
            "and the N > 1 steps read about as many experts as uniform routing would "
            "(expected_uniform_experts); every other weight as with dummy weights"
        )
    return common + (
        "With dummy weights (every parameter, the norms' included, uniform in +-1e-3) "
        "the router's logits vary by ~1e-5 and its correction bias (+-1e-3) picks the "
        "experts: every token routes to the same top-k, so the distinct experts stay at "
        "top-k for every N and the N > 1 steps read far fewer expert weights than real "
        "routing would (bench_decode.py --routing spread measures that case)"
    )


def routing_record(config: dict, routing: str, got: dict[str, dict], summary: dict) -> dict:
    """The report's "routing": the regime, and for spread routing what each engine's
    loader reported and the uniform-routing expectation beside the measured experts."""
    record: dict = {"regime": routing}
    if routing == "spread":
        record["engines"] = {role: got[role].get("routing_summary") for role in ROLES}
        record["expected_uniform_experts"] = {
            n: expected_uniform_experts(config, int(n)) for n in summary["distinct_experts"]
        }
    return record


def attach_correctness(data: dict, record: dict) -> None:
    """Put the end-to-end tests' record (tests/integration/conftest.py) into the report;
    it must come from the wheel the benchmark measured."""
    if record.get("fingerprint") != data["fingerprint"]:
        raise ValueError(
            f"the correctness record is of patch-set {record.get('fingerprint')!r}, the "
            f"benchmark of {data['fingerprint']!r}: run the tests with the measured wheel"
        )
    data["correctness"] = {k: v for k, v in record.items() if k != "fingerprint"}


def _write_report(args, config: dict, got: dict[str, dict], scratch: Path) -> int:
    try:
        model_dir = args.model_dir.resolve()
        shown = model_dir.relative_to(ROOT) if model_dir.is_relative_to(ROOT) else model_dir
        data = assemble(config, got, str(shown))
        if args.correctness:
            attach_correctness(data, json.loads(args.correctness.read_text()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = REPORT_STEMS[data["routing"]["regime"]]
    (args.out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    write_markdown(data, args.out_dir / f"{stem}.md")
    if not write_plot(data, args.out_dir / f"{stem}.png"):
        print(f"note: matplotlib not installed, {stem}.png not written", file=sys.stderr)
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()
    print(json.dumps(data["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

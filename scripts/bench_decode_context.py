#!/usr/bin/env python3
"""Decode step time inside vLLM at long contexts: stock vs latency_specialized.

`make bench` (scripts/bench_decode.py) starts from 4-token prompts, so its rows stay under
1030 tokens of context and the MLA attention's cost at long contexts never shows. Here N
requests with CONTEXT-token prompts start together and generate OUTPUT_TOKENS tokens each
(greedy, ignore_eos, dummy weights). The prompts are prefilled one after another, so the
first requests decode beside the later ones' prefill chunks: only the inter-token latencies
inside the window where all N requests decode (from the last request's first token to the
first request's last) are kept (`decode_window_samples`), and the prefill budget per step is
one whole prompt so that the window is long. Step time = the median of those samples,
median over the runs. One engine per backend, each in its own process and, on the offline
H200, its own device call:

    python3 scripts/bench_decode_context.py --roles auto               # stock engine
    python3 scripts/bench_decode_context.py --roles latency_specialized
    python3 scripts/bench_decode_context.py --render-only              # the report

Each role writes ``decode_context-<role>.json`` into --out-dir; every call then writes
``decode_context.{json,md}`` from the role results present there (ratios once both are).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402  (this folder's benchmark: the shared measurement parts)

ROOT = bench_decode.ROOT
CONTEXTS = (8192, 32768)
N_VALUES = (1, 2, 4, 8, 16)
OUTPUT_TOKENS = 128
RUNS = 2
# One request of this shape first: the engine's first-use work stays out of the timings.
SETTLE_PROMPT_TOKENS = 1024
SETTLE_OUTPUT_TOKENS = 32
# Fewer inter-token samples per request inside the all-decoding window fail the run.
MIN_WINDOW_STEPS = 32


def decode_window_samples(requests: list[list[tuple[float, int]]]) -> list[float]:
    """Inter-token latencies (s) of every request inside the window where all of them
    decode: from the last request's first token (its prefill done) to the first
    request's last token.  ``requests``: per request its streamed chunks (arrival time
    s, new tokens), as ``bench_decode.stream_batch`` returns them.  A chunk of k tokens
    gives k samples of dt / k, as ``bench_decode.itl_samples``.  Raises if a request has
    fewer than MIN_WINDOW_STEPS samples in the window (raise the output length)."""
    arrivals = [[(t, k) for t, k in chunks if k > 0] for chunks in requests]
    if any(len(a) < 2 for a in arrivals):
        raise RuntimeError("a request streamed fewer than two chunks")
    start = max(a[0][0] for a in arrivals)
    end = min(a[-1][0] for a in arrivals)
    samples = []
    for a in arrivals:
        inside = [
            [(t - t_prev) / k] * k
            for (t_prev, _), (t, k) in zip(a, a[1:])
            if t_prev >= start and t <= end
        ]
        mine = [x for part in inside for x in part]
        if len(mine) < MIN_WINDOW_STEPS:
            raise RuntimeError(
                f"only {len(mine)} inter-token samples of a request fall where all "
                f"{len(requests)} requests decode (need {MIN_WINDOW_STEPS}): raise "
                "--output-tokens"
            )
        samples += mine
    return samples


def result_path(out_dir: Path, role: str) -> Path:
    return out_dir / f"decode_context-{role}.json"


def run_backend(model_dir: Path, backend: str, contexts: list[int], ns: list[int], runs: int,
                output_tokens: int) -> dict:  # fmt: skip
    """One engine: step ms per (context, N), every run's median kept."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            max_model_len=max(*contexts, SETTLE_PROMPT_TOKENS + SETTLE_OUTPUT_TOKENS)
            + output_tokens
            + 8,
            # One whole prompt per step: the prefills end after N steps, not N x
            # context / 2048 (the default budget), so the all-decoding window is long.
            max_num_batched_tokens=max(2048, max(contexts)),
            gpu_memory_utilization=0.9,
            max_num_seqs=max(ns),
            enable_prefix_caching=False,
            seed=0,
            additional_config={"decode_backend": backend},
        )
    )

    async def main() -> dict:
        step_ms: dict[str, dict[str, float]] = {}
        step_ms_runs: dict[str, dict[str, list[float]]] = {}
        await bench_decode.stream_batch(
            engine, "settle", 1, SETTLE_PROMPT_TOKENS, SETTLE_OUTPUT_TOKENS
        )
        for context in contexts:
            for n in ns:
                medians = []
                for r in range(runs):
                    tag = f"c{context}n{n}r{r}"
                    chunks = await bench_decode.stream_batch(engine, tag, n, context, output_tokens)
                    if any(sum(c for _, c in ch) != output_tokens for ch in chunks):
                        raise RuntimeError(f"{tag}: a request did not get {output_tokens} tokens")
                    samples = decode_window_samples(chunks)
                    medians.append(statistics.median(samples) * 1e3)
                step_ms.setdefault(str(context), {})[str(n)] = statistics.median(medians)
                step_ms_runs.setdefault(str(context), {})[str(n)] = medians
                print(f"{backend} context={context} N={n}: {medians} ms", flush=True)
        return {"step_ms": step_ms, "step_ms_runs": step_ms_runs, "runs": runs}

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def summarize(results: dict[str, dict]) -> dict:
    """Per context and N: each backend's step ms and, with both, the speedup."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for role, result in results.items():
        for context, per_n in result["step_ms"].items():
            for n, ms in per_n.items():
                summary.setdefault(context, {}).setdefault(n, {})[role] = ms
    for per_n in summary.values():
        for row in per_n.values():
            if "auto" in row and "latency_specialized" in row:
                row["speedup"] = row["auto"] / row["latency_specialized"]
    return summary


def write_report(out_dir: Path) -> Path | None:
    results = {
        role: json.loads(result_path(out_dir, role).read_text())
        for role in bench_decode.BACKENDS
        if result_path(out_dir, role).exists()
    }
    if not results:
        return None
    data = {
        "method": (
            "median inter-token latency of N requests with CONTEXT-token prompts inside "
            "the window where all N decode (no prefill chunk in those steps), greedy, "
            "ignore_eos, median over the runs (of two: their mean); one engine per "
            "process, dummy weights, seed 0"
        ),
        "summary": summarize(results),
        "hosts": {role: r["host"] for role, r in results.items()},
        "results": results,
    }
    (out_dir / "decode_context.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# Decode step time at long contexts: stock vs latency-specialized (H200)", ""]
    for role, host in data["hosts"].items():
        lines.append(
            f"- `{role}`: {host['gpu']}, {host['date']}, vLLM `{host['vllm']}`, `{host['command']}`"
        )
    if len({host["fingerprint"] for host in data["hosts"].values()}) > 1:
        lines.append("- **The roles ran different builds**: the ratios compare them.")
    shapes = {(r["runs"], r["output_tokens"]) for r in results.values()}
    if len(shapes) > 1:
        lines.append(
            f"- **The roles ran different shapes** (runs, output tokens): {sorted(shapes)}."
        )
    lines += ["", data["method"] + ".", "", "| context | N | stock ms | specialized ms | speedup |"]
    lines.append("|---|---|---|---|---|")
    for context, per_n in data["summary"].items():
        for n, row in per_n.items():
            cells = [f"{row[k]:.3f}" if k in row else "-" for k in ("auto", "latency_specialized")]
            speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
            lines.append(f"| {context} | {n} | {cells[0]} | {cells[1]} | {speedup} |")
    path = out_dir / "decode_context.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _worker(args) -> int:
    out = run_backend(
        args.model_dir, args.worker, _ints(args.context), _ints(args.n), args.runs,
        args.output_tokens,
    )  # fmt: skip
    out["host"] = bench_decode.host_facts(os.environ.get(bench_decode.COMMAND_ENV, ""))
    out["output_tokens"] = args.output_tokens
    Path(args.result).write_text(json.dumps(out))
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "perf")
    ap.add_argument("--model-dir", type=Path, default=bench_decode.DEFAULT_MODEL_DIR)
    ap.add_argument("--context", default=",".join(map(str, CONTEXTS)), help="prompt tokens")
    ap.add_argument("--n", default=",".join(map(str, N_VALUES)))
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    ap.add_argument("--roles", default="", help="comma-separated: auto, latency_specialized")
    ap.add_argument("--render-only", action="store_true", help="only write the report")
    ap.add_argument("--triton-cache", type=Path, help="one Triton cache for every engine")
    ap.add_argument("--worker", choices=bench_decode.BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    roles = [r for r in args.roles.split(",") if r]
    unknown = sorted(set(roles) - set(bench_decode.BACKENDS))
    if unknown:
        ap.error(f"unknown roles {unknown}; choose from {list(bench_decode.BACKENDS)}")
    if not roles and not args.render_only:
        ap.error("give --roles (one engine per role) or --render-only")
    if min(_ints(args.context)) < 1 or min(_ints(args.n)) < 1 or args.output_tokens < 2:
        ap.error("contexts and N must be >= 1 and --output-tokens >= 2")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for role in roles:
        cmd = [
            sys.executable, __file__, "--worker", role,
            "--result", str(result_path(args.out_dir, role)),
            "--model-dir", str(args.model_dir), "--context", args.context, "--n", args.n,
            "--runs", str(args.runs), "--output-tokens", str(args.output_tokens),
        ]  # fmt: skip
        env = bench_decode.worker_env(os.environ, args.triton_cache)
        env[bench_decode.COMMAND_ENV] = "python3 " + " ".join(sys.argv)
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0:
            print(f"error: the {role} run failed (exit {done.returncode})", file=sys.stderr)
            return 1
    report = write_report(args.out_dir)
    print(f"wrote {report}" if report else f"no role results in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

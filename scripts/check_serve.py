#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` and `vllm bench latency` with decode_backend=latency_specialized (issue 6).

On the H200 with the patched wheel installed:

    python3 scripts/check_serve.py --out-dir docs/perf

1. `vllm serve <model> --additional-config '{"decode_backend": "latency_specialized"}'` (dummy
   weights, no tokenizer): waits for /health, then sends OpenAI completions requests (one
   prompt, then four in one request; token-id prompts, greedy) and checks every choice has
   max_tokens tokens, and that the server log shows the executor was built.
2. `vllm bench latency` with the same flag (4-token prompts, batch 1), its JSON kept.

Writes <out-dir>/serve_check.json; exits non-zero on the first failed check. On the GPU host
the serving packages come separately (`python3 ci/gpu/serve_wheels.py`, then carry
.gpu-bundle/serve and run its install.sh). The model is the
5-layer Kimi-Linear of the end-to-end tests by default (fast to start); --model-dir takes
the 48B config.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = ROOT / "tests" / "integration" / "kimi_linear_5_layers"
SPECIALIZED = json.dumps({"decode_backend": "latency_specialized"})
EXECUTOR_LOG_LINE = "Kimi-Linear specialized decode:"
VLLM_CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
# A fixed KV-cache size skips vLLM's start-up memory profiling, which reads the device's
# free memory: the check may run beside other engines (the end-to-end tests' engines).
COMMON_ARGS = [
    "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "2048",
    "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(4 << 30),
    "--additional-config", SPECIALIZED,
]  # fmt: skip
# What vLLM 0.26.0's CLI and OpenAI server import beyond the engine (ci/gpu/serve_wheels.py).
SERVE_MODULES = (
    "uvicorn",
    "watchfiles",
    "model_hosting_container_standards",
    "jmespath",
    "prometheus_fastapi_instrumentator",
)
START_TIMEOUT_S = 600
MAX_TOKENS = 32
# One batch: each `vllm bench latency` starts its own engine (~4 min for the 5-layer model
# beside the end-to-end engines on the H200, most of it Triton autotuning the prefill).
LATENCY_BATCHES = (1,)


class CheckFailed(RuntimeError):
    pass


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_healthy(port: int, server: subprocess.Popen, log: Path) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < START_TIMEOUT_S:
        if server.poll() is not None:
            raise CheckFailed(f"vllm serve exited with {server.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return time.perf_counter() - start
        except OSError:
            time.sleep(2)
    raise CheckFailed(f"vllm serve not healthy after {START_TIMEOUT_S} s; see {log}")


def _completion_tokens(choice: dict) -> int:
    ids = choice.get("token_ids")
    return len(ids) if ids is not None else -1


def require_serve_modules(find_spec=importlib.util.find_spec) -> None:
    """Fail before starting anything when the host lacks what vLLM's CLI imports for
    `serve` and `bench` (the GPU host's bundle does not carry it)."""
    missing = [name for name in SERVE_MODULES if find_spec(name) is None]
    if missing:
        raise CheckFailed(
            f"this Python cannot import {missing}, which `vllm serve` needs: stage them with "
            "`python3 ci/gpu/serve_wheels.py` and run .gpu-bundle/serve/install.sh on the host"
        )


def check_serve(model_dir: Path, out_dir: Path, port: int) -> dict:
    log = out_dir / "serve_check.serve.log"
    command = [*VLLM_CLI, "serve", str(model_dir), *COMMON_ARGS, "--port", str(port)]
    result: dict = {"command": " ".join(command[2:])}
    with log.open("w") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            result["start_s"] = round(_wait_healthy(port, server, log), 1)
            url = f"http://127.0.0.1:{port}/v1/completions"
            for name, prompt in (
                ("one_prompt", [1000, 1001, 1002, 1003]),
                ("four_prompts", [[2000 + 10 * i + j for j in range(4)] for i in range(4)]),
            ):
                reply = _post(url, {
                    "model": str(model_dir), "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                })  # fmt: skip
                counts = [_completion_tokens(c) for c in reply["choices"]]
                result[name] = {"choices": len(counts), "tokens": counts, "usage": reply["usage"]}
                expected = 1 if name == "one_prompt" else 4
                if len(counts) != expected or any(n != MAX_TOKENS for n in counts):
                    raise CheckFailed(f"{name}: expected {expected} x {MAX_TOKENS} tokens: {reply}")
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    if EXECUTOR_LOG_LINE not in log.read_text(errors="replace"):
        raise CheckFailed(f"the server log has no '{EXECUTOR_LOG_LINE}' line: executor not built")
    return result


def check_bench_latency(model_dir: Path, out_dir: Path) -> dict:
    result = {}
    for batch in LATENCY_BATCHES:
        output = out_dir / f"serve_check.latency_b{batch}.json"
        command = [
            *VLLM_CLI, "bench", "latency", "--model", str(model_dir), *COMMON_ARGS,
            "--disable-detokenize", "--input-len", "4", "--output-len", "128",
            "--batch-size", str(batch), "--num-iters-warmup", "1", "--num-iters", "3",
            "--output-json", str(output),
        ]  # fmt: skip
        log = out_dir / f"serve_check.latency_b{batch}.log"
        with log.open("w") as sink:
            done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT)
        if done.returncode != 0 or not output.exists():
            raise CheckFailed(f"vllm bench latency (batch {batch}) failed; see {log}")
        data = json.loads(output.read_text())
        result[str(batch)] = {"avg_latency_s": data.get("avg_latency")}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "perf")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model_dir": str(args.model_dir),
    }
    report_path = args.out_dir / "serve_check.json"
    status = 0
    try:
        require_serve_modules()
        report["serve"] = check_serve(args.model_dir, args.out_dir, args.port)
        # Written after each stage: a caller's time limit keeps what has passed.
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        report["bench_latency"] = check_bench_latency(args.model_dir, args.out_dir)
    except (CheckFailed, OSError, KeyError) as exc:
        report["failed"] = f"{type(exc).__name__}: {exc}"
        status = 1
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Run the end-to-end tests' engines, one subprocess each (engine_session.py), and read back
what they did. The tests use it through fixtures; on the H200 it is also a command, so the
engines can be run in separate device calls (each call has a 600 s limit) and judged after:

    python3 tests/integration/engine_runs.py --dir /tmp/integ stock specialized
    HD_INTEGRATION_DIR=/tmp/integ HD_INTEGRATION_REUSE=1 python3 -m pytest tests/integration

Kinds named together run at the same time (each engine is small; start-up, mostly compiling,
dominates): the specialized and auto engines wait for the stock tokens they are forced on.
With HD_INTEGRATION_REUSE=1 a kind whose finished run is already in the folder is not run
again (a forced one only if it was teacher-forced on the stock run there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import scenarios as sc

SESSION = Path(__file__).resolve().parent / "engine_session.py"
ENGINE_TIMEOUT_S = 900
# Kinds teacher-forced on the stock run's tokens (compared with it step by step).
FORCED_ON_STOCK = ("specialized", "auto")


@dataclass
class EngineRun:
    kind: str
    out: Path
    status: dict[str, Any]
    log: Path
    _loaded: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status.get("status") == "ok"

    @property
    def engine(self) -> dict[str, Any]:
        return self.status.get("engine", {})

    def describe_failure(self) -> str:
        error = self.status.get("error") or []
        head = "\n".join(f"  {kind}: {message}" for kind, message in error[:4])
        log_tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        return (
            f"{self.kind} engine: {self.status.get('status')}\n{head}\n"
            f"--- {self.log} (tail) ---\n{log_tail}"
        )

    def require_ok(self) -> None:
        if not self.ok:
            import pytest

            pytest.fail(self.describe_failure(), pytrace=False)

    def load(self, scenario: str) -> dict[str, Any]:
        import torch

        self.require_ok()
        if scenario not in self._loaded:
            self._loaded[scenario] = torch.load(self.out / f"{scenario}.pt")
        return self._loaded[scenario]


def _read(kind: str, out: Path) -> EngineRun:
    status_file = out / "session.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else {}
    return EngineRun(kind, out, status, out / "engine.log")


def run_engine(
    kind: str, root: Path, forced_from: Path | None = None, reuse: bool = False
) -> EngineRun:
    return run_engines([(kind, forced_from)], root, reuse)[0]


def run_engines(
    kinds: list[tuple[str, Path | None]], root: Path, reuse: bool = False
) -> list[EngineRun]:
    """Run one engine per ``(kind, forced_from)``, all at the same time."""
    done: dict[int, EngineRun] = {}
    started: list[tuple[int, str, Path, subprocess.Popen, Any]] = []
    for i, (kind, forced_from) in enumerate(kinds):
        out = root / kind
        if reuse:
            finished = _read(kind, out)
            if finished.ok and finished.status.get("forced_from") == (
                forced_from and str(forced_from)
            ):
                done[i] = finished
                continue
        out.mkdir(parents=True, exist_ok=True)
        (out / "session.json").unlink(missing_ok=True)
        for stale in out.glob("*.tokens.json"):  # a forced run must not read old tokens
            stale.unlink()
        command = [sys.executable, str(SESSION), "--kind", kind, "--out", str(out)]
        if forced_from is not None:
            command += ["--forced-from", str(forced_from)]
        sink = (out / "engine.log").open("w")
        process = subprocess.Popen(
            command, cwd=SESSION.parent, env=_engine_env(root), stdout=sink,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        started.append((i, kind, out, process, sink))
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    for i, kind, out, process, sink in started:
        try:
            returncode: int | None = process.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            returncode = None
        sink.close()
        run = _read(kind, out)
        status = run.status
        if returncode is None:
            status["status"] = f"timed out after {ENGINE_TIMEOUT_S} s"
        elif status.get("status") in (None, "starting") or (
            returncode and status["status"] == "ok"
        ):
            status["status"] = f"crashed (exit code {returncode})"
        done[i] = run
    return [done[i] for i in range(len(kinds))]


def _engine_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    # In-process engine core: start-up exceptions arrive unwrapped, collective_rpc callables
    # run on the live runner without serialization.
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    # vLLM points TRITON_CACHE_DIR at a folder named by the engine's compile hash, which
    # differs per engine kind, so every engine re-ran the ~80 s autotuning of the KDA prefill
    # kernels; engine_session.py shares one folder for the runs after engine start.
    # A folder the caller names (the device session's, carried between hosts) wins.
    env.setdefault("HD_TRITON_CACHE_DIR", str(root / "triton_cache"))
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_BREAKABLE_CUDAGRAPH"):
        env.pop(name, None)  # the default deployment
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("kinds", nargs="+", choices=sorted(sc.ENGINE_KINDS))
    args = parser.parse_args()
    failed = 0
    kinds = [(k, args.dir / "stock" if k in FORCED_ON_STOCK else None) for k in args.kinds]
    for (kind, _), run in zip(kinds, run_engines(kinds, args.dir)):
        print(f"{kind}: {run.status.get('status')} {run.status.get('seconds')}", flush=True)
        if not run.ok and kind != "unsupported":
            print(run.describe_failure(), flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

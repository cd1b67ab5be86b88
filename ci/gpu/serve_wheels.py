#!/usr/bin/env python3
"""Stage the packages `vllm serve` / `vllm bench latency` need on the offline H200.

The `vllm` profile of `../shared/gpu-bundle/build.py` carries what the engine imports,
not the OpenAI server: on the H200 (2026-11-30) `vllm.entrypoints.cli.main` failed with
"No module named 'uvicorn'", for every subcommand. SERVE_PINS is what the server and the
latency benchmark import beyond that bundle and the host image (KINDS.md's package
list), found by importing vllm.entrypoints.{serve,openai,generate,scale_out}, the
renderers and vllm.benchmarks with only those packages on the path; versions are the
ones vLLM 0.26.0 resolves to (the wheel venv), plus model-hosting-container-standards'
own dependency supervisor.

The `upstream-tests` profile stages what upstream vLLM's own tests import beyond that
bundle and the host image (the H200 run of 2026-12-01 stopped at tests/conftest.py:
"No module named 'tblib'"): the packages of ci/requirements-upstream-tests.txt, at the
versions pinned there (the CPU CI installs the same file), so the GPU subset of
ci/upstream_tests.yaml runs against the same test stack as the CPU one. It carries the
serve profile's packages too: upstream's tests/utils.py imports vllm.entrypoints, which
needs uvicorn (2026-12-04: test_cudagraph_dispatch.py and test_registry.py failed to
collect without it).

Usage (repository root, on a machine with pip access):
    python3 ci/gpu/serve_wheels.py [--profile serve|upstream-tests]
Output: .gpu-bundle/<profile>/{*.whl,install.sh} (git-ignored); carry that folder in a
device call after the vllm bundle is installed, then run its install.sh.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

SERVE_PINS = [
    "uvicorn==0.54.0",
    "watchfiles==1.3.0",
    "model-hosting-container-standards==0.1.16",
    "jmespath==1.1.0",
    "prometheus-fastapi-instrumentator==8.1.0",
    "supervisor==4.3.0",
]
# anthropic is a dependency of vLLM itself (requirements/common.txt; the CPU wheel
# venv has it) that the gpu-bundle's vllm profile leaves out, and upstream's
# tests/utils.py imports it: on the H200 (2026-12-01) 5 tests of
# tests/v1/worker/test_gpu_model_runner.py and the collection of
# tests/v1/cudagraph/test_cudagraph_dispatch.py stopped at "No module named
# 'anthropic'". Staged with the dependencies it brings beyond the bundle, at the
# versions the wheel venv resolves to.
GPU_HOST_TEST_PINS = [
    "anthropic==2.14.0",
    "jiter==0.19.0",  # anthropic's; the vllm bundle does not carry it (2026-12-04)
    "docstring-parser==0.18.0",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "opentelemetry-api==1.45.2",
]
# What the host's python3 is (KINDS.md): CPython 3.12 on x86_64 Linux.
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
CI_DIR = Path(__file__).resolve().parents[1]
TEST_REQUIREMENTS = CI_DIR / "requirements-upstream-tests.txt"
INSTALL_SH = """#!/bin/sh
# Install the staged {profile} packages into the host's python3 (no index, no deps).
set -e
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps "$here"/*.whl
python3 -c "import {imports}"
echo "{profile} deps ok"
"""


def upstream_test_pins(path: Path = TEST_REQUIREMENTS) -> list[str]:
    """The ``name==version`` lines of the upstream-tests requirements file."""
    pins = []
    for line in path.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if not spec:
            continue
        if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", spec):
            raise ValueError(f"{path}: {spec!r} is not pinned as name==version")
        pins.append(spec)
    return pins


# profile -> the modules its install.sh imports as the check.
PROFILE_IMPORTS = {
    "serve": "uvicorn, watchfiles, prometheus_fastapi_instrumentator",
    "upstream-tests": "tblib, pytest_asyncio, transformers, anthropic, uvicorn",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=tuple(PROFILE_IMPORTS), default="serve")
    args = ap.parse_args()
    pins = SERVE_PINS
    if args.profile == "upstream-tests":
        pins = upstream_test_pins() + GPU_HOST_TEST_PINS + SERVE_PINS
    imports = PROFILE_IMPORTS[args.profile]
    out = Path(".gpu-bundle") / args.profile
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.whl"):
        stale.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    cmd += ["-d", str(out)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    if subprocess.run(cmd + pins, env=env).returncode != 0:
        print("error: pip download failed; nothing staged", file=sys.stderr)
        return 1
    install = INSTALL_SH.format(profile=args.profile, imports=imports)
    (out / "install.sh").write_text(install)
    wheels = sorted(p.name for p in out.glob("*.whl"))
    if len(wheels) != len(pins):
        print(f"error: want {len(pins)} wheels, got {wheels}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: {len(wheels)} wheels, {size / 2**20:.1f} MiB; carry it, then "
          f"`sh {out}/install.sh`")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

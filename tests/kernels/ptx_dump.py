# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The PTX CuTe DSL writes for one compile, for tests that check instruction order."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compiled_ptx(tmp_path: Path, test_module: str, call: str) -> str:
    """Run ``t.<call>`` after ``import <test_module> as t`` in a fresh process (CuTe DSL
    reads its dump options at import) and return the PTX it wrote; skip if none."""
    env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import {test_module} as t; t.{call}"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parent, check=True)
    ptx = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    if not ptx:
        pytest.skip("this CuTe DSL build did not write PTX to CUTE_DSL_DUMP_DIR")
    return ptx[0].read_text()

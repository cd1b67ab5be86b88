# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The PTX CuTe DSL writes for one compile, for tests that check instruction order."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dumped(tmp_path: Path, test_module: str, call: str, keep: dict, suffix: str) -> str:
    """Run ``t.<call>`` after ``import <test_module> as t`` in a fresh process (CuTe DSL
    reads its dump options at import) with the ``keep`` variables set and return the
    first file ending in ``suffix`` it wrote; skip if none."""
    env = dict(os.environ, CUTE_DSL_DUMP_DIR=str(tmp_path), **keep)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import {test_module} as t; t.{call}"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parent, check=True)
    found = [p for p in tmp_path.iterdir() if p.name.endswith(suffix)]
    if not found:
        pytest.skip(f"this CuTe DSL build did not write *{suffix} to CUTE_DSL_DUMP_DIR")
    return found[0].read_text()


def compiled_ptx(tmp_path: Path, test_module: str, call: str) -> str:
    """The PTX of ``t.<call>`` (see ``_dumped``)."""
    return _dumped(tmp_path, test_module, call, {"CUTE_DSL_KEEP_PTX": "1"}, ".ptx")


def compiled_ir(tmp_path: Path, test_module: str, call: str) -> str:
    """The MLIR module of ``t.<call>`` after canonicalisation (host launch code and the
    kernel's attributes, ``CUTE_DSL_KEEP=ir``)."""
    return _dumped(tmp_path, test_module, call, {"CUTE_DSL_KEEP": "ir"}, ".mlir")

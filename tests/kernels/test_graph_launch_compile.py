# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile scripts/bench_graph_launch.py's CuTe DSL node for sm_90a without a GPU: with PDL
its PTX waits for the previous grid before the add and releases the next one after it, and
without PDL it does neither (the benchmark compares the two). Skips with the reason where
nvidia-cutlass-dsl is not installed."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ptx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_graph_launch  # noqa: E402


def compile_tick(pdl: bool):
    # Any 4-byte aligned address: compilation never dereferences it.
    ptr = cute.runtime.make_ptr(cutlass.Int32, 1 << 20, cute.AddressSpace.gmem, assumed_align=4)
    return cute.compile(bench_graph_launch.cute_tick(pdl), ptr, cuda.CUstream(0))


@pytest.mark.parametrize("pdl", [False, True])
def test_tick_orders_its_add_between_the_grid_dependency_wait_and_release(tmp_path, pdl):
    ptx = compiled_ptx(tmp_path, "test_graph_launch_compile", f"compile_tick({pdl})")
    body = ptx[ptx.index(".entry") :]
    if not pdl:
        assert "griddepcontrol" not in body
        assert "st.global" in body
        return
    wait = body.index("griddepcontrol.wait")
    store = body.index("st.global")
    release = body.index("griddepcontrol.launch_dependents")
    assert wait < store < release

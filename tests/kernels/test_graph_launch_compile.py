# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile scripts/bench_graph_launch.py's CuTe DSL node (one CTA, or one cluster) for sm_90a
without a GPU: with PDL its PTX waits for the previous grid before the add and releases the
next one after it, and without PDL it does neither (the benchmark compares the two). Skips
with the reason where nvidia-cutlass-dsl is not installed."""

import os
import re
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ir, compiled_ptx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_graph_launch  # noqa: E402


def compile_tick(pdl: bool, cluster_ctas: int = 1):
    # Any 4-byte aligned address: compilation never dereferences it.
    ptr = cute.runtime.make_ptr(cutlass.Int32, 1 << 20, cute.AddressSpace.gmem, assumed_align=4)
    tick = bench_graph_launch.cute_tick(pdl, cluster_ctas)
    return cute.compile(tick, ptr, cuda.CUstream(0))


@pytest.mark.parametrize("cluster_ctas", [1, bench_graph_launch.CLUSTER_CTAS])
@pytest.mark.parametrize("pdl", [False, True])
def test_tick_orders_its_add_between_the_grid_dependency_wait_and_release(
    tmp_path, pdl, cluster_ctas
):
    call = f"compile_tick({pdl}, {cluster_ctas})"
    ptx = compiled_ptx(tmp_path, "test_graph_launch_compile", call)
    body = ptx[ptx.index(".entry") :]
    if not pdl:
        assert "griddepcontrol" not in body
        assert "st.global" in body
        return
    wait = body.index("griddepcontrol.wait")
    store = body.index("st.global")
    release = body.index("griddepcontrol.launch_dependents")
    assert wait < store < release


@pytest.mark.parametrize("cluster_ctas", [1, bench_graph_launch.CLUSTER_CTAS])
def test_the_cluster_node_is_launched_as_one_cluster(tmp_path, cluster_ctas):
    ir = compiled_ir(tmp_path, "test_graph_launch_compile", f"compile_tick(True, {cluster_ctas})")
    launch = ir[ir.index("cuda.launch_cfg.create") : ir.index("cuda.launch_ex")]
    assert re.search(rf"gridDim = \(%c{cluster_ctas}_i32, %c1_i32, %c1_i32\)", launch)
    clusters = re.findall(r"cluster_dim\[%\w+\] \((%c\d+_i32), %c1_i32, %c1_i32\)", launch)
    assert clusters == ([f"%c{cluster_ctas}_i32"] if cluster_ctas > 1 else [])
    assert "programmatic_stream_serialization_allowed" in launch

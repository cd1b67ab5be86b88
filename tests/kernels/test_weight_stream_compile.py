# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile scripts/probe_weight_stream.py's bulk-staged GEMV for sm_90a without a GPU: the ring
is filled by bulk copies before the PDL wait, each completed on its stage's mbarrier, the
refill of a stage comes after the barrier that ends its reads and a proxy fence, and the rows
are read from shared memory 16 bytes at a time. Skips with the reason where nvidia-cutlass-dsl
is not installed."""

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
import probe_weight_stream  # noqa: E402

STAGES = 4


def _ptr(dtype):
    # Any 16-byte aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)


def compile_bulk():
    gemv, _ = probe_weight_stream.make_bulk_gemv(12576, 2304, 8, STAGES, 132)
    bf16 = _ptr(cutlass.BFloat16)
    return cute.compile(gemv(True), bf16, bf16, bf16, cuda.CUstream(0))


def test_the_ring_fills_before_the_wait_and_refills_after_its_reads(tmp_path):
    ptx = compiled_ptx(tmp_path, "test_weight_stream_compile", "compile_bulk()")
    body = ptx[ptx.index(".entry") :]
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    wait = body.index("griddepcontrol.wait")
    # One bulk copy a stage before the wait, each after its mbarrier's expect_tx.
    assert body.count(bulk, 0, wait) == STAGES
    assert body.count("mbarrier.arrive.expect_tx", 0, wait) == STAGES
    assert body.index("fence.mbarrier_init") < body.index(bulk)
    # After the wait: the stage's wait, its 16-byte shared reads, the barrier, the proxy
    # fence, then the refill.
    stage_wait = body.index("mbarrier.try_wait.parity", wait)
    reads = body.index("ld.shared.v4", stage_wait)
    fence = body.index("fence.proxy.async.shared::cta", reads)
    assert stage_wait < reads < body.rindex("bar.sync", 0, fence) < fence
    assert body.index(bulk, fence) > fence and body.count(bulk) == STAGES + 1
    # The weight comes by bulk copy only: the one global load is x's, after the wait.
    assert body.count("ld.global") == 1 and body.index("ld.global") > wait


def test_shapes_the_chunks_cannot_cover_are_refused():
    with pytest.raises(ValueError, match="chunks"):
        probe_weight_stream.make_bulk_gemv(12577, 2304, 8, STAGES, 132)
    with pytest.raises(ValueError, match="multiple of 256"):
        probe_weight_stream.make_bulk_gemv(12576, 2300, 8, STAGES, 132)

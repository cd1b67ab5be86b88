# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile scripts/probe_stage_handoff.py's kernels for sm_90a without a GPU: the chained stage
reads its input only after the PDL wait (and without PDL has neither half of it), and the
persistent kernel polls each counter with acquire loads before its reads and adds to the next
with a release after a barrier and a GPU fence. Skips with the reason where
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
import probe_stage_handoff  # noqa: E402


def _ptr(dtype):
    # Any 16-byte aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)


def compile_stage(pdl: bool):
    stage, _ = probe_stage_handoff.make_kernels(132, 128, 2304, 64)
    f32 = _ptr(cutlass.Float32)
    return cute.compile(stage(pdl), f32, f32, cuda.CUstream(0))


def compile_persistent(sleep_ns: int, fence: bool = True):
    _, persistent = probe_stage_handoff.make_kernels(132, 128, 2304, 64)
    args = (_ptr(cutlass.Float32), _ptr(cutlass.Int32), _ptr(cutlass.Int32))
    return cute.compile(persistent(sleep_ns, fence=fence), *args, cuda.CUstream(0))


@pytest.mark.parametrize("pdl", [False, True])
def test_the_chained_stage_reads_after_the_wait(tmp_path, pdl):
    ptx = compiled_ptx(tmp_path, "test_stage_handoff_compile", f"compile_stage({pdl})")
    body = ptx[ptx.index(".entry") :]
    assert "ld.global" in body and "st.global" in body
    if not pdl:
        assert "griddepcontrol" not in body
        return
    release = body.index("griddepcontrol.launch_dependents")
    wait = body.index("griddepcontrol.wait")
    assert release < wait < body.index("ld.global")


@pytest.mark.parametrize("sleep_ns", [0, probe_stage_handoff.SLEEP_NS])
def test_the_persistent_stages_hand_over_through_acquire_and_release(tmp_path, sleep_ns):
    ptx = compiled_ptx(tmp_path, "test_stage_handoff_compile", f"compile_persistent({sleep_ns})")
    body = ptx[ptx.index(".entry") :]
    # In the stage loop: the poll, the barrier, the vector's reads, the slice's stores, the
    # barrier, then thread 0's fence and release add (GPU scope is atom's default).
    poll = body.index("ld.acquire.gpu.global.b32")
    reads = body.index("ld.global.b32")
    stores = body.index("st.global.b32", reads)
    fence = body.index("fence.acq_rel.gpu")
    add = body.index("atom.global.release.add.u32", fence)
    assert poll < body.index("bar.sync", poll) < reads < stores < body.rindex("bar.sync", 0, fence)
    assert body.count("atom.global.release.add") == 1 and add > fence
    assert ("nanosleep" in body) == (sleep_ns > 0)
    assert "griddepcontrol" not in body


def test_the_lean_persistent_stage_releases_without_the_fence(tmp_path):
    ptx = compiled_ptx(tmp_path, "test_stage_handoff_compile", "compile_persistent(0, False)")
    body = ptx[ptx.index(".entry") :]
    assert "fence" not in body
    stores = body.index("st.global.b32", body.index("ld.global.b32"))
    add = body.index("atom.global.release.add.u32")
    assert stores < body.index("bar.sync", stores) < add

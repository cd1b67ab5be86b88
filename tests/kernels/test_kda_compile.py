# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile the fused KDA decode step for sm_90a without a GPU.

CuTe DSL lowers to PTX and a cubin on a machine with no GPU when the target is
named (CUTE_DSL_ARCH); this checks that every layout variant the prepared
binding can ask for traces, verifies and compiles, and that the PTX uses
16-byte state accesses.  Skips with the reason where nvidia-cutlass-dsl is
missing.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ptx  # noqa: E402

from kernels.kda.kernel import GATE_RANK, HEAD_DIM, KdaDecodeKernel  # noqa: E402


def _ptr(dtype, align=16):
    # Any aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)


def _kernel(
    heads=32, qkv_pitch=None, state_row=HEAD_DIM, conv_ds=False, use_pdl=True, warps=8,
    state_early=False, low_rank=False,
):  # fmt: skip
    proj = heads * HEAD_DIM
    pitch = qkv_pitch or proj
    gate_pitch = qkv_pitch or (GATE_RANK if low_rank else proj)
    conv_tap, conv_channel = (1, 3) if conv_ds else (3 * proj, 1)
    return KdaDecodeKernel(
        heads, (pitch, pitch, pitch), gate_pitch, heads, gate_pitch, proj,
        HEAD_DIM * state_row, state_row, conv_tap, conv_channel, use_pdl=use_pdl,
        warps=warps, state_loads_before_wait=state_early, low_rank_gates=low_rank,
    )  # fmt: skip


VARIANTS = {
    "kimi_linear_tp1": {},
    "packed_qkv_rows": {"qkv_pitch": 3 * 4096 + 288},
    "padded_state_rows": {"state_row": HEAD_DIM + 4},
    "conv_ds_layout": {"conv_ds": True},
    "no_pdl": {"use_pdl": False},
    "tp2_16_heads": {"heads": 16},
    "sixteen_warps": {"warps": 16},
    "sixteen_warps_padded_rows": {"warps": 16, "state_row": HEAD_DIM + 4},
    "state_loads_before_wait": {"state_early": True},
    # The decode executor's variant: f_a | g_a columns of the fused in_proj rows.
    "low_rank_gates_executor": {"state_early": True, "low_rank": True, "qkv_pitch": 12576},
    "low_rank_gates": {"low_rank": True},
    "low_rank_gates_no_pdl": {"low_rank": True, "use_pdl": False},
    "low_rank_gates_sixteen_warps": {"low_rank": True, "warps": 16},
}


def _compile(kern):
    bf16, f32 = _ptr(cutlass.BFloat16, 2), _ptr(cutlass.Float32)
    bf16_16 = _ptr(cutlass.BFloat16)  # f_b, g_b: 16-byte aligned for cp.async
    return cute.compile(
        kern, bf16, bf16, bf16, bf16, bf16, bf16, f32, _ptr(cutlass.Float32, 4),
        _ptr(cutlass.Float32, 4), _ptr(cutlass.Float32, 4), bf16_16, bf16_16,
        _ptr(cutlass.Int32, 4),
        bf16, f32, bf16, cutlass.Int32(1), cutlass.Int64(1 << 20), cutlass.Int64(1 << 21),
        cuda.CUstream(0),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_for_sm90a(name):
    assert _compile(_kernel(**VARIANTS[name])) is not None


def test_state_accesses_are_16_byte_vectors(tmp_path):
    text = compiled_ptx(
        tmp_path, "test_kda_compile", "_compile(t._kernel(state_row=t.HEAD_DIM + 8))"
    )
    # 16 state rows per thread in and out, plus 3 conv-weight rows in.
    assert text.count("ld.global.v4.b32") + text.count("ld.global.v4.f32") >= 19
    assert text.count("st.global.v4.b32") + text.count("st.global.v4.f32") >= 16
    assert "griddepcontrol.wait" in text
    # One round trip after the slot index: the state rows, conv history and
    # inputs (q, k, v, g1, g2: 14 bf16 loads) are all issued before the first
    # global store (the conv-state shift could alias them).
    first_store = text.index("st.global")
    before = text[:first_store]
    assert before.count("ld.global.v4") >= 19
    assert before.count("ld.global.b16") + before.count("ld.global.u16") >= 14
    assert ".local" not in text, "register spill / local array in the kernel"


def test_state_loads_before_wait_leave_only_inputs_after_it(tmp_path):
    """state_loads_before_wait: the slot index, the 16 state rows and the conv
    history (9 bf16 loads) are issued before griddepcontrol.wait; the inputs
    (q, k, v, g1, g2) after it."""
    text = compiled_ptx(tmp_path, "test_kda_compile", "_compile(t._kernel(state_early=True))")
    wait = text.index("griddepcontrol.wait")
    before, after = text[:wait], text[wait:]
    assert before.count("ld.global.v4.b32") + before.count("ld.global.v4.f32") >= 19
    assert before.count("ld.global.b16") + before.count("ld.global.u16") >= 9
    assert after.count("ld.global.b16") + after.count("ld.global.u16") >= 5
    assert "st.global" not in before


def test_low_rank_gate_weights_are_copied_before_the_wait(tmp_path):
    """low_rank_gates: the head's f_b and g_b rows (2 x 128 x 16 vectors of 16
    bytes over 256 threads: 16 cp.async per thread) are issued before
    griddepcontrol.wait, with the state loads; no spills."""
    text = compiled_ptx(
        tmp_path, "test_kda_compile",
        "_compile(t._kernel(state_early=True, low_rank=True, qkv_pitch=12576))",
    )  # fmt: skip
    wait = text.index("griddepcontrol.wait")
    before, after = text[:wait], text[wait:]
    copies = before.count("cp.async.ca.shared.global") + before.count("cp.async.cg.shared.global")
    assert copies == 16
    assert "cp.async.commit_group" in before
    assert "cp.async.wait_group" in after
    assert before.count("ld.global.v4.b32") + before.count("ld.global.v4.f32") >= 19
    # q, k, v and the two low-rank inputs after the wait; no full-width g1/g2.
    assert after.count("ld.global.b16") + after.count("ld.global.u16") >= 5
    assert ".local" not in text, "register spill / local array in the kernel"


def test_rejects_bad_configs():
    with pytest.raises(ValueError, match="multiples of 4"):
        _kernel(state_row=HEAD_DIM + 2)
    with pytest.raises(ValueError, match="warps must be one of"):
        _kernel(warps=4)


def _shuffles(ptx: str, kind: str) -> int:
    return sum(ln.strip().startswith(f"shfl.sync.{kind}") for ln in ptx.splitlines())


# shfl.sync.idx the kernel has besides the deltas' (the shared-memory base and the
# warp index made warp-uniform; the butterfly version had them too).
OTHER_INDEXED_SHUFFLES = 3


@pytest.mark.parametrize("warps", [8, 16])
def test_row_sums_take_a_shuffle_per_sum_and_one_per_row(tmp_path, warps):
    """The 2R row sums of a warp (R = 128 / warps rows, dot_k and dot_q) by
    recursive halving: 2R - 1 butterfly shuffles (R = 8: one more, a last
    butterfly round) where a butterfly took 5 x 2R, one to pair a row's delta
    with its dot_q, and R indexed ones that hand the deltas to every lane; plus
    the q / k norms' and k.q's three 5-round butterflies.  Nothing spills."""
    text = compiled_ptx(
        tmp_path, "test_kda_compile", f"_compile(t._kernel(state_early=True, warps={warps}))"
    )
    rows = HEAD_DIM // warps
    halving = 2 * rows - 1 + (1 if rows == 8 else 0)
    assert _shuffles(text, "bfly") == 3 * 5 + halving + 1
    assert _shuffles(text, "idx") == rows + OTHER_INDEXED_SHUFFLES
    assert ".local" not in text, "register spill / local array in the kernel"

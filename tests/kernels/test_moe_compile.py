# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile the small-batch MoE kernels for sm_90a without a GPU.

Catches CuTe DSL tracing/verification errors on CPU for each launch of the
block, both MMA widths (M-bucket <= 8 and 16), with and without the fused
residual + RMSNorm, at the Kimi-Linear-48B-A3B shape.  Skips with the reason
where nvidia-cutlass-dsl is not installed.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ptx  # noqa: E402

from kernels.moe.kernel import (  # noqa: E402
    MoeCombineKernel,
    MoeExpertKernel,
    MoeRouterKernel,
)
from kernels.moe.prepared import (  # noqa: E402
    ROUTER_MAX_STEPS,
    ROUTER_WARPS,
    MoeShape,
    router_split,
    slot_lanes_for,
)

HIDDEN, INTER, EXPERTS, TOP_K = 2304, 1024, 256, 8
SHAPE = MoeShape(HIDDEN, INTER, EXPERTS, TOP_K)


def _ptr(dtype):
    # Any 16-byte aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)


BF16, F32, I32 = _ptr(cutlass.BFloat16), _ptr(cutlass.Float32), _ptr(cutlass.Int32)
M, STREAM = cutlass.Int32(1), cuda.CUstream(0)


def _compile_router(kern):
    return cute.compile(kern, BF16, BF16, F32, F32, F32, I32, I32, F32, F32, BF16, BF16, M, STREAM)


def _router(bucket, input_norm=False):
    split, steps = router_split(HIDDEN)
    return MoeRouterKernel(
        HIDDEN, EXPERTS, TOP_K, bucket, split, ROUTER_WARPS, steps, 2.446,
        input_norm=input_norm,
    )  # fmt: skip


@pytest.mark.parametrize("bucket", [1, 16])
@pytest.mark.parametrize("input_norm", [False, True])
def test_router_compiles(bucket, input_norm):
    assert _compile_router(_router(bucket, input_norm))


@pytest.mark.parametrize("bucket", [1, 16])
def test_router_input_norm_reads_the_sums_from_l2_and_the_rows_from_smem(tmp_path, bucket):
    """The normalised rows go through shared memory (the MMAs' activation loads
    are ld.shared), the sums of squares are read with relaxed gpu-scope loads
    (they were added with atomics), and nothing spills to local memory."""
    ptx = compiled_ptx(tmp_path, "test_moe_compile", f"_compile_router(t._router({bucket}, True))")
    assert "ld.relaxed.gpu.global.b32" in ptx
    assert "ld.shared.v4" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize(
    "experts, warps",
    [(64, 2), (1024, 8)],  # 2 experts a lane (< top-k: sentinel), 32 (pruned sort)
)
def test_router_topk_compiles_for_other_lane_widths(experts, warps):
    kern = MoeRouterKernel(HIDDEN, experts, TOP_K, 1, 1, warps, 9, 2.446)
    assert _compile_router(kern)


@pytest.mark.parametrize("stage", ["gate_up", "down"])
@pytest.mark.parametrize("bucket", [1, 16])
def test_experts_compile(stage, bucket):
    kern = MoeExpertKernel(
        stage, HIDDEN, INTER, EXPERTS, TOP_K, bucket, slot_lanes_for(bucket, SHAPE), 4
    )
    out = BF16 if stage == "gate_up" else F32
    assert cute.compile(kern, BF16, BF16, BF16, I32, out, M, STREAM)


@pytest.mark.parametrize("fused", [False, True])
def test_combine_compiles(fused):
    kern = MoeCombineKernel(HIDDEN, EXPERTS, TOP_K, 16, fused)
    assert cute.compile(kern, F32, I32, F32, BF16, BF16, BF16, BF16, M, STREAM)


def test_router_split_loads_all_weights_in_one_batch():
    # Kimi-Linear: 72 K-steps over 8 warps, no split.
    assert router_split(HIDDEN) == (1, 9)
    # A longer K is split so that no warp has more than ROUTER_MAX_STEPS.
    for hidden in (2048, 4096, 7168, 8192, 16384):
        split, steps = router_split(hidden)
        total = hidden // 32
        slices = split * ROUTER_WARPS
        assert steps == -(-total // slices) <= ROUTER_MAX_STEPS
        assert steps * (slices - 1) < total


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        MoeRouterKernel(HIDDEN, 100, TOP_K, 1, 1, 4, 8, 1.0)
    with pytest.raises(ValueError, match="unknown stage"):
        MoeExpertKernel("up", HIDDEN, INTER, EXPERTS, TOP_K, 1, 9, 4)
    with pytest.raises(ValueError, match="without K work"):
        MoeExpertKernel("down", HIDDEN, 40, EXPERTS, TOP_K, 1, 9, 4)


def test_combine_reads_all_but_the_expert_rows_before_the_wait(tmp_path):
    """Routing rows and weights (2 + 2 vectors at top-8), residual and gamma
    before griddepcontrol.wait; the shared + 8 expert rows (18 vectors) after it,
    all issued before any store."""
    text = compiled_ptx(tmp_path, "test_moe_compile", "test_combine_compiles(True)")
    wait = text.index("griddepcontrol.wait")
    before, after = text[:wait], text[wait:]
    assert before.count("ld.global.v4") >= 6
    first_store = after.index("st.global")
    assert after[:first_store].count("ld.global.v4") >= 2 * (TOP_K + 1)


def test_router_topk_rounds_are_two_redux_on_the_lanes_heads(tmp_path):
    """Top-k: two redux.sync per round and, between a round's max and min, only
    the compare of the head with the max and the select of its id (the lanes
    sorted their experts first); the sort and the head shifts stay in registers."""
    text = compiled_ptx(tmp_path, "test_moe_compile", "test_router_compiles(1, False)")
    lines = [ln.strip() for ln in text.splitlines()]
    redux = [n for n, ln in enumerate(lines) if ln.startswith("redux.sync")]
    assert len(redux) == 2 * TOP_K
    for a, b in zip(redux[::2], redux[1::2]):
        assert lines[a].startswith("redux.sync.max") and lines[b].startswith("redux.sync.min")
        assert b - a <= 3
    assert "ld.local" not in text and "st.local" not in text

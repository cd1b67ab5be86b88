# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU compile checks of the L2 cache policies (sm_90a PTX, no GPU).

* ``weight_l2_policy`` of the skinny MMA loop (``SkinnyGemmKernel``, the MoE
  expert launches): None must emit the very PTX of a kernel built without the
  option; ``evict_first`` / ``evict_last`` turn every weight load, and only
  those, into a 16-byte ``ld.global.L2::cache_hint`` with CUTLASS's SM90
  policy constant.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import re  # noqa: E402

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ptx  # noqa: E402

from kernels.common.l2_policy import L2_POLICY_VALUES, l2_policy_value  # noqa: E402
from kernels.gemm.kernel import SkinnyGemmKernel  # noqa: E402
from kernels.moe.kernel import MoeExpertKernel  # noqa: E402
from kernels.moe.prepared import (  # noqa: E402
    M_BUCKETS,
    MoeShape,
    expert_l2_policy_for_bucket,
    slot_lanes_for,
)

HIDDEN, INTER, EXPERTS, TOP_K = 2304, 1024, 256, 8
SHAPE = MoeShape(HIDDEN, INTER, EXPERTS, TOP_K)
# "omitted": the constructor called without the option (today's code path).
POLICIES = ("omitted", "None", "evict_first", "evict_last")
HINTED_LOAD = "ld.global.L2::cache_hint.v4.b32"
# (N, K, m_bucket, epilogue, warps_k, split_k, unroll): o_proj's split-K
# residual_sumsq (as before a MoE), the KDA in_proj (plain, unsplit), and a
# ragged-K shape (the predicated loads).
GEMMS = {
    "o_proj": (2304, 4096, 8, "residual_sumsq", 4, 4, 8),
    "in_proj": (12576, 2304, 8, "plain", 4, 1, 8),
    "ragged": (1000, 2328, 16, "plain", 2, 1, 6),
}
EXPERT_CASES = {"gate_up-m1": ("gate_up", 1), "down-m1": ("down", 1),
                "gate_up-m16": ("gate_up", 16)}  # fmt: skip


def _ptr(dtype):
    # Any 16-byte aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)


BF16, F32, I32 = _ptr(cutlass.BFloat16), _ptr(cutlass.Float32), _ptr(cutlass.Int32)
M, STREAM = cutlass.Int32(1), cuda.CUstream(0)


def _policy_kwargs(policy: str) -> dict:
    if policy == "omitted":
        return {}
    return {"weight_l2_policy": None if policy == "None" else policy}


def gemm_kernel(name: str, policy: str) -> SkinnyGemmKernel:
    return SkinnyGemmKernel(*GEMMS[name], **_policy_kwargs(policy))


def compile_gemm(name: str, policy: str):
    kern = gemm_kernel(name, policy)
    return cute.compile(kern, BF16, BF16, BF16, BF16, BF16, BF16, F32, I32, F32, M, STREAM)


def expert_kernel(case: str, policy: str) -> MoeExpertKernel:
    stage, bucket = EXPERT_CASES[case]
    return MoeExpertKernel(
        stage, HIDDEN, INTER, EXPERTS, TOP_K, bucket, slot_lanes_for(bucket, SHAPE), 4,
        **_policy_kwargs(policy),
    )  # fmt: skip


def compile_expert(case: str, policy: str):
    kern = expert_kernel(case, policy)
    out = BF16 if EXPERT_CASES[case][0] == "gate_up" else F32
    return cute.compile(kern, BF16, BF16, BF16, I32, out, M, STREAM)


def _ptx_by_policy(tmp_path, call: str) -> dict[str, str]:
    out = {}
    for policy in POLICIES:
        (tmp_path / policy).mkdir()
        out[policy] = compiled_ptx(
            tmp_path / policy, "test_l2_policy_compile", call.format(policy=policy)
        )
    return out


def _vector_loads(ptx: str) -> int:
    return len(re.findall(r"ld\.global(?:\.L2::cache_hint)?\.v4\.b32", ptx))


def _check_policies(ptx: dict[str, str], weight_loads: int | None) -> None:
    """None is today's PTX; each policy hints ``weight_loads`` loads (every weight
    load, when the count is known), all of them 16 bytes, with its constant."""
    assert ptx["None"] == ptx["omitted"]
    assert "cache_hint" not in ptx["omitted"]
    for policy in ("evict_first", "evict_last"):
        text = ptx[policy]
        hinted = text.count(HINTED_LOAD)
        assert hinted == len(re.findall(r"L2::cache_hint", text))  # all 16-byte
        if weight_loads is None:
            assert hinted > 0
        else:
            assert hinted == weight_loads
        # Same number of 16-byte loads as the plain kernel: only the weight
        # loads changed, none was split or dropped.
        assert _vector_loads(text) == _vector_loads(ptx["omitted"])
        assert re.search(rf"mov\.b64\s+%rd\d+, {L2_POLICY_VALUES[policy]};", text)


@pytest.mark.parametrize("name", list(GEMMS))
def test_gemm_weight_policy_ptx(tmp_path, name):
    ptx = _ptx_by_policy(tmp_path, f"compile_gemm({name!r}, {{policy!r}})")
    kern = gemm_kernel(name, "omitted")
    # Unpredicated K: every warp issues two loads (row_lo, row_hi) per step,
    # all traced straight-line.
    loads = None if kern.mma.k_ragged else 2 * kern.mma.steps
    _check_policies(ptx, loads)


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_expert_weight_policy_ptx(tmp_path, case):
    ptx = _ptx_by_policy(tmp_path, f"compile_expert({case!r}, {{policy!r}})")
    _check_policies(ptx, None)


def test_weight_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown L2 cache policy"):
        gemm_kernel("in_proj", "evict_normal")
    with pytest.raises(ValueError, match="unknown L2 cache policy"):
        expert_kernel("down-m1", "last")
    assert l2_policy_value(None) is None


def test_expert_policy_stops_at_its_largest_bucket():
    """PreparedMoe compiles each M-bucket's expert launches with the policy up to
    ``expert_weight_l2_policy_max_bucket`` and plain loads above it."""
    got = {b: expert_l2_policy_for_bucket(b, "evict_first", 4) for b in M_BUCKETS}
    assert got == {1: "evict_first", 2: "evict_first", 4: "evict_first", 8: None, 16: None}
    assert {expert_l2_policy_for_bucket(b, "evict_last", None) for b in M_BUCKETS} == {"evict_last"}
    assert {expert_l2_policy_for_bucket(b, None, 16) for b in M_BUCKETS} == {None}

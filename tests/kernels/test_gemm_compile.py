# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile the skinny GEMM for sm_90a without a GPU (catches CuTe DSL errors on CPU).

CuTe DSL lowers to PTX and a cubin on a machine with no GPU when the target is
named (CUTE_DSL_ARCH); this checks that every epilogue, both M-buckets, the
split-K (through a thread-block cluster, the default, and through the global
workspace and tickets) and the ragged-K paths still trace, verify and compile.
Runs wherever nvidia-cutlass-dsl is installed; skips with the reason otherwise.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ptx  # noqa: E402
from sass import compile_sass, needs_sass_tools  # noqa: E402

from kernels.gemm.kernel import (  # noqa: E402
    MAX_CLUSTER_SPLIT_K,
    RowGroups,
    SkinnyGemmKernel,
    StagedSkinnyGemmKernel,
    stage_row_pitch,
    uses_cluster_split_k,
)
from kernels.gemm.prepared import launch_bounds_by_bucket  # noqa: E402


def _ptr(dtype):
    # Any 16-byte aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)


# (N, K, m_bucket, epilogue, warps_k, split_k, unroll, out_cols, norm_by_every_tile,
#  cluster_split_k); a split of 2..8 goes through the cluster unless the last is False.
VARIANTS = [
    (2304, 4096, 8, "plain", 4, 4, 8, None, False, True),  # grid split-K
    (2304, 1024, 16, "residual_rmsnorm", 4, 1, 6, None, False, True),  # last-tile norm
    (576, 2304, 16, "residual_rmsnorm", 4, 6, 6, None, False, True),  # split-K + grid ticket
    (2304, 4096, 8, "residual_rmsnorm", 4, 4, 8, None, True, True),  # split-K + barrier
    (2304, 4096, 16, "residual_sumsq", 4, 4, 6, None, False, True),  # split-K, sums only
    (2304, 1024, 8, "residual_sumsq", 4, 1, 8, None, False, True),  # sums only
    (2008, 1024, 16, "residual_rmsnorm", 4, 1, 6, None, True, True),  # ragged N + barrier
    (2016, 2312, 8, "silu_mul", 4, 2, 8, 1004, False, True),  # ragged K, padded I
    (1000, 2328, 16, "plain", 2, 1, 6, None, False, True),  # ragged N and K
    # The global workspace and per-tile tickets (the fallback of larger splits).
    (2304, 4096, 8, "plain", 4, 4, 8, None, False, False),
    (576, 2304, 16, "residual_rmsnorm", 4, 6, 6, None, False, False),
    (2304, 4096, 8, "residual_rmsnorm", 4, 4, 8, None, True, False),
    (2304, 4096, 16, "residual_sumsq", 4, 4, 6, None, False, False),
    (2016, 2312, 8, "silu_mul", 4, 2, 8, 1004, False, False),
    (576, 2304, 8, "plain", 2, 12, 8, None, False, True),  # split 12 > 8: tickets
]


def _barrier_kernel(polls: int):
    return SkinnyGemmKernel(
        2304, 4096, 8, "residual_rmsnorm", 4, 4, 8,
        norm_by_every_tile=True, barrier_max_polls=polls,
    )  # fmt: skip


def test_barrier_polls_with_a_pause_and_times_out_with_one_cas(tmp_path):
    """The waiting tiles poll the epoch word with acquire loads and a pause, give
    up with one compare-and-swap, and the last arrival opens it with an exchange
    whose old value tells it whether to normalise every row."""
    ptx = compiled_ptx(tmp_path, "test_gemm_compile", "_compile(t._barrier_kernel(5))")
    assert "nanosleep.u32" in ptx and "ld.acquire.gpu" in ptx
    assert ptx.count("atom.global.acq_rel.cas.b32") == 1
    assert ptx.count("atom.global.acq_rel.exch.b32") == 1


# The plain epilogue split 4 ways, as o_proj (2304 x 4096) at M <= 8.
PLAIN_SPLIT = (2304, 4096, 8, "plain", 4, 4, 8, None, False)


def _plain_split_kernel(cluster: bool):
    return _variant_kernel(PLAIN_SPLIT + (cluster,))


def test_cluster_split_k_reduces_in_distributed_shared_memory(tmp_path):
    """The cluster path maps the leader's shared memory (mapa), stores the
    partials there (st.shared::cluster), passes the existence barrier (relaxed)
    and the publishing one (release/acquire), and touches no global workspace:
    no atomic and no GPU-scope fence, which the ticket path has."""
    (tmp_path / "cluster").mkdir()
    (tmp_path / "ticket").mkdir()
    cluster = compiled_ptx(
        tmp_path / "cluster", "test_gemm_compile", "_compile(t._plain_split_kernel(True))"
    )
    assert "mapa.shared::cluster" in cluster
    assert "st.shared::cluster" in cluster
    assert cluster.count("barrier.cluster.arrive.relaxed;") == 1
    assert cluster.count("barrier.cluster.arrive;") == 1
    assert cluster.count("barrier.cluster.wait;") == 2
    for absent in ("atom.global", "fence.acq_rel.gpu", "membar"):
        assert absent not in cluster, absent
    # The same assertions fail on the ticket path: they test the reduction.
    ticket = compiled_ptx(
        tmp_path / "ticket", "test_gemm_compile", "_compile(t._plain_split_kernel(False))"
    )
    assert "atom.global.acq_rel.add.u32" in ticket and "fence.acq_rel.gpu" in ticket
    for absent in ("barrier.cluster", "mapa", "shared::cluster"):
        assert absent not in ticket, absent


def test_cluster_split_k_only_for_portable_cluster_sizes():
    assert not uses_cluster_split_k(1, True)
    assert all(uses_cluster_split_k(s, True) for s in range(2, MAX_CLUSTER_SPLIT_K + 1))
    assert not uses_cluster_split_k(MAX_CLUSTER_SPLIT_K + 1, True)
    assert not uses_cluster_split_k(4, False)
    kern = _plain_split_kernel(True)
    assert kern.cluster_shape == [1, 4, 1]
    assert _plain_split_kernel(False).cluster_shape is None


def _variant_id(v):
    split = ""
    if v[5] > 1:
        split = f"-split{v[5]}-" + ("cluster" if uses_cluster_split_k(v[5], v[9]) else "ticket")
    return f"{v[0]}x{v[1]}-m{v[2]}-{v[3]}" + ("-barrier" if v[8] else "") + split


def _variant_kernel(variant):
    n, k, bucket, epilogue, warps_k, split_k, unroll, out_cols, barrier, cluster = variant
    return SkinnyGemmKernel(
        n, k, bucket, epilogue, warps_k, split_k, unroll, out_cols=out_cols,
        norm_by_every_tile=barrier, cluster_split_k=cluster,
    )  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_compiles_for_sm90a(variant):
    kern = _variant_kernel(variant)
    assert kern.cluster_split_k == uses_cluster_split_k(variant[5], variant[9])
    assert _compile(kern) is not None


def _compile(kern):
    bf16 = _ptr(cutlass.BFloat16)
    return cute.compile(
        kern, bf16, bf16, bf16, bf16, bf16, bf16,
        _ptr(cutlass.Float32), _ptr(cutlass.Int32), _ptr(cutlass.Float32),
        cutlass.Int32(1), cuda.CUstream(0),
    )  # fmt: skip


# MLA's absorptions as row groups (32 heads): W_UV (R = V = 128 rows of each
# head's 256-row block of kv_b_proj, K = L = 512, x = attention output rows) and
# W_UK (R = L = 512, K = P = 128, x = the q_nope slices of the q_proj rows).
GROUPED = {
    "w_uv": (RowGroups(32, 128, 256, 32 * 512, 512), 512, 4, 1),
    "w_uk": (RowGroups(32, 512, 512, 6720, 192), 128, 2, 1),
    "w_uv_split_k": (RowGroups(32, 128, 256, 32 * 512, 512), 512, 2, 2),
}


@pytest.mark.parametrize("name", list(GROUPED))
@pytest.mark.parametrize("bucket", [8, 16])
def test_row_groups_compile_for_sm90a(name, bucket):
    groups, k, warps_k, split_k = GROUPED[name]
    n = groups.groups * groups.rows
    kern = SkinnyGemmKernel(n, k, bucket, "plain", warps_k, split_k, 6, row_groups=groups)
    assert _compile(kern) is not None


def test_row_groups_reject_bad_configs():
    with pytest.raises(ValueError, match="plain epilogue only"):
        SkinnyGemmKernel(
            4096, 512, 8, "residual_rmsnorm", 4, 1, 8,
            row_groups=RowGroups(32, 128, 256, 16384, 512),
        )  # fmt: skip
    with pytest.raises(ValueError, match="R % 16"):
        SkinnyGemmKernel(
            32 * 120, 512, 8, "plain", 4, 1, 8, row_groups=RowGroups(32, 120, 256, 16384, 512)
        )
    with pytest.raises(ValueError, match="overlap"):
        SkinnyGemmKernel(
            4096, 512, 8, "plain", 4, 1, 8, row_groups=RowGroups(32, 128, 64, 16384, 512)
        )
    with pytest.raises(ValueError, match="multiples of 8"):
        SkinnyGemmKernel(
            4096, 512, 8, "plain", 4, 1, 8, row_groups=RowGroups(32, 128, 256, 16384, 500)
        )


def test_rejects_configs_that_leave_warps_idle():
    with pytest.raises(ValueError, match="without K work"):
        SkinnyGemmKernel(576, 128, 8, "plain", 8, 2, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        SkinnyGemmKernel(576, 100, 8, "plain", 1, 1, 8)
    with pytest.raises(ValueError, match="unknown epilogue"):
        SkinnyGemmKernel(576, 128, 8, "gelu", 1, 1, 8)


def _in_proj_kernel(prewait_steps, min_ctas_per_sm=None):
    """The KDA in_proj (12576 x 2304, 4 warps, 18 K-steps a warp, unroll 8)."""
    return SkinnyGemmKernel(
        12576, 2304, 8, "plain", 4, 1, 8, prewait_steps=prewait_steps,
        min_ctas_per_sm=min_ctas_per_sm,
    )  # fmt: skip


@pytest.mark.parametrize(("prewait_steps", "loads"), [(None, 16), (0, 0), (3, 6), (6, 12)])
def test_prewait_steps_set_the_weight_loads_before_the_pdl_wait(tmp_path, prewait_steps, loads):
    """A warp issues two 16-byte weight loads per K-step (its tile's two 8-row
    halves) before griddepcontrol.wait: ``unroll`` steps by default, else
    ``prewait_steps``; all 18 steps' loads in every case."""
    ptx = compiled_ptx(
        tmp_path, "test_gemm_compile", f"_compile(t._in_proj_kernel({prewait_steps}))"
    )
    before, wait, after = ptx.partition("griddepcontrol.wait;")
    assert wait
    assert before.count("ld.global.v4") == loads
    # 36 weight loads and 18 activation loads in all.
    assert before.count("ld.global.v4") + after.count("ld.global.v4") == 54


def _in_proj_ptx(tmp_path, min_ctas_per_sm):
    (tmp_path / str(min_ctas_per_sm)).mkdir()
    call = f"_compile(t._in_proj_kernel(3, {min_ctas_per_sm}))"
    return compiled_ptx(tmp_path / str(min_ctas_per_sm), "test_gemm_compile", call)


def test_launch_bounds_add_the_directive_not_loads_or_mmas(tmp_path):
    """``min_ctas_per_sm=6`` (the KDA in_proj's 786 CTAs on 132 SMs): the PTX
    promises 6 CTAs an SM and keeps its loads and MMAs."""
    plain, bounded = (_in_proj_ptx(tmp_path, ctas) for ctas in (None, 6))
    assert ".minnctapersm" not in plain
    assert bounded.count(".minnctapersm 6") == 1
    for op in ("ld.global.v4", "mma.sync", "st.global"):
        assert bounded.count(op) == plain.count(op), op


@needs_sass_tools
def test_launch_bounds_keep_more_weight_loads_ahead_of_the_first_mma(tmp_path):
    """The KDA in_proj (3 pre-wait K-steps): without bounds ptxas 13.5 keeps 42
    registers and one load after the wait ahead of the first MMA (7 in all);
    promised 6 CTAs an SM it may use 85 and keeps more ahead, spilling nothing."""
    plain, bounded = (
        compile_sass(tmp_path, _in_proj_ptx(tmp_path, ctas), str(ctas)) for ctas in (None, 6)
    )
    assert bounded.registers <= 65536 // (6 * 128) and bounded.spill_bytes == 0
    ahead = [sass.loads_before_first_mma() for sass in (plain, bounded)]
    assert ahead[1] > ahead[0], ahead


def test_launch_bounds_by_m_bucket():
    """PreparedGemm's ``min_ctas_per_sm``: one bound for every M-bucket, or
    some buckets' own (the executor's: {16: 4}); a bucket the GEMM has not is
    refused."""
    assert launch_bounds_by_bucket(None, (8, 16)) == {}
    assert launch_bounds_by_bucket(4, (16, 8)) == {8: 4, 16: 4}
    assert launch_bounds_by_bucket({16: 4}, (8, 16)) == {16: 4}
    assert launch_bounds_by_bucket({}, (8, 16)) == {}
    with pytest.raises(ValueError, match=r"names M-buckets \[4\]; the GEMM's are \[8, 16\]"):
        launch_bounds_by_bucket({4: 4, 16: 4}, (8, 16))


@pytest.mark.parametrize("ctas", [0, 17])
def test_launch_bounds_beyond_an_sm_are_refused(ctas):
    with pytest.raises(ValueError, match=f"min_ctas_per_sm={ctas} outside 1..16"):
        _in_proj_kernel(3, ctas)


def test_prewait_steps_outside_the_warps_k_range_are_refused():
    with pytest.raises(ValueError, match="prewait_steps=19 outside 0..18"):
        _in_proj_kernel(19)


def _staged_in_proj(m_bucket=8, stages=4, epilogue="plain", n=12576, k=2304, ctas=None):
    """The KDA in_proj through 8-row shared-memory stages: 8 warps of 9 K-steps,
    one CTA on each of 132 SMs."""
    return StagedSkinnyGemmKernel(n, k, m_bucket, epilogue, 8, 3, stages, 132, min_ctas_per_sm=ctas)


@pytest.mark.parametrize("m_bucket", [8, 16])
def test_staged_stream_fills_the_ring_before_the_wait(tmp_path, m_bucket):
    """Before griddepcontrol.wait: the 4 stages armed on their mbarriers and
    their 8 row copies each in flight, no other global load. After it, per
    tile the stage waits, 16-byte shared reads and MMAs; a stage is refilled
    only after the warps' reduction barrier and a proxy fence. The activations
    (9 K-steps x the bucket's 8-token halves): at 8 tokens loaded once, ahead
    of the tile loop; at 16 in the tile loop, each batch's ahead of its shared
    reads."""
    ptx = compiled_ptx(tmp_path, "test_gemm_compile", f"_compile(t._staged_in_proj({m_bucket}))")
    body = ptx[ptx.index(".entry") :]
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    before, _, after = body.partition("griddepcontrol.wait;")
    assert before.count("mbarrier.arrive.expect_tx") == 4
    assert before.count(bulk) == 4 * 8
    assert before.index("fence.mbarrier_init") < before.index(bulk)
    assert "ld.global" not in before
    assert after.count("ld.global.v4") == 9 * (m_bucket // 8)
    stage_wait = after.index("mbarrier.try_wait.parity")
    reads = after.index("ld.shared.v4", stage_wait)
    assert stage_wait < reads < after.index("mma.sync", reads)
    if m_bucket == 8:
        assert after.index("ld.global.v4") < stage_wait
    else:
        # The first batch's 3 K-steps x 2 halves, then its shared reads.
        assert stage_wait < after.index("ld.global.v4") < reads
        assert after[stage_wait:reads].count("ld.global.v4") == 3 * 2
    fence = after.index("fence.proxy.async.shared::cta")
    assert reads < after.rindex("bar.sync", 0, fence) < fence < after.index(bulk, fence)
    # Two refill sites (the tile's two stages) of 8 row copies each.
    assert after.count(bulk) == 2 * 8


@needs_sass_tools
@pytest.mark.parametrize("m_bucket", [8, 16])
def test_staged_stream_leaves_room_for_the_next_kernel(tmp_path, m_bucket):
    """No spills, and few enough registers that a KDA step CTA (256 threads
    x 128 registers) fits beside the staged CTA's 256 threads: at 8 tokens
    with 36 registers of held activations, at 16 re-reading them (held, both
    halves took 137 registers)."""
    ptx = compiled_ptx(tmp_path, "test_gemm_compile", f"_compile(t._staged_in_proj({m_bucket}))")
    sass = compile_sass(tmp_path, ptx, f"staged{m_bucket}")
    assert sass.spill_bytes == 0
    assert sass.registers * 256 + 128 * 256 <= 64 * 1024, sass.registers


def test_stage_rows_sit_64_bytes_apart_modulo_128():
    for k in (128, 1024, 2304, 2312, 2328, 4096, 9216):
        pitch = stage_row_pitch(k)
        assert k <= pitch < k + 64 and (2 * pitch) % 128 == 64, k


def test_staged_stream_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="supports the .* epilogues, got 'residual_sumsq'"):
        _staged_in_proj(epilogue="residual_sumsq")
    with pytest.raises(ValueError, match="a tile needs 2 stages"):
        _staged_in_proj(stages=1)
    with pytest.raises(ValueError, match="bytes of shared memory a CTA"):
        _staged_in_proj(stages=4, k=4096)
    assert _staged_in_proj(stages=3, k=4096).smem_bytes <= 227 * 1024

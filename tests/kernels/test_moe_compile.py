# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile the small-batch MoE kernels for sm_90a without a GPU.

Catches CuTe DSL tracing/verification errors on CPU for each launch of the
block, both MMA widths (M-bucket <= 8 and 16), with and without the fused
residual + RMSNorm, the router's logits through a thread-block cluster and
through global memory and a ticket, at the Kimi-Linear-48B-A3B shape.  Skips
with the reason where nvidia-cutlass-dsl is not installed.
"""

import collections
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ir, compiled_ptx  # noqa: E402
from sass import compile_sass, needs_sass_tools  # noqa: E402

from kernels.moe.kernel import (  # noqa: E402
    MAX_CLUSTER_TILES,
    MAX_PORTABLE_CLUSTER,
    MoeCombineKernel,
    MoeDownAfterEarlySharedKernel,
    MoeExpertKernel,
    MoeGateUpEarlySharedDownKernel,
    MoeRouterKernel,
    uses_cluster_logits,
    uses_warp_table,
)
from kernels.moe.prepared import (  # noqa: E402
    M_BUCKETS,
    ROUTER_MAX_STEPS,
    ROUTER_WARPS,
    MoeConfig,
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


# The router's two ways of gathering the tiles' logits (MoeRouterKernel's
# cluster_logits): tile 0's shared memory through a cluster, or global memory
# and an atomic ticket.
PATHS = {"cluster": True, "ticket": False}
# SM90's shared memory per CTA with the opt-in (227 KiB), and what the router
# may take of it: the rest stays free for the CTAs of the kernel it overlaps
# under PDL (o_proj's take a few KiB each).
SM90_MAX_SMEM_PER_CTA = 227 * 1024
ROUTER_SMEM_BUDGET = 128 * 1024


def _router(bucket, input_norm=False, path="cluster", warp_table=False):
    split, steps = router_split(HIDDEN)
    return MoeRouterKernel(
        HIDDEN, EXPERTS, TOP_K, bucket, split, ROUTER_WARPS, steps, 2.446,
        input_norm=input_norm, cluster_logits=PATHS[path], warp_table=warp_table,
    )  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bucket", [1, 16])
@pytest.mark.parametrize("input_norm", [False, True])
def test_router_compiles(bucket, input_norm, path):
    kern = _router(bucket, input_norm, path)
    assert kern.cluster_logits == PATHS[path]
    assert _compile_router(kern)


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
    # 4 tiles: one cluster; 64 tiles: more than a cluster holds, the ticket.
    assert kern.cluster_shape == ([experts // 16, 1, 1] if experts <= 256 else None)
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
    text = compiled_ptx(tmp_path, "test_moe_compile", "test_router_compiles(1, False, 'cluster')")
    lines = [ln.strip() for ln in text.splitlines()]
    redux = [n for n, ln in enumerate(lines) if ln.startswith("redux.sync")]
    assert len(redux) == 2 * TOP_K
    for a, b in zip(redux[::2], redux[1::2]):
        assert lines[a].startswith("redux.sync.max") and lines[b].startswith("redux.sync.min")
        assert b - a <= 3
    assert "ld.local" not in text and "st.local" not in text


def _router_ptx(tmp_path, bucket, input_norm, path):
    out = tmp_path / path
    out.mkdir()
    call = f"_compile_router(t._router({bucket}, {input_norm}, {path!r}))"
    return compiled_ptx(out, "test_moe_compile", call)


def _count(ptx: str, prefix: str) -> int:
    """Instructions of ``ptx`` that start with ``prefix``."""
    return sum(ln.strip().startswith(prefix) for ln in ptx.splitlines())


@pytest.mark.parametrize("bucket, input_norm", [(1, False), (16, True)])
def test_router_cluster_gathers_the_logits_in_distributed_shared_memory(
    tmp_path, bucket, input_norm
):
    """The cluster path maps tile 0's shared memory (mapa), stores the logits
    there (st.shared::cluster), passes the existence barrier (relaxed) and the
    publishing one (release / acquire), and has exactly the logits ticket
    fewer: one atom.global (the ticket's add) and two fence.acq_rel.gpu (its
    release and the router's acquire) less than the ticket path, whose PTX has
    none of the cluster instructions.  The logits are still read as 16-byte
    vectors (from shared instead of global memory), the griddepcontrol calls
    keep their place, and nothing spills."""
    cluster = _router_ptx(tmp_path, bucket, input_norm, "cluster")
    ticket = _router_ptx(tmp_path, bucket, input_norm, "ticket")
    assert "mapa.shared::cluster" in cluster
    assert "st.shared::cluster" in cluster
    assert _count(cluster, "barrier.cluster.arrive.relaxed;") == 1
    assert _count(cluster, "barrier.cluster.arrive;") == 1
    assert _count(cluster, "barrier.cluster.wait;") == 2
    assert _count(ticket, "atom.global.acq_rel.add") == 1
    assert _count(cluster, "atom.global") == _count(ticket, "atom.global") - 1
    assert _count(cluster, "fence.acq_rel.gpu") == _count(ticket, "fence.acq_rel.gpu") - 2
    assert "fence" not in cluster and "membar" not in cluster
    # E / 32 = 8 logits per lane: two 16-byte vectors, from smem now.
    assert _count(cluster, "ld.shared.v4") == _count(ticket, "ld.shared.v4") + 2
    assert _count(cluster, "ld.global.v4") == _count(ticket, "ld.global.v4") - 2
    for ptx in (cluster, ticket):
        assert _count(ptx, "griddepcontrol.launch_dependents;") == 1
        assert _count(ptx, "griddepcontrol.wait;") == 1
        assert "ld.local" not in ptx and "st.local" not in ptx
    # Launch-dependents first, then the relaxed arrive, the GEMV's wait, and
    # the first cluster wait only after it.
    order = [
        cluster.index(s)
        for s in (
            "griddepcontrol.launch_dependents;",
            "barrier.cluster.arrive.relaxed;",
            "griddepcontrol.wait;",
            "barrier.cluster.wait;",
        )
    ]
    assert order == sorted(order)
    # The same assertions fail on the ticket path: they test the gathering.
    for absent in ("barrier.cluster", "mapa", "shared::cluster"):
        assert absent not in ticket, absent


def test_router_cluster_of_16_ctas_is_allowed_non_portable(tmp_path):
    """16 CTAs is beyond SM90's portable cluster size (8): the launch asks for
    a (16, 1, 1) cluster and CuTe DSL marks the kernel with the
    non-portable-cluster-size attribute (its ``cu_attrs``; its loader also sets
    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED on every kernel)."""
    ir = compiled_ir(tmp_path, "test_moe_compile", "_compile_router(t._router(16, True))")
    assert EXPERTS // 16 == MAX_CLUSTER_TILES > MAX_PORTABLE_CLUSTER
    assert "non_portable_cluster_size_allowed = 1" in ir
    assert "cuda.launch_cfg.cluster_dim[%2] (%c16_i32, %c1_i32, %c1_i32)" in ir
    assert "programmatic_stream_serialization_allowed[%2] %c1_i32" in ir


def test_router_cluster_only_for_one_cluster_of_unsplit_tiles():
    assert uses_cluster_logits(16, 1, True)
    assert uses_cluster_logits(2, 1, True)
    assert not uses_cluster_logits(16, 1, False)
    assert not uses_cluster_logits(16, 2, True)  # split K: the per-tile tickets
    assert not uses_cluster_logits(1, 1, True)
    assert not uses_cluster_logits(MAX_CLUSTER_TILES + 1, 1, True)
    assert _router(1).cluster_shape == [16, 1, 1]
    assert _router(1, path="ticket").cluster_shape is None


@pytest.mark.parametrize("input_norm", [False, True])
def test_router_cluster_shared_memory_fits(input_norm):
    """The cluster path adds the logits [m_bucket, E] FP32 to each CTA's shared
    memory (16 KiB at M-bucket 16) and stays well inside SM90's 227 KiB
    (largest: 116.4 KiB, input_norm at M-bucket 16)."""
    for bucket in M_BUCKETS:
        cluster = _router(bucket, input_norm)._smem_bytes()
        ticket = _router(bucket, input_norm, "ticket")._smem_bytes()
        assert cluster == ticket + 4 * bucket * EXPERTS
        assert cluster <= ROUTER_SMEM_BUDGET < SM90_MAX_SMEM_PER_CTA


def test_the_warp_table_is_for_one_token_only():
    assert uses_warp_table(1, True)
    assert not uses_warp_table(1, False)
    assert not any(uses_warp_table(bucket, True) for bucket in M_BUCKETS if bucket > 1)
    assert _router(2, warp_table=True).warp_table is False


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("input_norm", [False, True])
def test_router_warp_table_compiles(input_norm, path):
    kern = _router(1, input_norm, path, warp_table=True)
    assert kern.warp_table
    assert _compile_router(kern)


@pytest.mark.parametrize("path", list(PATHS))
def test_router_warp_table_drops_the_cta_wide_pass(tmp_path, path):
    """With the warp table the routing tile has four CTA barriers fewer (after
    the masks' zeroing, the choices, the warps' prefix totals and the slots), no
    shared-memory atomics (the expert masks) and no shfl.up (the prefix sums);
    the top-k rounds are unchanged and nothing spills."""
    cta = tmp_path / "cta"
    warp = tmp_path / "warp"
    cta.mkdir()
    warp.mkdir()
    base = compiled_ptx(cta, "test_moe_compile", f"_compile_router(t._router(1, True, {path!r}))")
    call = f"_compile_router(t._router(1, True, {path!r}, warp_table=True))"
    fast = compiled_ptx(warp, "test_moe_compile", call)
    assert _count(base, "bar.sync") - _count(fast, "bar.sync") == 4
    assert _count(base, "atom.shared") > 0 and _count(fast, "atom.shared") == 0
    assert _count(base, "shfl.sync.up") > 0 and _count(fast, "shfl.sync.up") == 0
    assert _count(fast, "redux.sync") == _count(base, "redux.sync") == 2 * TOP_K
    assert "ld.local" not in fast and "st.local" not in fast


def _expert_kernel(stage, prewait_steps, warps=None, max_registers=None):
    """The decode's M-bucket-1 expert launch (gate_up 8 warps, down 4 unless
    ``warps``) with the executor's evict_first weight loads."""
    warps = warps or (8 if stage == "gate_up" else 4)
    kern = MoeExpertKernel(
        stage, HIDDEN, INTER, EXPERTS, TOP_K, 1, slot_lanes_for(1, SHAPE), warps, True,
        "evict_first", prewait_steps, max_registers,
    )  # fmt: skip
    out = BF16 if stage == "gate_up" else F32
    return cute.compile(kern, BF16, BF16, BF16, I32, out, M, STREAM)


@pytest.mark.parametrize("stage", ["gate_up", "down"])
@pytest.mark.parametrize(("prewait_steps", "loads"), [(None, 16), (6, 12), (4, 8), (0, 0)])
def test_expert_prewait_steps_set_the_loads_before_the_pdl_wait(
    tmp_path, stage, prewait_steps, loads
):
    """The unit that loads before the wait (gate_up's shared expert, every down
    unit) issues two 16-byte weight loads per K-step of its first batch there:
    ``unroll`` = 8 steps by default, else ``prewait_steps``."""
    ptx = compiled_ptx(tmp_path, "test_moe_compile", f"_expert_kernel({stage!r}, {prewait_steps})")
    before, wait, _ = ptx.partition("griddepcontrol.wait;")
    assert wait
    assert len(re.findall(r"ld\.global\S*\.v4", before)) == loads


def test_more_prewait_steps_than_a_warp_has_load_them_all_before_the_wait(tmp_path):
    """An 8-warp down has 4 K-steps a warp: the executor's 6 (meant for the 4-warp
    down's 8) compiles to the default's PTX, all 4 steps before the wait."""
    ptx = {}
    for steps in (None, 6):
        (tmp_path / str(steps)).mkdir()
        call = f"_expert_kernel('down', {steps}, 8)"
        ptx[steps] = compiled_ptx(tmp_path / str(steps), "test_moe_compile", call)
    assert ptx[6] == ptx[None]
    before, wait, _ = ptx[6].partition("griddepcontrol.wait;")
    assert wait and len(re.findall(r"ld\.global\S*\.v4", before)) == 8


def _early_shared_down(stage, bucket=1):
    """The early shared down's pair at an M-bucket as the executor would take it
    (gate_up 8 warps and down 4 at bucket 1 with evict_first loads, else 4 + 4)."""
    lanes = slot_lanes_for(bucket, SHAPE)
    gate_up_warps, policy = (8, "evict_first") if bucket == 1 else (4, None)
    if stage == "gate_up":
        kern = MoeGateUpEarlySharedDownKernel(
            HIDDEN, INTER, EXPERTS, TOP_K, bucket, lanes, gate_up_warps, 4, True, policy
        )
        return cute.compile(kern, BF16, BF16, BF16, I32, BF16, BF16, F32, I32, M, STREAM)
    kern = MoeDownAfterEarlySharedKernel(
        HIDDEN, INTER, EXPERTS, TOP_K, bucket, lanes, 4, True, policy, 6
    )
    return cute.compile(kern, BF16, BF16, BF16, I32, F32, I32, M, STREAM)


@pytest.mark.parametrize("stage", ["gate_up", "down"])
@pytest.mark.parametrize("bucket", [1, 2, 8])
def test_early_shared_down_compiles(stage, bucket):
    assert _early_shared_down(stage, bucket)


def test_early_shared_down_is_for_one_mma_column_and_the_down_warps_within():
    lanes = slot_lanes_for(16, SHAPE)
    with pytest.raises(ValueError, match="up to 8 tokens"):
        MoeGateUpEarlySharedDownKernel(HIDDEN, INTER, EXPERTS, TOP_K, 16, lanes, 4, 4)
    with pytest.raises(ValueError, match="up to 8 tokens"):
        MoeDownAfterEarlySharedKernel(HIDDEN, INTER, EXPERTS, TOP_K, 16, lanes, 4)
    with pytest.raises(ValueError, match="among gate_up's"):
        MoeGateUpEarlySharedDownKernel(HIDDEN, INTER, EXPERTS, TOP_K, 1, lanes, 4, 8)


def test_early_shared_down_stages_its_weights_before_the_wait_and_polls_after(tmp_path):
    """gate_up: the shared down's 16 rows go to shared memory by cp.async before
    the PDL wait (8 of 16 bytes per thread at 8 warps, beside the shared gate_up's
    first batch); after the shared unit one release-acquire count per CTA, then
    the acquire polls; no local memory."""
    ptx = compiled_ptx(tmp_path, "test_moe_compile", "_early_shared_down('gate_up')")
    before, wait, after = ptx.partition("griddepcontrol.wait;")
    assert wait
    assert _count(before, "cp.async.ca.shared.global") == 8
    assert len(re.findall(r"ld\.global\S*\.v4", before)) == 16  # the shared gate_up's
    published, count, polls = after.partition("atom.global.acq_rel.add.u32")
    assert count and "fence.acq_rel.gpu;" in published
    assert _count(polls, "ld.acquire.gpu.global.b32") == 2  # the first read, the loop's
    assert "nanosleep.u32" in polls
    assert "ld.shared.v4" in polls  # the staged weights
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_down_after_the_early_shared_down_reads_the_tiles_flag_after_the_wait(tmp_path):
    """down: lane 0 reads its tile's flag after the wait (GPU scope, so not a
    stale line) and computes the shared tile only where gate_up left it."""
    ptx = compiled_ptx(tmp_path, "test_moe_compile", "_early_shared_down('down')")
    assert _count(ptx, "griddepcontrol.launch_dependents;") == 1
    before, wait, after = ptx.partition("griddepcontrol.wait;")
    assert wait and "ld.relaxed.gpu.global.b32" in after  # the tile's flag
    assert "ld.local" not in ptx and "st.local" not in ptx


def _expert_ptx(tmp_path, stage, max_registers):
    """The PTX of the decode's M-bucket-1 expert launch (8-warp gate_up, 4-warp
    down with its executor's first batch of 6) with or without launch bounds."""
    name = f"{stage}-{max_registers}"
    (tmp_path / name).mkdir()
    prewait = None if stage == "gate_up" else 6
    call = f"_expert_kernel({stage!r}, {prewait}, max_registers={max_registers})"
    return compiled_ptx(tmp_path / name, "test_moe_compile", call)


@pytest.mark.parametrize(("stage", "ctas"), [("gate_up", 2), ("down", 4)])
def test_expert_launch_bounds_add_only_the_directive(tmp_path, stage, ctas):
    """``max_registers=128``: ``.minnctapersm`` 2 for 256 threads, 4 for 128,
    and the same loads, stores, MMAs, float arithmetic and barriers as the
    unbounded launch (NVVM folds an index computation differently: only integer
    opcodes may differ)."""
    plain = _expert_ptx(tmp_path, stage, None)
    bounded = _expert_ptx(tmp_path, stage, 128)
    assert ".minnctapersm" not in plain
    assert _count(bounded, f".minnctapersm {ctas}") == 1
    differ = _opcodes(plain) - _opcodes(bounded) | _opcodes(bounded) - _opcodes(plain)
    assert all(re.fullmatch(r"(mad|mul|add|sub|or|and|shl|shr)\.(lo\.)?[su]?(32|b32|s32|u32)", op)
               for op in differ), differ  # fmt: skip


def _opcodes(ptx: str) -> collections.Counter:
    """How many times each opcode occurs in the PTX's instructions."""
    ops = collections.Counter()
    for line in ptx.splitlines():
        line = line.strip()
        if line and not line.startswith(("//", ".", "{", "}")) and not line.endswith(":"):
            ops[line.split()[0]] += 1
    return ops


@needs_sass_tools
def test_expert_launch_bounds_keep_more_of_a_batch_ahead_of_its_first_mma(tmp_path):
    """gate_up at M-bucket 1: with 128 registers allowed, ptxas keeps more of a
    routed unit's 16 weight and 8 activation loads ahead of its first MMA than
    without bounds (SASS of the wheel's ptxas), within two CTAs an SM.  A routed
    unit loads after gate_up's dependents trigger (PREEXIT, after its wait)."""
    plain = compile_sass(tmp_path, _expert_ptx(tmp_path, "gate_up", None), "plain")
    bounded = compile_sass(tmp_path, _expert_ptx(tmp_path, "gate_up", 128), "bounded")
    assert bounded.registers <= 128
    ahead = [sass.loads_before_first_mma("PREEXIT") for sass in (plain, bounded)]
    assert ahead[1] > ahead[0], ahead


def _bucket_expert_ptx(tmp_path, stage, bucket, max_registers):
    """The PTX of the decode's 4-warp expert launch at M-bucket ``bucket`` (>= 2)."""
    name = f"{stage}-{bucket}-{max_registers}"
    (tmp_path / name).mkdir()
    call = f"_bucket_expert_kernel({stage!r}, {bucket}, {max_registers})"
    return compiled_ptx(tmp_path / name, "test_moe_compile", call)


def _bucket_expert_kernel(stage, bucket, max_registers):
    policy = "evict_first" if bucket <= 4 else None
    prewait = None if stage == "gate_up" else 6
    kern = MoeExpertKernel(
        stage, HIDDEN, INTER, EXPERTS, TOP_K, bucket, slot_lanes_for(bucket, SHAPE), 4,
        True, policy, prewait, max_registers,
    )  # fmt: skip
    out = BF16 if stage == "gate_up" else F32
    return cute.compile(kern, BF16, BF16, BF16, I32, out, M, STREAM)


@needs_sass_tools
@pytest.mark.parametrize("stage", ["gate_up", "down"])
def test_expert_launch_bounds_spill_nothing_up_to_m_bucket_8_and_do_at_16(tmp_path, stage):
    """128 registers a thread, the executor's bound at M-buckets 2-8: the 4-warp
    expert launches spill nothing there. At 16 they spill (ptxas 13.5: 48 and 36
    bytes), which is why the executor leaves bucket 16 unbounded."""
    for bucket in (2, 4, 8):
        ptx = _bucket_expert_ptx(tmp_path, stage, bucket, 128)
        assert compile_sass(tmp_path, ptx, f"{stage}-{bucket}").spill_bytes == 0, bucket
    ptx = _bucket_expert_ptx(tmp_path, stage, 16, 128)
    assert compile_sass(tmp_path, ptx, "16").spill_bytes > 0


def test_expert_launch_bounds_must_leave_a_cta_room():
    with pytest.raises(ValueError, match="max_registers=300 leaves no 256-thread"):
        MoeExpertKernel("gate_up", HIDDEN, INTER, EXPERTS, TOP_K, 1, 9, 8, max_registers=300)


def test_expert_launch_bounds_apply_to_their_m_buckets_only():
    config = MoeConfig(
        expert_max_registers=128, expert_registers_min_bucket=2, expert_registers_max_bucket=8
    )
    assert [config.expert_registers(b) for b in M_BUCKETS] == [None, 128, 128, 128, None]
    assert [MoeConfig(expert_max_registers=96).expert_registers(b) for b in M_BUCKETS] == [96] * 5
    assert [MoeConfig().expert_registers(b) for b in M_BUCKETS] == [None] * 5

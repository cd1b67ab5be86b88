# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Skinny bf16 GEMM for decode on SM90: ``y[M, N] = x[M, K] @ W[N, K]^T``, M <= 16.

The main loop (``common.skinny_mma``) streams W once with 16-byte loads into
``mma.sync`` fragments, the problem computed transposed (``y^T = W @ x^T``).

* A warp owns one 16-row tile and a contiguous range of K "steps" (32
  K-values: 4 lanes x 8).  Warps of a CTA split K further (``warps_k``) and
  reduce through shared memory; small-N shapes additionally split K across
  CTAs (``split_k``).  With ``cluster_split_k`` (the default for split_k <=
  MAX_CLUSTER_SPLIT_K) the split CTAs of a tile form one thread-block
  cluster: each writes its FP32 partial into the shared memory of the
  cluster's first CTA (split 0) through distributed shared memory, one
  cluster barrier publishes them (a relaxed one, arrived at the start,
  makes sure every CTA of the cluster exists before the first remote
  store), and that CTA adds them and runs the epilogue.  The partials never
  leave the GPC, so no L2 store, GPU-scope fence, atomic round trip or L2
  re-read sits on the critical path of the tile.  Otherwise (larger
  splits, or disabled) every split CTA stores its partial to a global
  workspace and takes an atomic ticket; the last one re-reads the partials
  and runs the epilogue.  Both add the partials in split order 0, 1, ...,
  so the two give bit-identical results.
* Epilogues (compile time): plain store; SiLU(gate) * up with gate and up rows
  interleaved in 8-row blocks by ``pack_gate_up`` so each lane holds the gate
  and the up value of the same output; residual add + RMSNorm, where every
  tile writes its slice of the new residual and accumulates per-token sums of
  squares.  The norm then needs every tile's squares.  With
  ``norm_by_every_tile`` each tile waits at a grid barrier (atomic ticket,
  the last arrival advances an epoch word the others poll) and normalises its
  own rows, still in registers; without it the last tile of the grid
  normalises every row, re-reading them from L2.  That never waits on
  another CTA (for grids whose tiles cannot all be resident at once) and is
  the faster of the two for 1-2 tokens, where the whole-row pass is short.
  ``residual_sumsq`` stops after the residual and the squares: the sums go to
  the consumer's buffer (``sumsq_ptr``, one FP32 per token), which reads and
  re-arms them itself.

Counters and sums of squares are reset by the CTAs that consumed them, so a
captured CUDA graph can be replayed without any host work.  A launch adds its
squares to the buffer of sums selected by the epoch's parity.  The barrier's
last arrival zeroes the other buffer (no CTA of this launch reads it) and
advances the epoch; the last-tile pass zeroes its own buffer after reading it
and leaves the epoch, so launches of the two schemes may alternate.

Grouped variant (``RowGroups``, plain epilogue): G independent products
``y[:, g*R:(g+1)*R] = x_g @ W_g^T`` in one launch, each group with its own
activation slice ``x_g = x[:, g, :]`` and its own R weight rows, both given
by strides (MLA's per-head absorptions: W_UV read in place from
``kv_b_proj.weight``, x rows of the attention output).  A 16-row tile belongs
to one group (R % 16 == 0), so only the tile's row and activation bases change.
"""

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync

from ..common.launch_bounds import launch_bounds
from ..common.rmsnorm import normalized_chunk
from ..common.skinny_mma import (
    CHUNK,
    LANES_PER_QUAD,
    MAX_TOKENS,
    ROWS_PER_TILE,
    STEP_K,
    TOKENS_PER_MMA,
    WARP_THREADS,
    WarpRowTileMma,
    ceil_div,
    new_accumulators,
)

# The last CTA of a residual+RMSNorm launch loads this many 16-byte chunks per
# thread before using any, so the whole-row pass is not one L2 round trip per
# chunk.
NORM_LOADS_IN_FLIGHT = 8
# Workspace of the residual+RMSNorm epilogue, after the split-K tickets
# (counters[tile]): the grid-wide ticket, then the barrier's epoch word on a
# 128-byte line of its own (the waiting tiles poll it; the arrivals' atomics
# on the ticket stay off that line); and the per-token sums of squares, two
# buffers of MAX_TOKENS (epoch parity).
GRID_TICKET = 0
BARRIER_EPOCH = 32
NORM_COUNTERS = BARRIER_EPOCH + 1
SUMSQ_BUFFERS = 2
# Pause between two polls of the epoch word, in ns.
BARRIER_POLL_NS = 32
# A waiting tile gives up after this many polls (~50 us; a normal wait is a few
# us): it marks the barrier abandoned and exits, and the last arrival then
# normalises every row as the last-tile scheme does.  So a grid that cannot be
# resident at once (an MPS client limited to part of the SMs, a green context)
# is slower, never hung.
BARRIER_MAX_POLLS = 64
# The epoch word: the epoch in the low bits (wrapping), plus this bit while a
# waiting tile has abandoned the barrier of the current launch.
BARRIER_ABANDONED = 1 << 30
BARRIER_EPOCH_MASK = BARRIER_ABANDONED - 1
# Split-K through a cluster: the largest cluster SM90 launches without the
# non-portable cluster size opt-in, and the rank of the CTA (split 0) that
# gathers the partials.  The cluster is [1, split_k, 1] over a grid of
# [tiles, split_k, 1], so a CTA's rank in its cluster is its split index.
MAX_CLUSTER_SPLIT_K = 8
CLUSTER_LEADER = 0

EPILOGUE_PLAIN = "plain"
EPILOGUE_SILU_MUL = "silu_mul"
EPILOGUE_RESIDUAL_RMSNORM = "residual_rmsnorm"
# The residual add alone, plus the per-token sums of squares the RMSNorm needs,
# added into a buffer the next kernel owns: that kernel normalises its own
# input (the MoE router), so no tile waits for the grid's last one.
EPILOGUE_RESIDUAL_SUMSQ = "residual_sumsq"
EPILOGUES = (
    EPILOGUE_PLAIN,
    EPILOGUE_SILU_MUL,
    EPILOGUE_RESIDUAL_RMSNORM,
    EPILOGUE_RESIDUAL_SUMSQ,
)
RESIDUAL_EPILOGUES = (EPILOGUE_RESIDUAL_RMSNORM, EPILOGUE_RESIDUAL_SUMSQ)


# The weight stream staged through shared memory (StagedSkinnyGemmKernel): a
# stage is 8 weight rows (one bulk copy a row), a 16-row tile two stages.  Rows
# sit in shared memory at a pitch of 64 bytes modulo 128, so the two rows one
# quarter-warp reads with 16-byte loads (4 lanes each) fall on the two halves
# of the 32 banks: no bank conflict.
ROWS_PER_STAGE = TOKENS_PER_MMA
STAGES_PER_TILE = ROWS_PER_TILE // ROWS_PER_STAGE
STAGE_ROW_BANK_OFFSET = 64
SHARED_BANK_SPAN = 128
# The shared memory one CTA may use on SM90 (228 KB an SM, 1 KB reserved a CTA).
MAX_SMEM_PER_CTA = 227 * 1024
STAGED_EPILOGUES = (EPILOGUE_PLAIN, EPILOGUE_SILU_MUL)
# Up to this many 8-token halves a staged warp holds its K range's activations
# in registers across its tiles (36 registers for the in_proj's 9 K-steps); at
# two halves that would be 72, the kernel would need 137 registers a thread
# and the next kernel's CTAs (the KDA step's) no longer fit beside it, so each
# batch of K-steps re-reads its activation chunks, L1 hits after the first tile.
STAGED_HELD_ACTIVATION_HALVES = 1


def stage_row_pitch(k: int) -> int:
    """Elements between two weight rows of a shared-memory stage (>= K)."""
    row_bytes = 2 * k
    pad = (STAGE_ROW_BANK_OFFSET - row_bytes) % SHARED_BANK_SPAN
    return (row_bytes + pad) // 2


def uses_cluster_split_k(split_k: int, cluster_split_k: bool) -> bool:
    """Whether a launch of ``split_k`` CTAs per tile reduces through a cluster
    (else through the global workspace and the per-tile tickets)."""
    return cluster_split_k and 2 <= split_k <= MAX_CLUSTER_SPLIT_K


@dataclass(frozen=True)
class RowGroups:
    """G products of R rows each (strides in elements).

    Group g reads weight rows ``g * w_group_rows + r`` (r < R) of the
    ``[*, K]`` weight (row pitch K) and the activations
    ``x[t * x_row_stride + g * x_group_stride + k]``; it writes output
    columns ``g * R + r`` of the contiguous ``[M, G * R]`` output.
    """

    groups: int
    rows: int
    w_group_rows: int
    x_row_stride: int
    x_group_stride: int


class SkinnyGemmKernel:
    """Compile-time configuration of one skinny-GEMM variant.

    ``n``/``k`` are the (packed) weight's shape, ``m_bucket`` is 8 or 16 (the
    number of token columns the MMAs compute; the run-time ``m`` <= bucket
    selects how many are stored), ``warps_k`` warps per CTA split K inside a
    CTA, ``split_k`` CTAs per tile split it across the grid, and ``unroll``
    K-steps of loads are issued per warp before their MMAs.
    ``cluster_split_k`` reduces a split through a thread-block cluster when
    2 <= split_k <= MAX_CLUSTER_SPLIT_K (else, or with False, through the
    global workspace and an atomic ticket per tile).
    ``weight_l2_policy`` (None, "evict_first", "evict_last"): the L2 cache
    policy of W's loads (``WarpRowTileMma``); None emits the plain loads.
    ``min_ctas_per_sm`` (None: no bound): launch bounds promising ptxas that
    many CTAs an SM, so that it may use the registers they leave.  Without
    them ptxas 13.5 keeps the KDA in_proj (M-bucket 8, 3 pre-wait steps) to 42
    registers and 7 weight loads ahead of its first MMA; at 6, 78 registers and
    16 loads; at 4, 106 and 22 (``docs/perf/gemm_notes.md``).  Same
    instructions, same outputs.
    """

    def __init__(
        self,
        n: int,
        k: int,
        m_bucket: int,
        epilogue: str,
        warps_k: int,
        split_k: int,
        unroll: int,
        eps: float = 1e-5,
        out_cols: int | None = None,
        use_pdl: bool = True,
        row_groups: RowGroups | None = None,
        norm_by_every_tile: bool = False,
        barrier_max_polls: int = BARRIER_MAX_POLLS,
        cluster_split_k: bool = True,
        weight_l2_policy: str | None = None,
        prewait_steps: int | None = None,
        min_ctas_per_sm: int | None = None,
    ):
        if epilogue not in EPILOGUES:
            raise ValueError(
                f"unknown epilogue {epilogue!r}; expected one of {EPILOGUES}"
            )
        if m_bucket not in (TOKENS_PER_MMA, MAX_TOKENS):
            raise ValueError(f"m_bucket must be 8 or 16, got {m_bucket}")
        if k % CHUNK:
            raise ValueError(f"K={k} must be a multiple of {CHUNK} (16-byte rows)")
        self.n, self.k, self.m_bucket, self.epilogue = n, k, m_bucket, epilogue
        self.warps_k, self.split_k = warps_k, split_k
        self.eps = eps
        self.halves = m_bucket // TOKENS_PER_MMA
        self.k_chunks = k // CHUNK
        self.num_tiles = ceil_div(n, ROWS_PER_TILE)
        total_steps = ceil_div(self.k_chunks, LANES_PER_QUAD)
        k_slices = warps_k * split_k
        self.steps_per_warp = ceil_div(total_steps, k_slices)
        if self.steps_per_warp * (k_slices - 1) >= total_steps:
            raise ValueError(
                f"warps_k*split_k={k_slices} leaves a warp without K work for K={k}"
            )
        # K predicates are needed only when the slices overhang the real K.
        k_ragged = self.steps_per_warp * k_slices * STEP_K != k
        self.mma = WarpRowTileMma(
            k,
            self.steps_per_warp,
            unroll,
            self.halves,
            k_ragged,
            weight_l2_policy,
            prewait_steps,
        )
        self.n_ragged = n % ROWS_PER_TILE != 0
        self.threads = warps_k * WARP_THREADS
        self.launch_bounds = launch_bounds(min_ctas_per_sm, self.threads)
        self.values_per_lane = 4 * self.halves
        if epilogue == EPILOGUE_SILU_MUL and n % ROWS_PER_TILE:
            raise ValueError(
                "silu_mul needs the packed gate/up weight (see pack_gate_up)"
            )
        if epilogue in RESIDUAL_EPILOGUES and n % CHUNK:
            raise ValueError(f"{epilogue} needs N % {CHUNK} == 0, got N={n}")
        # silu_mul: the packed weight may carry zero padding rows; out_cols is
        # the caller's real intermediate size (row stride and store bound).
        self.out_cols = out_cols or (n // 2 if epilogue == EPILOGUE_SILU_MUL else n)
        # Programmatic dependent launch: start streaming weights while the
        # previous kernel in the stream finishes (SM90 griddepcontrol).
        self.use_pdl = use_pdl
        self.row_groups = row_groups
        # Only the caller knows whether all tiles fit on the GPU at once (the
        # barrier's condition); PreparedGemm decides from the SM count.
        self.norm_by_every_tile = (
            norm_by_every_tile and epilogue == EPILOGUE_RESIDUAL_RMSNORM
        )
        self.barrier_max_polls = barrier_max_polls
        self.cluster_split_k = uses_cluster_split_k(split_k, cluster_split_k)
        # The leader's buffer of the other splits' partials (allocated in every
        # CTA of the cluster: they share one shared-memory layout).
        self.cluster_partials_bytes = 0
        self.cluster_shape = None
        if self.cluster_split_k:
            self.cluster_partials_bytes = (
                (split_k - 1) * WARP_THREADS * self.values_per_lane * 4
            )
            self.cluster_shape = [1, split_k, 1]
        if row_groups is not None:
            g = row_groups
            if epilogue != EPILOGUE_PLAIN:
                raise ValueError("row groups support the plain epilogue only")
            if g.rows % ROWS_PER_TILE or n != g.groups * g.rows:
                raise ValueError(
                    f"row groups need R % {ROWS_PER_TILE} == 0 and N = G * R, got "
                    f"G={g.groups}, R={g.rows}, N={n}"
                )
            if g.w_group_rows < g.rows:
                raise ValueError(
                    f"groups' weight rows overlap: w_group_rows={g.w_group_rows} < "
                    f"R={g.rows}"
                )
            if g.x_row_stride % CHUNK or g.x_group_stride % CHUNK:
                raise ValueError(
                    f"x strides must be multiples of {CHUNK} elements (16-byte "
                    f"loads), got {g.x_row_stride}, {g.x_group_stride}"
                )

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        residual_ptr: cute.Pointer,
        residual_out_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        partial_ptr: cute.Pointer,
        counter_ptr: cute.Pointer,
        sumsq_ptr: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        grid, smem_bytes, cluster = self._launch_shape()
        self.kernel(
            x_ptr,
            w_ptr,
            out_ptr,
            residual_ptr,
            residual_out_ptr,
            gamma_ptr,
            partial_ptr,
            counter_ptr,
            sumsq_ptr,
            m,
        ).launch(  # fmt: skip
            grid=grid,
            block=[self.threads, 1, 1],
            cluster=cluster,
            smem=smem_bytes,
            stream=stream,
            use_pdl=self.use_pdl,
            **self.launch_bounds,
        )

    def _launch_shape(self) -> tuple[list[int], int, list[int] | None]:
        """(grid, shared-memory bytes, cluster shape) of a launch."""
        smem_bytes = self.warps_k * WARP_THREADS * self.values_per_lane * 4
        smem_bytes += 4 * WARP_THREADS + 4 * MAX_TOKENS  # ticket flag + rstd
        # Every buffer's size is a multiple of 16 bytes: no alignment padding.
        smem_bytes += self.cluster_partials_bytes
        return [self.num_tiles, self.split_k, 1], smem_bytes, self.cluster_shape

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        residual_ptr: cute.Pointer,
        residual_out_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        partial_ptr: cute.Pointer,
        counter_ptr: cute.Pointer,
        sumsq_ptr: cute.Pointer,
        m: Int32,
    ):
        n, k_chunks, halves = self.n, self.k_chunks, self.halves
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(self.use_pdl):
            # Let the next kernel launch once every CTA of this grid is
            # resident; it waits (griddepcontrol.wait) before touching
            # anything this kernel writes.
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.cluster_split_k):
            # Remote shared memory may only be written once every CTA of the
            # cluster has started: arrive now (no ordering needed), wait just
            # before the first remote store, long after the last CTA started.
            cute.arch.cluster_arrive_relaxed()
        tile, split, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        quad_row = lane // LANES_PER_QUAD  # MMA groupID: weight row / token column
        quad_lane = lane % LANES_PER_QUAD  # MMA threadID_in_group: K chunk / token pair

        # Chunked views: (rows, K/8, 8) so one [r, c, None] slice is a 16-byte load.
        w_rows = n
        w_row_base = tile * ROWS_PER_TILE
        groups = self.row_groups
        if const_expr(groups is not None):
            tiles_per_group = groups.rows // ROWS_PER_TILE
            group = tile // tiles_per_group
            w_rows = groups.groups * groups.w_group_rows
            w_row_base = (
                group * groups.w_group_rows + (tile % tiles_per_group) * ROWS_PER_TILE
            )
        w_chunks = cute.make_tensor(
            w_ptr,
            cute.make_layout((w_rows, k_chunks, CHUNK), stride=(self.k, CHUNK, 1)),
        )
        if const_expr(groups is None):
            x_chunks = cute.make_tensor(
                x_ptr,
                cute.make_layout(
                    (MAX_TOKENS, k_chunks, CHUNK), stride=(self.k, CHUNK, 1)
                ),
            )
        else:
            x_groups = cute.make_tensor(
                x_ptr,
                cute.make_layout(
                    (MAX_TOKENS, groups.groups, k_chunks, CHUNK),
                    stride=(groups.x_row_stride, groups.x_group_stride, CHUNK, 1),
                ),
            )
            x_chunks = x_groups[None, group, None, None]

        row_lo = w_row_base + quad_row
        row_hi = row_lo + TOKENS_PER_MMA
        if const_expr(self.n_ragged):
            # Rows past N are computed from a duplicate row and never stored.
            row_lo = cutlass.min(row_lo, n - 1)
            row_hi = cutlass.min(row_hi, n - 1)
        # Token columns past m read token m-1 (valid memory); never stored.
        x_rows = [
            cutlass.min(quad_row + h * TOKENS_PER_MMA, m - 1) for h in range(halves)
        ]

        acc = new_accumulators(halves)
        first_step = (split * self.warps_k + warp) * self.steps_per_warp
        vals = self.values_per_lane
        residual_in = cute.make_rmem_tensor((vals,), Float32)
        epoch_in = cute.make_rmem_tensor((1,), Int32)
        gamma_rows = cute.make_rmem_tensor((2,), Float32)
        if const_expr(self.norm_by_every_tile):
            # The norm weight never depends on the previous kernel.
            self._load_gamma_rows(gamma_rows, gamma_ptr, tile, quad_row)
        if const_expr(self.epilogue in RESIDUAL_EPILOGUES):
            # The residual may be the previous kernel's output: loaded right
            # after the wait, with the activations, not after the reduction.
            self.mma.accumulate(
                acc, w_chunks, row_lo, row_hi, x_chunks, x_rows, first_step,
                quad_lane, self.use_pdl,
                lambda: self._load_residual(
                    residual_in, epoch_in, residual_ptr, counter_ptr, tile,
                    quad_row, quad_lane, m,
                ),  # fmt: skip
            )  # fmt: skip
        else:
            self.mma.accumulate(
                acc, w_chunks, row_lo, row_hi, x_chunks, x_rows, first_step,
                quad_lane, self.use_pdl,
            )  # fmt: skip

        # ---- reduce the K slices of this CTA's warps through shared memory
        smem = cutlass.utils.SmemAllocator()
        red = smem.allocate_tensor(
            Float32,
            cute.make_layout((self.warps_k, WARP_THREADS, vals)),
            byte_alignment=16,
        )
        flag = smem.allocate_tensor(Int32, cute.make_layout((WARP_THREADS,)), 4)
        rstd = smem.allocate_tensor(Float32, cute.make_layout((MAX_TOKENS,)), 4)
        if const_expr(self.cluster_split_k):
            # cluster_partials[s - 1, lane, v]: split s's total, lane-major so
            # a lane's values are contiguous (16-byte stores and loads).
            cluster_partials = smem.allocate_tensor(
                Float32,
                cute.make_layout(
                    (self.split_k - 1, WARP_THREADS, vals),
                    stride=(WARP_THREADS * vals, vals, 1),
                ),
                byte_alignment=16,
            )
        if tidx < WARP_THREADS:
            flag[tidx] = Int32(0)
        total = cute.make_rmem_tensor((vals,), Float32)
        self.mma.reduce_warps(acc, total, red, warp, lane, self.warps_k)
        if const_expr(self.cluster_split_k):
            # Every thread of every CTA passes the cluster barriers (not only
            # warp 0): barrier.cluster counts threads.
            self._cluster_reduce_and_epilogue(
                total, tile, split, warp, lane, quad_row, quad_lane, m,
                out_ptr, residual_in, epoch_in, residual_out_ptr, gamma_rows,
                counter_ptr, sumsq_ptr, flag, cluster_partials,
            )  # fmt: skip
        else:
            if warp == 0:
                if const_expr(self.split_k > 1):
                    self._split_k_reduce_and_epilogue(
                        total, tile, split, lane, quad_row, quad_lane, m,
                        out_ptr, residual_in, epoch_in, residual_out_ptr,
                        gamma_rows, partial_ptr, counter_ptr, sumsq_ptr, flag,
                    )  # fmt: skip
                else:
                    self._epilogue(
                        total, tile, lane, quad_row, quad_lane, m,
                        out_ptr, residual_in, epoch_in, residual_out_ptr,
                        gamma_rows, counter_ptr, sumsq_ptr, flag,
                    )  # fmt: skip

        if const_expr(self.epilogue == EPILOGUE_RESIDUAL_RMSNORM):
            # The last tile normalises every row: always in the last-tile
            # scheme, after an abandoned barrier in the other (which has
            # re-armed the ticket and the sums already).
            cute.arch.sync_threads()
            if flag[0] == 1:
                self._normalize_rows(
                    tidx, m, residual_out_ptr, gamma_ptr, out_ptr, counter_ptr,
                    sumsq_ptr, epoch_in[0] % SUMSQ_BUFFERS, rstd,
                    not self.norm_by_every_tile,
                )  # fmt: skip

    @cute.jit
    def _cluster_reduce_and_epilogue(
        self, total, tile, split, warp, lane, quad_row, quad_lane, m,
        out_ptr, residual_in, epoch_in, residual_out_ptr, gamma_rows,
        counter_ptr, sumsq_ptr, flag, cluster_partials,
    ):  # fmt: skip
        """Split-K through the cluster: splits 1.. store their totals into the
        leader's (split 0's) shared memory, the leader adds them in split
        order and runs the epilogue, as the ticket path's last CTA does."""
        vals = self.values_per_lane
        # Pairs with the relaxed arrive at the start: every CTA exists.
        cute.arch.cluster_wait()
        if warp == 0:  # noqa: SIM102 (run-time `and` does not lower)
            if split != CLUSTER_LEADER:
                leader_partials = cute.make_tensor(
                    cute.arch.map_dsmem_ptr(cluster_partials.iterator, CLUSTER_LEADER),
                    cluster_partials.layout,
                )
                cute.autovec_copy(total, leader_partials[split - 1, lane, None])
        # Release the remote stores (default .release) and acquire them in the
        # leader (default .acquire), cluster scope: no GPU-scope fence.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if warp == 0:  # noqa: SIM102
            if split == CLUSTER_LEADER:
                others = cute.make_rmem_tensor((vals,), Float32)
                # total = p0 + p1 + ... as the ticket path adds the workspace.
                for s in cutlass.range_constexpr(1, self.split_k):
                    cute.autovec_copy(cluster_partials[s - 1, lane, None], others)
                    for v in cutlass.range_constexpr(vals):
                        total[v] = total[v] + others[v]
                self._epilogue(
                    total, tile, lane, quad_row, quad_lane, m,
                    out_ptr, residual_in, epoch_in, residual_out_ptr, gamma_rows,
                    counter_ptr, sumsq_ptr, flag,
                )  # fmt: skip

    @cute.jit
    def _split_k_reduce_and_epilogue(
        self, total, tile, split, lane, quad_row, quad_lane, m,
        out_ptr, residual_in, epoch_in, residual_out_ptr, gamma_rows, partial_ptr,
        counter_ptr, sumsq_ptr, flag,
    ):  # fmt: skip
        vals = self.values_per_lane
        # partial[tile, split, lane, v]: lane-major so a warp's store is coalesced.
        partials = cute.make_tensor(
            partial_ptr,
            cute.make_layout(
                (self.num_tiles, self.split_k, WARP_THREADS, vals),
                stride=(
                    self.split_k * WARP_THREADS * vals,
                    WARP_THREADS * vals,
                    vals,
                    1,
                ),
            ),
        )
        counters = cute.make_tensor(counter_ptr, cute.make_layout((self.num_tiles,)))
        for v in cutlass.range_constexpr(vals):
            partials[tile, split, lane, v] = total[v]
        # Publish the partial before taking a ticket (release), and make the
        # other CTAs' partials visible to the last one (acquire).
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        ticket = Int32(0)
        if lane == 0:
            ticket = cute.arch.atomic_add(
                counters.iterator + tile, Int32(1), sem="acq_rel", scope="gpu"
            )
        ticket = cute.arch.shuffle_sync(ticket, 0)
        if ticket == self.split_k - 1:
            cute.arch.fence_acq_rel_gpu()
            # Fixed summation order (split 0, 1, ...) keeps results reproducible.
            for v in cutlass.range_constexpr(vals):
                total[v] = partials[tile, 0, lane, v]
            for s in cutlass.range_constexpr(1, self.split_k):
                for v in cutlass.range_constexpr(vals):
                    total[v] = total[v] + partials[tile, s, lane, v]
            if lane == 0:
                # Re-arm for the next launch (graph replay): every CTA of this
                # tile has taken its ticket.
                counters[tile] = Int32(0)
            self._epilogue(
                total, tile, lane, quad_row, quad_lane, m,
                out_ptr, residual_in, epoch_in, residual_out_ptr, gamma_rows,
                counter_ptr, sumsq_ptr, flag,
            )  # fmt: skip

    @cute.jit
    def _epilogue(
        self, total, tile, lane, quad_row, quad_lane, m,
        out_ptr, residual_in, epoch_in, residual_out_ptr, gamma_rows, counter_ptr,
        sumsq_ptr, flag,
    ):  # fmt: skip
        n = self.n
        # total[4h + v]: v=0/1 -> row g, tokens 2t/2t+1; v=2/3 -> row g+8.
        if const_expr(self.epilogue == EPILOGUE_PLAIN):
            out = cute.make_tensor(
                out_ptr, cute.make_layout((MAX_TOKENS, n), stride=(n, 1))
            )
            for h in cutlass.range_constexpr(self.halves):
                for v in cutlass.range_constexpr(4):
                    token = h * TOKENS_PER_MMA + 2 * quad_lane + (v % 2)
                    row = tile * ROWS_PER_TILE + quad_row + TOKENS_PER_MMA * (v // 2)
                    if token < m and row < n:
                        out[token, row] = total[4 * h + v].to(BFloat16)
        elif const_expr(self.epilogue == EPILOGUE_SILU_MUL):
            cols = self.out_cols
            out = cute.make_tensor(
                out_ptr, cute.make_layout((MAX_TOKENS, cols), stride=(cols, 1))
            )
            # Packed tile rows 0-7 are gate rows, 8-15 the matching up rows.
            col = tile * TOKENS_PER_MMA + quad_row
            for h in cutlass.range_constexpr(self.halves):
                for v in cutlass.range_constexpr(2):
                    token = h * TOKENS_PER_MMA + 2 * quad_lane + v
                    gate = total[4 * h + v]
                    up = total[4 * h + 2 + v]
                    silu = gate / (Float32(1.0) + cute.math.exp(-gate, fastmath=True))
                    if token < m and col < cols:
                        out[token, col] = (silu * up).to(BFloat16)
        else:
            self._residual_epilogue(
                total, tile, lane, quad_row, quad_lane, m, out_ptr, residual_in,
                epoch_in[0], residual_out_ptr, gamma_rows, counter_ptr, sumsq_ptr,
                flag,
            )  # fmt: skip

    @cute.jit
    def _load_residual(
        self, residual_in, epoch_in, residual_ptr, counter_ptr, tile, quad_row,
        quad_lane, m,
    ):  # fmt: skip
        """This lane's residual values in the accumulator layout (clamped
        indices: every load is in bounds, values past M or N are never used)
        and the epoch, which the previous launch may have advanced."""
        n = self.n
        if const_expr(self.epilogue == EPILOGUE_RESIDUAL_RMSNORM):
            epoch_in[0] = cute.arch.load(
                counter_ptr + self.num_tiles + BARRIER_EPOCH, Int32,
                sem="relaxed", scope="gpu",
            )  # fmt: skip
        else:
            epoch_in[0] = Int32(0)  # the consumer's buffer has no epochs
        residual = cute.make_tensor(
            residual_ptr, cute.make_layout((MAX_TOKENS, n), stride=(n, 1))
        )
        for h in cutlass.range_constexpr(self.halves):
            for v in cutlass.range_constexpr(4):
                token = h * TOKENS_PER_MMA + 2 * quad_lane + (v % 2)
                row = tile * ROWS_PER_TILE + quad_row + TOKENS_PER_MMA * (v // 2)
                residual_in[4 * h + v] = residual[
                    cutlass.min(token, m - 1), cutlass.min(row, n - 1)
                ].to(Float32)

    @cute.jit
    def _load_gamma_rows(self, gamma_rows, gamma_ptr, tile, quad_row):
        n = self.n
        gamma = cute.make_tensor(gamma_ptr, cute.make_layout((n,)))
        for r in cutlass.range_constexpr(2):
            row = tile * ROWS_PER_TILE + quad_row + TOKENS_PER_MMA * r
            gamma_rows[r] = gamma[cutlass.min(row, n - 1)].to(Float32)

    @cute.jit
    def _residual_epilogue(
        self, total, tile, lane, quad_row, quad_lane, m, out_ptr, residual_in,
        epoch, residual_out_ptr, gamma_rows, counter_ptr, sumsq_ptr, flag,
    ):  # fmt: skip
        n = self.n
        residual_out = cute.make_tensor(
            residual_out_ptr, cute.make_layout((MAX_TOKENS, n), stride=(n, 1))
        )
        counters = cute.make_tensor(
            counter_ptr, cute.make_layout((self.num_tiles + NORM_COUNTERS,))
        )
        sumsq = cute.make_tensor(
            sumsq_ptr,
            cute.make_layout((SUMSQ_BUFFERS, MAX_TOKENS), stride=(MAX_TOKENS, 1)),
        )
        # residual_sumsq: epoch 0, so buffer 0 = the consumer's MAX_TOKENS sums.
        buffer = epoch % SUMSQ_BUFFERS
        hidden = cute.make_rmem_tensor((self.values_per_lane,), Float32)
        squares = cute.make_rmem_tensor((self.values_per_lane,), Float32)
        for h in cutlass.range_constexpr(self.halves):
            for v in cutlass.range_constexpr(4):
                token = h * TOKENS_PER_MMA + 2 * quad_lane + (v % 2)
                row = tile * ROWS_PER_TILE + quad_row + TOKENS_PER_MMA * (v // 2)
                # The new residual is stored in bf16, and the norm is taken of
                # exactly what is stored (as vLLM's fused_add_rms_norm).
                stored = (total[4 * h + v] + residual_in[4 * h + v]).to(BFloat16)
                hidden[4 * h + v] = stored.to(Float32)
                squares[4 * h + v] = Float32(0.0)
                if token < m and row < n:
                    residual_out[token, row] = stored
                    squares[4 * h + v] = hidden[4 * h + v] * hidden[4 * h + v]
        for h in cutlass.range_constexpr(self.halves):
            for p in cutlass.range_constexpr(2):
                token = h * TOKENS_PER_MMA + 2 * quad_lane + p
                s = squares[4 * h + p] + squares[4 * h + 2 + p]
                # Sum over the 8 quad rows (lane bits 2..4) of this tile.
                for offset in cutlass.range_constexpr(3):
                    s = s + cute.arch.shuffle_sync_bfly(s, 4 << offset)
                if quad_row == 0 and token < m:
                    cute.arch.atomic_add(
                        sumsq.iterator + buffer * MAX_TOKENS + token, s, scope="gpu"
                    )
        if const_expr(self.epilogue == EPILOGUE_RESIDUAL_RMSNORM):
            self._ticket_and_normalize(
                hidden, epoch, buffer, tile, lane, quad_row, quad_lane, m,
                out_ptr, gamma_rows, counters, sumsq, flag,
            )  # fmt: skip

    @cute.jit
    def _ticket_and_normalize(
        self, hidden, epoch, buffer, tile, lane, quad_row, quad_lane, m, out_ptr,
        gamma_rows, counters, sumsq, flag,
    ):  # fmt: skip
        grid_ticket = counters.iterator + self.num_tiles + GRID_TICKET
        # Release this tile's residual slice and squares, then take a ticket.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        ticket = Int32(0)
        if lane == 0:
            ticket = cute.arch.atomic_add(
                grid_ticket, Int32(1), sem="acq_rel", scope="gpu"
            )
        ticket = cute.arch.shuffle_sync(ticket, 0)
        if const_expr(self.norm_by_every_tile):
            self._barrier_and_normalize(
                hidden, ticket, epoch, buffer, tile, lane, quad_row, quad_lane, m,
                out_ptr, gamma_rows, counters, sumsq, flag,
            )  # fmt: skip
        else:
            # The last tile of the grid normalises every row.  Nested rather
            # than `and`: DSL conditions on run-time values lower to one
            # scf.if each.
            if lane == 0:  # noqa: SIM102
                if ticket == self.num_tiles - 1:
                    flag[0] = Int32(1)

    @cute.jit
    def _barrier_and_normalize(
        self, hidden, ticket, epoch, buffer, tile, lane, quad_row, quad_lane, m,
        out_ptr, gamma_rows, counters, sumsq, flag,
    ):  # fmt: skip
        epoch_word = counters.iterator + self.num_tiles + BARRIER_EPOCH
        opened = (epoch + 1) & BARRIER_EPOCH_MASK
        abandoned = epoch | BARRIER_ABANDONED
        # What this tile found the barrier in: opened (normalise its rows) or
        # abandoned (the last arrival normalises every row).
        state = opened
        if ticket == self.num_tiles - 1:
            # Last arrival: re-arm the ticket and the next launch's sums,
            # then open the barrier.
            if lane < MAX_TOKENS:
                sumsq[1 - buffer, lane] = Float32(0.0)
            if lane == 0:
                counters[self.num_tiles + GRID_TICKET] = Int32(0)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_warp()
            if lane == 0:
                before = cute.arch.atomic_exch(
                    epoch_word, opened, sem="acq_rel", scope="gpu"
                )
                if before == abandoned:
                    flag[0] = Int32(1)
        else:
            if lane == 0:
                seen = epoch
                polls = Int32(0)
                waiting = Int32(1)
                while waiting == 1:
                    nvvm.nanosleep(Int32(BARRIER_POLL_NS).ir_value())
                    seen = cute.arch.load(epoch_word, Int32, sem="acquire", scope="gpu")
                    polls = polls + 1
                    # One condition per select: run-time `and` does not lower.
                    limit = self.barrier_max_polls
                    in_time = Int32(cutlass.select_(polls < limit, 1, 0))
                    waiting = Int32(cutlass.select_(seen == epoch, in_time, Int32(0)))
                if seen == epoch:
                    # Give up, unless the barrier opened meanwhile.
                    seen = cute.arch.atomic_cas(
                        epoch_word, cmp=epoch, val=abandoned, sem="acq_rel",
                        scope="gpu",
                    )  # fmt: skip
                    if seen == epoch:
                        seen = abandoned
                state = seen
            state = cute.arch.shuffle_sync(state, 0)
        if state == opened:
            self._normalize_own_rows(
                hidden, buffer, tile, lane, quad_row, quad_lane, m, out_ptr,
                gamma_rows, sumsq,
            )  # fmt: skip

    @cute.jit
    def _normalize_own_rows(
        self, hidden, buffer, tile, lane, quad_row, quad_lane, m, out_ptr,
        gamma_rows, sumsq,
    ):  # fmt: skip
        n = self.n
        cute.arch.fence_acq_rel_gpu()
        # Lane t < M holds token t's 1/rms; every lane gathers its tokens'.
        inv_rms = Float32(0.0)
        if lane < m:
            total_sq = cute.arch.atomic_add(
                sumsq.iterator + buffer * MAX_TOKENS + lane, Float32(0.0),
                scope="gpu",
            )  # fmt: skip
            inv_rms = cute.math.rsqrt(total_sq / Float32(n) + Float32(self.eps))
        out = cute.make_tensor(
            out_ptr, cute.make_layout((MAX_TOKENS, n), stride=(n, 1))
        )
        for h in cutlass.range_constexpr(self.halves):
            for p in cutlass.range_constexpr(2):
                token = h * TOKENS_PER_MMA + 2 * quad_lane + p
                scale = cute.arch.shuffle_sync(inv_rms, token)
                for r in cutlass.range_constexpr(2):
                    row = tile * ROWS_PER_TILE + quad_row + TOKENS_PER_MMA * r
                    normed = (hidden[4 * h + 2 * r + p] * scale).to(BFloat16)
                    if token < m and row < n:
                        out[token, row] = (normed.to(Float32) * gamma_rows[r]).to(
                            BFloat16
                        )

    @cute.jit
    def _normalize_rows(
        self, tidx, m, residual_out_ptr, gamma_ptr, out_ptr, counter_ptr, sumsq_ptr,
        buffer, rstd, rearm: cutlass.Constexpr,
    ):  # fmt: skip
        n = self.n
        row_chunks = n // CHUNK
        cute.arch.fence_acq_rel_gpu()
        counters = cute.make_tensor(
            counter_ptr, cute.make_layout((self.num_tiles + NORM_COUNTERS,))
        )
        sumsq = cute.make_tensor(
            sumsq_ptr,
            cute.make_layout((SUMSQ_BUFFERS, MAX_TOKENS), stride=(MAX_TOKENS, 1)),
        )
        if tidx < MAX_TOKENS:
            # Read through an atomic so the value comes from L2, then re-arm.
            total_sq = cute.arch.atomic_add(
                sumsq.iterator + buffer * MAX_TOKENS + tidx, Float32(0.0), scope="gpu"
            )
            rstd[tidx] = cute.math.rsqrt(total_sq / Float32(n) + Float32(self.eps))
            if const_expr(rearm):
                sumsq[buffer, tidx] = Float32(0.0)
        if const_expr(rearm):  # noqa: SIM102 (const_expr and a run-time test)
            if tidx == 0:
                counters[self.num_tiles + GRID_TICKET] = Int32(0)
        cute.arch.sync_threads()
        chunk_layout = cute.make_layout(
            (MAX_TOKENS, row_chunks, CHUNK), stride=(n, CHUNK, 1)
        )
        hidden = cute.make_tensor(residual_out_ptr, chunk_layout)
        out = cute.make_tensor(out_ptr, chunk_layout)
        gamma = cute.make_tensor(
            gamma_ptr, cute.make_layout((row_chunks, CHUNK), stride=(CHUNK, 1))
        )
        work = self.m_bucket * row_chunks
        iters = ceil_div(work, self.threads)
        for start in cutlass.range_constexpr(0, iters, NORM_LOADS_IN_FLIGHT):
            batch = min(NORM_LOADS_IN_FLIGHT, iters - start)
            hs = [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(batch)]
            gs = [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(batch)]
            for j in cutlass.range_constexpr(batch):
                item = tidx + (start + j) * self.threads
                token = item // row_chunks
                chunk = item % row_chunks
                if token < m:
                    cute.autovec_copy(hidden[token, chunk, None], hs[j])
                    cute.autovec_copy(gamma[chunk, None], gs[j])
            for j in cutlass.range_constexpr(batch):
                item = tidx + (start + j) * self.threads
                token = item // row_chunks
                chunk = item % row_chunks
                if token < m:
                    scale = rstd[token]
                    res = cute.make_rmem_tensor((CHUNK,), BFloat16)
                    normalized_chunk(hs[j], gs[j], scale, res)
                    cute.autovec_copy(res, out[token, chunk, None])


class StagedSkinnyGemmKernel(SkinnyGemmKernel):
    """The skinny GEMM with its weight staged through shared memory.

    The register stream (``SkinnyGemmKernel``) keeps in flight what its
    registers hold: a few K-steps a warp before its PDL wait.  Here a grid of
    ``grid_ctas`` CTAs (one an SM in PreparedGemm) walks the 16-row tiles in
    contiguous runs; warp 0 of a CTA puts ``weight_stages`` stages of 8 rows
    in flight with ``cp.async.bulk`` (one copy a row, completed on the stage's
    mbarrier) before ``griddepcontrol.wait``, so up to that many rows an SM stream in
    while the kernel before still runs.  Every warp then owns one K range for
    all tiles: up to 8 tokens it loads its activations once into registers (at
    16 every batch of K-steps re-reads them, from L1 after the first tile:
    STAGED_HELD_ACTIVATION_HALVES), and per tile it waits for the tile's two
    stages, runs the MMAs from 16-byte shared-memory reads, and the warps
    reduce through shared memory (whose first barrier also ends every read of
    the two stages); warp 0 refills them with the stages ``weight_stages``
    further on, then runs the tile's epilogue (``plain`` or ``silu_mul``, the
    register stream's).  Same MMAs, same fragment order, same warp reduction
    order: for equal ``warps_k`` the outputs are bit-identical to the register
    stream's.
    """

    def __init__(
        self,
        n: int,
        k: int,
        m_bucket: int,
        epilogue: str,
        warps_k: int,
        unroll: int,
        weight_stages: int,
        grid_ctas: int,
        out_cols: int | None = None,
        use_pdl: bool = True,
        min_ctas_per_sm: int | None = None,
    ):
        if epilogue not in STAGED_EPILOGUES:
            raise ValueError(
                f"the staged weight stream supports the {STAGED_EPILOGUES} epilogues, "
                f"got {epilogue!r}"
            )
        super().__init__(
            n, k, m_bucket, epilogue, warps_k, 1, unroll, out_cols=out_cols,
            use_pdl=use_pdl, min_ctas_per_sm=min_ctas_per_sm,
        )  # fmt: skip
        if weight_stages < STAGES_PER_TILE:
            raise ValueError(
                f"weight_stages={weight_stages}: a tile needs {STAGES_PER_TILE} stages"
            )
        if grid_ctas < 1:
            raise ValueError(f"grid_ctas must be >= 1, got {grid_ctas}")
        self.weight_stages = weight_stages
        self.grid_ctas = min(grid_ctas, self.num_tiles)
        self.row_pitch = stage_row_pitch(k)
        self.stage_elems = ROWS_PER_STAGE * self.row_pitch
        self.stage_bytes = ROWS_PER_STAGE * 2 * k  # what a stage's copies bring
        self.smem_bytes = (
            weight_stages * self.stage_elems * 2  # the ring (128-byte aligned first)
            # An mbarrier a stage, padded: the reduction buffer is 16-byte aligned.
            + ceil_div(weight_stages * 8, 16) * 16
            + warps_k * WARP_THREADS * self.values_per_lane * 4  # warp reduction
        )
        if self.smem_bytes > MAX_SMEM_PER_CTA:
            raise ValueError(
                f"{weight_stages} stages of {ROWS_PER_STAGE} rows of K={k} take "
                f"{self.smem_bytes} bytes of shared memory a CTA; SM90 gives a CTA "
                f"{MAX_SMEM_PER_CTA}"
            )

    def _launch_shape(self) -> tuple[list[int], int, list[int] | None]:
        return [self.grid_ctas, 1, 1], self.smem_bytes, None

    @cute.jit
    def _load_stage(self, atom, w_ptr, ring, bars, first_tile, stage, slot):
        """Put stage ``stage`` of this CTA's run (rows of tile ``first_tile +
        stage // 2``) in flight into ring slot ``slot``: warp 0, one elected
        thread arming the slot's mbarrier with the stage's bytes.  Rows past N
        copy the last row (computed, never stored)."""
        n, k = self.n, self.k
        row0 = (first_tile + stage // STAGES_PER_TILE) * ROWS_PER_TILE + (
            stage % STAGES_PER_TILE
        ) * ROWS_PER_STAGE
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(
                bars.iterator + slot, self.stage_bytes
            )
        for r in cutlass.range_constexpr(ROWS_PER_STAGE):
            row = row0 + r
            if const_expr(self.n_ragged):
                row = cutlass.min(row, n - 1)
            src = cute.make_tensor(w_ptr + row * k, cute.make_layout((k,)))
            dst = cute.make_tensor(
                ring.iterator + slot * self.stage_elems + r * self.row_pitch,
                cute.make_layout((k,)),
            )
            cute.copy(atom, src, dst, mbar_ptr=bars.iterator + slot)

    @cute.kernel
    def kernel(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        residual_ptr: cute.Pointer,
        residual_out_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        partial_ptr: cute.Pointer,
        counter_ptr: cute.Pointer,
        sumsq_ptr: cute.Pointer,
        m: Int32,
    ):
        stages, halves, vals = self.weight_stages, self.halves, self.values_per_lane
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        quad_row = lane // LANES_PER_QUAD
        quad_lane = lane % LANES_PER_QUAD

        smem = cutlass.utils.SmemAllocator()
        # ring[slot, row, chunk, e]: element e of 16-byte chunk of row of a stage.
        ring = smem.allocate_tensor(
            BFloat16,
            cute.make_layout(
                (stages, ROWS_PER_STAGE, self.row_pitch // CHUNK, CHUNK),
                stride=(self.stage_elems, self.row_pitch, CHUNK, 1),
            ),
            byte_alignment=SHARED_BANK_SPAN,
        )
        bars = smem.allocate_tensor(Int64, cute.make_layout((stages,)), 8)
        red = smem.allocate_tensor(
            Float32,
            cute.make_layout((self.warps_k, WARP_THREADS, vals)),
            byte_alignment=16,
        )
        # This CTA's run of tiles.
        first_tile = cta * self.num_tiles // self.grid_ctas
        tiles = (cta + 1) * self.num_tiles // self.grid_ctas - first_tile
        run_stages = tiles * STAGES_PER_TILE
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), BFloat16)

        if tidx == 0:
            for s in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(bars.iterator + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # The weight never depends on the kernel before: fill the ring first.
        if warp == 0:
            for s in cutlass.range_constexpr(stages):
                if s < run_stages:
                    self._load_stage(atom, w_ptr, ring, bars, first_tile, s, s)
        if const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()

        x_chunks = cute.make_tensor(
            x_ptr,
            cute.make_layout(
                (MAX_TOKENS, self.k_chunks, CHUNK), stride=(self.k, CHUNK, 1)
            ),
        )
        # Token columns past m read token m-1 (valid memory); never stored.
        x_rows = [
            cutlass.min(quad_row + h * TOKENS_PER_MMA, m - 1) for h in range(halves)
        ]
        first_step = warp * self.steps_per_warp
        xs = None
        if const_expr(halves <= STAGED_HELD_ACTIVATION_HALVES):
            xs = self.mma.load_activations(x_chunks, x_rows, first_step, quad_lane)
        total = cute.make_rmem_tensor((vals,), Float32)
        # The register stream's residual/norm state: unused by these epilogues.
        unused = cute.make_rmem_tensor((vals,), Float32)
        for t in cutlass.range(tiles):
            lo = t * STAGES_PER_TILE
            lo_slot = lo % stages
            hi_slot = (lo + 1) % stages
            cute.arch.mbarrier_wait(bars.iterator + lo_slot, (lo // stages) % 2)
            cute.arch.mbarrier_wait(bars.iterator + hi_slot, ((lo + 1) // stages) % 2)
            acc = new_accumulators(halves)
            self.mma.accumulate_staged(
                acc, ring[lo_slot, None, None, None], ring[hi_slot, None, None, None],
                xs, first_step, quad_row, quad_lane, x_chunks, x_rows,
            )  # fmt: skip
            # Its first barrier ends every warp's reads of the tile's stages.
            self.mma.reduce_warps(acc, total, red, warp, lane, self.warps_k)
            if warp == 0:
                # Order those generic-proxy reads before the async-proxy refill.
                cute.arch.fence_proxy("async.shared", space="cta")
                if lo + stages < run_stages:
                    self._load_stage(
                        atom, w_ptr, ring, bars, first_tile, lo + stages, lo_slot
                    )
                if lo + 1 + stages < run_stages:
                    self._load_stage(
                        atom, w_ptr, ring, bars, first_tile, lo + 1 + stages, hi_slot
                    )
                self._epilogue(
                    total, first_tile + t, lane, quad_row, quad_lane, m, out_ptr,
                    unused, unused, residual_out_ptr, unused, counter_ptr,
                    sumsq_ptr, unused,
                )  # fmt: skip

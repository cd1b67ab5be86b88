# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One warp's share of a skinny (<= 16 token) product ``W @ x^T`` on SM90.

Shared by the decode GEMM and the MoE experts.  Decode products read far more
weight bytes than they do arithmetic, so the loop is built around streaming W
once at full HBM bandwidth:

* The product is computed transposed on the warp-level ``mma.sync.m16n8k16``
  tensor-core instruction: 16 weight rows are the MMA's M side and up to 8
  tokens its N side (two MMAs per weight fragment for 16 tokens).  The tensor
  cores keep the FP32 FMA pipe out of the critical path, which a CUDA-core
  dot product would saturate at 16 tokens.
* Every lane loads its weight fragments with 16-byte loads straight from
  global memory into registers.  The MMA fragment wants 4 K-values per row per
  lane; a dot product does not care in which order K is summed, so lane ``t``
  of a quad takes 8 consecutive K-values (one 16-byte chunk) and feeds them to
  two MMAs, with the activation chunk permuted identically.  No shared-memory
  staging or swizzling is needed.
* A warp owns one 16-row tile (any two 8-row groups: ``row_lo`` and
  ``row_hi``) and a contiguous range of K "steps" of 32 K-values (4 lanes x 8).
* Optionally (``weight_l2_policy``) the weight loads carry an L2 cache policy
  (``ld.global.L2::cache_hint``, still 16 bytes): ``evict_first`` keeps a
  streamed-once weight from displacing lines other kernels re-read from L2
  (docs/perf/gemm_notes.md, last section, has what it measured); the
  activation loads never carry one (they are re-read by every tile).

Accumulator layout per 8-token half ``h`` (the MMA's C fragment): value ``v``
of lane (quad row ``g``, quad lane ``t``) is row ``g`` (v < 2) or ``g + 8``
(v >= 2) of the tile, token ``8h + 2t + v % 2``.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64

from .l2_policy import l2_policy_value

# One mma.sync.m16n8k16 covers 16 weight rows (its M) and 8 tokens (its N).
ROWS_PER_TILE = 16
TOKENS_PER_MMA = 8
MMA_K = 16
# A 16-byte load holds 8 bf16; it feeds two MMAs of one lane (4 K-values each).
CHUNK = 8
# The 4 lanes of a quad share a row pair in the MMA fragment, so one warp step
# consumes 4 chunks = 32 K-values of each of its 16 rows.
LANES_PER_QUAD = 4
STEP_K = CHUNK * LANES_PER_QUAD
WARP_THREADS = 32
# Largest token count: two n8 MMAs per weight fragment.
MAX_TOKENS = 2 * TOKENS_PER_MMA
# Bits of one weight load (a CHUNK of bf16): the cache-hinted loads keep it.
CHUNK_BITS = CHUNK * 16


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def new_accumulators(halves: int) -> list:
    """Zeroed FP32 C fragments, one per 8-token half."""
    acc = [cute.make_rmem_tensor((4, 1, 1), Float32) for _ in range(halves)]
    for h in range(halves):
        acc[h].fill(0.0)
    return acc


class WarpRowTileMma:
    """Compile-time shape of one warp's K range.

    ``k`` is the row length (a multiple of ``CHUNK``), ``steps`` the number of
    32-wide K steps the warp covers, ``unroll`` how many steps of loads are
    issued before their MMAs, ``halves`` the 8-token MMA columns (1 or 2).
    ``k_ragged`` guards chunks past ``k`` (when the warps' ranges overhang it).
    ``weight_l2_policy`` (``None``, ``"evict_first"``, ``"evict_last"``): the
    L2 cache policy of the weight loads; ``None`` emits the plain loads (the
    same code as without the option).
    """

    def __init__(
        self,
        k: int,
        steps: int,
        unroll: int,
        halves: int,
        k_ragged: bool,
        weight_l2_policy: str | None = None,
        prewait_steps: int | None = None,
    ):
        if k % CHUNK:
            raise ValueError(f"K={k} must be a multiple of {CHUNK} (16-byte rows)")
        if halves not in (1, 2):
            raise ValueError(f"halves must be 1 or 2, got {halves}")
        self.k_chunks = k // CHUNK
        self.steps = steps
        self.unroll = max(1, min(unroll, steps))
        self.halves = halves
        self.k_ragged = k_ragged
        self.weight_policy_value = l2_policy_value(weight_l2_policy)
        # Steps whose weight loads are issued before griddepcontrol.wait (the
        # first batch); None: one whole batch of ``unroll`` steps.
        if prewait_steps is not None and not 0 <= prewait_steps <= self.steps:
            raise ValueError(f"prewait_steps={prewait_steps} outside 0..{steps}")
        self.prewait_steps = prewait_steps

    @cute.jit
    def _load_weight(self, src: cute.Tensor, dst: cute.Tensor, atom, policy):
        """One 16-byte weight chunk: a plain vector load, or one carrying the
        configured L2 policy."""
        if cutlass.const_expr(atom is None):
            cute.autovec_copy(src, dst)
        else:
            cute.copy(atom, src, dst, cache_policy=policy)

    @cute.jit
    def accumulate(
        self,
        acc,
        w_chunks: cute.Tensor,
        row_lo,
        row_hi,
        x_chunks: cute.Tensor,
        x_rows,
        first_step,
        quad_lane,
        wait_after_first_loads: cutlass.Constexpr,
        after_wait: cutlass.Constexpr = None,
    ):
        """``acc[h] += W[rows, K range] @ x[x_rows[h], K range]^T``.

        ``w_chunks``/``x_chunks`` are ``(rows, K/8, 8)`` views, ``x_rows[h]``
        the activation row this lane's quad row reads for half ``h``.  With
        ``wait_after_first_loads`` the first batch of weight loads is issued
        before ``griddepcontrol.wait`` (weights never depend on the previous
        kernel; the activations may).  ``after_wait`` (traced once, right
        after the wait and before the first activation loads) lets the caller
        issue its own loads of the previous kernel's output in the same round
        trip.
        """
        halves, k_chunks = self.halves, self.k_chunks
        mma_atom, frag_a, frag_b = self._mma_atom_and_fragments()
        w_atom, w_policy = None, None
        if cutlass.const_expr(self.weight_policy_value is not None):
            # A G2R atom takes the policy operand at copy time; 128 bits keeps
            # the loads as wide as the plain path's.
            w_atom = cute.make_copy_atom(
                cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=CHUNK_BITS
            )
            w_policy = Int64(self.weight_policy_value)
        unroll = self.unroll
        # (first step, steps) of each batch of loads issued before its MMAs.
        steps = self.steps
        batches = [(b, min(unroll, steps - b)) for b in range(0, steps, unroll)]
        if cutlass.const_expr(self.prewait_steps is not None):
            p = self.prewait_steps
            batches = [(0, p)] + [
                (b, min(unroll, steps - b)) for b in range(p, steps, unroll)
            ]
        for index, (batch_start, batch) in enumerate(batches):
            w_lo = [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(batch)]
            w_hi = [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(batch)]
            xs = [
                [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(halves)]
                for _ in range(batch)
            ]
            # Issue every load of the batch before the first MMA needs one.
            for j in cutlass.range_constexpr(batch):
                chunk = (first_step + batch_start + j) * LANES_PER_QUAD + quad_lane
                if cutlass.const_expr(self.k_ragged):
                    if chunk < k_chunks:
                        self._load_weight(
                            w_chunks[row_lo, chunk, None], w_lo[j], w_atom, w_policy
                        )
                        self._load_weight(
                            w_chunks[row_hi, chunk, None], w_hi[j], w_atom, w_policy
                        )
                    else:
                        w_lo[j].fill(0.0)
                        w_hi[j].fill(0.0)
                else:
                    self._load_weight(
                        w_chunks[row_lo, chunk, None], w_lo[j], w_atom, w_policy
                    )
                    self._load_weight(
                        w_chunks[row_hi, chunk, None], w_hi[j], w_atom, w_policy
                    )
            if cutlass.const_expr(wait_after_first_loads and index == 0):
                cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(after_wait is not None and index == 0):
                after_wait()
            for j in cutlass.range_constexpr(batch):
                chunk = (first_step + batch_start + j) * LANES_PER_QUAD + quad_lane
                for h in cutlass.range_constexpr(halves):
                    if cutlass.const_expr(self.k_ragged):
                        if chunk < k_chunks:
                            cute.autovec_copy(
                                x_chunks[x_rows[h], chunk, None], xs[j][h]
                            )
                        else:
                            xs[j][h].fill(0.0)
                    else:
                        cute.autovec_copy(x_chunks[x_rows[h], chunk, None], xs[j][h])
            for j in cutlass.range_constexpr(batch):
                self._mma_chunk(mma_atom, acc, frag_a, frag_b, w_lo[j], w_hi[j], xs[j])

    def _mma_chunk(self, mma_atom, acc, frag_a, frag_b, w_lo, w_hi, x_halves):
        """The MMAs of one 16-byte chunk of the two rows (``w_lo``, ``w_hi``)
        and of each half's activation chunk (``x_halves[h]``).  A plain method
        (its loops are Python loops): traced inline where the caller calls it."""
        # A 16-byte chunk is two MMA K-slices of 4 values per lane.
        for s in range(2):
            # Fragment order a0..a7: (row g, k0,k1) (row g+8, k0,k1)
            # (row g, k8,k9) (row g+8, k8,k9); k0,k1 <- chunk[4s:4s+2],
            # k8,k9 <- chunk[4s+2:4s+4], the same for the B operand.
            frag_a[0] = w_lo[4 * s + 0]
            frag_a[1] = w_lo[4 * s + 1]
            frag_a[2] = w_hi[4 * s + 0]
            frag_a[3] = w_hi[4 * s + 1]
            frag_a[4] = w_lo[4 * s + 2]
            frag_a[5] = w_lo[4 * s + 3]
            frag_a[6] = w_hi[4 * s + 2]
            frag_a[7] = w_hi[4 * s + 3]
            for h in range(self.halves):
                for v in range(4):
                    frag_b[v] = x_halves[h][4 * s + v]
                cute.gemm(mma_atom, acc[h], frag_a, frag_b, acc[h])

    def _mma_atom_and_fragments(self):
        mma_atom = cute.make_mma_atom(
            cute.nvgpu.warp.MmaF16BF16Op(
                BFloat16, Float32, (ROWS_PER_TILE, TOKENS_PER_MMA, MMA_K)
            )
        )
        frag_a = cute.make_rmem_tensor((8, 1, 1), BFloat16)
        frag_b = cute.make_rmem_tensor((4, 1, 1), BFloat16)
        return mma_atom, frag_a, frag_b

    @cute.jit
    def load_activations(
        self, x_chunks: cute.Tensor, x_rows, first_step, quad_lane, start=0, count=None
    ):
        """This lane's activation chunks of K-steps ``start .. start + count``
        of the warp's range (default: all of it), ``[step][h]`` (zeros past K):
        held across a warp's row tiles (``accumulate_staged``), or one batch's."""
        if cutlass.const_expr(count is None):
            count = self.steps
        xs = [
            [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(self.halves)]
            for _ in range(count)
        ]
        for j in cutlass.range_constexpr(count):
            chunk = (first_step + start + j) * LANES_PER_QUAD + quad_lane
            for h in cutlass.range_constexpr(self.halves):
                if cutlass.const_expr(self.k_ragged):
                    if chunk < self.k_chunks:
                        cute.autovec_copy(x_chunks[x_rows[h], chunk, None], xs[j][h])
                    else:
                        xs[j][h].fill(0.0)
                else:
                    cute.autovec_copy(x_chunks[x_rows[h], chunk, None], xs[j][h])
        return xs

    @cute.jit
    def accumulate_staged(
        self, acc, w_lo_rows: cute.Tensor, w_hi_rows: cute.Tensor, xs, first_step,
        quad_row, quad_lane, x_chunks=None, x_rows=None,
    ):  # fmt: skip
        """``acc[h] += W[tile, K range] @ x^T`` with the tile's two 8-row groups
        in shared memory: ``w_lo_rows``/``w_hi_rows`` are ``(8, chunks, 8)``
        views (16-byte reads), ``xs`` is ``load_activations``' result for the
        whole K range, or None: each batch then loads its own steps' chunks of
        ``x_chunks`` rows ``x_rows`` (L1 hits after a warp's first tile) ahead
        of its shared reads.  Chunks past K read as zeros (their activations
        are zeros too, but shared memory past a row may hold anything, NaN
        included)."""
        mma_atom, frag_a, frag_b = self._mma_atom_and_fragments()
        for batch_start in cutlass.range_constexpr(0, self.steps, self.unroll):
            batch = min(self.unroll, self.steps - batch_start)
            if cutlass.const_expr(xs is None):
                batch_xs = self.load_activations(
                    x_chunks, x_rows, first_step, quad_lane, batch_start, batch
                )
            else:
                batch_xs = xs[batch_start : batch_start + batch]
            w_lo = [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(batch)]
            w_hi = [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(batch)]
            for j in cutlass.range_constexpr(batch):
                chunk = (first_step + batch_start + j) * LANES_PER_QUAD + quad_lane
                if cutlass.const_expr(self.k_ragged):
                    if chunk < self.k_chunks:
                        cute.autovec_copy(w_lo_rows[quad_row, chunk, None], w_lo[j])
                        cute.autovec_copy(w_hi_rows[quad_row, chunk, None], w_hi[j])
                    else:
                        w_lo[j].fill(0.0)
                        w_hi[j].fill(0.0)
                else:
                    cute.autovec_copy(w_lo_rows[quad_row, chunk, None], w_lo[j])
                    cute.autovec_copy(w_hi_rows[quad_row, chunk, None], w_hi[j])
            for j in cutlass.range_constexpr(batch):
                self._mma_chunk(
                    mma_atom, acc, frag_a, frag_b, w_lo[j], w_hi[j], batch_xs[j]
                )

    @cute.jit
    def reduce_warps(self, acc, total, red, warp, lane, warps: cutlass.Constexpr):
        """Sum the accumulators of ``warps`` warps (K slices) into warp 0's
        ``total[4h + v]`` through shared memory ``red[warp, lane, value]``;
        ends with a barrier, so ``red`` may be reused afterwards."""
        vals = 4 * self.halves
        if cutlass.const_expr(warps > 1):
            for h in cutlass.range_constexpr(self.halves):
                for v in cutlass.range_constexpr(4):
                    red[warp, lane, 4 * h + v] = acc[h][v]
            cute.arch.sync_threads()
            if warp == 0:
                for v in cutlass.range_constexpr(vals):
                    total[v] = red[0, lane, v]
                for w in cutlass.range_constexpr(1, warps):
                    for v in cutlass.range_constexpr(vals):
                        total[v] = total[v] + red[w, lane, v]
            cute.arch.sync_threads()
        else:
            for h in cutlass.range_constexpr(self.halves):
                for v in cutlass.range_constexpr(4):
                    total[4 * h + v] = acc[h][v]

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Embedding lookup + the first layer's input RMSNorm in one launch (SM90).

``residual[b] = embed[ids[b]]`` and ``x[b] = rmsnorm(residual[b]) * gamma``,
one CTA per row, one 16-byte chunk of the row per thread.  The stock path runs
two kernels without programmatic dependent launch (``index_select``, vLLM's
``rms_norm``), so the first GEMM of the step starts cold behind them; this
launch lets its dependent start at once (``griddepcontrol.launch_dependents``
first), so the first in_proj loads its pre-wait weights while the rows are
gathered.  The norm rounds as every kernel of this package does
(``common.rmsnorm``): bf16 after the 1/rms scale, again after gamma.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from ..common.rmsnorm import normalized_chunk
from ..common.skinny_mma import CHUNK, WARP_THREADS
from ..common.warp import warp_sum

# Rows (tokens) of one launch: the grid's x dimension; the executor's largest
# prepared batch is 64.
MAX_ROWS = 1 << 16


class EmbedRmsNormKernel:
    """One launch per step: grid ``(rows,)``, ``hidden / 8`` threads."""

    def __init__(self, hidden: int, eps: float, use_pdl: bool = True):
        if hidden % CHUNK:
            raise ValueError(f"hidden={hidden} must be a multiple of {CHUNK}")
        self.hidden, self.eps, self.use_pdl = hidden, eps, use_pdl
        self.chunks = hidden // CHUNK
        self.warps = (self.chunks + WARP_THREADS - 1) // WARP_THREADS
        self.threads = self.warps * WARP_THREADS
        if self.threads > 1024:
            raise ValueError(f"hidden={hidden} needs more than 1024 threads")

    @cute.jit
    def __call__(
        self,
        ids_ptr: cute.Pointer,
        embed_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        residual_ptr: cute.Pointer,
        x_ptr: cute.Pointer,
        rows: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(ids_ptr, embed_ptr, gamma_ptr, residual_ptr, x_ptr).launch(
            grid=[rows, 1, 1],
            block=[self.threads, 1, 1],
            smem=self.warps * 4 + 16,
            stream=stream,
            use_pdl=self.use_pdl,
        )

    @cute.kernel
    def kernel(
        self,
        ids_ptr: cute.Pointer,
        embed_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        residual_ptr: cute.Pointer,
        x_ptr: cute.Pointer,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        if const_expr(self.use_pdl):
            # The next launch (the first in_proj) loads its weights meanwhile.
            cute.arch.griddepcontrol_launch_dependents()
        smem = cutlass.utils.SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps,)), 16)
        chunks = self.chunks
        layout = cute.make_layout((chunks, CHUNK), stride=(CHUNK, 1))
        gamma = cute.make_tensor(gamma_ptr, layout)
        # Threads past the row read chunk 0 (in bounds) and store nothing.
        chunk = cutlass.select_(tidx < chunks, tidx, Int32(0))
        g = cute.make_rmem_tensor((CHUNK,), BFloat16)
        cute.autovec_copy(gamma[chunk, None], g)
        if const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()  # the ids are the step's input
        ids = cute.make_tensor(ids_ptr, cute.make_layout((MAX_ROWS,)))
        embed_row = self._row(embed_ptr, ids[row])
        values = cute.make_rmem_tensor((CHUNK,), BFloat16)
        cute.autovec_copy(embed_row[chunk, None], values)
        square = Float32(0.0)
        for e in cutlass.range_constexpr(CHUNK):
            v = values[e].to(Float32)
            square = square + v * v
        square = cutlass.select_(tidx < chunks, square, Float32(0.0))
        square = warp_sum(square)
        if lane == 0:
            warp_sums[warp] = square
        cute.arch.sync_threads()
        total = Float32(0.0)
        for w in cutlass.range_constexpr(self.warps):
            total = total + warp_sums[w]
        scale = cute.math.rsqrt(total / Float32(self.hidden) + Float32(self.eps))
        out = cute.make_rmem_tensor((CHUNK,), BFloat16)
        normalized_chunk(values, g, scale, out)
        residual = self._row(residual_ptr, row)
        x = self._row(x_ptr, row)
        if tidx < chunks:
            cute.autovec_copy(values, residual[chunk, None])
            cute.autovec_copy(out, x[chunk, None])

    @cute.jit
    def _row(self, base_ptr: cute.Pointer, index):
        """Row ``index`` of a bf16 ``[*, hidden]`` array as (chunks, CHUNK); the
        offset in 64 bits (the embedding table is 755 MB)."""
        address = base_ptr.toint() + Int64(index) * Int64(self.hidden * 2)
        return cute.make_tensor(
            cute.make_ptr(BFloat16, address, cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((self.chunks, CHUNK), stride=(CHUNK, 1)),
        )

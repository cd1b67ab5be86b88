# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The new latent-cache row of each decode request, in one launch (SM90).

MLA's decode step writes one row per request into the paged latent cache: the
RMS-normalised compressed KV (``kv_c``, the first ``lora`` columns of the
``kv_a_proj_with_mqa`` output) followed by the rope key part (``k_pe``, the
last ``rope`` columns, as they are):

    cache[slot // block_size, slot % block_size] = [rmsnorm(kv_c) * w | k_pe]

Stock vLLM 0.26.0 does this in two launches (its RMSNorm kernel, then
``concat_and_cache_mla``), neither chained with programmatic dependent launch.
Here one CTA per request row does both: its threads hold 8 latent values
each (one 16-byte load), reduce the sum of squares through shared memory, and
store the normalised row and ``k_pe`` straight into the cache.  The rounding
follows vLLM's RMSNorm kernel: ``bf16(x * rsqrt(mean(x^2) + eps) * w)`` in
FP32, one rounding.  Rows whose slot is negative (graph padding) write
nothing.

PDL: the norm weight is loaded before ``griddepcontrol.wait``; the projection
rows and the slots (which a kernel before this one may write) after it, in
one round trip.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

# A 16-byte load holds 8 bf16.
CHUNK = 8
WARP_THREADS = 32
# Rows per launch (the decode graphs' batch sizes); one CTA each.
MAX_ROWS = 16


class MlaCacheRowKernel:
    """Compile-time shape: ``lora`` latent columns (normalised), ``rope``
    columns copied as they are, the projection's row stride and the cache's
    block size and strides (elements)."""

    def __init__(
        self,
        lora: int,
        rope: int,
        eps: float,
        x_row_stride: int,
        block_size: int,
        cache_block_stride: int,
        cache_token_stride: int,
        use_pdl: bool = True,
    ):
        if lora % (CHUNK * WARP_THREADS) or rope % CHUNK:
            raise ValueError(
                f"lora={lora} must be a multiple of {CHUNK * WARP_THREADS} and "
                f"rope={rope} of {CHUNK}"
            )
        if rope // CHUNK > lora // CHUNK:
            raise ValueError(f"rope={rope} wider than lora={lora}")
        for name, stride in (
            ("x_row_stride", x_row_stride),
            ("cache_block_stride", cache_block_stride),
            ("cache_token_stride", cache_token_stride),
        ):
            if stride % CHUNK:
                raise ValueError(
                    f"{name}={stride} must be a multiple of {CHUNK} (16-byte rows)"
                )
        self.lora, self.rope, self.eps = lora, rope, eps
        self.x_row_stride = x_row_stride
        self.block_size = block_size
        self.cache_block_stride = cache_block_stride
        self.cache_token_stride = cache_token_stride
        self.use_pdl = use_pdl
        # One thread per 8 latent values; the first rope/8 also copy k_pe.
        self.threads = lora // CHUNK
        self.warps = self.threads // WARP_THREADS

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        slot_ptr: cute.Pointer,
        cache_ptr: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(x_ptr, gamma_ptr, slot_ptr, cache_ptr, m).launch(
            grid=[MAX_ROWS, 1, 1],
            block=[self.threads, 1, 1],
            smem=4 * self.warps + 64,
            stream=stream,
            use_pdl=self.use_pdl,
        )

    @cute.kernel
    def kernel(
        self,
        x_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        slot_ptr: cute.Pointer,
        cache_ptr: cute.Pointer,
        m: Int32,
    ):
        lora, rope = self.lora, self.rope
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        if const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()
        smem = cutlass.utils.SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps,)), 16)
        rstd = smem.allocate_tensor(Float32, cute.make_layout((1,)), 4)
        if row < m:
            width_chunks = (lora + rope) // CHUNK
            x = cute.make_tensor(
                x_ptr,
                cute.make_layout(
                    (MAX_ROWS, width_chunks, CHUNK),
                    stride=(self.x_row_stride, CHUNK, 1),
                ),
            )
            gamma = cute.make_tensor(
                gamma_ptr,
                cute.make_layout((lora // CHUNK, CHUNK), stride=(CHUNK, 1)),
            )
            slots = cute.make_tensor(slot_ptr, cute.make_layout((MAX_ROWS,)))
            # The norm weight never depends on the previous kernel.
            g = cute.make_rmem_tensor((CHUNK,), BFloat16)
            cute.autovec_copy(gamma[tidx, None], g)
            if const_expr(self.use_pdl):
                cute.arch.griddepcontrol_wait()
            latent = cute.make_rmem_tensor((CHUNK,), BFloat16)
            pe = cute.make_rmem_tensor((CHUNK,), BFloat16)
            cute.autovec_copy(x[row, tidx, None], latent)
            # Threads past the rope chunks re-read chunk 0 (in bounds) and
            # store nothing of it.
            pe_chunk = cutlass.min(tidx, rope // CHUNK - 1)
            cute.autovec_copy(x[row, lora // CHUNK + pe_chunk, None], pe)
            slot = Int64(slots[row])
            square_sum = Float32(0.0)
            for i in cutlass.range_constexpr(CHUNK):
                v = latent[i].to(Float32)
                square_sum = square_sum + v * v
            for o in cutlass.range_constexpr(5):
                square_sum = square_sum + cute.arch.shuffle_sync_bfly(
                    square_sum, 16 >> o
                )
            if lane == 0:
                warp_sums[warp] = square_sum
            cute.arch.sync_threads()
            if tidx == 0:
                total = warp_sums[0]
                for w in cutlass.range_constexpr(1, self.warps):
                    total = total + warp_sums[w]
                rstd[0] = cute.math.rsqrt(total / Float32(lora) + Float32(self.eps))
            cute.arch.sync_threads()
            scale = rstd[0]
            normed = cute.make_rmem_tensor((CHUNK,), BFloat16)
            for i in cutlass.range_constexpr(CHUNK):
                normed[i] = (latent[i].to(Float32) * scale * g[i].to(Float32)).to(
                    BFloat16
                )
            if slot >= Int64(0):
                block = slot // Int64(self.block_size)
                offset = slot - block * Int64(self.block_size)
                base = block * Int64(self.cache_block_stride) + offset * Int64(
                    self.cache_token_stride
                )
                dst = cute.make_ptr(
                    BFloat16,
                    cache_ptr.toint() + base * Int64(2),
                    cute.AddressSpace.gmem,
                    assumed_align=16,
                )
                cache_row = cute.make_tensor(
                    dst, cute.make_layout((width_chunks, CHUNK), stride=(CHUNK, 1))
                )
                cute.autovec_copy(normed, cache_row[tidx, None])
                if tidx < rope // CHUNK:
                    cute.autovec_copy(pe, cache_row[lora // CHUNK + tidx, None])

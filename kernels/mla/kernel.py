# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MLA decode kernels (SM90): each request's new latent-cache row, and the
decode attention over the paged latent cache (split pass + merge).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.warp import warp_sum

# A 16-byte load holds 8 bf16.
CHUNK = 8
WARP_THREADS = 32
# Rows per launch (the decode graphs' batch sizes); one CTA each.
MAX_ROWS = 16


def _check_chunk_strides(**strides: int) -> None:
    """Element strides the kernels step in whole 16-byte chunks."""
    for name, stride in strides.items():
        if stride % CHUNK:
            raise ValueError(
                f"{name}={stride} must be a multiple of {CHUNK} (16-byte rows)"
            )


# ---------------------------------------------------------------------------
# The new latent-cache row of each decode request, in one launch
# ---------------------------------------------------------------------------
#
# MLA's decode step writes one row per request into the paged latent cache: the
# RMS-normalised compressed KV (``kv_c``, the first ``lora`` columns of the
# ``kv_a_proj_with_mqa`` output) followed by the rope key part (``k_pe``, the
# last ``rope`` columns, as they are):
#
#     cache[slot // block_size, slot % block_size] = [rmsnorm(kv_c) * w | k_pe]
#
# Stock vLLM 0.26.0 does this in two launches (its RMSNorm kernel, then
# ``concat_and_cache_mla``), neither chained with programmatic dependent launch.
# Here one CTA per request row does both: its threads hold 8 latent values
# each (one 16-byte load), reduce the sum of squares through shared memory, and
# store the normalised row and ``k_pe`` straight into the cache.  The rounding
# follows vLLM's RMSNorm kernel: ``bf16(x * rsqrt(mean(x^2) + eps) * w)`` in
# FP32, one rounding.  Rows whose slot is negative (graph padding) write
# nothing.
#
# PDL: the norm weight is loaded before ``griddepcontrol.wait``; the projection
# rows and the slots (which a kernel before this one may write) after it, in
# one round trip.


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
        _check_chunk_strides(
            x_row_stride=x_row_stride,
            cache_block_stride=cache_block_stride,
            cache_token_stride=cache_token_stride,
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
            square_sum = warp_sum(square_sum)
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


# ---------------------------------------------------------------------------
# Decode attention over the paged latent cache (split over the sequence)
# ---------------------------------------------------------------------------
#
# MLA decode with the absorbed query: per request and head,
#
#     o = softmax(scale * q K^T) V,   q = [ql_nope | q_pe] (lora + rope),
#     K = cache rows (lora + rope), V = their first lora columns,
#
# the output (lora wide per head) is what W_UV multiplies.  A decode request
# has one query token, so the work is one cache pass: a row's tokens are cut
# into up to `splits` contiguous ranges of TILE_TOKENS-token tiles, one CTA
# each; a CTA keeps an online softmax over its tiles and writes an FP32 partial
# (unnormalised output, running max and sum per head); a second launch merges
# the used splits in a fixed order (bit-reproducible) and writes bf16.
#
# Per tile the CTA stages the tile's cache rows (cp.async, 16 bytes each,
# through the block table) and computes, on mma.sync.m16n8k16 tensor cores:
#   S = Q K^T: heads are the MMA's M side, tokens its N side; warp w owns
#     head tile w % 2 and token tile w // 2 (32 heads x 32 tokens in 8 warps);
#   P V: heads M, latent columns N, tokens K; warp w owns lora / 8 columns.
# The MMA fragments pack two consecutive K values per register.  For S that
# is two consecutive latent columns, contiguous in both Q and the cache rows.
# For P V the K side is tokens: a lane's four K slots are mapped to four
# consecutive tokens (the same map for P and V, so the sum is unchanged), P's
# four values are one 8-byte load, and V's are four 8-byte loads of four
# columns each, one per token, regrouped in registers into the fragments of
# four MMAs whose output columns interleave (MMA column n of group member j
# is latent column 4n + j).
#
# Shared-memory rows are 16-byte chunks XOR-swizzled within each 128-byte
# group (`_swizzle`), so that both the S loads (8 lanes: two rows, four
# chunks) and the V loads (16 lanes: four rows four apart, two chunks) hit
# distinct banks.

# Cache rows per tile: four 8-token MMA columns for S, one 16-token MMA K step
# pair for P V.
TILE_TOKENS = 32
ATTN_WARPS = 8
ATTN_THREADS = ATTN_WARPS * WARP_THREADS
# mma.sync.m16n8k16: 16 heads (M) x 8 tokens (N) for S; K = 16.
HEADS_PER_MMA = 16
TOKENS_PER_MMA = 8
MMA_K = 16
# P V: four 8-column MMAs share one lane's four tokens; 32 latent columns.
PV_GROUP_MMAS = 4
PV_GROUP_COLS = PV_GROUP_MMAS * TOKENS_PER_MMA
# S pass: lane t of a quad reads chunk 4 i + t, so a warp step is 4 chunks.
QUAD_LANES = 4
# The swizzle permutes the 8 chunks of a 128-byte bank row.
CHUNKS_PER_BANK_ROW = 8
# Softmax: each head's TILE_TOKENS scores are spread over this many threads.
SOFTMAX_LANES = 8
# Row pitches of the score (FP32) and probability (bf16) tiles, in elements:
# the padding keeps the P loads of 16 lanes on distinct banks.
S_ROW_PITCH = TILE_TOKENS + 4
P_ROW_PITCH = TILE_TOKENS + 16
# The CTAs the split grid aims for: two per SM of an H200 at this kernel's
# ~82 KB of shared memory.  (132: the SMs of an H200; other SM90 parts only
# size the grid differently.)
CTAS_PER_SM = 2
SMEM_CARVEOUT_MAX = 100
H200_SMS = 132
TARGET_CTAS = H200_SMS * CTAS_PER_SM
# A row's tiles are cut into at most SHORT_SPLITS ranges (the merge reads
# them in two rounds) until a range would exceed LONG_TILES tiles (a CTA
# runs its tiles one after another); longer rows use more splits, up to the
# grid (TARGET_CTAS // B), so that long contexts stream the cache at HBM
# bandwidth from every SM rather than a few CTAs' tiles back to back.
SHORT_SPLITS = 64
LONG_TILES = 4
# Merge: one CTA per (head, row); each thread owns this many latent columns
# and reads (at most) this many splits' partials per round of loads.
MERGE_COLS = 4
MERGE_BATCH = 64
LOG2_E = 1.4426950408889634
BF16_BYTES = 2


def splits_for(batch: int) -> int:
    """The split grid's width for ``batch`` rows (compile-time)."""
    return max(1, TARGET_CTAS // batch)


def split_range(tiles: int, splits: int) -> tuple[int, int]:
    """(tiles per split, used splits) for ``tiles`` tiles and a grid of
    ``splits``: the host-side twin of ``_split_range`` (for tests)."""
    per_split = max(min(-(-tiles // SHORT_SPLITS), LONG_TILES), -(-tiles // splits), 1)
    return per_split, -(-tiles // per_split)


def _pick(cond, if_true, if_false):
    """Branch-free select that keeps the type of ``if_false``."""
    return type(if_false)(cutlass.select_(cond, if_true, if_false))


def _swizzle(row, chunk):
    """Physical 16-byte chunk of logical ``chunk`` in shared-memory ``row``.

    Bit 2 flips with the row's parity (the S loads read rows 2k and 2k + 1),
    bits 1-2 take row bits 2-3 (the V loads read rows 4 apart); the XOR stays
    inside the chunk's 128-byte group.
    """
    return chunk ^ ((((row >> 2) & 3) << 1) ^ ((row & 1) << 2))


@cute.jit
def _split_range(seq, splits: cutlass.Constexpr):
    """(tiles per split, used splits) of a row of ``seq`` tokens: contiguous
    ranges of whole tiles; both launches derive it from ``seq`` alone."""
    tiles = (seq + (TILE_TOKENS - 1)) // TILE_TOKENS
    short = cutlass.min((tiles + (SHORT_SPLITS - 1)) // SHORT_SPLITS, LONG_TILES)
    per_split = cutlass.max(
        cutlass.max(short, (tiles + (splits - 1)) // splits), Int32(1)
    )
    used = (tiles + per_split - 1) // per_split
    return tiles, per_split, used


class MlaDecodeAttentionKernel:
    """Split pass: partial outputs of one (split, row) per CTA.

    Compile-time shape: ``num_heads`` (32), ``lora`` (512), ``rope`` (64),
    the softmax ``scale``, the batch rows of the graph, the query's strides
    (``ql_nope`` rows; ``q_pe`` rows and heads), the cache's block size and
    strides (elements).  The block table's row stride is a launch argument:
    the warmup's stand-in table and vLLM's differ, and a compile must not
    happen inside graph capture.

    PDL: with ``metadata_before_wait`` the sequence lengths, the block table
    and every cache row but the request's newest are read before
    ``griddepcontrol.wait``: inside the decode graph nothing chained before
    this kernel writes them (the runner copies the metadata before the replay;
    older rows were written by earlier steps).  The newest row (written by the
    cache-row kernel just before) and the query are read after it.
    """

    def __init__(
        self,
        num_heads: int,
        lora: int,
        rope: int,
        scale: float,
        batch: int,
        q_nope_row_stride: int,
        q_pe_row_stride: int,
        q_pe_head_stride: int,
        block_size: int,
        cache_block_stride: int,
        cache_token_stride: int,
        use_pdl: bool = True,
        metadata_before_wait: bool = True,
    ):
        width = lora + rope
        if num_heads != 2 * HEADS_PER_MMA:
            raise ValueError(
                f"num_heads={num_heads}: the S pass's warp split (2 head tiles x "
                f"4 token tiles in {ATTN_WARPS} warps) is built for "
                f"{2 * HEADS_PER_MMA} heads"
            )
        if lora % (ATTN_WARPS * PV_GROUP_COLS) or rope % CHUNK:
            raise ValueError(
                f"lora={lora} must be a multiple of {ATTN_WARPS * PV_GROUP_COLS} and "
                f"rope={rope} of {CHUNK}"
            )
        if width % (CHUNK * CHUNKS_PER_BANK_ROW):
            raise ValueError(
                f"lora + rope = {width} must be a multiple of "
                f"{CHUNK * CHUNKS_PER_BANK_ROW} (whole swizzle groups)"
            )
        if not 1 <= batch <= MAX_ROWS:
            raise ValueError(f"batch={batch} is outside 1..{MAX_ROWS}")
        _check_chunk_strides(
            q_nope_row_stride=q_nope_row_stride,
            q_pe_row_stride=q_pe_row_stride,
            q_pe_head_stride=q_pe_head_stride,
            cache_block_stride=cache_block_stride,
            cache_token_stride=cache_token_stride,
        )
        self.num_heads, self.lora, self.rope = num_heads, lora, rope
        self.width, self.chunks = width, width // CHUNK
        self.lora_chunks, self.rope_chunks = lora // CHUNK, rope // CHUNK
        self.scale_log2 = scale * LOG2_E
        self.batch, self.splits = batch, splits_for(batch)
        self.q_nope_row_stride = q_nope_row_stride
        self.q_pe_row_stride = q_pe_row_stride
        self.q_pe_head_stride = q_pe_head_stride
        self.block_size = block_size
        self.cache_block_stride = cache_block_stride
        self.cache_token_stride = cache_token_stride
        self.use_pdl = use_pdl
        self.metadata_before_wait = metadata_before_wait
        # Without PDL nothing runs concurrently: the first tile in one pass.
        self.first_tile_rows = "older" if use_pdl else "all"
        self.head_tiles = num_heads // HEADS_PER_MMA
        self.cols_per_warp = lora // ATTN_WARPS
        self.groups_per_warp = self.cols_per_warp // PV_GROUP_COLS
        # Loads per thread to stage a tile (or the query): whole rounds.
        self.stage_rounds = TILE_TOKENS * self.chunks // ATTN_THREADS
        self.q_rounds = num_heads * self.chunks // ATTN_THREADS
        assert TILE_TOKENS * self.chunks % ATTN_THREADS == 0
        assert num_heads * self.chunks % ATTN_THREADS == 0
        assert self.head_tiles * (TILE_TOKENS // TOKENS_PER_MMA) == ATTN_WARPS
        assert num_heads * SOFTMAX_LANES == ATTN_THREADS

    def smem_bytes(self) -> int:
        rows = (self.num_heads + TILE_TOKENS) * self.width * BF16_BYTES
        scores = self.num_heads * S_ROW_PITCH * 4
        probs = self.num_heads * P_ROW_PITCH * BF16_BYTES
        row_bases = 8 * TILE_TOKENS
        return rows + scores + probs + 4 * self.num_heads + row_bases + 4 * 128

    @cute.jit
    def __call__(
        self,
        q_nope_ptr: cute.Pointer,
        q_pe_ptr: cute.Pointer,
        cache_ptr: cute.Pointer,
        block_table_ptr: cute.Pointer,
        block_table_stride: Int32,
        seq_lens_ptr: cute.Pointer,
        partial_o_ptr: cute.Pointer,
        partial_ml_ptr: cute.Pointer,
        stream: cuda.CUstream,
    ):
        self.kernel(
            q_nope_ptr, q_pe_ptr, cache_ptr, block_table_ptr, block_table_stride,
            seq_lens_ptr, partial_o_ptr, partial_ml_ptr,
        ).launch(
            grid=[self.splits, self.batch, 1],
            block=[ATTN_THREADS, 1, 1],
            smem=self.smem_bytes(),
            stream=stream,
            use_pdl=self.use_pdl,
            # Two CTAs per SM: at most 128 registers a thread, and all of the
            # unified L1 / shared memory as shared (the carve-out, in percent;
            # given here, the compile does not query a device for it).
            min_blocks_per_mp=CTAS_PER_SM,
            preferred_smem_carveout=SMEM_CARVEOUT_MAX,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        q_nope_ptr: cute.Pointer,
        q_pe_ptr: cute.Pointer,
        cache_ptr: cute.Pointer,
        block_table_ptr: cute.Pointer,
        block_table_stride: Int32,
        seq_lens_ptr: cute.Pointer,
        partial_o_ptr: cute.Pointer,
        partial_ml_ptr: cute.Pointer,
    ):
        heads, chunks = self.num_heads, self.chunks
        block_table = cute.make_tensor(
            block_table_ptr,
            cute.make_layout((self.batch, 1 << 24), stride=(block_table_stride, 1)),
        )
        tidx, _, _ = cute.arch.thread_idx()
        split, row, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        if const_expr(self.use_pdl):
            # The merge launches now and waits for this grid before reading.
            cute.arch.griddepcontrol_launch_dependents()

        smem = cutlass.utils.SmemAllocator()
        q_s = smem.allocate_tensor(
            BFloat16,
            cute.make_layout((heads, chunks, CHUNK), stride=(self.width, CHUNK, 1)),
            byte_alignment=128,
        )
        kv_s = smem.allocate_tensor(
            BFloat16,
            cute.make_layout(
                (TILE_TOKENS, chunks, CHUNK), stride=(self.width, CHUNK, 1)
            ),
            byte_alignment=128,
        )
        s_s = smem.allocate_tensor(
            Float32,
            cute.make_layout(
                (heads, S_ROW_PITCH // QUAD_LANES, QUAD_LANES),
                stride=(S_ROW_PITCH, QUAD_LANES, 1),
            ),
            byte_alignment=16,
        )
        p_s = smem.allocate_tensor(
            BFloat16,
            cute.make_layout(
                (heads, P_ROW_PITCH // QUAD_LANES, QUAD_LANES),
                stride=(P_ROW_PITCH, QUAD_LANES, 1),
            ),
            byte_alignment=16,
        )
        alpha_s = smem.allocate_tensor(Float32, cute.make_layout((heads,)), 16)
        # Element offset of each cache row of the tile being staged (-1: past
        # the sequence), read from the block table once per tile.
        row_base_s = smem.allocate_tensor(Int64, cute.make_layout((TILE_TOKENS,)), 16)
        # The same cache tile as 8-byte quarters of chunks, for the V loads.
        kv_quads = cute.make_tensor(
            kv_s.iterator,
            cute.make_layout(
                (TILE_TOKENS, 2 * chunks, QUAD_LANES),
                stride=(self.width, QUAD_LANES, 1),
            ),
        )

        seq_lens = cute.make_tensor(seq_lens_ptr, cute.make_layout((self.batch,)))
        if const_expr(self.use_pdl and not self.metadata_before_wait):
            cute.arch.griddepcontrol_wait()
        seq = seq_lens[row]
        tiles, per_split, _ = _split_range(seq, self.splits)
        first = split * per_split
        last = cutlass.min(first + per_split, tiles)
        # (Two ifs: a compile-time test cannot be and-ed with a traced one.)
        if const_expr(self.use_pdl and self.metadata_before_wait):  # noqa: SIM102
            if first >= last:
                # Idle splits wait too: this grid completes only after the one
                # before it, which the kernels after it rely on (the next MLA
                # layer's split pass rewrites the shared partials after its wait).
                cute.arch.griddepcontrol_wait()
        if first < last:
            self._tile_rows(row_base_s, block_table, row, first, seq, tidx)
            self._stage_tile(
                kv_s, row_base_s, cache_ptr, seq - first * TILE_TOKENS, tidx,
                self.first_tile_rows,
            )  # fmt: skip
            cute.arch.cp_async_commit_group()
            if const_expr(self.use_pdl and self.metadata_before_wait):
                cute.arch.griddepcontrol_wait()
            self._stage_query(q_s, q_nope_ptr, q_pe_ptr, row, tidx)
            if const_expr(self.use_pdl):
                self._stage_tile(
                    kv_s, row_base_s, cache_ptr, seq - first * TILE_TOKENS, tidx,
                    "newest",
                )  # fmt: skip
            cute.arch.cp_async_commit_group()

            # Output accumulators: [head tile][column group][group member].
            acc = [
                [
                    [cute.make_rmem_tensor((4, 1, 1), Float32) for _ in range(4)]
                    for _ in range(self.groups_per_warp)
                ]
                for _ in range(self.head_tiles)
            ]
            for mt in cutlass.range_constexpr(self.head_tiles):
                for gi in cutlass.range_constexpr(self.groups_per_warp):
                    for j in cutlass.range_constexpr(PV_GROUP_MMAS):
                        acc[mt][gi][j].fill(0.0)
            # Online softmax state of head tidx // SOFTMAX_LANES (log2 domain).
            run_max = Float32(-float("inf"))
            run_sum = Float32(0.0)
            for tile in cutlass.range(first, last):
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                self._scores(q_s, kv_s, s_s, warp, lane, tile, seq)
                cute.arch.sync_threads()
                run_max, run_sum = self._softmax(
                    s_s, p_s, alpha_s, tidx, run_max, run_sum
                )
                cute.arch.sync_threads()
                self._accumulate_pv(acc, p_s, kv_quads, alpha_s, warp, lane)
                cute.arch.sync_threads()
                if tile + 1 < last:
                    self._tile_rows(row_base_s, block_table, row, tile + 1, seq, tidx)
                    self._stage_tile(
                        kv_s, row_base_s, cache_ptr,
                        seq - (tile + 1) * TILE_TOKENS, tidx, "all",
                    )  # fmt: skip
                    cute.arch.cp_async_commit_group()

            self._store_partial(
                acc, partial_o_ptr, partial_ml_ptr, row, split, warp, lane, tidx,
                run_max, run_sum,
            )  # fmt: skip

    @cute.jit
    def _tile_rows(self, row_base_s, block_table, row, tile, seq, tidx):
        """Element offsets of ``tile``'s cache rows into ``row_base_s`` (-1
        past ``seq``): one block-table load per row, by the first warp; ends
        with a barrier."""
        if tidx < TILE_TOKENS:
            pos = tile * TILE_TOKENS + tidx
            base = Int64(-1)
            if pos < seq:
                block = block_table[row, pos // self.block_size]
                base = Int64(block) * Int64(self.cache_block_stride) + Int64(
                    pos % self.block_size
                ) * Int64(self.cache_token_stride)
            row_base_s[tidx] = base
        cute.arch.sync_threads()

    @cute.jit
    def _stage_tile(
        self, kv_s, row_base_s, cache_ptr, rows_left, tidx, which: cutlass.Constexpr
    ):
        """cp.async the tile's cache rows (``row_base_s``) into ``kv_s``; rows
        past the sequence are zeroed (their V must not be garbage: P is 0
        there, but 0 * NaN is not).  ``rows_left``: the sequence's tokens from
        the tile's first on (the newest row is ``rows_left - 1``).  ``which``:
        "all"; "older" (every row but the newest); "newest" (only that row, no
        zeroing)."""
        chunks = self.chunks
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=8 * BF16_BYTES * CHUNK
        )
        zeros = cute.make_rmem_tensor((CHUNK,), BFloat16)
        zeros.fill(0.0)
        for i in cutlass.range(self.stage_rounds, unroll=1):
            index = tidx + i * ATTN_THREADS
            r = index // chunks
            c = index % chunks
            dst = kv_s[r, _swizzle(r, c), None]
            base = row_base_s[r]
            if r < rows_left:
                if const_expr(which == "all"):
                    self._copy_cache_chunk(atom, cache_ptr, base, c, dst)
                elif const_expr(which == "older"):
                    if r != rows_left - 1:
                        self._copy_cache_chunk(atom, cache_ptr, base, c, dst)
                else:
                    if r == rows_left - 1:
                        self._copy_cache_chunk(atom, cache_ptr, base, c, dst)
            else:
                if const_expr(which != "newest"):
                    cute.autovec_copy(zeros, dst)

    @cute.jit
    def _copy_cache_chunk(self, atom, cache_ptr, base, c, dst):
        """cp.async chunk ``c`` of the cache row at element ``base`` to ``dst``."""
        src = cute.make_tensor(
            cute.make_ptr(
                BFloat16,
                cache_ptr.toint() + (base + Int64(c * CHUNK)) * Int64(BF16_BYTES),
                cute.AddressSpace.gmem,
                assumed_align=16,
            ),
            cute.make_layout((CHUNK,)),
        )
        cute.copy(atom, src, dst)

    @cute.jit
    def _stage_query(self, q_s, q_nope_ptr, q_pe_ptr, row, tidx):
        """cp.async this row's query, [ql_nope | q_pe] per head, into ``q_s``."""
        chunks, lora_chunks = self.chunks, self.lora_chunks
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=8 * BF16_BYTES * CHUNK
        )
        q_nope = cute.make_tensor(
            q_nope_ptr,
            cute.make_layout(
                (self.batch, self.num_heads * lora_chunks, CHUNK),
                stride=(self.q_nope_row_stride, CHUNK, 1),
            ),
        )
        q_pe = cute.make_tensor(
            q_pe_ptr,
            cute.make_layout(
                (self.batch, self.num_heads, self.rope_chunks, CHUNK),
                stride=(self.q_pe_row_stride, self.q_pe_head_stride, CHUNK, 1),
            ),
        )
        for i in cutlass.range(self.q_rounds, unroll=1):
            index = tidx + i * ATTN_THREADS
            h = index // chunks
            c = index % chunks
            dst = q_s[h, _swizzle(h, c), None]
            if c < lora_chunks:
                cute.copy(atom, q_nope[row, h * lora_chunks + c, None], dst)
            else:
                cute.copy(atom, q_pe[row, h, c - lora_chunks, None], dst)

    @cute.jit
    def _scores(self, q_s, kv_s, s_s, warp, lane, tile, seq):
        """S = scale * log2(e) * Q K^T of this warp's 16 heads x 8 tokens into
        ``s_s``; tokens past ``seq`` get -inf."""
        quad_row = lane // QUAD_LANES
        quad_lane = lane % QUAD_LANES
        head_tile = warp % self.head_tiles
        token_tile = warp // self.head_tiles
        h_lo = head_tile * HEADS_PER_MMA + quad_row
        h_hi = h_lo + HEADS_PER_MMA // 2
        token = token_tile * TOKENS_PER_MMA + quad_row
        mma_atom = cute.make_mma_atom(
            cute.nvgpu.warp.MmaF16BF16Op(
                BFloat16, Float32, (HEADS_PER_MMA, TOKENS_PER_MMA, MMA_K)
            )
        )
        # Four accumulators: the MMA chain is four times shorter.
        partial = [cute.make_rmem_tensor((4, 1, 1), Float32) for _ in range(4)]
        for a in cutlass.range_constexpr(4):
            partial[a].fill(0.0)
        frag_a = cute.make_rmem_tensor((8, 1, 1), BFloat16)
        frag_b = cute.make_rmem_tensor((4, 1, 1), BFloat16)
        # The swizzle changes only a chunk's low 3 bits, which here are the
        # step's parity and the quad lane: the physical chunk of step 2 p + e
        # is 8 p + (in-group chunk of e), computed once per row.
        in_group = [
            [(QUAD_LANES * e + quad_lane) ^ _swizzle(r, 0) for e in range(2)]
            for r in (h_lo, h_hi, token)
        ]
        # A dynamic loop over pairs of steps: fully unrolled, ptxas hoists all
        # 54 shared-memory loads and the kernel needs ~250 registers (one CTA
        # per SM instead of two).
        for pair in cutlass.range(self.chunks // (2 * QUAD_LANES), unroll=1):
            for parity in cutlass.range_constexpr(2):
                group = pair * CHUNKS_PER_BANK_ROW
                q_lo = cute.make_rmem_tensor((CHUNK,), BFloat16)
                q_hi = cute.make_rmem_tensor((CHUNK,), BFloat16)
                k = cute.make_rmem_tensor((CHUNK,), BFloat16)
                cute.autovec_copy(q_s[h_lo, group + in_group[0][parity], None], q_lo)
                cute.autovec_copy(q_s[h_hi, group + in_group[1][parity], None], q_hi)
                cute.autovec_copy(kv_s[token, group + in_group[2][parity], None], k)
                # A 16-byte chunk is two MMA K-slices of 4 values per lane (the
                # fragment order of kernels/common/skinny_mma.py).
                for s in cutlass.range_constexpr(2):
                    frag_a[0] = q_lo[4 * s + 0]
                    frag_a[1] = q_lo[4 * s + 1]
                    frag_a[2] = q_hi[4 * s + 0]
                    frag_a[3] = q_hi[4 * s + 1]
                    frag_a[4] = q_lo[4 * s + 2]
                    frag_a[5] = q_lo[4 * s + 3]
                    frag_a[6] = q_hi[4 * s + 2]
                    frag_a[7] = q_hi[4 * s + 3]
                    for v in cutlass.range_constexpr(4):
                        frag_b[v] = k[4 * s + v]
                    dst = partial[2 * parity + s]
                    cute.gemm(mma_atom, dst, frag_a, frag_b, dst)
        for v in cutlass.range_constexpr(4):
            total = (partial[0][v] + partial[1][v]) + (partial[2][v] + partial[3][v])
            head = h_lo if v < 2 else h_hi
            t = token_tile * TOKENS_PER_MMA + 2 * quad_lane + v % 2
            valid = tile * TILE_TOKENS + t < seq
            s_s[head, t // QUAD_LANES, t % QUAD_LANES] = _pick(
                valid, total * Float32(self.scale_log2), Float32(-float("inf"))
            )

    @cute.jit
    def _softmax(self, s_s, p_s, alpha_s, tidx, run_max, run_sum):
        """Online softmax of one tile: head tidx // 8 over 8 threads of 4
        tokens each.  Writes P (bf16) and the old-to-new rescale factor;
        returns the new running max and sum (identical in the 8 threads)."""
        head = tidx // SOFTMAX_LANES
        part = tidx % SOFTMAX_LANES
        scores = cute.make_rmem_tensor((QUAD_LANES,), Float32)
        cute.autovec_copy(s_s[head, part, None], scores)
        tile_max = cute.arch.fmax(
            cute.arch.fmax(scores[0], scores[1]), cute.arch.fmax(scores[2], scores[3])
        )
        for o in cutlass.range_constexpr(3):
            tile_max = cute.arch.fmax(
                tile_max, cute.arch.shuffle_sync_bfly(tile_max, 1 << o)
            )
        new_max = cute.arch.fmax(run_max, tile_max)
        probs = cute.make_rmem_tensor((QUAD_LANES,), BFloat16)
        tile_sum = Float32(0.0)
        for v in cutlass.range_constexpr(QUAD_LANES):
            p = cute.math.exp2(scores[v] - new_max, fastmath=True)
            tile_sum = tile_sum + p
            probs[v] = p.to(BFloat16)
        for o in cutlass.range_constexpr(3):
            tile_sum = tile_sum + cute.arch.shuffle_sync_bfly(tile_sum, 1 << o)
        # exp2(-inf) = 0 on the first tile: nothing to rescale.
        alpha = cute.math.exp2(run_max - new_max, fastmath=True)
        cute.autovec_copy(probs, p_s[head, part, None])
        if part == 0:
            alpha_s[head] = alpha
        return new_max, run_sum * alpha + tile_sum

    @cute.jit
    def _accumulate_pv(self, acc, p_s, kv_quads, alpha_s, warp, lane):
        """acc = alpha * acc + P V over this warp's lora / 8 columns."""
        quad_row = lane // QUAD_LANES
        quad_lane = lane % QUAD_LANES
        mma_atom = cute.make_mma_atom(
            cute.nvgpu.warp.MmaF16BF16Op(
                BFloat16, Float32, (HEADS_PER_MMA, TOKENS_PER_MMA, MMA_K)
            )
        )
        for mt in cutlass.range_constexpr(self.head_tiles):
            lo = alpha_s[mt * HEADS_PER_MMA + quad_row]
            hi = alpha_s[mt * HEADS_PER_MMA + quad_row + HEADS_PER_MMA // 2]
            for gi in cutlass.range_constexpr(self.groups_per_warp):
                for j in cutlass.range_constexpr(PV_GROUP_MMAS):
                    acc[mt][gi][j][0] = acc[mt][gi][j][0] * lo
                    acc[mt][gi][j][1] = acc[mt][gi][j][1] * lo
                    acc[mt][gi][j][2] = acc[mt][gi][j][2] * hi
                    acc[mt][gi][j][3] = acc[mt][gi][j][3] * hi
        frag_a = [
            cute.make_rmem_tensor((8, 1, 1), BFloat16) for _ in range(self.head_tiles)
        ]
        frag_b = cute.make_rmem_tensor((4, 1, 1), BFloat16)
        for ks in cutlass.range(TILE_TOKENS // MMA_K, unroll=1):
            # K slots 2t, 2t+1, 2t+8, 2t+9 of lane t <- tokens 4t .. 4t+3.
            quad = ks * QUAD_LANES + quad_lane
            for mt in cutlass.range_constexpr(self.head_tiles):
                p_lo = cute.make_rmem_tensor((QUAD_LANES,), BFloat16)
                p_hi = cute.make_rmem_tensor((QUAD_LANES,), BFloat16)
                h_lo = mt * HEADS_PER_MMA + quad_row
                cute.autovec_copy(p_s[h_lo, quad, None], p_lo)
                cute.autovec_copy(p_s[h_lo + HEADS_PER_MMA // 2, quad, None], p_hi)
                frag_a[mt][0] = p_lo[0]
                frag_a[mt][1] = p_lo[1]
                frag_a[mt][2] = p_hi[0]
                frag_a[mt][3] = p_hi[1]
                frag_a[mt][4] = p_lo[2]
                frag_a[mt][5] = p_lo[3]
                frag_a[mt][6] = p_hi[2]
                frag_a[mt][7] = p_hi[3]
            for gi in cutlass.range_constexpr(self.groups_per_warp):
                col0 = warp * self.cols_per_warp + gi * PV_GROUP_COLS
                chunk = col0 // CHUNK + quad_row // 2
                v = [cute.make_rmem_tensor((QUAD_LANES,), BFloat16) for _ in range(4)]
                for i in cutlass.range_constexpr(4):
                    r = ks * MMA_K + quad_lane * QUAD_LANES + i
                    quarter = 2 * _swizzle(r, chunk) + quad_row % 2
                    cute.autovec_copy(kv_quads[r, quarter, None], v[i])
                for j in cutlass.range_constexpr(PV_GROUP_MMAS):
                    for i in cutlass.range_constexpr(4):
                        frag_b[i] = v[i][j]
                    for mt in cutlass.range_constexpr(self.head_tiles):
                        dst = acc[mt][gi][j]
                        cute.gemm(mma_atom, dst, frag_a[mt], frag_b, dst)

    @cute.jit
    def _store_partial(
        self, acc, partial_o_ptr, partial_ml_ptr, row, split, warp, lane, tidx,
        run_max, run_sum,
    ):  # fmt: skip
        """The unnormalised output rows and (max, sum) per head of this split."""
        heads, lora = self.num_heads, self.lora
        quad_row = lane // QUAD_LANES
        quad_lane = lane % QUAD_LANES
        partial_o = cute.make_tensor(
            partial_o_ptr,
            cute.make_layout(
                (self.batch, self.splits, heads, lora // CHUNK, CHUNK),
                stride=(self.splits * heads * lora, heads * lora, lora, CHUNK, 1),
            ),
        )
        partial_ml = cute.make_tensor(
            partial_ml_ptr,
            cute.make_layout(
                (self.batch, self.splits, heads, 2),
                stride=(self.splits * heads * 2, heads * 2, 2, 1),
            ),
        )
        if tidx % SOFTMAX_LANES == 0:
            head = tidx // SOFTMAX_LANES
            partial_ml[row, split, head, 0] = run_max
            partial_ml[row, split, head, 1] = run_sum
        # Lane (g, t) holds, over the group's 4 MMAs, columns col0 + 8t .. + 7
        # of heads g and g + 8 (C fragment: columns 2t, 2t+1 -> 4n + j).
        for mt in cutlass.range_constexpr(self.head_tiles):
            for gi in cutlass.range_constexpr(self.groups_per_warp):
                col0 = warp * self.cols_per_warp + gi * PV_GROUP_COLS
                for half in cutlass.range_constexpr(2):
                    out = cute.make_rmem_tensor((CHUNK,), Float32)
                    for j in cutlass.range_constexpr(PV_GROUP_MMAS):
                        out[j] = acc[mt][gi][j][2 * half]
                        out[PV_GROUP_MMAS + j] = acc[mt][gi][j][2 * half + 1]
                    head = mt * HEADS_PER_MMA + quad_row + half * (HEADS_PER_MMA // 2)
                    chunk = col0 // CHUNK + quad_lane
                    cute.autovec_copy(out, partial_o[row, split, head, chunk, None])


class MlaAttentionMergeKernel:
    """Merge pass: ``out[row, head] = sum_s w_s O_s / sum_s w_s l_s`` with
    ``w_s = exp2(m_s - max m)`` over the used splits, in split order.  One CTA
    per (head, row); rows of ``seq`` 0 (graph padding) are written as zeros.
    The sequence lengths are read before ``griddepcontrol.wait`` (see
    MlaDecodeAttentionKernel), the partials after it."""

    def __init__(
        self,
        num_heads: int,
        lora: int,
        batch: int,
        out_row_stride: int,
        use_pdl: bool = True,
        metadata_before_wait: bool = True,
    ):
        if lora % MERGE_COLS or out_row_stride % MERGE_COLS:
            raise ValueError(
                f"lora={lora} and out_row_stride={out_row_stride} must be "
                f"multiples of {MERGE_COLS}"
            )
        if not 1 <= batch <= MAX_ROWS:
            raise ValueError(f"batch={batch} is outside 1..{MAX_ROWS}")
        self.num_heads, self.lora, self.batch = num_heads, lora, batch
        self.splits = splits_for(batch)
        self.out_row_stride = out_row_stride
        self.use_pdl = use_pdl
        self.metadata_before_wait = metadata_before_wait
        self.threads = lora // MERGE_COLS
        # Splits per round of loads: no more than the grid has.
        self.merge_batch = min(MERGE_BATCH, self.splits)
        # Splits' (max, sum) pairs each thread reads.
        self.ml_rounds = -(-self.splits // self.threads)

    def smem_bytes(self) -> int:
        rows = self.merge_batch * self.lora * 4
        return rows + 4 * (self.splits + self.threads // WARP_THREADS) + 3 * 16

    @cute.jit
    def __call__(
        self,
        partial_o_ptr: cute.Pointer,
        partial_ml_ptr: cute.Pointer,
        seq_lens_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        stream: cuda.CUstream,
    ):
        self.kernel(partial_o_ptr, partial_ml_ptr, seq_lens_ptr, out_ptr).launch(
            grid=[self.num_heads, self.batch, 1],
            block=[self.threads, 1, 1],
            smem=self.smem_bytes(),
            stream=stream,
            use_pdl=self.use_pdl,
        )

    @cute.kernel
    def kernel(
        self,
        partial_o_ptr: cute.Pointer,
        partial_ml_ptr: cute.Pointer,
        seq_lens_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
    ):
        heads, lora, splits = self.num_heads, self.lora, self.splits
        tidx, _, _ = cute.arch.thread_idx()
        head, row, _ = cute.arch.block_idx()
        if const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()
        smem = cutlass.utils.SmemAllocator()
        weight_s = smem.allocate_tensor(Float32, cute.make_layout((self.splits,)), 16)
        red_s = smem.allocate_tensor(
            Float32, cute.make_layout((self.threads // WARP_THREADS,)), 16
        )
        rows_s = smem.allocate_tensor(
            Float32,
            cute.make_layout(
                (self.merge_batch, self.threads, MERGE_COLS),
                stride=(self.threads * MERGE_COLS, MERGE_COLS, 1),
            ),
            16,
        )
        partial_o = cute.make_tensor(
            partial_o_ptr,
            cute.make_layout(
                (self.batch, splits, heads, lora // MERGE_COLS, MERGE_COLS),
                stride=(splits * heads * lora, heads * lora, lora, MERGE_COLS, 1),
            ),
        )
        partial_ml = cute.make_tensor(
            partial_ml_ptr,
            cute.make_layout(
                (self.batch, splits, heads, 2),
                stride=(splits * heads * 2, heads * 2, 2, 1),
            ),
        )
        out = cute.make_tensor(
            out_ptr,
            cute.make_layout(
                (self.batch, heads, lora // MERGE_COLS, MERGE_COLS),
                stride=(self.out_row_stride, lora, MERGE_COLS, 1),
            ),
        )
        seq_lens = cute.make_tensor(seq_lens_ptr, cute.make_layout((self.batch,)))
        if const_expr(self.use_pdl and not self.metadata_before_wait):
            cute.arch.griddepcontrol_wait()
        _, _, used = _split_range(seq_lens[row], splits)
        if const_expr(self.use_pdl and self.metadata_before_wait):
            cute.arch.griddepcontrol_wait()
        # Thread t holds the (max, sum) of splits t, t + threads, ...: the
        # overall max and the denominator by block reductions (fixed trees:
        # the same sums at every replay), the weights exp2(m_s - max) shared.
        maxima = cute.make_rmem_tensor((self.ml_rounds,), Float32)
        sums = cute.make_rmem_tensor((self.ml_rounds,), Float32)
        local_max = Float32(-float("inf"))
        for k in cutlass.range_constexpr(self.ml_rounds):
            s = tidx + k * self.threads
            maxima[k] = Float32(-float("inf"))
            sums[k] = Float32(0.0)
            if s < used:
                maxima[k] = partial_ml[row, s, head, 0]
                sums[k] = partial_ml[row, s, head, 1]
            local_max = cute.arch.fmax(local_max, maxima[k])
        top = self._block_reduce(local_max, "max", red_s, tidx)
        local_sum = Float32(0.0)
        for k in cutlass.range_constexpr(self.ml_rounds):
            s = tidx + k * self.threads
            weight = _pick(
                s < used, cute.math.exp2(maxima[k] - top, fastmath=True), Float32(0.0)
            )
            if s < self.splits:
                weight_s[s] = weight
            local_sum = local_sum + weight * sums[k]
        denom = self._block_reduce(local_sum, "sum", red_s, tidx)
        total = cute.make_rmem_tensor((MERGE_COLS,), Float32)
        total.fill(0.0)
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32 * MERGE_COLS
        )
        for s0 in cutlass.range(0, used, self.merge_batch, unroll=1):
            # All of the batch's partial rows in flight at once: cp.async
            # into shared memory (register loads would be issued a few at a
            # time by ptxas, one L2 round trip each); splits past `used`
            # re-read the last used one and weigh 0.  Each thread reads back
            # only what it copied: no barrier.
            for i in cutlass.range(self.merge_batch, unroll_full=True):
                s = cutlass.min(s0 + i, used - 1)
                cute.copy(
                    atom, partial_o[row, s, head, tidx, None], rows_s[i, tidx, None]
                )
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            for i in cutlass.range(self.merge_batch, unroll_full=True):
                w = weight_s[cutlass.min(s0 + i, self.splits - 1)]
                w = _pick(s0 + i < used, w, Float32(0.0))
                part = cute.make_rmem_tensor((MERGE_COLS,), Float32)
                cute.autovec_copy(rows_s[i, tidx, None], part)
                for v in cutlass.range_constexpr(MERGE_COLS):
                    total[v] = total[v] + w * part[v]
        result = cute.make_rmem_tensor((MERGE_COLS,), BFloat16)
        inv = _pick(used > 0, Float32(1.0) / denom, Float32(0.0))
        for v in cutlass.range_constexpr(MERGE_COLS):
            result[v] = (total[v] * inv).to(BFloat16)
        cute.autovec_copy(result, out[row, head, tidx, None])

    @cute.jit
    def _block_reduce(self, value, op: cutlass.Constexpr, red_s, tidx):
        """Max or sum of ``value`` over the CTA (butterfly in each warp, then
        the warps in order); every thread gets the result.  Ends with a
        barrier, so ``red_s`` may be reused."""
        for o in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_bfly(value, 16 >> o)
            if const_expr(op == "max"):
                value = cute.arch.fmax(value, other)
            else:
                value = value + other
        if tidx % WARP_THREADS == 0:
            red_s[tidx // WARP_THREADS] = value
        cute.arch.sync_threads()
        result = red_s[0]
        for w in cutlass.range_constexpr(1, self.threads // WARP_THREADS):
            if const_expr(op == "max"):
                result = cute.arch.fmax(result, red_s[w])
            else:
                result = result + red_s[w]
        cute.arch.sync_threads()
        return result

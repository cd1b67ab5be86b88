# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small-batch (M <= 16) MoE block for decode on SM90: router, experts, combine.

Four launches per layer, chained with programmatic dependent launch (PDL):

1. ``MoeRouterKernel``: router logits ``x @ W_gate^T`` (one CTA per 16-expert
   tile, its weight loaded before ``griddepcontrol.wait``; K is split over
   CTAs only for long K, and then the last CTA of the tile reduces), rounded
   to bf16 as the stock bf16 gate GEMM does.  With ``cluster_logits`` (the
   default when K is not split and there are 2..16 tiles) the tiles' CTAs are
   one thread-block cluster: each stores its logits into the shared memory of
   tile 0 through distributed shared memory, one cluster barrier publishes
   them, and tile 0 routes from its own shared memory (no global logits, GPU
   fence or atomic ticket).  Otherwise the logits go to global memory and the
   last tile of the grid (atomic ticket) routes from there.  The routing tile
   runs sigmoid + score-correction bias, top-k (ties to the lower
   expert id: each lane sorts its experts with a sorting network, then every
   round takes the best of the lanes' heads with two ``redux.sync``),
   renormalisation and scaling for every token, and writes a
   routing table: the distinct experts in ascending id ("slots"), each with its
   tokens, and for every (token, choice) the row its expert output will land in.
   With ``input_norm`` the router takes the residual stream instead of ``x``
   and applies the RMSNorm itself, from per-token sums of squares the
   producing GEMM accumulated (``residual_sumsq``): every CTA normalises the
   rows into shared memory, the first also writes them out as ``x`` for the
   experts, and the routing tile re-arms the sums.  The producer then needs no
   grid-wide ticket and whole-row pass between its tiles and the router.
2. ``MoeExpertKernel("gate_up")``: for every slot (and the shared expert as
   unit 0), ``h = SiLU(x W_gate^T) * (x W_up^T)`` over the slot's tokens.  The
   gate and the up row of an output column are the two 8-row halves of one
   MMA tile, so vLLM's stacked ``w13 [E, 2I, H]`` is read in place.
3. ``MoeExpertKernel("down")``: ``y = h W_2^T`` per slot, FP32 rows.
4. ``MoeCombineKernel``: per token, ``shared + sum_k weight_k * y_k`` in a
   fixed order (bit-reproducible), optionally + residual and RMSNorm.

Launch 2 and 3 have a static grid ``(tiles, slot_lanes)`` sized for the
M-bucket; a CTA walks the slots ``lane, lane + slot_lanes, ...`` that exist,
so idle CTAs exit at once and no host work depends on the routing.  Weights
never depend on the previous kernel, so each launch issues its first weight
loads before ``griddepcontrol.wait`` wherever the weight's address is known:
the router and the shared expert always, the routed ``down`` experts because
the routing table is complete before ``gate_up`` lets ``down`` launch.  The
combine reads the routing rows, weights, residual and gamma before its wait
too, so only the expert rows are left after it (one round trip).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync

from ..common.launch_bounds import ctas_for_registers, launch_bounds
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
from ..common.warp import warp_sum

STAGE_GATE_UP = "gate_up"
STAGE_DOWN = "down"
# Head key of a router lane whose experts top-k has all taken: below the key
# of any number.
REMOVED_KEY = -(2**31)
# The renormalisation divides by (sum + this), as vLLM's grouped top-k does.
RENORM_EPS = 1e-20
# K-steps of weight loads in flight per warp before their MMAs, by MMA width:
# both keep the staged fragments at ~96 registers per thread.
UNROLL_BY_HALVES = {1: 8, 2: 6}
# The combine kernel loads each token's expert rows in 16-byte halves of a
# CHUNK of FP32 values.
Y_HALF = CHUNK // 2
# The router's input normalisation loads this many 16-byte chunks per thread
# before using any (one L2 round trip per batch, not per chunk).
INPUT_NORM_LOADS_IN_FLIGHT = 8
# Row pitch padding (elements) of the router's normalised rows in shared
# memory: the 8 quad rows of a warp read 16-byte chunks of 8 different token
# rows, which a 64-byte skew spreads over distinct banks.
INPUT_ROW_SKEW = 32
# The router's logits through a thread-block cluster: SM90 launches clusters
# of up to 8 CTAs portably and up to 16 with the non-portable cluster size
# opt-in (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, which CuTe DSL
# sets on every kernel it loads); the cluster is the whole grid [tiles, 1, 1],
# so a CTA's rank in it is its tile, and tile 0 routes.
MAX_PORTABLE_CLUSTER = 8
MAX_CLUSTER_TILES = 16
CLUSTER_LEADER = 0
# The early shared down (``MoeGateUpEarlySharedDownKernel``): its words in the
# layer's int32 sync workspace, the count of the shared expert's gate_up tiles
# done (on a 128-byte line of its own: the waiting CTAs poll it), then one
# "done" flag per down row tile.
EARLY_H_TILES_DONE = 0
EARLY_DOWN_DONE = 32
# Pause between two polls of the count, in ns, and the polls after which a CTA
# leaves its shared down tiles to the down launch (~50 us; the count is normally
# complete ~1-2 us after a CTA's own tile): a grid whose shared-expert CTAs
# cannot all be resident at once is slower, never hung.
EARLY_POLL_NS = 32
EARLY_MAX_POLLS = 64
# Padding (elements) of a shared-memory row of staged down weights: rows 2 KiB
# apart would put the 8 rows a warp's quads read at once in the same banks.
EARLY_ROW_PAD = 8


def early_sync_words(hidden: int) -> int:
    """Int32 words of the early shared down's sync workspace for ``hidden``."""
    return EARLY_DOWN_DONE + hidden // ROWS_PER_TILE


def _ordered_key(value: Float32) -> Int32:
    """An Int32 whose signed order is ``value``'s order as a float (not NaN).

    Non-negative floats already order as their bit patterns; negative ones
    order reversed, so their magnitude bits are flipped.  -0.0 maps to the key
    of +0.0 so that the two compare equal, as floats do.
    """
    bits = Int32(llvm.bitcast(Int32.mlir_type, value.ir_value()))
    key = _pick(bits < 0, bits ^ Int32(0x7FFFFFFF), bits)
    return _pick(key == -1, Int32(0), key)


def _pick(cond, if_true, if_false):
    """Branch-free select that keeps the type of ``if_false``."""
    return type(if_false)(cutlass.select_(cond, if_true, if_false))


def lane_sort_network(n: int, keep: int) -> tuple[tuple[int, int], ...]:
    """Compare-exchanges ``(a, b)``, ``a < b``, that put the best ``keep`` of ``n``
    slots in order in slots ``0..keep-1`` (any strict total order).

    Batcher's merge exchange (Knuth, TAOCP 5.2.2, algorithm M) for any ``n``:
    19 compare-exchanges in 6 layers for 8.  Those that cannot reach the first
    ``keep`` slots are dropped (walking back from the end, a compare-exchange
    is kept when either of its slots still feeds a kept one).
    """
    pairs = []
    t = max(n - 1, 0).bit_length()
    p = 1 << t >> 1
    while p > 0:
        q, r, d = 1 << t >> 1, 0, p
        while d > 0:
            pairs += [(i, i + d) for i in range(n - d) if i & p == r]
            d, q, r = q - p, q >> 1, p
        p >>= 1
    live, kept = set(range(keep)), []
    for a, b in reversed(pairs):
        if a in live or b in live:
            live |= {a, b}
            kept.append((a, b))
    return tuple(reversed(kept))


def _compare_exchange(keys, ids, a: int, b: int):
    """Order slots ``a`` < ``b`` of a lane's candidates best first: the higher
    key, and of equal keys the lower expert id (what a round must pick)."""
    key_a, key_b, id_a, id_b = keys[a], keys[b], ids[a], ids[b]
    swap = (key_b > key_a) | ((key_b == key_a) & (id_b < id_a))
    keys[a] = cutlass.max(key_a, key_b)
    keys[b] = cutlass.min(key_a, key_b)
    ids[a] = _pick(swap, id_b, id_a)
    ids[b] = _pick(swap, id_a, id_b)


def uses_cluster_logits(tiles: int, split_k: int, cluster_logits: bool) -> bool:
    """Whether a router launch of ``tiles`` x ``split_k`` CTAs gathers its
    logits through a thread-block cluster (else global memory and a ticket)."""
    return cluster_logits and split_k == 1 and 2 <= tiles <= MAX_CLUSTER_TILES


def uses_warp_table(m_bucket: int, warp_table: bool) -> bool:
    """Whether the router's top-k warp writes the routing table itself: only
    where one token is routed, so that its top-k experts are the slots."""
    return warp_table and m_bucket == 1


def halves_for(m_bucket: int) -> int:
    return 1 if m_bucket <= TOKENS_PER_MMA else 2


class RoutingTable:
    """Int32 layout of the routing table the router writes (offsets in ints).

    ``count``: number of distinct routed experts (slots); per slot ``s`` <
    count: ``expert[s]``, ``ntok[s]``, ``row0[s]`` (first expert-output row)
    and ``tokens[s, 0:ntok]`` ascending; ``route_row[t, k]``: the expert-output
    row of token ``t``'s ``k``-th choice.  Rows ``0..m-1`` are the shared
    expert's (row = token), routed rows follow from ``m``.
    """

    def __init__(self, num_experts: int, top_k: int):
        self.num_experts, self.top_k = num_experts, top_k
        self.count = 0
        self.expert = 4
        self.ntok = self.expert + num_experts
        self.row0 = self.ntok + num_experts
        self.tokens = self.row0 + num_experts
        self.route_row = self.tokens + num_experts * MAX_TOKENS
        self.size = self.route_row + MAX_TOKENS * top_k
        # Expert-output rows: the shared expert's plus one per (token, choice).
        self.max_rows = MAX_TOKENS * (1 + top_k)


class MoeRouterKernel:
    """Router GEMV + top-k + routing table (launch 1).

    ``cluster_logits`` (effective when ``split_k == 1`` and 2 <= tiles <=
    MAX_CLUSTER_TILES, see ``uses_cluster_logits``): the grid is one cluster
    and the logits meet in tile 0's shared memory; ``logits_ptr`` and
    ``counter_ptr`` are then never touched (nothing but the router reads the
    logits: the global copy is written on the ticket path only).  Both paths
    give the same ids, scores, weights and table bit for bit.

    ``warp_table`` (effective at M-bucket 1 only, see ``uses_warp_table``):
    the one token's top-k warp writes the routing table itself, its k
    distinct experts ranked by id in registers, instead of the CTA-wide pass
    (expert masks, prefix sums, four barriers) that many tokens need.  The
    same table bit for bit.
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        m_bucket: int,
        split_k: int,
        warps: int,
        unroll: int,
        routed_scaling_factor: float,
        renormalize: bool = True,
        use_pdl: bool = True,
        input_norm: bool = False,
        input_eps: float = 1e-5,
        cluster_logits: bool = True,
        warp_table: bool = False,
    ):
        if num_experts % (ROWS_PER_TILE * 2) or num_experts > 32 * WARP_THREADS:
            raise ValueError(
                f"num_experts={num_experts} must be a multiple of 32 and <= 1024"
            )
        if not 1 <= top_k <= WARP_THREADS:
            raise ValueError(f"top_k={top_k} must be in 1..32")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.m_bucket, self.split_k, self.warps = m_bucket, split_k, warps
        self.scale = routed_scaling_factor
        self.renormalize = renormalize
        self.use_pdl = use_pdl
        self.input_norm, self.input_eps = input_norm, input_eps
        if input_norm and hidden % CHUNK:
            raise ValueError(f"input_norm needs H % {CHUNK} == 0, got H={hidden}")
        self.input_pitch = hidden + INPUT_ROW_SKEW
        self.halves = halves_for(m_bucket)
        self.tiles = num_experts // ROWS_PER_TILE
        self.cluster_logits = uses_cluster_logits(self.tiles, split_k, cluster_logits)
        # The whole grid is one cluster (tile t is rank t); None: no cluster.
        self.cluster_shape = [self.tiles, 1, 1] if self.cluster_logits else None
        self.warp_table = uses_warp_table(m_bucket, warp_table)
        self.threads = warps * WARP_THREADS
        if num_experts % self.threads:
            raise ValueError(
                f"num_experts={num_experts} must be a multiple of {self.threads}"
            )
        total_steps = ceil_div(hidden // CHUNK, LANES_PER_QUAD)
        slices = warps * split_k
        steps = ceil_div(total_steps, slices)
        if steps * (slices - 1) >= total_steps:
            raise ValueError(
                f"warps*split_k={slices} leaves a warp without K work for K={hidden}"
            )
        self.mma = WarpRowTileMma(
            hidden, steps, unroll, self.halves, steps * slices * STEP_K != hidden
        )
        self.table = RoutingTable(num_experts, top_k)
        # A lane's experts need ordering only as deep as top-k can take them.
        per_lane = num_experts // WARP_THREADS
        self.sort_network = lane_sort_network(per_lane, min(per_lane, top_k))

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        bias_ptr: cute.Pointer,
        partial_ptr: cute.Pointer,
        logits_ptr: cute.Pointer,
        counter_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        sums_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        normed_ptr: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        """With ``input_norm``, ``x_ptr`` is the residual stream ``[m, H]``,
        ``sums_ptr`` its per-token sums of squares, ``gamma_ptr`` the norm
        weight and ``normed_ptr`` where the normalised rows go; else the three
        are never touched."""
        self.kernel(
            x_ptr,
            w_ptr,
            bias_ptr,
            partial_ptr,
            logits_ptr,
            counter_ptr,
            table_ptr,
            weight_ptr,
            sums_ptr,
            gamma_ptr,
            normed_ptr,
            m,
        ).launch(  # fmt: skip
            grid=[self.tiles, self.split_k, 1],
            block=[self.threads, 1, 1],
            cluster=self.cluster_shape,
            smem=self._smem_bytes(),
            stream=stream,
            use_pdl=self.use_pdl,
        )

    def _smem_bytes(self) -> int:
        e, k = self.num_experts, self.top_k
        red = self.warps * WARP_THREADS * 4 * self.halves * 4
        select = 4 * (e * MAX_TOKENS + 2 * MAX_TOKENS * k + 2 * e + 2 * self.warps)
        rows = 2 * self.m_bucket * self.input_pitch if self.input_norm else 0
        # The cluster's logits [m_bucket, E] FP32 (in every CTA: one layout).
        logits = 4 * self.m_bucket * e if self.cluster_logits else 0
        # + alignment padding of each allocation
        return red + select + rows + logits + 4 * WARP_THREADS + 256

    @cute.kernel
    def kernel(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        bias_ptr: cute.Pointer,
        partial_ptr: cute.Pointer,
        logits_ptr: cute.Pointer,
        counter_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        sums_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        normed_ptr: cute.Pointer,
        m: Int32,
    ):
        hidden, e = self.hidden, self.num_experts
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(self.use_pdl):
            # The next launch waits for this grid before reading the table.
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.cluster_logits):
            # Remote shared memory may only be written once every CTA of the
            # cluster has started: arrive now (no ordering needed), wait just
            # before the first remote store, after this CTA's whole GEMV.
            cute.arch.cluster_arrive_relaxed()
        tile, split, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        quad_row = lane // LANES_PER_QUAD
        quad_lane = lane % LANES_PER_QUAD

        smem = cutlass.utils.SmemAllocator()
        vals = 4 * self.halves
        red = smem.allocate_tensor(
            Float32, cute.make_layout((self.warps, WARP_THREADS, vals)), 16
        )
        # The ticket path's "this CTA routes" flag (the cluster's router is
        # tile 0, known from the start).
        flag = None
        if const_expr(not self.cluster_logits):
            flag = smem.allocate_tensor(Int32, cute.make_layout((WARP_THREADS,)), 4)
        # Routing scratch: scores[t, e] (sigmoid, unbiased) for the weights;
        # choice[t, k] the k-th expert of token t; per-expert token mask (bit
        # t set when token t picked it) and first expert-output row.
        scores = smem.allocate_tensor(
            Float32, cute.make_layout((MAX_TOKENS, e), stride=(e, 1)), 16
        )
        choice = smem.allocate_tensor(
            Int32,
            cute.make_layout((MAX_TOKENS, self.top_k), stride=(self.top_k, 1)),
            16,
        )
        expert_mask = smem.allocate_tensor(Int32, cute.make_layout((e,)), 16)
        expert_row0 = smem.allocate_tensor(Int32, cute.make_layout((e,)), 16)
        warp_totals = smem.allocate_tensor(
            Int32, cute.make_layout((self.warps, 2), stride=(2, 1)), 16
        )
        cluster_logits = None
        if const_expr(self.cluster_logits):
            # cluster_logits[t, e]: every tile's logits, stored by the tiles
            # into tile 0's copy (the other CTAs' copies stay unused).
            cluster_logits = smem.allocate_tensor(
                Float32, self._logits_layout(self.m_bucket), 16
            )
        else:
            if tidx == 0:
                flag[0] = Int32(0)

        k_chunks = hidden // CHUNK
        w_chunks = cute.make_tensor(
            w_ptr, cute.make_layout((e, k_chunks, CHUNK), stride=(hidden, CHUNK, 1))
        )
        row_lo = tile * ROWS_PER_TILE + quad_row
        x_rows = [
            cutlass.min(quad_row + h * TOKENS_PER_MMA, m - 1)
            for h in range(self.halves)
        ]
        acc = new_accumulators(self.halves)
        first_step = (split * self.warps + warp) * self.mma.steps
        if const_expr(self.input_norm):
            # The MMAs read the rows this CTA normalised into shared memory.
            x_chunks = smem.allocate_tensor(
                BFloat16,
                cute.make_layout(
                    (self.m_bucket, k_chunks, CHUNK),
                    stride=(self.input_pitch, CHUNK, 1),
                ),
                16,
            )
            self.mma.accumulate(
                acc, w_chunks, row_lo, row_lo + TOKENS_PER_MMA, x_chunks, x_rows,
                first_step, quad_lane, self.use_pdl,
                lambda: self._normalize_input(
                    tidx, tile, split, m, x_ptr, sums_ptr, gamma_ptr, normed_ptr,
                    x_chunks,
                ),
            )  # fmt: skip
        else:
            x_chunks = cute.make_tensor(
                x_ptr,
                cute.make_layout(
                    (MAX_TOKENS, k_chunks, CHUNK), stride=(hidden, CHUNK, 1)
                ),
            )
            self.mma.accumulate(
                acc, w_chunks, row_lo, row_lo + TOKENS_PER_MMA, x_chunks, x_rows,
                first_step, quad_lane, self.use_pdl,
            )  # fmt: skip
        total = cute.make_rmem_tensor((vals,), Float32)
        self.mma.reduce_warps(acc, total, red, warp, lane, self.warps)
        if const_expr(self.cluster_logits):
            # The biases never change: every CTA loads them now (1 KiB from
            # L2), so that their round trip overlaps the cluster barrier
            # instead of following it in tile 0.
            my_bias = self._load_lane_bias(bias_ptr, lane)
            # Every thread of every CTA passes the cluster barriers (they count
            # threads); the other tiles are done after them.
            self._publish_logits_to_leader(
                total, tile, warp, quad_row, quad_lane, m, cluster_logits
            )
            if tile == CLUSTER_LEADER:
                self._finish_routing(
                    tidx, warp, lane, m, bias_ptr, cluster_logits.iterator,
                    counter_ptr, table_ptr, weight_ptr, sums_ptr, scores, choice,
                    expert_mask, expert_row0, warp_totals, my_bias,
                )  # fmt: skip
        else:
            if warp == 0:
                self._publish_logits(
                    total, tile, split, lane, quad_row, quad_lane, m, partial_ptr,
                    logits_ptr, counter_ptr, flag,
                )  # fmt: skip
            cute.arch.sync_threads()
            if flag[0] == 1:
                self._finish_routing(
                    tidx, warp, lane, m, bias_ptr, logits_ptr, counter_ptr,
                    table_ptr, weight_ptr, sums_ptr, scores, choice, expert_mask,
                    expert_row0, warp_totals,
                )  # fmt: skip

    def _logits_layout(self, rows: int):
        """logits[t, e] of ``rows`` tokens, expert-contiguous."""
        e = self.num_experts
        return cute.make_layout((rows, e), stride=(e, 1))

    @cute.jit
    def _finish_routing(
        self, tidx, warp, lane, m, bias_ptr, logits_src, counter_ptr, table_ptr,
        weight_ptr, sums_ptr, scores, choice, expert_mask, expert_row0, warp_totals,
        my_bias=None,
    ):  # fmt: skip
        """The routing CTA's work once every tile's logits are in
        ``logits_src`` (global on the ticket path, this CTA's shared memory on
        the cluster path): re-arm the input sums, then ``_route``."""
        if const_expr(self.input_norm):  # noqa: SIM102
            # Every CTA read the sums before its ticket (or before its cluster
            # barrier arrive): re-arm them for the producer's next launch.
            if tidx < MAX_TOKENS:
                sums = cute.make_tensor(sums_ptr, cute.make_layout((MAX_TOKENS,)))
                sums[tidx] = Float32(0.0)
        self._route(
            tidx, warp, lane, m, bias_ptr, logits_src, counter_ptr, table_ptr,
            weight_ptr, scores, choice, expert_mask, expert_row0, warp_totals,
            my_bias,
        )  # fmt: skip

    @cute.jit
    def _publish_logits_to_leader(
        self, total, tile, warp, quad_row, quad_lane, m, cluster_logits
    ):
        """Cluster path: warp 0 of every tile stores its bf16-rounded logits
        into tile 0's ``cluster_logits`` (distributed shared memory), then
        every thread passes the cluster barrier that publishes them."""
        # Pairs with the relaxed arrive at the start: every CTA exists.
        cute.arch.cluster_wait()
        if warp == 0:
            leader_logits = cute.make_tensor(
                cute.arch.map_dsmem_ptr(cluster_logits.iterator, CLUSTER_LEADER),
                cluster_logits.layout,
            )
            self._store_tile_logits(
                total, tile, quad_row, quad_lane, m, leader_logits, remote=True
            )
        # Release the remote stores (barrier.cluster.arrive defaults to
        # .release) and acquire them in tile 0 (wait defaults to .acquire),
        # cluster scope: no GPU-scope fence, no atomic.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def _normalize_input(
        self, tidx, tile, split, m, residual_ptr, sums_ptr, gamma_ptr, normed_ptr,
        rows,
    ):  # fmt: skip
        """``rows[t] = rmsnorm(residual[t]) * gamma`` for t < m (bf16, rounded
        as the GEMM's residual_rmsnorm epilogue does), from the producer's
        sums of squares; CTA (0, 0) also stores them to ``normed_ptr``.  Runs
        right after ``griddepcontrol.wait``; ends with a barrier."""
        hidden = self.hidden
        k_chunks = hidden // CHUNK
        chunks = cute.make_layout(
            (MAX_TOKENS, k_chunks, CHUNK), stride=(hidden, CHUNK, 1)
        )
        residual = cute.make_tensor(residual_ptr, chunks)
        normed = cute.make_tensor(normed_ptr, chunks)
        gamma = cute.make_tensor(
            gamma_ptr, cute.make_layout((k_chunks, CHUNK), stride=(CHUNK, 1))
        )
        iters = ceil_div(self.m_bucket * k_chunks, self.threads)
        for start in cutlass.range_constexpr(0, iters, INPUT_NORM_LOADS_IN_FLIGHT):
            batch = min(INPUT_NORM_LOADS_IN_FLIGHT, iters - start)
            hs = [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(batch)]
            gs = [cute.make_rmem_tensor((CHUNK,), BFloat16) for _ in range(batch)]
            sq = cute.make_rmem_tensor((batch,), Float32)
            for j in cutlass.range_constexpr(batch):
                item = tidx + (start + j) * self.threads
                token = item // k_chunks
                chunk = item % k_chunks
                if token < m:
                    cute.autovec_copy(residual[token, chunk, None], hs[j])
                    cute.autovec_copy(gamma[chunk, None], gs[j])
                    # The sums were added with atomics: read them from L2.
                    sq[j] = cute.arch.load(
                        sums_ptr + token, Float32, sem="relaxed", scope="gpu"
                    )
            for j in cutlass.range_constexpr(batch):
                item = tidx + (start + j) * self.threads
                token = item // k_chunks
                chunk = item % k_chunks
                if token < m:
                    scale = cute.math.rsqrt(
                        sq[j] / Float32(hidden) + Float32(self.input_eps)
                    )
                    res = cute.make_rmem_tensor((CHUNK,), BFloat16)
                    normalized_chunk(hs[j], gs[j], scale, res)
                    cute.autovec_copy(res, rows[token, chunk, None])
                    if tile == 0:  # noqa: SIM102 (run-time `and` does not lower)
                        if split == 0:
                            cute.autovec_copy(res, normed[token, chunk, None])
        cute.arch.sync_threads()

    @cute.jit
    def _publish_logits(
        self, total, tile, split, lane, quad_row, quad_lane, m, partial_ptr,
        logits_ptr, counter_ptr, flag,
    ):  # fmt: skip
        """Reduce the split-K partials of this tile (last CTA of the tile),
        store its bf16-rounded logits, and raise ``flag`` in the last tile."""
        vals = 4 * self.halves
        counters = cute.make_tensor(counter_ptr, cute.make_layout((self.tiles + 1,)))
        if const_expr(self.split_k > 1):
            partials = cute.make_tensor(
                partial_ptr,
                cute.make_layout(
                    (self.tiles, self.split_k, WARP_THREADS, vals),
                    stride=(
                        self.split_k * WARP_THREADS * vals,
                        WARP_THREADS * vals,
                        vals,
                        1,
                    ),
                ),
            )
            for v in cutlass.range_constexpr(vals):
                partials[tile, split, lane, v] = total[v]
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
                # Fixed summation order keeps the logits reproducible.
                for v in cutlass.range_constexpr(vals):
                    total[v] = partials[tile, 0, lane, v]
                for s in cutlass.range_constexpr(1, self.split_k):
                    for v in cutlass.range_constexpr(vals):
                        total[v] = total[v] + partials[tile, s, lane, v]
                if lane == 0:
                    counters[tile] = Int32(0)  # re-armed for the next launch
                self._store_logits(
                    total, tile, lane, quad_row, quad_lane, m, logits_ptr, counters,
                    flag,
                )  # fmt: skip
        else:
            self._store_logits(
                total, tile, lane, quad_row, quad_lane, m, logits_ptr, counters, flag
            )

    @cute.jit
    def _store_logits(
        self, total, tile, lane, quad_row, quad_lane, m, logits_ptr, counters, flag
    ):
        """Store this tile's bf16-rounded logits; the last tile raises ``flag``."""
        logits = cute.make_tensor(logits_ptr, self._logits_layout(MAX_TOKENS))
        self._store_tile_logits(total, tile, quad_row, quad_lane, m, logits)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        last = Int32(0)
        if lane == 0:
            last = cute.arch.atomic_add(
                counters.iterator + self.tiles, Int32(1), sem="acq_rel", scope="gpu"
            )
        last = cute.arch.shuffle_sync(last, 0)
        if lane == 0:  # noqa: SIM102
            if last == self.tiles - 1:
                flag[0] = Int32(1)

    @cute.jit
    def _store_tile_logits(
        self, total, tile, quad_row, quad_lane, m, logits,
        remote: cutlass.Constexpr = False,
    ):  # fmt: skip
        """``logits[t, e]`` of this tile's 16 experts for the tokens < m
        (warp 0's C fragments), rounded to bf16.  ``remote``: ``logits`` is
        another CTA's shared memory (DSMEM), which CuTe tensors do not
        store to element-wise: a scalar ``st.shared::cluster`` per value."""
        for h in cutlass.range_constexpr(self.halves):
            for v in cutlass.range_constexpr(4):
                token = h * TOKENS_PER_MMA + 2 * quad_lane + (v % 2)
                row = tile * ROWS_PER_TILE + quad_row + TOKENS_PER_MMA * (v // 2)
                if token < m:
                    # The stock gate is a bf16 GEMM: its logits are bf16.
                    value = total[4 * h + v].to(BFloat16).to(Float32)
                    if const_expr(remote):
                        one = cute.make_rmem_tensor((1,), Float32)
                        one[0] = value
                        offset = token * self.num_experts + row
                        dst = cute.make_tensor(
                            logits.iterator + offset, cute.make_layout((1,))
                        )
                        cute.autovec_copy(one, dst)
                    else:
                        logits[token, row] = value

    @cute.jit
    def _load_lane_bias(self, bias_ptr, lane):
        """The score-correction biases of this lane's E / 32 experts (as
        ``_route`` assigns them), in 16-byte vectors."""
        per_lane = self.num_experts // WARP_THREADS
        lane_bias = cute.make_tensor(
            bias_ptr, cute.make_layout((WARP_THREADS, per_lane), stride=(per_lane, 1))
        )
        my_bias = cute.make_rmem_tensor((per_lane,), Float32)
        cute.autovec_copy(lane_bias[lane, None], my_bias)
        return my_bias

    @cute.jit
    def _route(
        self, tidx, warp, lane, m, bias_ptr, logits_src, counter_ptr, table_ptr,
        weight_ptr, scores, choice, expert_mask, expert_row0, warp_totals,
        my_bias=None,
    ):  # fmt: skip
        """Top-k per token (one warp per token) and the routing table, from
        the logits at ``logits_src``: global memory [MAX_TOKENS, E] after the
        ticket, or this CTA's shared memory [m_bucket, E] after the cluster
        barrier (which already acquired them).  ``my_bias``: this lane's
        biases if already loaded (``_load_lane_bias``), else loaded here."""
        e, top_k, tab = self.num_experts, self.top_k, self.table
        per_lane = e // WARP_THREADS
        per_thread = e // self.threads
        if const_expr(not self.cluster_logits):
            # Acquire the other tiles' global logits after the ticket.
            cute.arch.fence_acq_rel_gpu()
        table = cute.make_tensor(table_ptr, cute.make_layout((tab.size,)))
        weights = cute.make_tensor(
            weight_ptr, cute.make_layout((MAX_TOKENS, top_k), stride=(top_k, 1))
        )
        if const_expr(not self.warp_table):
            for i in cutlass.range_constexpr(per_thread):
                expert_mask[tidx * per_thread + i] = Int32(0)
            cute.arch.sync_threads()

        # ---- top-k, one warp per token: lane l holds experts l*P .. l*P+P-1
        # (P = E / 32), loaded as whole 16-byte vectors before any is used.
        # Each lane first sorts its candidates (order-preserving integer key
        # descending, ties to the lower expert id) with a sorting network, so a
        # round's dependency chain is only its two redux.sync: the max of the
        # lanes' head keys, then the lowest head id holding it (ties go to the
        # lower expert id: a lane's head is its lowest id of that key); the
        # winning lane then shifts its list by one.  This replaces a P-deep max
        # and a P-deep select chain per round (and before that a shuffle tree
        # carrying value, score and id).
        logit_rows = MAX_TOKENS
        if const_expr(self.cluster_logits):
            logit_rows = self.m_bucket
        lane_logits = cute.make_tensor(
            logits_src,
            cute.make_layout(
                (logit_rows, WARP_THREADS, per_lane), stride=(e, per_lane, 1)
            ),
        )
        first_id = lane * per_lane
        if const_expr(my_bias is None):
            my_bias = self._load_lane_bias(bias_ptr, lane)
        token_args = (
            lane, lane_logits, my_bias, first_id, scores, weights, choice,
            expert_mask, table,
        )  # fmt: skip
        if const_expr(self.warp_table):
            # One token (M-bucket 1): warp 0 routes it, no loop.
            if warp == 0:
                self._route_token(Int32(0), *token_args)
        else:
            for t in cutlass.range(warp, m, self.warps):
                self._route_token(t, *token_args)
        if const_expr(not self.warp_table):
            cute.arch.sync_threads()
            self._store_table(
                tidx, warp, lane, m, table, choice, expert_mask, expert_row0,
                warp_totals,
            )  # fmt: skip
        if const_expr(not self.cluster_logits):  # noqa: SIM102
            if tidx == 0:
                # Re-arm the grid ticket for the next launch.
                counters = cute.make_tensor(
                    counter_ptr, cute.make_layout((self.tiles + 1,))
                )
                counters[self.tiles] = Int32(0)

    @cute.jit
    def _route_token(
        self, t, lane, lane_logits, my_bias, first_id, scores, weights, choice,
        expert_mask, table,
    ):  # fmt: skip
        """Top-k of token ``t`` by one warp, its weights, and its choices for
        the table (``choice`` and ``expert_mask``, or with ``warp_table`` the
        table itself)."""
        e, top_k = self.num_experts, self.top_k
        per_lane = e // WARP_THREADS
        my_logits = cute.make_rmem_tensor((per_lane,), Float32)
        cute.autovec_copy(lane_logits[t, lane, None], my_logits)
        # Slot per_lane is the sentinel a lane shifts in once all its
        # experts are taken: REMOVED_KEY (below every head that is left) and
        # id E (above every real id, so it never wins a tie).
        keys = cute.make_rmem_tensor((per_lane + 1,), Int32)
        ids = cute.make_rmem_tensor((per_lane + 1,), Int32)
        for j in cutlass.range_constexpr(per_lane):
            s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-my_logits[j]))
            scores[t, first_id + j] = s
            keys[j] = _ordered_key(s + my_bias[j])
            ids[j] = first_id + j
        keys[per_lane] = Int32(REMOVED_KEY)
        ids[per_lane] = Int32(e)
        # A Python loop over the constant network: unrolled while tracing.
        for a, b in self.sort_network:
            _compare_exchange(keys, ids, a, b)
        mine_id = Int32(0)
        for r in cutlass.range_constexpr(top_k):
            best = cute.arch.warp_redux_sync(keys[0], "max")
            candidate = _pick(keys[0] == best, ids[0], Int32(e))
            winner = cute.arch.warp_redux_sync(candidate, "min")
            mine_id = _pick(lane == r, winner, mine_id)
            # The winner's lane shifts; only the slots that can still become
            # a head in the rounds left are kept current.
            won = ids[0] == winner
            for j in cutlass.range_constexpr(min(per_lane, top_k - 1 - r)):
                keys[j] = _pick(won, keys[j + 1], keys[j])
                ids[j] = _pick(won, ids[j + 1], ids[j])
        cute.arch.sync_warp()
        mine_score = scores[t, mine_id]
        denom = Float32(1.0)
        if const_expr(self.renormalize):
            # Same fixed order in every lane: reproducible.
            total = Float32(RENORM_EPS)
            for r in cutlass.range_constexpr(top_k):
                total = total + cute.arch.shuffle_sync(mine_score, r)
            denom = total
        if lane < top_k:
            weights[t, lane] = mine_score / denom * Float32(self.scale)
            if const_expr(not self.warp_table):
                choice[t, lane] = mine_id
                cute.arch.atomic_or(
                    expert_mask.iterator + mine_id, Int32(1) << t, scope="cta"
                )
        if const_expr(self.warp_table):
            self._store_one_token_table(lane, mine_id, table)

    @cute.jit
    def _store_one_token_table(self, lane, mine_id, table):
        """The table of the one token (``warp_table``: token 0, so routed rows
        start at 1), by its top-k warp: lane ``r`` < k holds the r-th choice
        ``mine_id``; its slot is its id's rank among the k (distinct) choices,
        as the CTA-wide pass orders slots by id."""
        tab, top_k = self.table, self.top_k
        rank = Int32(0)
        for j in cutlass.range_constexpr(top_k):
            other = cute.arch.shuffle_sync(mine_id, j)
            rank = rank + _pick(other < mine_id, Int32(1), Int32(0))
        if lane < top_k:
            table[tab.expert + rank] = mine_id
            table[tab.ntok + rank] = Int32(1)
            table[tab.row0 + rank] = rank + 1
            table[tab.tokens + rank * MAX_TOKENS] = Int32(0)
            table[tab.route_row + lane] = rank + 1
        if lane == 0:
            table[tab.count] = Int32(top_k)

    @cute.jit
    def _store_table(
        self, tidx, warp, lane, m, table, choice, expert_mask, expert_row0,
        warp_totals,
    ):  # fmt: skip
        """The CTA-wide table pass, once every token's choices are in
        ``choice`` and ``expert_mask``."""
        tab, top_k = self.table, self.top_k
        per_thread = self.num_experts // self.threads
        # ---- distinct experts -> slots (ascending id), rows, token lists
        masks = cute.make_rmem_tensor((per_thread,), Int32)
        counts = cute.make_rmem_tensor((per_thread,), Int32)
        local_slots = Int32(0)
        local_rows = Int32(0)
        for i in cutlass.range_constexpr(per_thread):
            mask = expert_mask[tidx * per_thread + i]
            count = cute.arch.popc(mask)
            masks[i] = mask
            counts[i] = count
            local_slots = local_slots + _pick(count > 0, Int32(1), Int32(0))
            local_rows = local_rows + count
        # Exclusive prefix sums over threads: warp scan, then warp totals.
        # (shfl.up needs clamp 0: with the default 31 every lane keeps its own.)
        incl_slots = local_slots
        incl_rows = local_rows
        for o in cutlass.range_constexpr(5):
            up_slots = cute.arch.shuffle_sync_up(incl_slots, 1 << o, mask_and_clamp=0)
            up_rows = cute.arch.shuffle_sync_up(incl_rows, 1 << o, mask_and_clamp=0)
            has_up = lane >= (1 << o)
            incl_slots = incl_slots + _pick(has_up, up_slots, Int32(0))
            incl_rows = incl_rows + _pick(has_up, up_rows, Int32(0))
        if lane == WARP_THREADS - 1:
            warp_totals[warp, 0] = incl_slots
            warp_totals[warp, 1] = incl_rows
        cute.arch.sync_threads()
        slot = incl_slots - local_slots
        row = m + incl_rows - local_rows
        for w in cutlass.range_constexpr(self.warps - 1):
            before = w < warp
            slot = slot + _pick(before, warp_totals[w, 0], Int32(0))
            row = row + _pick(before, warp_totals[w, 1], Int32(0))
        for i in cutlass.range_constexpr(per_thread):
            ex = tidx * per_thread + i
            expert_row0[ex] = row
            if counts[i] > 0:
                table[tab.expert + slot] = ex
                table[tab.ntok + slot] = counts[i]
                table[tab.row0 + slot] = row
            pos = Int32(0)
            for t in cutlass.range_constexpr(MAX_TOKENS):
                bit = (masks[i] >> t) & 1
                if bit != 0:
                    table[tab.tokens + slot * MAX_TOKENS + pos] = Int32(t)
                pos = pos + bit
            slot = slot + _pick(counts[i] > 0, Int32(1), Int32(0))
            row = row + counts[i]
        if tidx == self.threads - 1:
            table[tab.count] = slot
        cute.arch.sync_threads()
        for p in cutlass.range(tidx, m * top_k, self.threads):
            t = p // top_k
            ex = choice[t, p % top_k]
            below = expert_mask[ex] & ((Int32(1) << t) - 1)
            table[tab.route_row + p] = expert_row0[ex] + cute.arch.popc(below)


class MoeExpertKernel:
    """Routed experts + shared expert, one projection (launch 2 or 3).

    ``gate_up``: ``x [m, H]`` bf16 -> ``h [rows, I]`` bf16 = SiLU(gate) * up.
    ``down``: ``h [rows, I]`` bf16 -> ``y [rows, H]`` FP32.
    ``w_ptr`` is the routed experts' weight (``[E, 2I, H]`` / ``[E, H, I]``),
    ``shared_w_ptr`` the shared expert's, of the same per-expert shape.
    ``weight_l2_policy`` (None, "evict_first", "evict_last"): the L2 cache
    policy of the expert weights' loads, shared expert included
    (``WarpRowTileMma``); None emits the plain loads. ``prewait_steps``: at
    most this many K-steps in a unit's first batch of weight loads (None:
    ``unroll``), the ones issued before the PDL wait where a unit loads before
    it; a warp with fewer steps loads them all there.

    ``max_registers`` (None: no bound): launch bounds that let ptxas use up to
    this many registers a thread (``min_blocks_per_mp``, ``.minnctapersm`` in
    the PTX).  Without them ptxas keeps fewer registers than the occupancy
    needs and sinks part of a batch's loads below its first MMAs, so a unit
    loading after its wait takes two HBM round trips, not one (SASS of gate_up
    at M-bucket 1, 8 warps: 110 registers, 10 of its 16 first-batch weight loads
    ahead of the first MMA; with 128 allowed, 116 registers and 14).  The PTX
    instructions are the same, so the outputs are bit for bit.
    """

    def __init__(
        self,
        stage: str,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        m_bucket: int,
        slot_lanes: int,
        warps: int,
        use_pdl: bool = True,
        weight_l2_policy: str | None = None,
        prewait_steps: int | None = None,
        max_registers: int | None = None,
    ):
        if stage not in (STAGE_GATE_UP, STAGE_DOWN):
            raise ValueError(f"unknown stage {stage!r}")
        if inter % TOKENS_PER_MMA or hidden % ROWS_PER_TILE:
            raise ValueError(
                f"need I % {TOKENS_PER_MMA} == 0 and H % {ROWS_PER_TILE} == 0, "
                f"got I={inter}, H={hidden}"
            )
        self.stage, self.hidden, self.inter = stage, hidden, inter
        self.num_experts, self.m_bucket = num_experts, m_bucket
        self.slot_lanes, self.warps, self.use_pdl = slot_lanes, warps, use_pdl
        self.halves = halves_for(m_bucket)
        self.table = RoutingTable(num_experts, top_k)
        if stage == STAGE_GATE_UP:
            self.k, self.tiles = hidden, inter // TOKENS_PER_MMA
            self.rows, self.out_cols = 2 * inter, inter
        else:
            self.k, self.tiles = inter, hidden // ROWS_PER_TILE
            self.rows, self.out_cols = hidden, hidden
        self.expert_elems = self.rows * self.k
        total_steps = ceil_div(self.k // CHUNK, LANES_PER_QUAD)
        steps = ceil_div(total_steps, warps)
        if steps * (warps - 1) >= total_steps:
            raise ValueError(f"{warps} warps leave one without K work for K={self.k}")
        k_ragged = steps * warps * STEP_K != self.k
        # One config serves every M-bucket and warp count (MoeConfig): an
        # 8-warp down has 4 steps a warp where a 4-warp one has 8.
        if prewait_steps is not None:
            prewait_steps = min(prewait_steps, steps)
        # One main loop per MMA width (the 16-token bucket uses both).
        self.mmas = {
            h: WarpRowTileMma(
                self.k,
                steps,
                UNROLL_BY_HALVES[h],
                h,
                k_ragged,
                weight_l2_policy,
                prewait_steps,
            )  # fmt: skip
            for h in range(1, self.halves + 1)
        }
        self.threads = warps * WARP_THREADS
        self.launch_bounds = launch_bounds(
            None
            if max_registers is None
            else ctas_for_registers(max_registers, self.threads),
            self.threads,
        )

    def reduction_bytes(self) -> int:
        """Shared memory of the cross-warp reduction every expert CTA ends with."""
        return self.warps * WARP_THREADS * 4 * self.halves * 4

    @cute.jit
    def _reduction_buffer(self, smem):
        return smem.allocate_tensor(
            Float32,
            cute.make_layout((self.warps, WARP_THREADS, 4 * self.halves)),
            16,
        )

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        shared_w_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        red_bytes = self.reduction_bytes()
        self.kernel(x_ptr, w_ptr, shared_w_ptr, table_ptr, out_ptr, m).launch(
            grid=[self.tiles, self.slot_lanes, 1],
            block=[self.threads, 1, 1],
            smem=red_bytes + 64,
            stream=stream,
            use_pdl=self.use_pdl,
            **self.launch_bounds,
        )

    @cute.kernel
    def kernel(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        shared_w_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        m: Int32,
    ):
        tab = self.table
        tile, slot_lane, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        red = self._reduction_buffer(smem)
        table = cute.make_tensor(table_ptr, cute.make_layout((tab.size,)))
        if const_expr(self.stage == STAGE_GATE_UP):
            # The shared expert's weights and tokens are known before the
            # router finishes: stream them first.
            if slot_lane == 0:
                self._unit(
                    Int32(0), tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr,
                    red, m, self.use_pdl,
                )  # fmt: skip
            if const_expr(self.use_pdl):
                cute.arch.griddepcontrol_wait()
                # Only now: ``down`` reads the routing table before its wait.
                cute.arch.griddepcontrol_launch_dependents()
            first = slot_lane
            if slot_lane == 0:
                first = Int32(self.slot_lanes)
            for unit in cutlass.range(first, table[tab.count] + 1, self.slot_lanes):
                self._unit(
                    unit, tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr, red,
                    m, False,
                )  # fmt: skip
        else:
            if const_expr(self.use_pdl):
                cute.arch.griddepcontrol_launch_dependents()
            # The router finished before ``gate_up`` let this grid launch.
            for unit in cutlass.range(slot_lane, table[tab.count] + 1, self.slot_lanes):
                self._unit(
                    unit, tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr, red,
                    m, self.use_pdl,
                )  # fmt: skip

    @cute.jit
    def _unit(
        self, unit, tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr, red, m,
        weights_before_wait: cutlass.Constexpr,
    ):  # fmt: skip
        """One expert (``unit`` 0: shared, else routed slot ``unit - 1``) for
        this CTA's tile of output columns."""
        tab = self.table
        # Selects, not branches (this runs inside the dynamic slot loop); for
        # the shared unit the table reads hit valid, unused entries.
        slot = unit - 1
        routed = unit != 0
        # The expert's base address, re-asserted 16-byte aligned: a pointer
        # advanced by a run-time offset would lose the alignment and with it
        # the 16-byte vector loads.
        expert_bytes = Int64(self.expert_elems * 2)
        routed_base = w_ptr.toint() + Int64(table[tab.expert + slot]) * expert_bytes
        base = _pick(routed, routed_base, shared_w_ptr.toint())
        weight_ptr = cute.make_ptr(
            BFloat16, base, cute.AddressSpace.gmem, assumed_align=16
        )
        ntok = _pick(routed, table[tab.ntok + slot], m)
        row0 = _pick(routed, table[tab.row0 + slot], Int32(0))
        if const_expr(self.halves == 1):
            self._project(
                1, slot, routed, tile, weight_ptr, x_ptr, table, out_ptr, red,
                ntok, row0, weights_before_wait,
            )  # fmt: skip
        else:
            # Most slots hold <= 8 tokens even at M = 16: their path runs one
            # MMA per fragment with the deeper load batch.
            if ntok <= TOKENS_PER_MMA:
                self._project(
                    1, slot, routed, tile, weight_ptr, x_ptr, table, out_ptr, red,
                    ntok, row0, weights_before_wait,
                )  # fmt: skip
            else:
                self._project(
                    2, slot, routed, tile, weight_ptr, x_ptr, table, out_ptr, red,
                    ntok, row0, weights_before_wait,
                )  # fmt: skip

    @cute.jit
    def _project(
        self, halves: cutlass.Constexpr, slot, routed, tile, weight_ptr, x_ptr,
        table, out_ptr, red, ntok, row0, weights_before_wait: cutlass.Constexpr,
    ):  # fmt: skip
        """This CTA's output tile of one expert for its ``ntok`` tokens, with
        ``halves`` 8-token MMA columns."""
        tab, mma = self.table, self.mmas[halves]
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        quad_row = lane // LANES_PER_QUAD
        quad_lane = lane % LANES_PER_QUAD
        k_chunks = self.k // CHUNK
        w_chunks = cute.make_tensor(
            weight_ptr,
            cute.make_layout((self.rows, k_chunks, CHUNK), stride=(self.k, CHUNK, 1)),
        )
        x_chunks = cute.make_tensor(
            x_ptr,
            cute.make_layout(
                (self.table.max_rows, k_chunks, CHUNK), stride=(self.k, CHUNK, 1)
            ),
        )
        x_rows = []
        for h in cutlass.range_constexpr(halves):
            pos = cutlass.min(quad_row + h * TOKENS_PER_MMA, ntok - 1)
            if const_expr(self.stage == STAGE_GATE_UP):
                slot_token = table[tab.tokens + slot * MAX_TOKENS + pos]
                x_rows.append(_pick(routed, slot_token, pos))
            else:
                x_rows.append(row0 + pos)
        if const_expr(self.stage == STAGE_GATE_UP):
            # Tile i: gate rows 8i..8i+7, then the matching up rows.
            row_lo = tile * TOKENS_PER_MMA + quad_row
            row_hi = row_lo + self.inter
        else:
            row_lo = tile * ROWS_PER_TILE + quad_row
            row_hi = row_lo + TOKENS_PER_MMA
        acc = new_accumulators(halves)
        mma.accumulate(
            acc, w_chunks, row_lo, row_hi, x_chunks, x_rows, warp * mma.steps,
            quad_lane, weights_before_wait,
        )  # fmt: skip
        total = cute.make_rmem_tensor((4 * halves,), Float32)
        mma.reduce_warps(acc, total, red, warp, lane, self.warps)
        if warp == 0:
            if const_expr(self.stage == STAGE_GATE_UP):
                out = cute.make_tensor(
                    out_ptr,
                    cute.make_layout(
                        (self.table.max_rows, self.inter), stride=(self.inter, 1)
                    ),
                )
                col = tile * TOKENS_PER_MMA + quad_row
                for h in cutlass.range_constexpr(halves):
                    for v in cutlass.range_constexpr(2):
                        token = h * TOKENS_PER_MMA + 2 * quad_lane + v
                        gate = total[4 * h + v]
                        up = total[4 * h + 2 + v]
                        silu = gate / (Float32(1.0) + cute.math.exp(-gate))
                        if token < ntok:
                            out[row0 + token, col] = (silu * up).to(BFloat16)
            else:
                out = cute.make_tensor(
                    out_ptr,
                    cute.make_layout(
                        (self.table.max_rows, self.hidden), stride=(self.hidden, 1)
                    ),
                )
                for h in cutlass.range_constexpr(halves):
                    for v in cutlass.range_constexpr(4):
                        token = h * TOKENS_PER_MMA + 2 * quad_lane + (v % 2)
                        row = (
                            tile * ROWS_PER_TILE + quad_row + TOKENS_PER_MMA * (v // 2)
                        )
                        if token < ntok:
                            out[row0 + token, row] = total[4 * h + v]


class MoeGateUpEarlySharedDownKernel(MoeExpertKernel):
    """``gate_up`` (launch 2) whose shared-expert CTAs also run the shared
    expert's down projection, so that the ``down`` launch streams the routed
    experts only and the shared down's weights load before this launch's PDL
    wait, while the router still runs.

    A shared-expert CTA (slot lane 0, column tile ``t``) stages the shared
    down's rows of down tile ``t`` (16 x I bf16) into shared memory with
    cp.async before its wait, runs its shared gate_up tile as ``gate_up``
    does, counts it done (a GPU-scope atomic after its h columns), and then
    polls the count until every tile of the shared h exists.  It computes down
    tile ``t`` (and ``t + tiles``, ... where down has more tiles) from shared
    memory with the K split of the ``down`` launch (``down_warps`` warps,
    that launch's ``WarpRowTileMma`` shape), so the FP32 sums are the down
    launch's bit for bit, writes the shared expert's rows of ``y`` and marks
    the tile done.  ``MoeDownAfterEarlySharedKernel`` computes every tile not
    marked (a CTA that stopped polling after ``max_polls``) and re-arms the
    flags and the count, so the pair replays in a CUDA graph.

    Only for M-buckets of up to 8 tokens (one MMA column).
    """

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        m_bucket: int,
        slot_lanes: int,
        warps: int,
        down_warps: int,
        use_pdl: bool = True,
        weight_l2_policy: str | None = None,
        prewait_steps: int | None = None,
        max_polls: int = EARLY_MAX_POLLS,
        max_registers: int | None = None,
    ):
        super().__init__(
            STAGE_GATE_UP, hidden, inter, num_experts, top_k, m_bucket, slot_lanes,
            warps, use_pdl, weight_l2_policy, prewait_steps, max_registers,
        )  # fmt: skip
        if self.halves != 1:
            raise ValueError(
                f"the early shared down is for M-buckets of up to {TOKENS_PER_MMA} "
                f"tokens, got {m_bucket}"
            )
        if down_warps > warps:
            raise ValueError(
                f"the shared down's {down_warps} warps must be among gate_up's {warps}"
            )
        # The down launch's K split (its shared unit's arithmetic, bit for
        # bit); the weights come from shared memory here, so no L2 policy. The
        # warps past ``down_warps`` find their K range past the row: guarded,
        # they load nothing and add zeros that reduce_warps leaves out.
        down = MoeExpertKernel(
            STAGE_DOWN, hidden, inter, num_experts, top_k, m_bucket, slot_lanes,
            down_warps, use_pdl,
        )  # fmt: skip
        plain = down.mmas[1]
        self.down_mma = WarpRowTileMma(
            inter, plain.steps, plain.unroll, 1, plain.k_ragged or warps > down_warps
        )
        self.down_warps = down_warps
        self.down_tiles = down.tiles
        self.down_k_chunks = inter // CHUNK
        self.row_pitch = inter + EARLY_ROW_PAD
        stage_chunks = ROWS_PER_TILE * self.down_k_chunks
        if stage_chunks % self.threads:
            raise ValueError(
                f"{stage_chunks} weight chunks of a down tile do not split over "
                f"{self.threads} threads"
            )
        self.stage_rounds = stage_chunks // self.threads
        self.max_polls = max_polls

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        shared_w_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        shared_down_ptr: cute.Pointer,
        y_ptr: cute.Pointer,
        sync_ptr: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        red_bytes = self.reduction_bytes()
        stage_bytes = ROWS_PER_TILE * self.row_pitch * 2
        args = (x_ptr, w_ptr, shared_w_ptr, table_ptr, out_ptr, shared_down_ptr, y_ptr)
        self.kernel(*args, sync_ptr, m).launch(
            grid=[self.tiles, self.slot_lanes, 1],
            block=[self.threads, 1, 1],
            smem=red_bytes + stage_bytes + 64,
            stream=stream,
            use_pdl=self.use_pdl,
            **self.launch_bounds,
        )

    @cute.kernel
    def kernel(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        shared_w_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        shared_down_ptr: cute.Pointer,
        y_ptr: cute.Pointer,
        sync_ptr: cute.Pointer,
        m: Int32,
    ):
        tab = self.table
        tile, slot_lane, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        smem = cutlass.utils.SmemAllocator()
        red = self._reduction_buffer(smem)
        staged = smem.allocate_tensor(
            BFloat16,
            cute.make_layout(
                (ROWS_PER_TILE, self.down_k_chunks, CHUNK),
                stride=(self.row_pitch, CHUNK, 1),
            ),
            16,
        )
        ready = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)
        table = cute.make_tensor(table_ptr, cute.make_layout((tab.size,)))
        sync = cute.make_tensor(
            sync_ptr, cute.make_layout((early_sync_words(self.hidden),))
        )
        if slot_lane == 0:
            # The shared down's weights never depend on the router: stage them
            # now, beside the shared gate_up's first weight batch.
            if tile < self.down_tiles:
                self._stage_down_rows(staged, shared_down_ptr, tile, tidx)
            cute.arch.cp_async_commit_group()
            self._unit(
                Int32(0), tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr, red, m,
                self.use_pdl,
            )  # fmt: skip
            # Warp 0 stored this tile's h columns: publish them (release).
            if warp == 0:
                cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.atomic_add(
                        sync.iterator + EARLY_H_TILES_DONE, Int32(1), sem="acq_rel",
                        scope="gpu",
                    )  # fmt: skip
        if const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()
            # Only now: ``down`` reads the routing table before its wait.
            cute.arch.griddepcontrol_launch_dependents()
        first = slot_lane
        if slot_lane == 0:
            self._early_shared_down(
                staged, ready, red, sync, shared_down_ptr, out_ptr, y_ptr, tile, m,
                tidx, warp, lane,
            )  # fmt: skip
            first = Int32(self.slot_lanes)
        for unit in cutlass.range(first, table[tab.count] + 1, self.slot_lanes):
            self._unit(
                unit, tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr, red, m, False
            )

    @cute.jit
    def _stage_down_rows(self, staged, shared_down_ptr, down_tile, tidx):
        """cp.async the shared down's 16 weight rows of ``down_tile`` into
        ``staged`` (every thread its ``stage_rounds`` 16-byte chunks)."""
        k_chunks = self.down_k_chunks
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=CHUNK * 16
        )
        rows = cute.make_tensor(
            shared_down_ptr,
            cute.make_layout(
                (self.hidden, k_chunks, CHUNK), stride=(self.inter, CHUNK, 1)
            ),
        )
        for i in cutlass.range_constexpr(self.stage_rounds):
            index = tidx + i * self.threads
            r = index // k_chunks
            c = index % k_chunks
            cute.copy(
                atom, rows[down_tile * ROWS_PER_TILE + r, c, None], staged[r, c, None]
            )

    @cute.jit
    def _early_shared_down(
        self, staged, ready, red, sync, shared_down_ptr, h_ptr, y_ptr, tile, m,
        tidx, warp, lane,
    ):  # fmt: skip
        """Wait for every tile of the shared h (thread 0 polls the count), then
        compute this CTA's down tiles from shared memory and mark them done; a
        CTA that stops polling leaves its tiles to the down launch."""
        if tidx == 0:
            count = sync.iterator + EARLY_H_TILES_DONE
            seen = cute.arch.load(count, Int32, sem="acquire", scope="gpu")
            polls = Int32(0)
            in_time = Int32(cutlass.select_(polls < self.max_polls, 1, 0))
            waiting = Int32(cutlass.select_(seen < self.tiles, in_time, Int32(0)))
            while waiting == 1:
                nvvm.nanosleep(Int32(EARLY_POLL_NS).ir_value())
                seen = cute.arch.load(count, Int32, sem="acquire", scope="gpu")
                polls = polls + 1
                # One condition per select: run-time `and` does not lower.
                in_time = Int32(cutlass.select_(polls < self.max_polls, 1, 0))
                waiting = Int32(cutlass.select_(seen < self.tiles, in_time, Int32(0)))
            ready[0] = Int32(cutlass.select_(seen < self.tiles, 0, 1))
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if ready[0] == 1:
            # Every CTA's h columns were released before its count: acquire.
            cute.arch.fence_acq_rel_gpu()
            for down_tile in cutlass.range(tile, self.down_tiles, self.tiles, unroll=1):
                if down_tile != tile:
                    # The previous tile's MMAs read ``staged`` before the
                    # barrier that ends ``reduce_warps``.
                    self._stage_down_rows(staged, shared_down_ptr, down_tile, tidx)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.sync_threads()
                self._shared_down_tile(
                    staged, red, h_ptr, y_ptr, down_tile, m, warp, lane
                )
                if tidx == 0:
                    sync[EARLY_DOWN_DONE + down_tile] = Int32(1)

    @cute.jit
    def _shared_down_tile(self, staged, red, h_ptr, y_ptr, down_tile, m, warp, lane):
        """The shared expert's ``y`` rows of ``down_tile``: the down launch's
        shared unit (row 0 onwards, ``m`` tokens) with the weights from
        ``staged``."""
        quad_row = lane // LANES_PER_QUAD
        quad_lane = lane % LANES_PER_QUAD
        h_chunks = cute.make_tensor(
            h_ptr,
            cute.make_layout(
                (self.table.max_rows, self.down_k_chunks, CHUNK),
                stride=(self.inter, CHUNK, 1),
            ),
        )
        x_rows = [cutlass.min(quad_row, m - 1)]
        acc = new_accumulators(1)
        self.down_mma.accumulate(
            acc, staged, quad_row, quad_row + TOKENS_PER_MMA, h_chunks, x_rows,
            warp * self.down_mma.steps, quad_lane, False,
        )  # fmt: skip
        total = cute.make_rmem_tensor((4,), Float32)
        self.down_mma.reduce_warps(acc, total, red, warp, lane, self.down_warps)
        if warp == 0:
            y = cute.make_tensor(
                y_ptr,
                cute.make_layout(
                    (self.table.max_rows, self.hidden), stride=(self.hidden, 1)
                ),
            )
            for v in cutlass.range_constexpr(4):
                token = 2 * quad_lane + (v % 2)
                row = down_tile * ROWS_PER_TILE + quad_row + TOKENS_PER_MMA * (v // 2)
                if token < m:
                    y[token, row] = total[v]


class MoeDownAfterEarlySharedKernel(MoeExpertKernel):
    """``down`` (launch 3) after ``MoeGateUpEarlySharedDownKernel``: the
    shared expert's tiles that ``gate_up`` marked done are skipped (no weight
    load), any other is computed here after the wait; the flags and the
    count are re-armed for the next launch."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        m_bucket: int,
        slot_lanes: int,
        warps: int,
        use_pdl: bool = True,
        weight_l2_policy: str | None = None,
        prewait_steps: int | None = None,
        max_registers: int | None = None,
    ):
        super().__init__(
            STAGE_DOWN, hidden, inter, num_experts, top_k, m_bucket, slot_lanes,
            warps, use_pdl, weight_l2_policy, prewait_steps, max_registers,
        )  # fmt: skip
        if self.halves != 1:
            raise ValueError(
                f"the early shared down is for M-buckets of up to {TOKENS_PER_MMA} "
                f"tokens, got {m_bucket}"
            )

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        shared_w_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        sync_ptr: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        red_bytes = self.reduction_bytes()
        self.kernel(x_ptr, w_ptr, shared_w_ptr, table_ptr, out_ptr, sync_ptr, m).launch(
            grid=[self.tiles, self.slot_lanes, 1],
            block=[self.threads, 1, 1],
            smem=red_bytes + 64,
            stream=stream,
            use_pdl=self.use_pdl,
            **self.launch_bounds,
        )

    @cute.kernel
    def kernel(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        shared_w_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        sync_ptr: cute.Pointer,
        m: Int32,
    ):
        tab = self.table
        tile, slot_lane, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.utils.SmemAllocator()
        red = self._reduction_buffer(smem)
        table = cute.make_tensor(table_ptr, cute.make_layout((tab.size,)))
        sync = cute.make_tensor(
            sync_ptr, cute.make_layout((early_sync_words(self.hidden),))
        )
        if const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()
        if slot_lane == 0:
            # gate_up wrote the flag before its grid completed: after the wait.
            if const_expr(self.use_pdl):
                cute.arch.griddepcontrol_wait()
            done = cute.arch.load(
                sync.iterator + EARLY_DOWN_DONE + tile, Int32, sem="relaxed",
                scope="gpu",
            )  # fmt: skip
            cute.arch.sync_threads()
            if tidx == 0:
                sync[EARLY_DOWN_DONE + tile] = Int32(0)
                if tile == 0:
                    # Every gate_up CTA stopped polling when its grid completed.
                    sync[EARLY_H_TILES_DONE] = Int32(0)
            if done == 0:
                self._unit(
                    Int32(0), tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr, red,
                    m, False,
                )  # fmt: skip
            for unit in cutlass.range(
                self.slot_lanes, table[tab.count] + 1, self.slot_lanes
            ):
                self._unit(
                    unit, tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr, red, m,
                    False,
                )  # fmt: skip
        else:
            # The router finished before ``gate_up`` let this grid launch.
            for unit in cutlass.range(slot_lane, table[tab.count] + 1, self.slot_lanes):
                self._unit(
                    unit, tile, x_ptr, w_ptr, shared_w_ptr, table, out_ptr, red, m,
                    self.use_pdl,
                )  # fmt: skip


class MoeCombineKernel:
    """``shared + sum_k w_k y_k`` per token (launch 4), optionally + residual
    and RMSNorm: ``residual_out = residual + moe`` (bf16) and
    ``out = rmsnorm(residual_out) * gamma``."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        m_bucket: int,
        residual_rmsnorm: bool,
        eps: float = 1e-5,
        use_pdl: bool = True,
    ):
        if hidden % CHUNK:
            raise ValueError(f"hidden={hidden} must be a multiple of {CHUNK}")
        self.hidden, self.top_k, self.m_bucket = hidden, top_k, m_bucket
        self.residual_rmsnorm, self.eps, self.use_pdl = residual_rmsnorm, eps, use_pdl
        self.table = RoutingTable(num_experts, top_k)
        self.chunks = hidden // CHUNK
        self.threads = ceil_div(self.chunks, WARP_THREADS) * WARP_THREADS
        self.warps = self.threads // WARP_THREADS

    @cute.jit
    def __call__(
        self,
        y_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        residual_ptr: cute.Pointer,
        residual_out_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        m: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(
            y_ptr,
            table_ptr,
            weight_ptr,
            residual_ptr,
            residual_out_ptr,
            gamma_ptr,
            out_ptr,
            m,
        ).launch(  # fmt: skip
            grid=[self.m_bucket, 1, 1],
            block=[self.threads, 1, 1],
            smem=4 * self.warps + 64,
            stream=stream,
            use_pdl=self.use_pdl,
        )

    @cute.kernel
    def kernel(
        self,
        y_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        residual_ptr: cute.Pointer,
        residual_out_ptr: cute.Pointer,
        gamma_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        m: Int32,
    ):
        tab, hidden, top_k = self.table, self.hidden, self.top_k
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        if const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()
        smem = cutlass.utils.SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps,)), 16)
        rstd = smem.allocate_tensor(Float32, cute.make_layout((1,)), 4)
        if token < m:
            table = cute.make_tensor(table_ptr, cute.make_layout((tab.size,)))
            weights = cute.make_tensor(
                weight_ptr, cute.make_layout((MAX_TOKENS, top_k), stride=(top_k, 1))
            )
            y = cute.make_tensor(
                y_ptr,
                cute.make_layout(
                    (tab.max_rows, self.chunks, 2, Y_HALF),
                    stride=(hidden, CHUNK, Y_HALF, 1),
                ),
            )
            row_layout = cute.make_layout(
                (MAX_TOKENS, self.chunks, CHUNK), stride=(hidden, CHUNK, 1)
            )
            # Threads past the row load chunk 0 (in bounds) and store nothing.
            chunk = _pick(tidx < self.chunks, tidx, Int32(0))
            # Before the wait, everything but the expert rows: the routing
            # table and weights are complete (the router finished before
            # ``gate_up`` let ``down`` launch, and ``down`` launched this grid),
            # and so is the residual, which the router's predecessor wrote.
            rows = cute.make_rmem_tensor((top_k,), Int32)
            route_w = cute.make_rmem_tensor((top_k,), Float32)
            for k in cutlass.range_constexpr(top_k):
                rows[k] = table[tab.route_row + token * top_k + k]
                route_w[k] = weights[token, k]
            old = cute.make_rmem_tensor((CHUNK,), BFloat16)
            g = cute.make_rmem_tensor((CHUNK,), BFloat16)
            if const_expr(self.residual_rmsnorm):
                residual = cute.make_tensor(residual_ptr, row_layout)
                gamma = cute.make_tensor(
                    gamma_ptr, cute.make_layout((self.chunks, CHUNK), stride=(CHUNK, 1))
                )
                cute.autovec_copy(residual[token, chunk, None], old)
                cute.autovec_copy(gamma[chunk, None], g)
            if const_expr(self.use_pdl):
                cute.arch.griddepcontrol_wait()
            # Every expert row at once (one round trip), then the fixed-order
            # sum (shared, choice 0, 1, ...): bit-reproducible.
            parts = [
                [cute.make_rmem_tensor((Y_HALF,), Float32) for _ in range(2)]
                for _ in range(top_k + 1)
            ]
            for half in cutlass.range_constexpr(2):
                cute.autovec_copy(y[token, chunk, half, None], parts[0][half])
            for k in cutlass.range_constexpr(top_k):
                for half in cutlass.range_constexpr(2):
                    cute.autovec_copy(y[rows[k], chunk, half, None], parts[k + 1][half])
            acc = cute.make_rmem_tensor((CHUNK,), Float32)
            for half in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(Y_HALF):
                    acc[half * Y_HALF + i] = parts[0][half][i]
            for k in cutlass.range_constexpr(top_k):
                for half in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(Y_HALF):
                        acc[half * Y_HALF + i] = (
                            acc[half * Y_HALF + i] + route_w[k] * parts[k + 1][half][i]
                        )
            out = cute.make_tensor(out_ptr, row_layout)
            res = cute.make_rmem_tensor((CHUNK,), BFloat16)
            if const_expr(self.residual_rmsnorm):
                residual_out = cute.make_tensor(residual_out_ptr, row_layout)
                square_sum = Float32(0.0)
                for i in cutlass.range_constexpr(CHUNK):
                    # Normalise exactly what is stored (as fused_add_rms_norm).
                    res[i] = (acc[i] + old[i].to(Float32)).to(BFloat16)
                    v = res[i].to(Float32)
                    square_sum = square_sum + v * v
                square_sum = _pick(tidx < self.chunks, square_sum, Float32(0.0))
                square_sum = warp_sum(square_sum)
                if lane == 0:
                    warp_sums[warp] = square_sum
                cute.arch.sync_threads()
                if tidx == 0:
                    total = warp_sums[0]
                    for w in cutlass.range_constexpr(1, self.warps):
                        total = total + warp_sums[w]
                    rstd[0] = cute.math.rsqrt(
                        total / Float32(hidden) + Float32(self.eps)
                    )
                cute.arch.sync_threads()
                scale = rstd[0]
                normed = cute.make_rmem_tensor((CHUNK,), BFloat16)
                for i in cutlass.range_constexpr(CHUNK):
                    n = (res[i].to(Float32) * scale).to(BFloat16)
                    normed[i] = (n.to(Float32) * g[i].to(Float32)).to(BFloat16)
                if tidx < self.chunks:
                    cute.autovec_copy(res, residual_out[token, chunk, None])
                    cute.autovec_copy(normed, out[token, chunk, None])
            else:
                for i in cutlass.range_constexpr(CHUNK):
                    res[i] = acc[i].to(BFloat16)
                if tidx < self.chunks:
                    cute.autovec_copy(res, out[token, chunk, None])

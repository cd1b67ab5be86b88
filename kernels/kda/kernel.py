# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused Kimi Delta Attention (KDA) decode step for SM90, one launch per layer.

Replaces stock vLLM 0.26.0's decode sequence (three ``causal_conv1d_update``,
``fused_kda_gate``, ``fused_recurrent_kda``, gated RMSNorm, plus the memsets and
copies between them) for one token per request:

* width-4 causal conv + SiLU on the q, k and v channels of the head, reading
  and shifting the bf16 conv state in place (vLLM's SD layout
  ``[slot, 3 taps, 3*H*D]``; any tap/channel strides);
* gate ``g = -exp(A_log[h]) * softplus(g1 + dt_bias)`` and ``beta =
  sigmoid(b)``;
* L2-normalised q (scaled by D^-0.5) and k;
* the gated delta rule on the FP32 state ``S[v, k]`` of the slot, in place:
  ``S <- exp(g)[k] * S``, ``v' = beta * (v - S k)``, ``S <- S + v' k^T``,
  ``o = S q``;
* ``RMSNorm(o) * w * sigmoid(g2)`` written as bf16.

With ``low_rank_gates`` the step also takes the gates' second projections:
its inputs are ``f_a(x)`` and ``g_a(x)`` (128 values per row each) and it forms
``g1 = f_b f_a(x)`` and ``g2 = g_b g_a(x)`` for its head itself, from the
head's 128 rows of ``f_b`` and ``g_b`` (64 KiB, copied to shared memory with
cp.async before the PDL wait).  The decode step then needs no launch between
the input projection and this kernel.  g1 and g2 are rounded to bf16, as the
stock ``f_b_proj`` / ``g_b_proj`` outputs are.

Grid: one CTA per (head, request row).  The whole 128x128 FP32 head state
(64 KiB) lives in registers of the CTA's 8 (or 16) warps for the update: a
warp owns 16 (8) value rows, a lane 4 consecutive keys of each row, so every
state access is a 16-byte load/store and a warp touches 512 contiguous bytes
per row.  One CTA per head (rather than several per head splitting the value
rows) keeps the conv-state update race-free: the q/k conv channels of a head
are read and rewritten by exactly one CTA.

Both dot products of a row are taken on the decayed state in one pass:
``o = S' q = S_d q + v' (k . q)`` with ``S' = S_d + v' k^T``, so the two warp
reductions of a row run together instead of one after the other.

Rounding points follow vLLM: the conv outputs are rounded to bf16 (stock
``causal_conv1d_update`` returns bf16), and so is ``o`` before the norm (stock
``fused_recurrent_kda`` writes a bf16 output that the gated RMSNorm reads).

Memory round trips per CTA: the weights (before the PDL wait), the slot index,
then every other load of the step at once (state, conv history, inputs),
issued before any store that could alias them.  With
``state_loads_before_wait`` the slot index, state and conv history are loaded
before the PDL wait too, so only the inputs are left after it.

Rows whose state index is <= 0 (the null block, or padding) read and write
nothing: the branch covers every load of state, conv state and inputs.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.warp import warp_sum

HEAD_DIM = 128
# Width-4 causal conv: three past inputs are kept per channel.
CONV_WIDTH = 4
CONV_TAPS = CONV_WIDTH - 1
# q, k and v: the conv state and conv weight hold the three streams in order.
STREAMS = 3
WARP_THREADS = 32
# Default CTA: 8 warps x 16 value rows = 128 rows; 64 state floats per thread
# stay in registers between the load and the store (128 registers: 2 CTAs/SM).
# 16 warps x 8 rows is the other supported shape: 102 registers x 512 threads
# fit one CTA per SM, and it measured slower at every batch on the H200
# (docs/perf/kda_notes.md); kept as a tested option, not the default.
WARPS = 8
SUPPORTED_WARPS = (8, 16)
# A lane holds 4 keys (one 16-byte FP32 vector); 32 lanes cover the 128 keys.
KEYS_PER_LANE = HEAD_DIM // WARP_THREADS
FP32_BYTES = 4
# softplus(x) = x above this (as the stock fused_kda_gate, threshold 20).
SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6
# Low-rank gates: f_b and g_b are [H*D, GATE_RANK]; a head's block of each is
# staged in shared memory as 16-byte vectors, rows padded by one vector (272 B,
# an odd number of vectors) so that the 8 threads of a shared-memory phase,
# reading the same column of 8 consecutive rows, hit 8 different bank groups.
GATE_RANK = HEAD_DIM
GATE_MATRICES = 2  # f_b, g_b
BF16_PER_VECTOR = 8
GATE_VECTORS = GATE_RANK // BF16_PER_VECTOR
GATE_ROW_PITCH = GATE_RANK + BF16_PER_VECTOR
# Partial sums per thread in the gate dot products (independent FMA chains).
GATE_ACCUMULATORS = 4
# Dynamic shared memory the kernel carves (SmemAllocator): conv outputs of q, k,
# v and the decay (4 x 128 floats), o (128 floats), the per-warp sums of squares
# and beta; with low-rank gates also the two weight blocks, the two low-rank
# inputs (FP32) and g2.  Each block 16-byte aligned (128 bytes of slack).


def smem_bytes(warps: int, low_rank_gates: bool = False) -> int:
    size = (STREAMS + 2) * HEAD_DIM * 4 + warps * 4 + 16 + 128
    if low_rank_gates:
        size += GATE_MATRICES * HEAD_DIM * GATE_ROW_PITCH * 2
        size += GATE_MATRICES * GATE_RANK * 4 + HEAD_DIM * 4 + 64
    return size


def _select(cond, if_true, if_false):
    """Branch-free select of two FP32 values."""
    return Float32(cutlass.select_(cond, if_true, if_false))


class KdaDecodeKernel:
    """Compile-time configuration of the fused KDA decode step.

    Strides are in elements.  ``*_row_stride`` are the per-request strides of
    the activation tensors (their last dim is contiguous); the state strides
    inside a slot (head, value row) and the conv-state strides inside a slot
    (tap, channel) are compile-time; the slot strides of both caches are
    run-time Int64 arguments (a slot x page offset can pass 2^31 elements).
    """

    def __init__(
        self,
        num_heads: int,
        qkv_row_strides: tuple[int, int, int],
        g1_row_stride: int,
        beta_row_stride: int,
        g2_row_stride: int,
        out_row_stride: int,
        state_head_stride: int,
        state_row_stride: int,
        conv_tap_stride: int,
        conv_channel_stride: int,
        scale: float = HEAD_DIM**-0.5,
        norm_eps: float = 1e-5,
        use_pdl: bool = True,
        warps: int = WARPS,
        state_loads_before_wait: bool = False,
        low_rank_gates: bool = False,
    ):
        if warps not in SUPPORTED_WARPS:
            raise ValueError(f"warps must be one of {SUPPORTED_WARPS}, got {warps}")
        self.warps = warps
        self.rows_per_warp = HEAD_DIM // warps
        if state_head_stride % KEYS_PER_LANE or state_row_stride % KEYS_PER_LANE:
            raise ValueError(
                "state head/row strides must be multiples of 4 floats (16-byte "
                f"vectors), got {state_head_stride}, {state_row_stride}"
            )
        self.num_heads = num_heads
        self.proj = num_heads * HEAD_DIM
        self.qkv_row_strides = tuple(qkv_row_strides)
        self.g1_row_stride = g1_row_stride
        self.beta_row_stride = beta_row_stride
        self.g2_row_stride = g2_row_stride
        self.out_row_stride = out_row_stride
        self.state_head_stride = state_head_stride
        self.state_row_stride = state_row_stride
        self.conv_tap_stride = conv_tap_stride
        self.conv_channel_stride = conv_channel_stride
        self.scale = scale
        self.norm_eps = norm_eps
        # Programmatic dependent launch: load this head's weights while the
        # previous kernel of the stream drains; everything it may write
        # (activations, slot indices, caches) is read after griddepcontrol.wait.
        self.use_pdl = use_pdl
        # With PDL, also issue the slot index, the recurrent state and the conv
        # history before the wait: the step's long pole then overlaps the
        # predecessor (the projections).  Only for callers that guarantee that
        # no kernel chained before this launch writes the slot indices or the
        # caches (a decode graph: a layer's state is written only by its own
        # step, once per replay); back-to-back launches on one layer would race.
        self.state_loads_before_wait = use_pdl and state_loads_before_wait
        # g1/g2 arrive as f_a(x)/g_a(x) (GATE_RANK wide; g1/g2_row_stride are
        # their row strides) and f_b/g_b are applied here (module docstring).
        self.low_rank_gates = low_rank_gates

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        g1_ptr: cute.Pointer,
        beta_ptr: cute.Pointer,
        g2_ptr: cute.Pointer,
        conv_weight_ptr: cute.Pointer,
        a_log_ptr: cute.Pointer,
        dt_bias_ptr: cute.Pointer,
        norm_weight_ptr: cute.Pointer,
        f_b_ptr: cute.Pointer,
        g_b_ptr: cute.Pointer,
        slot_ptr: cute.Pointer,
        conv_state_ptr: cute.Pointer,
        state_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        batch: Int32,
        conv_slot_stride: Int64,
        state_slot_stride: Int64,
        stream: cuda.CUstream,
    ):
        self.kernel(
            q_ptr,
            k_ptr,
            v_ptr,
            g1_ptr,
            beta_ptr,
            g2_ptr,
            conv_weight_ptr,
            a_log_ptr,
            dt_bias_ptr,
            norm_weight_ptr,
            f_b_ptr,
            g_b_ptr,
            slot_ptr,
            conv_state_ptr,
            state_ptr,
            out_ptr,
            conv_slot_stride,
            state_slot_stride,
        ).launch(  # fmt: skip
            grid=[self.num_heads, batch, 1],
            block=[self.warps * WARP_THREADS, 1, 1],
            smem=smem_bytes(self.warps, self.low_rank_gates),
            stream=stream,
            use_pdl=self.use_pdl,
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        q_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        g1_ptr: cute.Pointer,
        beta_ptr: cute.Pointer,
        g2_ptr: cute.Pointer,
        conv_weight_ptr: cute.Pointer,
        a_log_ptr: cute.Pointer,
        dt_bias_ptr: cute.Pointer,
        norm_weight_ptr: cute.Pointer,
        f_b_ptr: cute.Pointer,
        g_b_ptr: cute.Pointer,
        slot_ptr: cute.Pointer,
        conv_state_ptr: cute.Pointer,
        state_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        conv_slot_stride: Int64,
        state_slot_stride: Int64,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head, row, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP_THREADS
        if const_expr(self.use_pdl):
            # Let the next kernel start its own weight loads early; it waits
            # for this grid before reading anything written here.
            cute.arch.griddepcontrol_launch_dependents()

        proj = self.proj
        smem = cutlass.utils.SmemAllocator()
        # Conv outputs (fp32 of the bf16-rounded values) for q, k, v; the
        # per-key decay exp(g); the norm's per-warp sums of squares; beta; o.
        qkv_s = smem.allocate_tensor(
            Float32,
            cute.make_layout(
                (STREAMS, WARP_THREADS, KEYS_PER_LANE),
                stride=(HEAD_DIM, KEYS_PER_LANE, 1),
            ),
            byte_alignment=16,
        )
        decay_s = smem.allocate_tensor(
            Float32,
            cute.make_layout((WARP_THREADS, KEYS_PER_LANE), stride=(KEYS_PER_LANE, 1)),
            byte_alignment=16,
        )
        o_s = smem.allocate_tensor(Float32, cute.make_layout((HEAD_DIM,)), 16)
        sumsq_s = smem.allocate_tensor(Float32, cute.make_layout((self.warps,)), 16)
        beta_s = smem.allocate_tensor(Float32, cute.make_layout((1,)), 16)

        # ---- weights: independent of the previous kernel, loaded before the
        # PDL wait.  Threads 0..127 each own one channel d of the head.
        d = tidx % HEAD_DIM
        channel = head * HEAD_DIM + d
        conv_w = cute.make_tensor(
            conv_weight_ptr,
            cute.make_layout((STREAMS * proj, CONV_WIDTH), stride=(CONV_WIDTH, 1)),
        )
        taps_w = [cute.make_rmem_tensor((CONV_WIDTH,), Float32) for _ in range(3)]
        for s in cutlass.range_constexpr(STREAMS):
            cute.autovec_copy(conv_w[s * proj + channel, None], taps_w[s])
        dt_bias = cute.make_tensor(dt_bias_ptr, cute.make_layout((proj,)))
        a_log = cute.make_tensor(a_log_ptr, cute.make_layout((self.num_heads,)))
        norm_w = cute.make_tensor(norm_weight_ptr, cute.make_layout((HEAD_DIM,)))
        bias_d = dt_bias[channel]
        neg_a = -cute.math.exp(a_log[head])
        gamma_d = norm_w[d]
        if const_expr(self.low_rank_gates):
            # f_b / g_b rows of this head: [matrix, channel, vector, element].
            gate_w_s = smem.allocate_tensor(
                BFloat16,
                cute.make_layout(
                    (GATE_MATRICES, HEAD_DIM, GATE_VECTORS, BF16_PER_VECTOR),
                    stride=(
                        HEAD_DIM * GATE_ROW_PITCH,
                        GATE_ROW_PITCH,
                        BF16_PER_VECTOR,
                        1,
                    ),
                ),
                byte_alignment=16,
            )
            # f_a(x), g_a(x) of this row (FP32 of the bf16 inputs), and g2.
            low_rank_s = smem.allocate_tensor(
                Float32,
                cute.make_layout(
                    (GATE_MATRICES, GATE_VECTORS, BF16_PER_VECTOR),
                    stride=(GATE_RANK, BF16_PER_VECTOR, 1),
                ),
                byte_alignment=16,
            )
            g2_s = smem.allocate_tensor(Float32, cute.make_layout((HEAD_DIM,)), 16)
            self._stage_gate_weights(tidx, head, f_b_ptr, 0, gate_w_s)
            self._stage_gate_weights(tidx, head, g_b_ptr, 1, gate_w_s)
            cute.arch.cp_async_commit_group()

        if const_expr(self.use_pdl and not self.state_loads_before_wait):
            cute.arch.griddepcontrol_wait()

        slots = cute.make_tensor(slot_ptr, cute.make_layout((1 << 30,)))
        slot = slots[row]
        if slot > 0:
            # ---- state loads first: they are the long pole; the conv and
            # gate work below runs while they are in flight.
            state_addr = (
                state_ptr.toint()
                + (Int64(slot) * state_slot_stride + head * self.state_head_stride)
                * FP32_BYTES
            )
            state_base = cute.make_ptr(
                Float32, state_addr, cute.AddressSpace.gmem, assumed_align=16
            )
            state = cute.make_tensor(
                state_base,
                cute.make_layout(
                    (HEAD_DIM, WARP_THREADS, KEYS_PER_LANE),
                    stride=(self.state_row_stride, KEYS_PER_LANE, 1),
                ),
            )
            rows = [
                cute.make_rmem_tensor((KEYS_PER_LANE,), Float32)
                for _ in range(self.rows_per_warp)
            ]
            first_row = warp * self.rows_per_warp
            for i in cutlass.range_constexpr(self.rows_per_warp):
                cute.autovec_copy(state[first_row + i, lane, None], rows[i])

            # ---- every other load of the step, issued before any result is
            # used or any conv-state store (which could alias them), so the
            # whole step costs one memory round trip after the slot index.
            inputs = cute.make_rmem_tensor((STREAMS,), BFloat16)
            history = cute.make_rmem_tensor((STREAMS, CONV_TAPS), BFloat16)
            gate_in = cute.make_rmem_tensor((2,), BFloat16)  # g1, g2
            conv = self._conv_page(conv_state_ptr, slot, conv_slot_stride)
            if tidx < HEAD_DIM:
                self._load_history(channel, conv, history)
            if const_expr(self.state_loads_before_wait):
                cute.arch.griddepcontrol_wait()
            if tidx < HEAD_DIM:
                self._load_inputs(
                    row, channel, q_ptr, k_ptr, v_ptr, g1_ptr, g2_ptr, inputs, gate_in
                )
            if tidx == HEAD_DIM:
                betas = cute.make_tensor(beta_ptr, cute.make_layout((1 << 30,)))
                logit = betas[row * self.beta_row_stride + head].to(Float32)
                beta_s[0] = Float32(1.0) / (Float32(1.0) + cute.math.exp(-logit))
            if const_expr(self.low_rank_gates):
                self._gate_projections(
                    tidx, row, g1_ptr, g2_ptr, gate_w_s, low_rank_s, g2_s, gate_in
                )
            if tidx < HEAD_DIM:
                self._conv_and_gate(
                    d, channel, taps_w, bias_d, neg_a, conv, inputs, history,
                    gate_in, qkv_s, decay_s,
                )  # fmt: skip
            gate_out = gate_in[1].to(Float32)
            cute.arch.sync_threads()

            # ---- this lane's 4 keys of q, k and the decay; the norms are
            # warp reductions (each warp recomputes them: no extra barrier).
            q4 = cute.make_rmem_tensor((KEYS_PER_LANE,), Float32)
            k4 = cute.make_rmem_tensor((KEYS_PER_LANE,), Float32)
            decay4 = cute.make_rmem_tensor((KEYS_PER_LANE,), Float32)
            cute.autovec_copy(qkv_s[0, lane, None], q4)
            cute.autovec_copy(qkv_s[1, lane, None], k4)
            cute.autovec_copy(decay_s[lane, None], decay4)
            sq_q = Float32(0.0)
            sq_k = Float32(0.0)
            for e in cutlass.range_constexpr(KEYS_PER_LANE):
                sq_q = sq_q + q4[e] * q4[e]
                sq_k = sq_k + k4[e] * k4[e]
            sq_q = warp_sum(sq_q)
            sq_k = warp_sum(sq_k)
            q_scale = Float32(self.scale) / cute.math.sqrt(sq_q + Float32(L2NORM_EPS))
            k_scale = Float32(1.0) / cute.math.sqrt(sq_k + Float32(L2NORM_EPS))
            kq = Float32(0.0)
            for e in cutlass.range_constexpr(KEYS_PER_LANE):
                q4[e] = q4[e] * q_scale
                k4[e] = k4[e] * k_scale
                kq = kq + q4[e] * k4[e]
            kq = warp_sum(kq)
            beta = beta_s[0]

            # ---- decay, then both dot products of every row in one pass.
            dot_k = cute.make_rmem_tensor((self.rows_per_warp,), Float32)
            dot_q = cute.make_rmem_tensor((self.rows_per_warp,), Float32)
            for i in cutlass.range_constexpr(self.rows_per_warp):
                acc_k = Float32(0.0)
                acc_q = Float32(0.0)
                for e in cutlass.range_constexpr(KEYS_PER_LANE):
                    rows[i][e] = rows[i][e] * decay4[e]
                    acc_k = acc_k + rows[i][e] * k4[e]
                    acc_q = acc_q + rows[i][e] * q4[e]
                dot_k[i] = acc_k
                dot_q[i] = acc_q
            # The 2R row sums (R = rows_per_warp) over the warp's lanes by
            # recursive halving: at offset o a lane keeps the half of its
            # partial sums whose index bit matches its lane bit and adds its
            # partner's partials of that half (own + partner's, as a butterfly
            # adds them, so every sum is the butterfly's bit for bit), with
            # 2R - 1 shuffles instead of the butterfly's 5 x 2R.  Lane l ends
            # with sum index l >> (5 - log2(2R)): dot_k of rows 0..R-1 in lanes
            # 0..15, dot_q of the same rows in lanes 16..31 (with R = 8 each in
            # two neighbouring lanes, after a last butterfly round).
            sums = [dot_k[i] for i in range(self.rows_per_warp)]
            sums += [dot_q[i] for i in range(self.rows_per_warp)]
            for offset in cutlass.range_constexpr(5):
                bit = 16 >> offset
                if const_expr(len(sums) > 1):
                    half = len(sums) // 2
                    upper = (lane & bit) != 0
                    kept = []
                    for j in cutlass.range_constexpr(half):
                        mine = _select(upper, sums[j + half], sums[j])
                        theirs = _select(upper, sums[j], sums[j + half])
                        kept.append(mine + cute.arch.shuffle_sync_bfly(theirs, bit))
                    sums = kept
                else:
                    sums[0] = sums[0] + cute.arch.shuffle_sync_bfly(sums[0], bit)
            lanes_per_sum = WARP_THREADS // (2 * self.rows_per_warp)
            my_row = (lane // lanes_per_sum) % self.rows_per_warp
            holds_q = lane >= WARP_THREADS // 2

            # ---- delta rule: delta of a row where its dot_k is, then to its
            # dot_q's lanes (16 apart) for o (rounded to bf16 as stock), and to
            # every lane for its four keys of the row's update.
            value_row = first_row + my_row
            v_in = qkv_s[2, value_row // KEYS_PER_LANE, value_row % KEYS_PER_LANE]
            my_delta = beta * (v_in - sums[0])
            row_delta = cute.arch.shuffle_sync_bfly(my_delta, WARP_THREADS // 2)
            if holds_q and lane % lanes_per_sum == 0:
                o_val = (sums[0] + row_delta * kq).to(BFloat16).to(Float32)
                o_s[value_row] = o_val
            for i in cutlass.range_constexpr(self.rows_per_warp):
                delta = cute.arch.shuffle_sync(my_delta, i * lanes_per_sum)
                for e in cutlass.range_constexpr(KEYS_PER_LANE):
                    rows[i][e] = rows[i][e] + delta * k4[e]
                cute.autovec_copy(rows[i], state[first_row + i, lane, None])
            # The norm's sum of squares in row order, as before.
            cute.arch.sync_warp()
            if lane == 0:
                sq_o = Float32(0.0)
                for i in cutlass.range_constexpr(self.rows_per_warp):
                    o_val = o_s[first_row + i]
                    sq_o = sq_o + o_val * o_val
                sumsq_s[warp] = sq_o
            cute.arch.sync_threads()

            # ---- gated RMSNorm over the head's 128 outputs.
            if tidx < HEAD_DIM:
                total = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    total = total + sumsq_s[w]
                rstd = cute.math.rsqrt(
                    total / Float32(HEAD_DIM) + Float32(self.norm_eps)
                )
                gate_pre = gate_out
                if const_expr(self.low_rank_gates):
                    gate_pre = g2_s[d]
                gate = Float32(1.0) / (Float32(1.0) + cute.math.exp(-gate_pre))
                normed = o_s[d] * rstd * gamma_d.to(Float32) * gate
                out = cute.make_tensor(out_ptr, cute.make_layout((1 << 30,)))
                out[row * self.out_row_stride + channel] = normed.to(BFloat16)
        if const_expr(self.low_rank_gates):
            # Padding rows skipped the wait above: no copy may outlive the CTA.
            cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _conv_page(self, conv_state_ptr, slot, conv_slot_stride):
        """[tap, channel] view of this slot's conv state (64-bit slot offset)."""
        conv_addr = (
            conv_state_ptr.toint() + Int64(slot) * conv_slot_stride * 2  # bf16 bytes
        )
        conv_base = cute.make_ptr(
            BFloat16, conv_addr, cute.AddressSpace.gmem, assumed_align=2
        )
        return cute.make_tensor(
            conv_base,
            cute.make_layout(
                (CONV_TAPS, STREAMS * self.proj),
                stride=(self.conv_tap_stride, self.conv_channel_stride),
            ),
        )

    @cute.jit
    def _stage_gate_weights(self, tidx, head, weight_ptr, matrix: int, gate_w_s):
        """cp.async this head's GATE_RANK-wide rows of one gate weight into
        ``gate_w_s[matrix]``: 16-byte vectors, consecutive threads on
        consecutive vectors of a row (coalesced)."""
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=8 * 2 * BF16_PER_VECTOR
        )
        weight = cute.make_tensor(
            weight_ptr,
            cute.make_layout(
                (self.proj, GATE_VECTORS, BF16_PER_VECTOR),
                stride=(GATE_RANK, BF16_PER_VECTOR, 1),
            ),
        )
        threads = self.warps * WARP_THREADS
        for i in cutlass.range_constexpr(HEAD_DIM * GATE_VECTORS // threads):
            vector = i * threads + tidx
            channel = vector // GATE_VECTORS
            part = vector % GATE_VECTORS
            cute.copy(
                atom,
                weight[head * HEAD_DIM + channel, part, None],
                gate_w_s[matrix, channel, part, None],
            )

    @cute.jit
    def _gate_projections(
        self, tidx, row, g1_ptr, g2_ptr, gate_w_s, low_rank_s, g2_s, gate_in
    ):
        """g1 (threads 0..127, into gate_in[0]) and g2 (threads 128..255, into
        g2_s) of channel tidx % 128: one row of f_b / g_b times f_a(x) / g_a(x)."""
        d = tidx % HEAD_DIM
        matrix = tidx // HEAD_DIM
        # This row's low-rank inputs, one element per thread.
        f_a = cute.make_tensor(g1_ptr, cute.make_layout((1 << 30,)))
        g_a = cute.make_tensor(g2_ptr, cute.make_layout((1 << 30,)))
        if tidx < HEAD_DIM:
            low_rank_s[0, d // BF16_PER_VECTOR, d % BF16_PER_VECTOR] = f_a[
                row * self.g1_row_stride + d
            ].to(Float32)
        elif tidx < GATE_MATRICES * HEAD_DIM:
            low_rank_s[1, d // BF16_PER_VECTOR, d % BF16_PER_VECTOR] = g_a[
                row * self.g2_row_stride + d
            ].to(Float32)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if tidx < GATE_MATRICES * HEAD_DIM:
            acc = [Float32(0.0) for _ in range(GATE_ACCUMULATORS)]
            for j in cutlass.range_constexpr(GATE_VECTORS):
                w8 = cute.make_rmem_tensor((BF16_PER_VECTOR,), BFloat16)
                x8 = cute.make_rmem_tensor((BF16_PER_VECTOR,), Float32)
                cute.autovec_copy(gate_w_s[matrix, d, j, None], w8)
                cute.autovec_copy(low_rank_s[matrix, j, None], x8)
                for e in cutlass.range_constexpr(BF16_PER_VECTOR):
                    a = e % GATE_ACCUMULATORS
                    acc[a] = acc[a] + w8[e].to(Float32) * x8[e]
            total = (acc[0] + acc[1]) + (acc[2] + acc[3])
            if matrix == 0:
                gate_in[0] = total.to(BFloat16)
            else:
                g2_s[d] = total.to(BFloat16).to(Float32)

    @cute.jit
    def _load_history(self, channel, conv, history):
        """This thread's channel of the three conv histories (q, k, v)."""
        for s in cutlass.range_constexpr(STREAMS):
            for t in cutlass.range_constexpr(CONV_TAPS):
                history[s, t] = conv[t, s * self.proj + channel]

    @cute.jit
    def _load_inputs(
        self, row, channel, q_ptr, k_ptr, v_ptr, g1_ptr, g2_ptr, inputs, gate_in
    ):
        """This thread's channel of q, k, v (and of g1, g2 unless low-rank)."""
        sources = (q_ptr, k_ptr, v_ptr)
        for s in cutlass.range_constexpr(STREAMS):
            src = cute.make_tensor(sources[s], cute.make_layout((1 << 30,)))
            inputs[s] = src[row * self.qkv_row_strides[s] + channel]
        if const_expr(not self.low_rank_gates):  # else: _gate_projections
            g1 = cute.make_tensor(g1_ptr, cute.make_layout((1 << 30,)))
            g2 = cute.make_tensor(g2_ptr, cute.make_layout((1 << 30,)))
            gate_in[0] = g1[row * self.g1_row_stride + channel]
            gate_in[1] = g2[row * self.g2_row_stride + channel]

    @cute.jit
    def _conv_and_gate(
        self, d, channel, taps_w, bias_d, neg_a, conv, inputs, history, gate_in,
        qkv_s, decay_s,
    ):  # fmt: skip
        for s in cutlass.range_constexpr(STREAMS):
            acc = taps_w[s][CONV_TAPS] * inputs[s].to(Float32)
            for t in cutlass.range_constexpr(CONV_TAPS):
                acc = acc + taps_w[s][t] * history[s, t].to(Float32)
            # Shift the window: oldest tap out, this token's input in.
            conv_channel = s * self.proj + channel
            for t in cutlass.range_constexpr(CONV_TAPS - 1):
                conv[t, conv_channel] = history[s, t + 1]
            conv[CONV_TAPS - 1, conv_channel] = inputs[s]
            silu = acc / (Float32(1.0) + cute.math.exp(-acc))
            qkv_s[s, d // KEYS_PER_LANE, d % KEYS_PER_LANE] = silu.to(BFloat16).to(
                Float32
            )
        pre = gate_in[0].to(Float32) + bias_d
        softplus = cute.math.log(Float32(1.0) + cute.math.exp(pre))
        if pre > Float32(SOFTPLUS_THRESHOLD):
            softplus = pre
        decay_s[d // KEYS_PER_LANE, d % KEYS_PER_LANE] = cute.math.exp(neg_a * softplus)

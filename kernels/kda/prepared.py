# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bind one KDA layer's weights and cache views once; launch the fused step.

``PreparedKda(...)`` validates the layer's weights and its two cache views
(vLLM's conv state and FP32 recurrent state, strided views into the layer's
pages), makes the small contiguous FP32 copies the kernel reads (stacked conv
weight, A_log, norm weight), and compiles on first use (cached process-wide per
layout).  ``run()`` only validates shapes/dtypes/strides on the host, builds raw
pointers and launches on the current stream: no host sync, no allocation, so
it can be captured in a CUDA graph and replayed.

Slot indices must lie in ``[-inf, num_slots)``; rows with index <= 0 are
padding and touch nothing.  Indices are not range-checked (that would need a
host sync); active rows must own distinct slots, as in vLLM.
"""

import time

import cutlass
import torch

from ..common.compile_cache import compile_kernel
from ..common.host import current_stream, gmem_ptr
from .kernel import (
    CONV_TAPS,
    CONV_WIDTH,
    GATE_RANK,
    HEAD_DIM,
    STREAMS,
    SUPPORTED_WARPS,
    WARPS,
    KdaDecodeKernel,
)

# One CTA per (head, request): the grid's y dimension bounds the batch.
MAX_BATCH = 65535
CONV_LAYOUTS = ("SD", "DS")

_COMPILED: dict[tuple, object] = {}
COMPILE_SECONDS: dict[tuple, float] = {}


def _tensor(name, t, dtype, shape, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the layer's state on {device}")
    return t


def _rows(name, t, dtype, batch, width, device) -> int:
    """Check a [batch, width] activation whose rows may be strided; return the
    row stride."""
    _tensor(name, t, dtype, (batch, width), device)
    if t.stride(1) != 1 and width > 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim, strides {t.stride()}"
        )
    return t.stride(0) if batch > 1 else width


def _gate_weights(gate_weights, proj, device):
    """Validate the optional (f_b, g_b) pair; return it as detached tensors."""
    if gate_weights is None:
        return None
    if not isinstance(gate_weights, (tuple, list)) or len(gate_weights) != 2:
        raise ValueError("gate_weights must be the (f_b, g_b) weights")
    checked = []
    for name, w in zip(("f_b", "g_b"), gate_weights):
        _tensor(name, w, torch.bfloat16, (proj, GATE_RANK), device)
        if not w.is_contiguous() or w.data_ptr() % 16:
            raise ValueError(
                f"{name} must be contiguous with a 16-byte aligned base (cp.async "
                f"of 16-byte vectors), strides {w.stride()}, address {w.data_ptr():#x}"
            )
        checked.append(w.detach())
    return tuple(checked)


class PreparedKda:
    """One KDA layer's decode step: conv + gate + delta rule + gated RMSNorm.

    Weights (vLLM parameter shapes accepted as they are):
      conv_weights: (q, k, v) conv weights, each ``H*D x 4`` elements
        (``[H*D, 1, 4]`` in vLLM), any float dtype; stacked once as FP32.
      a_log: ``H`` elements (``[1, 1, H, 1]`` in vLLM), FP32.
      dt_bias: ``[H*D]`` FP32.
      norm_weight: o_norm weight ``[D]`` (shared by the heads), bf16 or FP32.
    warps: 8 (default) or 16 warps per CTA (see kernel.py).
    state_loads_before_wait: with PDL, read the slot indices and both caches
      before waiting for the previous kernel (see kernel.py).  Only where no
      kernel chained before a launch writes them: inside a decode graph, not
      for back-to-back launches on one layer.
    gate_weights: optional ``(f_b, g_b)`` weights, bf16 ``[H*D, 128]``
      contiguous with 16-byte aligned bases (vLLM's f_b_proj / g_b_proj
      weights, read in place).  ``run()`` then takes ``f_a(x)`` and
      ``g_a(x)`` (``[B, 128]``) as ``g1`` and ``g2`` and the kernel applies
      f_b and g_b itself (one launch less before the step).
    Caches (strided views are fine; nothing is copied):
      conv_state: bf16, ``[slots, 3, 3*H*D]`` (vLLM's SD layout) or
        ``[slots, 3*H*D, 3]`` with ``conv_layout="DS"``; channels q | k | v.
      recurrent_state: FP32 ``[slots, H, D(v), D(k)]``, key dim contiguous,
        other strides multiples of 4 elements, 16-byte aligned.
    """

    def __init__(
        self,
        conv_weights,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        num_heads: int = 32,
        norm_eps: float = 1e-5,
        conv_layout: str = "SD",
        use_pdl: bool = True,
        warps: int = WARPS,
        state_loads_before_wait: bool = False,
        gate_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if warps not in SUPPORTED_WARPS:
            raise ValueError(f"warps must be one of {SUPPORTED_WARPS}, got {warps}")
        self.warps = warps
        if conv_layout not in CONV_LAYOUTS:
            raise ValueError(
                f"conv_layout must be one of {CONV_LAYOUTS}, got {conv_layout!r}"
            )
        _tensor("recurrent_state", recurrent_state, torch.float32, None, None)
        device = recurrent_state.device
        if not recurrent_state.is_cuda:
            raise ValueError(f"recurrent_state must be on a CUDA device, got {device}")
        heads, proj = num_heads, num_heads * HEAD_DIM
        if recurrent_state.dim() != 4 or tuple(recurrent_state.shape[1:]) != (
            heads, HEAD_DIM, HEAD_DIM,
        ):  # fmt: skip
            raise ValueError(
                f"recurrent_state must be [slots, {heads}, {HEAD_DIM}, {HEAD_DIM}], "
                f"got {tuple(recurrent_state.shape)}"
            )
        s_slot, s_head, s_row, s_key = recurrent_state.stride()
        if s_key != 1:
            raise ValueError(
                f"recurrent_state must be contiguous along keys, strides "
                f"{recurrent_state.stride()}"
            )
        if s_slot % 4 or s_head % 4 or s_row % 4 or recurrent_state.data_ptr() % 16:
            raise ValueError(
                "recurrent_state needs 16-byte aligned rows (slot/head/row strides "
                "multiples of 4, base 16-byte aligned); strides "
                f"{recurrent_state.stride()}"
            )
        _tensor("conv_state", conv_state, torch.bfloat16, None, device)
        conv_shape = (CONV_TAPS, STREAMS * proj)
        if conv_layout == "DS":
            conv_shape = conv_shape[::-1]
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != conv_shape:
            raise ValueError(
                f"conv_state ({conv_layout}) must be [slots, {conv_shape[0]}, "
                f"{conv_shape[1]}], got {tuple(conv_state.shape)}"
            )
        if conv_state.shape[0] != recurrent_state.shape[0]:
            raise ValueError(
                f"conv_state has {conv_state.shape[0]} slots, recurrent_state "
                f"{recurrent_state.shape[0]}"
            )
        c_slot = conv_state.stride(0)
        if conv_layout == "SD":
            c_tap, c_channel = conv_state.stride(1), conv_state.stride(2)
        else:
            c_channel, c_tap = conv_state.stride(1), conv_state.stride(2)

        if not isinstance(conv_weights, (tuple, list)) or len(conv_weights) != STREAMS:
            raise ValueError("conv_weights must be the (q, k, v) conv weights")
        stacked = []
        for name, w in zip(("q", "k", "v"), conv_weights):
            if not isinstance(w, torch.Tensor) or not w.is_floating_point():
                raise TypeError(f"{name} conv weight must be a float torch.Tensor")
            if w.numel() != proj * CONV_WIDTH:
                raise ValueError(
                    f"{name} conv weight must have {proj}x{CONV_WIDTH} elements, got "
                    f"shape {tuple(w.shape)}"
                )
            if w.device != device:
                raise ValueError(
                    f"{name} conv weight is on {w.device}, state on {device}"
                )
            stacked.append(w.detach().reshape(proj, CONV_WIDTH).float())
        self.conv_weight = torch.cat(stacked).contiguous()
        if a_log.numel() != heads or a_log.dtype != torch.float32:
            raise ValueError(
                f"a_log must hold {heads} FP32 values, got {a_log.dtype} "
                f"{tuple(a_log.shape)}"
            )
        self.a_log = a_log.detach().reshape(heads).contiguous()
        self.dt_bias = _tensor(
            "dt_bias", dt_bias.detach(), torch.float32, (proj,), device
        )
        self.dt_bias = self.dt_bias.contiguous()
        if norm_weight.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(
                f"norm_weight must be bf16 or FP32, got {norm_weight.dtype}"
            )
        _tensor("norm_weight", norm_weight, norm_weight.dtype, (HEAD_DIM,), device)
        # The stock gated RMSNorm computes in FP32 with the weight upcast.
        self.norm_weight = norm_weight.detach().float().contiguous()
        for name in ("a_log",):
            if getattr(self, name).device != device:
                raise ValueError(
                    f"{name} is on {getattr(self, name).device}, state on {device}"
                )
        self.gate_weights = _gate_weights(gate_weights, proj, device)
        self.low_rank_gates = self.gate_weights is not None
        # Width of run()'s g1 / g2: the low-rank inputs or the full gate inputs.
        self.gate_width = GATE_RANK if self.low_rank_gates else proj

        self.device, self.num_heads, self.proj = device, heads, proj
        self.norm_eps, self.use_pdl = norm_eps, use_pdl
        self.state_loads_before_wait = use_pdl and state_loads_before_wait
        self.conv_state, self.recurrent_state = conv_state, recurrent_state
        self.num_slots = recurrent_state.shape[0]
        self._layout = (s_head, s_row, c_tap, c_channel)
        self._slot_strides = (cutlass.Int64(c_slot), cutlass.Int64(s_slot))
        # Without gate weights the kernel ignores its f_b / g_b pointers.
        f_b, g_b = self.gate_weights or (self.norm_weight, self.norm_weight)
        self._static_ptrs = (
            gmem_ptr(self.conv_weight, cutlass.Float32),
            gmem_ptr(self.a_log, cutlass.Float32, 4),
            gmem_ptr(self.dt_bias, cutlass.Float32, 4),
            gmem_ptr(self.norm_weight, cutlass.Float32, 4),
            gmem_ptr(f_b, cutlass.BFloat16, 16),
            gmem_ptr(g_b, cutlass.BFloat16, 16),
        )
        self._cache_ptrs = (
            gmem_ptr(conv_state, cutlass.BFloat16, 2),
            gmem_ptr(recurrent_state, cutlass.Float32, 16),
        )

    # ------------------------------------------------------------- compiling
    def _key(self, row_strides: tuple) -> tuple:
        return (
            self.num_heads, row_strides, self._layout, self.norm_eps, self.use_pdl,
            self.warps, self.state_loads_before_wait, self.low_rank_gates,
        )  # fmt: skip

    def compile(self, row_strides: tuple) -> float:
        """Compile (or fetch) the variant for these activation row strides
        ``(q, k, v, g1, beta, g2, out)``; returns the compile seconds."""
        key = self._key(row_strides)
        if key not in _COMPILED:
            s_head, s_row, c_tap, c_channel = self._layout
            q_s, k_s, v_s, g1_s, beta_s, g2_s, out_s = row_strides
            kern = KdaDecodeKernel(
                self.num_heads, (q_s, k_s, v_s), g1_s, beta_s, g2_s, out_s,
                s_head, s_row, c_tap, c_channel, norm_eps=self.norm_eps,
                use_pdl=self.use_pdl, warps=self.warps,
                state_loads_before_wait=self.state_loads_before_wait,
                low_rank_gates=self.low_rank_gates,
            )  # fmt: skip
            bf16 = gmem_ptr(self.norm_weight, cutlass.BFloat16, 2)
            slots = gmem_ptr(self.a_log, cutlass.Int32, 4)
            conv, state = self._cache_ptrs
            start = time.perf_counter()
            _COMPILED[key] = compile_kernel(
                "kda", key, kern, bf16, bf16, bf16, bf16, bf16, bf16,
                *self._static_ptrs, slots, conv, state, bf16, cutlass.Int32(1),
                *self._slot_strides,
                current_stream(self.device),
            )  # fmt: skip
            COMPILE_SECONDS[key] = time.perf_counter() - start
        return COMPILE_SECONDS[key]

    # --------------------------------------------------------------- running
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g1: torch.Tensor,
        beta_logits: torch.Tensor,
        g2: torch.Tensor,
        slot_indices: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One decode token per row; returns ``out`` ``[B, H*D]`` bf16.

        q, k, v: projections before the conv, g1: ``f_b(f_a(x))`` (gate input),
        g2: ``g_b(g_a(x))`` (output gate), all ``[B, H*D]`` bf16 with rows
        of any stride (with ``gate_weights``: g1 = ``f_a(x)``, g2 =
        ``g_a(x)``, ``[B, 128]``); beta_logits: ``b_proj(x)`` ``[B, H]`` bf16;
        slot_indices: int32 ``[>= B]`` contiguous.  Rows with slot <= 0 leave
        ``out`` and both caches untouched.  Raises before launching on any
        wrong dtype, shape, device or layout.
        """
        if not isinstance(q, torch.Tensor) or q.dim() != 2:
            raise ValueError("q must be a 2-D [batch, H*D] torch.Tensor")
        batch = q.shape[0]
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch={batch} is outside 1..{MAX_BATCH}")
        bf16, proj, dev = torch.bfloat16, self.proj, self.device
        gates = self.gate_width
        strides = (
            _rows("q", q, bf16, batch, proj, dev),
            _rows("k", k, bf16, batch, proj, dev),
            _rows("v", v, bf16, batch, proj, dev),
            _rows("g1", g1, bf16, batch, gates, dev),
            _rows("beta_logits", beta_logits, bf16, batch, self.num_heads, dev),
            _rows("g2", g2, bf16, batch, gates, dev),
            _rows("out", out, bf16, batch, proj, dev),
        )
        _tensor("slot_indices", slot_indices, torch.int32, None, dev)
        if slot_indices.dim() != 1 or slot_indices.shape[0] < batch:
            raise ValueError(
                f"slot_indices must be 1-D with >= {batch} entries, got "
                f"{tuple(slot_indices.shape)}"
            )
        if slot_indices.stride(0) != 1:
            raise ValueError("slot_indices must be contiguous")
        key = self._key(strides)
        fn = _COMPILED.get(key)
        if fn is None:
            self.compile(strides)
            fn = _COMPILED[key]
        conv, state = self._cache_ptrs
        p = lambda t: gmem_ptr(t, cutlass.BFloat16, 2)  # noqa: E731
        fn(
            p(q), p(k), p(v), p(g1), p(beta_logits), p(g2), *self._static_ptrs,
            gmem_ptr(slot_indices, cutlass.Int32, 4), conv, state, p(out),
            cutlass.Int32(batch), *self._slot_strides, current_stream(dev),
        )  # fmt: skip
        return out

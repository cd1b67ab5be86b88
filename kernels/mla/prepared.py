# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bind one MLA layer's latent cache and norm once; write each step's rows.

``PreparedMlaCacheRow(norm_weight, eps, kv_cache)`` checks the cache (bf16
``[blocks, block_size, lora + rope]``, last dim contiguous; other strides
are read, nothing is copied) and compiles on first use per layout (cached
process-wide).  ``run(kv, slots)`` validates on the host, builds raw pointers
and launches on the current stream: no sync, no allocation, so a CUDA graph
can capture it.  Slots are not range-checked (that would need a host sync);
negative slots are padding.
"""

import time

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from ..common.host import current_stream, gmem_ptr
from .kernel import CHUNK, MAX_ROWS, MlaCacheRowKernel

_COMPILED: dict[tuple, object] = {}
COMPILE_SECONDS: dict[tuple, float] = {}


class PreparedMlaCacheRow:
    """``cache[slot] = [rmsnorm(kv[:, :lora]) * norm_weight | kv[:, lora:]]``.

    norm_weight: bf16 ``[lora]`` (the layer's ``kv_a_layernorm`` weight).
    kv_cache: bf16 ``[blocks, block_size, lora + rope]`` (vLLM's MLA cache
      with ``kv_cache_dtype="auto"``), last dim contiguous, 16-byte aligned.
    run(kv, slots): kv bf16 ``[M, lora + rope]`` (M <= 16; rows may be
      strided, e.g. columns of the q | kv_a projection), slots int64 ``[>= M]``
      (vLLM's slot mapping; negative = padding).
    """

    def __init__(
        self,
        norm_weight: torch.Tensor,
        eps: float,
        kv_cache: torch.Tensor,
        rope: int = 64,
        use_pdl: bool = True,
    ):
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3:
            raise ValueError("kv_cache must be a 3-D [blocks, block_size, D] tensor")
        if kv_cache.dtype != torch.bfloat16:
            raise TypeError(
                f"kv_cache must be bfloat16 (kv_cache_dtype auto), got {kv_cache.dtype}"
            )
        width = kv_cache.shape[-1]
        lora = width - rope
        if not isinstance(norm_weight, torch.Tensor) or tuple(norm_weight.shape) != (
            lora,
        ):
            raise ValueError(f"norm_weight must be [{lora}] (cache width - rope)")
        if norm_weight.dtype != torch.bfloat16 or not norm_weight.is_contiguous():
            raise TypeError("norm_weight must be a contiguous bfloat16 tensor")
        if norm_weight.device != kv_cache.device:
            raise ValueError(
                f"norm_weight is on {norm_weight.device}, the cache on "
                f"{kv_cache.device}"
            )
        if kv_cache.stride(2) != 1 or kv_cache.data_ptr() % 16:
            raise ValueError(
                "kv_cache needs a contiguous, 16-byte aligned last dim (strides "
                f"{kv_cache.stride()})"
            )
        if kv_cache.stride(0) % CHUNK or kv_cache.stride(1) % CHUNK:
            raise ValueError(
                f"kv_cache strides {kv_cache.stride()} must be multiples of {CHUNK}"
            )
        self.norm_weight, self.eps, self.cache = norm_weight, eps, kv_cache
        self.lora, self.rope, self.device = lora, rope, kv_cache.device
        self.block_size = kv_cache.shape[1]
        self.use_pdl = use_pdl
        self._fns: dict[int, object] = {}

    def _key(self, x_row_stride: int) -> tuple:
        c = self.cache
        return (
            self.lora, self.rope, self.eps, x_row_stride, self.block_size,
            c.stride(0), c.stride(1), self.use_pdl,
        )  # fmt: skip

    def _compile(self, x_row_stride: int) -> object:
        key = self._key(x_row_stride)
        if key not in _COMPILED:
            kern = MlaCacheRowKernel(
                self.lora, self.rope, self.eps, x_row_stride, self.block_size,
                self.cache.stride(0), self.cache.stride(1), self.use_pdl,
            )  # fmt: skip
            bf16 = gmem_ptr(self.cache, cutlass.BFloat16)
            slots = gmem_ptr(self.cache, cutlass.Int64, assumed_align=8)
            start = time.perf_counter()
            _COMPILED[key] = cute.compile(
                kern, bf16, bf16, slots, bf16, cutlass.Int32(1), cuda.CUstream(0)
            )
            COMPILE_SECONDS[key] = time.perf_counter() - start
        self._fns[x_row_stride] = _COMPILED[key]
        return _COMPILED[key]

    def run(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Launch on the current stream.  Raises before launch on a wrong
        dtype, shape, device, layout or alignment."""
        width = self.lora + self.rope
        if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[1] != width:
            raise ValueError(f"kv must be [M, {width}]")
        m = kv.shape[0]
        if not 1 <= m <= MAX_ROWS:
            raise ValueError(f"M={m} is outside 1..{MAX_ROWS}")
        if kv.dtype != torch.bfloat16 or kv.device != self.device:
            raise TypeError(f"kv must be bfloat16 on {self.device}")
        row_stride = kv.stride(0) if m > 1 else width
        if kv.stride(1) != 1 or row_stride % CHUNK or kv.data_ptr() % 16:
            raise ValueError(
                "kv needs a contiguous last dim and 16-byte aligned rows (strides "
                f"{kv.stride()}, address {kv.data_ptr():#x})"
            )
        if (
            not isinstance(slots, torch.Tensor)
            or slots.dtype != torch.int64
            or slots.dim() != 1
            or slots.shape[0] < m
            or not slots.is_contiguous()
            or slots.device != self.device
        ):
            raise ValueError(
                f"slots must be a contiguous int64 [>= {m}] tensor on {self.device}"
            )
        fn = self._fns.get(row_stride) or self._compile(row_stride)
        fn(
            gmem_ptr(kv, cutlass.BFloat16),
            gmem_ptr(self.norm_weight, cutlass.BFloat16),
            gmem_ptr(slots, cutlass.Int64, assumed_align=8),
            gmem_ptr(self.cache, cutlass.BFloat16),
            m,
            current_stream(self.device),
        )

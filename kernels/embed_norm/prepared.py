# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bind the embedding table and the first input norm once; launch them fused.

``PreparedEmbedNorm(embed_weight, norm_weight, eps)`` reads vLLM's tensors in
place and compiles on first use (cached process-wide per (hidden, eps, PDL)).
``run(ids, residual, x)`` only validates, builds raw pointers and launches on
the current stream, so it can be captured in a CUDA graph.  Token ids are not
range-checked (that would need a host sync); vLLM's are in range.
"""

import time

import cuda.bindings.driver as cuda
import cutlass
import torch

from ..common.compile_cache import compile_kernel
from ..common.host import current_stream, gmem_ptr
from .kernel import MAX_ROWS, EmbedRmsNormKernel

_COMPILED: dict[tuple, object] = {}
COMPILE_SECONDS: dict[tuple, float] = {}


def _check(name: str, t, dtype, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the embedding on {device}")


class PreparedEmbedNorm:
    """``residual = embed_weight[ids]``, ``x = rmsnorm(residual) * norm_weight``
    (bf16; the norm rounded as ``common.rmsnorm``), one launch."""

    def __init__(
        self,
        embed_weight: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float = 1e-5,
        use_pdl: bool = True,
    ):
        if not isinstance(embed_weight, torch.Tensor) or embed_weight.dim() != 2:
            raise ValueError("embed_weight must be a 2-D [vocab, hidden] torch.Tensor")
        if not embed_weight.is_cuda:
            raise ValueError(
                f"embed_weight must be on a CUDA device, got {embed_weight.device}"
            )
        self.device = embed_weight.device
        vocab, hidden = embed_weight.shape
        _check(
            "embed_weight", embed_weight, torch.bfloat16, (vocab, hidden), self.device
        )
        _check("norm_weight", norm_weight, torch.bfloat16, (hidden,), self.device)
        self.embed, self.gamma = embed_weight, norm_weight
        self.hidden, self.eps, self.use_pdl = hidden, float(eps), use_pdl
        self.kernel = EmbedRmsNormKernel(hidden, self.eps, use_pdl)
        self._fn = None

    def _key(self) -> tuple:
        return (self.hidden, self.eps, self.use_pdl)

    def compile(self) -> float:
        """Compile (or fetch from the process cache); seconds."""
        key = self._key()
        if key not in _COMPILED:
            bf16 = cutlass.BFloat16
            ptr = gmem_ptr(self.gamma, bf16)
            # Addresses are never dereferenced while compiling.
            ids = gmem_ptr(self.gamma, cutlass.Int32, assumed_align=4)
            start = time.perf_counter()
            _COMPILED[key] = compile_kernel(
                "embed_norm", key, self.kernel, ids, ptr, ptr, ptr, ptr,
                cutlass.Int32(1), cuda.CUstream(0),
            )  # fmt: skip
            COMPILE_SECONDS[key] = time.perf_counter() - start
        self._fn = _COMPILED[key]
        return COMPILE_SECONDS[key]

    def run(self, ids: torch.Tensor, residual: torch.Tensor, x: torch.Tensor) -> None:
        """``ids`` int32 [B]; ``residual`` and ``x`` bf16 [B, hidden], written.
        Raises before launch on a wrong dtype, shape, device or alignment."""
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dim() != 1
            or ids.dtype != torch.int32
        ):
            raise ValueError("ids must be a 1-D int32 torch.Tensor (vLLM's input_ids)")
        rows = ids.shape[0]
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"{rows} rows is outside 1..{MAX_ROWS}")
        if ids.device != self.device or not ids.is_contiguous():
            raise ValueError(f"ids must be contiguous on {self.device}")
        for name, t in (("residual", residual), ("x", x)):
            _check(name, t, torch.bfloat16, (rows, self.hidden), self.device)
        if self._fn is None:
            self.compile()
        bf16 = cutlass.BFloat16
        self._fn(
            gmem_ptr(ids, cutlass.Int32, assumed_align=4), gmem_ptr(self.embed, bf16),
            gmem_ptr(self.gamma, bf16), gmem_ptr(residual, bf16), gmem_ptr(x, bf16),
            cutlass.Int32(rows), current_stream(self.device),
        )  # fmt: skip

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bind one MLA layer's latent cache once; write each step's rows and attend.

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
import torch

from ..common.compile_cache import compile_kernel
from ..common.host import current_stream, gmem_ptr
from .kernel import (
    CHUNK,
    MAX_ROWS,
    MlaAttentionMergeKernel,
    MlaCacheRowKernel,
    MlaDecodeAttentionKernel,
    splits_for,
)

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
        _check_cache(kv_cache)
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
            _COMPILED[key] = compile_kernel(
                "mla_cache_row", key, kern, bf16, bf16, slots, bf16,
                cutlass.Int32(1), cuda.CUstream(0),
            )  # fmt: skip
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
        _check_vector(slots, "slots", torch.int64, m, self.device)
        fn = self._fns.get(row_stride) or self._compile(row_stride)
        fn(
            gmem_ptr(kv, cutlass.BFloat16),
            gmem_ptr(self.norm_weight, cutlass.BFloat16),
            gmem_ptr(slots, cutlass.Int64, assumed_align=8),
            gmem_ptr(self.cache, cutlass.BFloat16),
            m,
            current_stream(self.device),
        )


def attention_workspace_elements(
    num_heads: int, lora: int, max_batch: int = MAX_ROWS
) -> tuple[int, int]:
    """FP32 elements of the split partials (outputs, then max and sum per head)
    for every batch size up to ``max_batch``."""
    rows = max(b * splits_for(b) for b in range(1, max_batch + 1))
    return rows * num_heads * lora, rows * num_heads * 2


def attention_workspace(
    num_heads: int, lora: int, device: torch.device, max_batch: int = MAX_ROWS
) -> torch.Tensor:
    """One FP32 workspace any number of layers' attentions may share (they run
    one after another on one stream)."""
    o, ml = attention_workspace_elements(num_heads, lora, max_batch)
    return torch.empty(o + ml, dtype=torch.float32, device=device)


class PreparedMlaDecodeAttention:
    """``out[b, h] = softmax(scale * q[b, h] K_b^T) V_b`` over request ``b``'s
    latent cache rows (K = the 576-wide rows, V = their first ``lora``).

    kv_cache: bf16 ``[blocks, block_size, lora + rope]`` as for
      PreparedMlaCacheRow (strides read, nothing copied).
    workspace: FP32, at least ``attention_workspace_elements`` long (one may
      be shared by all layers); allocated here if None.
    run(q_nope, q_pe, seq_lens, block_table, out):
      q_nope bf16 ``[B, heads * lora]`` (the W_UK-absorbed query),
      q_pe bf16 ``[B, heads, rope]`` (rows and heads may be strided, e.g. the
      rope columns of the q projection), seq_lens int32 ``[>= B]`` (0 = a
      padding row: its output is zeros), block_table int32 ``[>= B, W]`` in
      the cache's blocks, out bf16 ``[B, heads * lora]``.  B <= 16.

    Two launches (the split pass and the merge, PDL-chained).  With
    ``metadata_before_wait`` (the default, for the decode graph) seq_lens, the
    block table and every cache row but each request's newest are read before
    ``griddepcontrol.wait``: nothing chained before the split pass may write
    them.  Tokens are not range-checked against the block table (a host sync).
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        rope: int = 64,
        workspace: torch.Tensor | None = None,
        use_pdl: bool = True,
        metadata_before_wait: bool = True,
    ):
        _check_cache(kv_cache)
        self.cache, self.device = kv_cache, kv_cache.device
        self.num_heads, self.rope = num_heads, rope
        self.lora = kv_cache.shape[-1] - rope
        self.scale = float(scale)
        self.block_size = kv_cache.shape[1]
        self.use_pdl, self.metadata_before_wait = use_pdl, metadata_before_wait
        o, ml = attention_workspace_elements(num_heads, self.lora)
        if workspace is None:
            workspace = attention_workspace(num_heads, self.lora, self.device)
        if (
            workspace.dtype != torch.float32
            or workspace.device != self.device
            or not workspace.is_contiguous()
            or workspace.numel() < o + ml
            or workspace.data_ptr() % 16
        ):
            raise ValueError(
                f"workspace must be a contiguous, 16-byte aligned float32 tensor "
                f"of >= {o + ml} elements on {self.device}"
            )
        self.workspace = workspace
        self.partial_o, self.partial_ml = workspace[:o], workspace[o : o + ml]
        self.workspace_bytes = 4 * (o + ml)
        self._fns: dict[tuple, tuple] = {}

    def _compile(self, key: tuple) -> tuple:
        (batch, nope_stride, pe_row, pe_head, out_stride) = key
        c = self.cache
        full = (
            "attention", self.num_heads, self.lora, self.rope, self.scale, *key,
            self.block_size, c.stride(0), c.stride(1), self.use_pdl,
            self.metadata_before_wait,
        )  # fmt: skip
        if full not in _COMPILED:
            split = MlaDecodeAttentionKernel(
                self.num_heads, self.lora, self.rope, self.scale, batch,
                nope_stride, pe_row, pe_head, self.block_size, c.stride(0),
                c.stride(1), self.use_pdl, self.metadata_before_wait,
            )  # fmt: skip
            merge = MlaAttentionMergeKernel(
                self.num_heads, self.lora, batch, out_stride, self.use_pdl,
                self.metadata_before_wait,
            )  # fmt: skip
            bf16 = gmem_ptr(c, cutlass.BFloat16)
            i32 = gmem_ptr(c, cutlass.Int32, assumed_align=4)
            f32 = gmem_ptr(self.workspace, cutlass.Float32)
            stream = cuda.CUstream(0)
            start = time.perf_counter()
            _COMPILED[full] = (
                compile_kernel(
                    "mla_split", full, split, bf16, bf16, bf16, i32,
                    cutlass.Int32(1), i32, f32, f32, stream,
                ),
                compile_kernel("mla_merge", full, merge, f32, f32, i32, bf16, stream),
            )  # fmt: skip
            COMPILE_SECONDS[full] = time.perf_counter() - start
        self._fns[key] = _COMPILED[full]
        return _COMPILED[full]

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Launch on the current stream.  Raises before launch on a wrong
        dtype, shape, device, layout or alignment."""
        heads, lora, rope = self.num_heads, self.lora, self.rope
        b = q_nope.shape[0] if isinstance(q_nope, torch.Tensor) else 0
        if not 1 <= b <= MAX_ROWS:
            raise ValueError(f"batch {b} is outside 1..{MAX_ROWS}")
        nope_stride = _rows(q_nope, "q_nope", (b, heads * lora), self.device)
        out_stride = _rows(out, "out", (b, heads * lora), self.device)
        if (
            not isinstance(q_pe, torch.Tensor)
            or tuple(q_pe.shape) != (b, heads, rope)
            or q_pe.dtype != torch.bfloat16
            or q_pe.device != self.device
        ):
            raise ValueError(
                f"q_pe must be bfloat16 [{b}, {heads}, {rope}] on {self.device}"
            )
        pe_row = q_pe.stride(0) if b > 1 else 0
        if (
            q_pe.stride(2) != 1
            or pe_row % CHUNK
            or q_pe.stride(1) % CHUNK
            or q_pe.data_ptr() % 16
        ):
            raise ValueError(
                "q_pe needs a contiguous last dim and 16-byte aligned heads "
                f"(strides {q_pe.stride()}, address {q_pe.data_ptr():#x})"
            )
        _check_vector(seq_lens, "seq_lens", torch.int32, b, self.device)
        if (
            not isinstance(block_table, torch.Tensor)
            or block_table.dtype != torch.int32
            or block_table.dim() != 2
            or block_table.shape[0] < b
            or block_table.stride(1) != 1
            or block_table.device != self.device
        ):
            raise ValueError(
                f"block_table must be an int32 [>= {b}, W] tensor with a "
                f"contiguous last dim on {self.device}"
            )
        # The block table's row stride is a launch argument, not in the key:
        # the warmup's stand-in table and vLLM's share one compile.
        key = (b, nope_stride, pe_row, q_pe.stride(1), out_stride)
        split, merge = self._fns.get(key) or self._compile(key)
        stream = current_stream(self.device)
        f32 = cutlass.Float32
        split(
            gmem_ptr(q_nope, cutlass.BFloat16),
            gmem_ptr(q_pe, cutlass.BFloat16),
            gmem_ptr(self.cache, cutlass.BFloat16),
            gmem_ptr(block_table, cutlass.Int32, assumed_align=4),
            block_table.stride(0),
            gmem_ptr(seq_lens, cutlass.Int32, assumed_align=4),
            gmem_ptr(self.partial_o, f32),
            gmem_ptr(self.partial_ml, f32),
            stream,
        )
        merge(
            gmem_ptr(self.partial_o, f32),
            gmem_ptr(self.partial_ml, f32),
            gmem_ptr(seq_lens, cutlass.Int32, assumed_align=4),
            gmem_ptr(out, cutlass.BFloat16),
            stream,
        )


def _check_cache(kv_cache: torch.Tensor) -> None:
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3:
        raise ValueError("kv_cache must be a 3-D [blocks, block_size, D] tensor")
    if kv_cache.dtype != torch.bfloat16:
        raise TypeError(
            f"kv_cache must be bfloat16 (kv_cache_dtype auto), got {kv_cache.dtype}"
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


def _check_vector(
    t: torch.Tensor, name: str, dtype: torch.dtype, rows: int, device: torch.device
) -> None:
    """A contiguous 1-D index tensor with an entry per row (or more)."""
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != dtype
        or t.dim() != 1
        or t.shape[0] < rows
        or not t.is_contiguous()
        or t.device != device
    ):
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"{name} must be a contiguous {kind} [>= {rows}] tensor on {device}"
        )


def _rows(t: torch.Tensor, name: str, shape: tuple, device: torch.device) -> int:
    """Check a bf16 [B, N] tensor of 16-byte aligned rows; its row stride
    (0 for one row, whose stride is never used)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be [{shape[0]}, {shape[1]}]")
    if t.dtype != torch.bfloat16 or t.device != device:
        raise TypeError(f"{name} must be bfloat16 on {device}")
    stride = t.stride(0) if shape[0] > 1 else 0
    if t.stride(1) != 1 or stride % CHUNK or t.data_ptr() % 16:
        raise ValueError(
            f"{name} needs a contiguous last dim and 16-byte aligned rows (strides "
            f"{t.stride()}, address {t.data_ptr():#x})"
        )
    return stride

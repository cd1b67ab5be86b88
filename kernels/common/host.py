# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Launch helpers shared by the prepared kernels.

Kernels take raw global-memory pointers (no DLPack conversion per launch, so a
launch costs only argument packing) and the current torch stream as a
``cuda.CUstream``, which is what lets a CUDA graph capture the launch.
"""

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch


def gmem_ptr(t: torch.Tensor, dtype, assumed_align: int = 16) -> cute.Pointer:
    """Raw pointer to ``t``'s first element; the caller checked the alignment."""
    return cute.runtime.make_ptr(
        dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=assumed_align
    )


def current_stream(device: torch.device) -> cuda.CUstream:
    """The current torch stream of ``device`` (captured when inside a graph)."""
    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)

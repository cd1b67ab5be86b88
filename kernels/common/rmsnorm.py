# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The RMSNorm rounding every kernel that normalises a row shares.

vLLM's ``rms_norm`` rounds to bf16 after the 1/rms scale and again after the
weight; a row normalised by the GEMM's epilogue and by the MoE router must be
bit-identical for the same sum of squares, so both build it here.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32


@cute.jit
def normalized_chunk(hidden, gamma, scale, out):
    """``out[e] = bf16(bf16(hidden[e] * scale) * gamma[e])`` for one chunk of
    bf16 values (``scale`` = 1/rms in FP32)."""
    for e in cutlass.range_constexpr(cute.size(out)):
        unit = (hidden[e].to(Float32) * scale).to(BFloat16)
        out[e] = (unit.to(Float32) * gamma[e].to(Float32)).to(BFloat16)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reductions over one warp that several kernels share."""

import cutlass
import cutlass.cute as cute

WARP_LANES_LOG2 = 5


@cute.jit
def warp_sum(value):
    """Sum of ``value`` over the 32 lanes by a butterfly: every lane ends with the
    same sum, added in the same order, so replays and lanes agree bit for bit."""
    for step in cutlass.range_constexpr(WARP_LANES_LOG2):
        value = value + cute.arch.shuffle_sync_bfly(value, 16 >> step)
    return value

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SM90 L2 cache policies for cache-hinted global accesses.

``ld.global.L2::cache_hint`` and ``cp.async.bulk.prefetch.L2.L2::cache_hint``
take an opaque 64-bit policy operand, the value ``createpolicy`` would
produce.  These are the encodings CUTLASS passes as the SM90 TMA cache hints
(``CacheHintSm90`` in ``cute/arch/copy_sm90_desc.hpp``): a fractional policy
over the whole access (fraction 1.0) with the given priority.  Using the
constants saves a ``createpolicy`` per thread; the encoding is the same for
every instruction with an ``.L2::cache_hint`` qualifier.
"""

L2_EVICT_NORMAL = "evict_normal"
L2_EVICT_FIRST = "evict_first"
L2_EVICT_LAST = "evict_last"
L2_POLICY_VALUES = {
    L2_EVICT_NORMAL: 0x1000000000000000,
    L2_EVICT_FIRST: 0x12F0000000000000,
    L2_EVICT_LAST: 0x14F0000000000000,
}
# What the weight loads of the skinny MMA loop accept (None: no hint, the
# plain vector loads).
WEIGHT_L2_POLICIES = (None, L2_EVICT_FIRST, L2_EVICT_LAST)


def l2_policy_value(name: str | None, allowed=WEIGHT_L2_POLICIES) -> int | None:
    """The 64-bit policy operand for ``name`` (None for no hint); raises on a
    name outside ``allowed``."""
    if name not in allowed:
        raise ValueError(f"unknown L2 cache policy {name!r}; expected one of {allowed}")
    return None if name is None else L2_POLICY_VALUES[name]

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Launch bounds for the streaming kernels: a promise to ptxas of the CTAs an SM
will hold (``.minnctapersm``), so that it may use every register that
occupancy leaves.  Without one, ptxas keeps the weight loads' registers few and
sinks part of a batch of loads below its first MMAs (docs/perf/moe_notes.md,
"Candidate: launch bounds on the expert launches"); the PTX instructions stay
the same, so the outputs do too."""

# An SM90 SM's 32-bit registers and the most threads it holds at once.
REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
# The shared-memory carve-out "no preference" (the driver's default), given so
# that compiling with launch bounds queries no device for it.
CARVEOUT_NO_PREFERENCE = -1


def ctas_for_registers(max_registers: int, threads: int) -> int:
    """The CTAs of ``threads`` an SM holds at ``max_registers`` registers a
    thread; raises if not one."""
    ctas = REGISTERS_PER_SM // (max_registers * threads)
    if ctas < 1:
        raise ValueError(
            f"max_registers={max_registers} leaves no {threads}-thread CTA room "
            "on an SM"
        )
    return ctas


def launch_bounds(min_ctas_per_sm: int | None, threads: int) -> dict:
    """The ``launch()`` keywords that promise ``min_ctas_per_sm`` CTAs of
    ``threads`` an SM ({} for None: no bounds)."""
    if min_ctas_per_sm is None:
        return {}
    if not 1 <= min_ctas_per_sm <= THREADS_PER_SM // threads:
        raise ValueError(
            f"min_ctas_per_sm={min_ctas_per_sm} outside 1..{THREADS_PER_SM // threads} "
            f"for {threads}-thread CTAs"
        )
    return {
        "min_blocks_per_mp": min_ctas_per_sm,
        "preferred_smem_carveout": CARVEOUT_NO_PREFERENCE,
    }

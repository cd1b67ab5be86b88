# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The latency-specialized decode step of KimiLinearForCausalLM on SM90.

``KimiLinearDecodeExecutor`` is built once from the loaded model's own tensors
(``SpecializedDecodeModule.process_weights_after_loading``), binds to the KV
caches every time vLLM (re)allocates them (``bind_kv_caches``) and runs one
uniform decode step of a prepared batch size as a fixed sequence of kernel
launches (``plan``) on static buffers, so the step can be captured in vLLM's
FULL decode CUDA graph. ``KimiLinearForCausalLM.forward`` calls ``maybe_run``;
it returns None wherever the stock forward must run instead.

Per layer (B rows, one decode token each; seams fused into the epilogues):

* KDA: ``in_proj`` (q|k|v|b|f_a|g_a, one GEMM) reads the normed input; the
  fused KDA step applies f_b / g_b to f_a(x) / g_a(x) itself (the gates' low
  rank), then conv, gate, delta rule and gated RMSNorm, updating the layer's
  conv and recurrent state in place; ``o_proj`` adds the residual and applies
  the post-attention RMSNorm.
* MLA: ``qkv_a`` (q_proj|kv_a_proj_with_mqa, one GEMM); the new latent cache
  row (kv_a_layernorm and the cache write, one kernel); the decode attention
  over the paged latent cache (for graphs of up to
  ``MLA_OWN_ATTENTION_MAX_BATCH`` rows a split pass and a merge of kernels/mla,
  above that vLLM's FlashAttention-3 ``impl.forward_mqa``), between the two per-head
  absorptions (W_UK into the query, W_UV out of the latent), each one grouped
  skinny GEMM over the 32 heads (W_UV read in place, W_UK from a [N, L, P]
  copy); ``o_proj`` with the residual + RMSNorm epilogue.
* FFN: layer 0 dense MLP (``gate_up`` SiLU-and-mul, ``down`` with the residual +
  next-input-RMSNorm epilogue); MoE layers one ``PreparedMoe`` whose epilogue
  adds the residual and applies the next layer's input RMSNorm (the final norm
  after the last layer). Before a MoE, ``o_proj`` only adds the residual and
  sums its squares (``residual_sumsq``); the MoE's router applies the
  post-attention RMSNorm itself, which saves o_proj's grid-wide ticket and
  whole-row pass on the critical path.

The step's output is what ``KimiLinearModel.forward`` returns (final RMSNorm
applied), the tensor ``compute_logits`` consumes.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers.hpc.hpc_module import HpcModule

from . import MAX_PREPARED_TOKENS, SpecializedDecodeConfig

logger = init_logger(__name__)

# Extra GPU memory the executor may hold beyond the model's weights (issue 6).
MAX_EXTRA_BYTES = 2 << 30
# Graphs of at most this many rows run the MLA decode attention of kernels/mla;
# larger ones vLLM's FlashAttention-3 MLA decode. Alone on an H200
# (docs/perf/mla_attention.md, 2026-12-01) the own kernel is ahead of FA3 at
# B = 1 at every context length measured (512-32K tokens) and about even at
# B = 2 once FA3's cost to W_UV after it is counted (W_UV cannot start
# PDL-chained behind FA3), but behind from B = 4 at 4K tokens and more (it
# stages one cache tile at a time); the bench's short rows do not show that.
MLA_OWN_ATTENTION_MAX_BATCH = 2
# PreparedGemm epilogues (kernels/gemm).
EPILOGUE_PLAIN = "plain"
EPILOGUE_SILU_MUL = "silu_mul"
EPILOGUE_RESIDUAL_RMSNORM = "residual_rmsnorm"
EPILOGUE_RESIDUAL_SUMSQ = "residual_sumsq"
# Conv-state layouts, as PreparedKda names them.
CONV_LAYOUT_SD = "SD"
CONV_LAYOUT_DS = "DS"

KernelLaunch = Callable[["StepContext"], None]
# The plan's name for a MoE's input sums of squares (o_proj writes, router reads).
MOE_INPUT_SUMS = "moe_input_sums"
# The KDA projections of the normed input, in the row order of the fused in_proj.
KDA_IN_PROJ_PARTS = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")


# An MPS client limited to part of the GPU's threads (this variable below 100)
# may be unable to place a thread-block cluster on one GPC; its split GEMMs then
# reduce K through global memory and atomic tickets, which need no co-scheduling.
MPS_THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def clusters_allowed(environ: dict[str, str] | None = None) -> bool:
    """Whether the kernels may launch thread-block clusters here: not under an
    MPS active-thread limit below 100% (an unparsable value counts as a limit)."""
    value = (os.environ if environ is None else environ).get(MPS_THREAD_PERCENTAGE_ENV)
    if value is None:
        return True
    try:
        return float(value) >= 100
    except ValueError:
        return False


# The L2 cache policy of the MoE experts' weight loads and the largest M-bucket
# that takes it (None: every bucket). Streamed once per step, the expert lines
# marked evict_first leave the activations, the MoE workspace and the next
# GEMM's first lines in L2: 1.0-1.25 us less per MoE layer at M = 1-4 and 0.5 us
# more at M = 8 (kernel probe), 27 / 17 us less per decode step at N = 1 / 2 in
# the engine (docs/perf/gemm_notes.md, 2026-12-02 and 2026-12-03).
DEFAULT_EXPERT_L2_POLICY: tuple[str | None, int | None] = ("evict_first", 4)
# Overrides it for A/Bs: "none" (plain loads, the kernels of hd.13 and before),
# or "evict_first" / "evict_last" at every bucket.
EXPERT_L2_POLICY_ENV = "VLLM_HD_EXPERT_L2_POLICY"
EXPERT_L2_POLICY_OFF = "none"
EXPERT_L2_POLICIES = ("evict_first", "evict_last")


def expert_l2_policy_from_env(
    environ: dict[str, str] | None = None,
) -> tuple[str | None, int | None]:
    """(policy, largest M-bucket that takes it) as ``EXPERT_L2_POLICY_ENV`` asks
    (``DEFAULT_EXPERT_L2_POLICY`` if unset or empty); raises, naming the
    variable, on an unknown value."""
    value = (os.environ if environ is None else environ).get(EXPERT_L2_POLICY_ENV)
    if not value:
        return DEFAULT_EXPERT_L2_POLICY
    if value == EXPERT_L2_POLICY_OFF:
        return (None, None)
    if value not in EXPERT_L2_POLICIES:
        raise ValueError(
            f"{EXPERT_L2_POLICY_ENV}={value!r}: expected one of "
            f"{', '.join((EXPERT_L2_POLICY_OFF, *EXPERT_L2_POLICIES))} (or unset)"
        )
    return (value, None)


# Warps per CTA of the MoE expert launches, (gate_up, down), and the largest
# M-bucket that takes them (None: every bucket; larger buckets keep 4 + 4). An
# 8-warp gate_up CTA loads 8 of each warp's 9 K-steps in its first batch, before
# its PDL wait. One-host engine A/B against 4 + 4 (docs/perf/decode_notes.md,
# 2026-12-04): 21 us less GPU busy per N = 1 step, but N = 2 / 4 / 8 steps 18 /
# 46 / 43 us slower, so only M-bucket 1 takes it. 8-warp down CTAs (4 K-steps a
# warp) made the engine slower (docs/perf/moe_notes.md, 2026-12-03).
DEFAULT_MOE_EXPERT_WARPS: tuple[int, int, int | None] = (8, 4, 1)
# Overrides it for A/Bs: "W" (both launches) or "GATE_UP,DOWN", each in
# MOE_EXPERT_WARPS, at every M-bucket, or up to bucket B with a suffix "@B";
# "4" is the CTAs of hd.14 and before.
MOE_EXPERT_WARPS_ENV = "VLLM_HD_MOE_EXPERT_WARPS"
MOE_EXPERT_WARPS = (4, 8)


def moe_expert_warps_from_env(
    environ: dict[str, str] | None = None,
) -> tuple[int, int, int | None]:
    """(gate_up warps, down warps, largest M-bucket that takes them) of the MoE
    expert CTAs as ``MOE_EXPERT_WARPS_ENV`` asks (``DEFAULT_MOE_EXPERT_WARPS``
    if unset or empty); raises, naming the variable, on another value."""
    value = (os.environ if environ is None else environ).get(MOE_EXPERT_WARPS_ENV)
    if not value:
        return DEFAULT_MOE_EXPERT_WARPS
    warps, at, max_bucket = value.partition("@")
    parts = warps.split(",")
    bucket_ok = not at or re.fullmatch(r"[1-9][0-9]*", max_bucket) is not None
    if (
        len(parts) > 2
        or not set(parts) <= {str(w) for w in MOE_EXPERT_WARPS}
        or not bucket_ok
    ):
        raise ValueError(
            f"{MOE_EXPERT_WARPS_ENV}={value!r}: expected W or GATE_UP,DOWN, each one "
            f"of {', '.join(map(str, MOE_EXPERT_WARPS))}, optionally followed by "
            "@B, the largest M-bucket that takes them (or unset)"
        )
    return (int(parts[0]), int(parts[-1]), int(max_bucket) if max_bucket else None)


# The weight K-steps the KDA in_proj's warps load before their PDL wait (of 18
# a warp) and the MoE down launches' first weight batch, instead of the kernels'
# one batch of ``unroll`` = 8: in_proj's early loads contend less with the MoE
# still streaming and the KDA step starts ~13 us earlier under it. In the engine
# on one H200 (2026-12-04), both together: GPU busy per median step -20 us at
# N = 1 and -18 at N = 2; either alone -2..-11 (docs/perf/gemm_notes.md, "Fewer
# weight steps before the PDL wait"). Loads move, arithmetic does not: outputs
# are bit-identical.
KDA_IN_PROJ_PREWAIT_STEPS = 3
MOE_DOWN_PREWAIT_STEPS = 6

# Weight K-steps a warp loads before its PDL wait, by the GEMM's weight shape,
# for A/Bs: "NxK:S[,NxK:S...]" (e.g. "12576x2304:8", the KDA in_proj as in hd.17);
# it overrides the executor's choice for that shape. Unset or empty: the KDA
# in_proj takes KDA_IN_PROJ_PREWAIT_STEPS, every other GEMM its config's one
# batch of ``unroll`` steps.
GEMM_PREWAIT_ENV = "VLLM_HD_GEMM_PREWAIT"


def _gemm_shape_values_from_env(
    name: str, environ: dict[str, str] | None, value_pattern: str, expected: str
) -> dict[tuple[int, int], str]:
    """{(N, K) of a weight: V} from the variable ``name`` as "NxK:V[,NxK:V...]"
    with V matching ``value_pattern`` ({} if unset or empty); raises, naming the
    variable and ``expected``, on another value."""
    value = (os.environ if environ is None else environ).get(name)
    if not value:
        return {}
    values: dict[tuple[int, int], str] = {}
    for item in value.split(","):
        match = re.fullmatch(rf"([1-9][0-9]*)x([1-9][0-9]*):({value_pattern})", item)
        shape = (int(match[1]), int(match[2])) if match else None
        if shape is None or shape in values:
            raise ValueError(f"{name}={value!r}: expected {expected} (or unset)")
        values[shape] = match[3]
    return values


def gemm_prewait_from_env(
    environ: dict[str, str] | None = None,
) -> dict[tuple[int, int], int]:
    """{(N, K) of a weight: pre-wait K-steps} as ``GEMM_PREWAIT_ENV`` asks ({}
    if unset or empty); raises, naming the variable, on another value."""
    steps = _gemm_shape_values_from_env(
        GEMM_PREWAIT_ENV,
        environ,
        "[0-9]|[1-9][0-9]",
        "NxK:S[,NxK:S...], a GEMM's weight shape (each once) and the K-steps S "
        "(0-99) its warps load before the PDL wait",
    )
    return {shape: int(s) for shape, s in steps.items()}


# Launch bounds of the GEMMs whose 9-16-token launches (M-bucket 16) keep too few weight
# loads in flight: the KDA in_proj, the MLA's q / kv_a projection and the dense MLP's
# gate_up. Promised 4 CTAs an SM, ptxas 13.5 keeps 25 16-byte weight loads ahead of the
# first MMA instead of 13 (8 for the in_proj with its KDA_IN_PROJ_PREWAIT_STEPS), at 127
# registers (docs/perf/gemm_notes.md, the SASS tables). On one H200
# (2026-12-06): scripts/bench_gemm.py at M = 16 in_proj 17.26 us against 19.74 (cuBLAS
# 17.40), dense gate_up 24.15 against 28.96, q_proj 8.76 against 10.46; the engine at
# N = 16 3.075 ms a step against 3.129, GPU busy per median step -57 us
# (docs/perf/gemm_notes.md, "Launch bounds on the GEMMs, measured"). At M-bucket 8 the
# engine moved by -7..+12 us at N = 1-8 and the KDA step started 15 us later under
# in_proj: no bounds there. Outputs are bit-identical (tests/kernels/test_gemm.py).
GEMM_MIN_CTAS_BUCKET_16 = {16: 4}
# The GEMMs' M-buckets (PreparedGemm's configs: 1-8 and 9-16 tokens).
GEMM_M_BUCKETS = (8, 16)

# For A/Bs: "NxK:C[@B][,...]" promises ptxas C CTAs an SM (1-16 for the 4-warp CTAs)
# for the GEMMs of that weight shape, at every M-bucket or at bucket B (8 or 16) only;
# C = 0 takes the bounds off that shape. Other shapes keep the executor's bounds; "0"
# takes them off every GEMM. Unset or empty: the executor's (GEMM_MIN_CTAS_BUCKET_16).
GEMM_MIN_CTAS_ENV = "VLLM_HD_GEMM_MIN_CTAS"


def _gemm_bucket_values_from_env(
    name: str, environ: dict[str, str] | None, value_pattern: str, expected: str
) -> dict[tuple[int, int], dict[int, int]] | None:
    """{(N, K) of a weight: {M-bucket: V}} from the variable ``name`` as
    "NxK:V[@B][,...]" (V matching ``value_pattern``; every M-bucket, or bucket B
    only; V = 0: {} for that shape), {} if unset or empty, None for "0"; raises,
    naming the variable and ``expected``, on another value."""
    if (os.environ if environ is None else environ).get(name) == "0":
        return None
    buckets = "|".join(map(str, GEMM_M_BUCKETS))
    asked = _gemm_shape_values_from_env(
        name, environ, rf"(?:{value_pattern})(?:@(?:{buckets}))?", expected
    )
    values: dict[tuple[int, int], dict[int, int]] = {}
    for shape, text in asked.items():
        value, _, bucket = text.partition("@")
        taking = (int(bucket),) if bucket else GEMM_M_BUCKETS
        values[shape] = dict.fromkeys(taking, int(value)) if int(value) else {}
    return values


def gemm_min_ctas_from_env(
    environ: dict[str, str] | None = None,
) -> dict[tuple[int, int], dict[int, int]] | None:
    """{(N, K) of a weight: {M-bucket: CTAs an SM its launch bounds promise}} as
    ``GEMM_MIN_CTAS_ENV`` asks, overriding the executor's bounds for those
    shapes ({} if unset or empty; {} as a shape's value: no bounds); None for
    "0", no bounds on any GEMM. Raises, naming the variable, on another value."""
    return _gemm_bucket_values_from_env(
        GEMM_MIN_CTAS_ENV,
        environ,
        "[0-9]|1[0-6]",
        "0 or NxK:C[@B][,NxK:C[@B]...], a GEMM's weight shape (each once) and the "
        "CTAs C (1-16; 0: none) an SM its launch bounds promise, at every M-bucket or "
        f"at bucket B ({' or '.join(map(str, GEMM_M_BUCKETS))})",
    )


# The KDA in_proj's weight at 1-8 tokens streams through 2 shared-memory stages
# of 8 rows (PreparedGemm's ``weight_stages``, StagedSkinnyGemmKernel): bulk copies
# fill the stages before its PDL wait and the KDA step's CTAs still fit beside
# its 83 KB (3 stages or more crowd them out: the KDA step then starts ~11 us
# before in_proj's end, not ~29). On one H100 (2026-12-06, `engine-ab
# VLLM_HD_GEMM_WEIGHT_STAGES` with the model cut to 12 layers, dummy routing),
# step time against the register stream: -15 us at N = 1 (twice), -20 / -26 at
# N = 2, -31 at N = 4, +4 at N = 8; at 9-16 tokens (M-bucket 16) +2 at N = 16,
# so the register stream stays there (docs/perf/gemm_notes.md, "The staged
# weight stream in the engine"). Same MMAs and reduction order as a register
# stream of 8 warps; against the default 4-warp one the sums differ in order.
KDA_IN_PROJ_WEIGHT_STAGES = {8: 2}

# For A/Bs: "NxK:S[@B][,...]" streams the GEMMs of that weight shape through S
# shared-memory stages of 8 rows (2-9; 0: the register stream) at every M-bucket
# or at bucket B (8 or 16) only (plain and silu_mul GEMMs), the other shapes
# keeping the executor's choice; "0" turns the stages off everywhere. Unset or
# empty: the executor's (KDA_IN_PROJ_WEIGHT_STAGES).
GEMM_WEIGHT_STAGES_ENV = "VLLM_HD_GEMM_WEIGHT_STAGES"


def gemm_weight_stages_from_env(
    environ: dict[str, str] | None = None,
) -> dict[tuple[int, int], dict[int, int]] | None:
    """{(N, K) of a weight: {M-bucket: shared-memory stages}} as
    ``GEMM_WEIGHT_STAGES_ENV`` asks, overriding the executor's choice for those
    shapes ({} if unset or empty; {} as a shape's value: the register stream);
    None for "0", no stages on any GEMM. Raises, naming the variable, on another
    value."""
    return _gemm_bucket_values_from_env(
        GEMM_WEIGHT_STAGES_ENV,
        environ,
        "[02-9]",
        "0 or NxK:S[@B][,NxK:S[@B]...], a GEMM's weight shape (each once) and the "
        "shared-memory stages S (2-9; 0: none) of 8 weight rows its weight streams "
        "through, at every M-bucket or at bucket B "
        f"({' or '.join(map(str, GEMM_M_BUCKETS))})",
    )


# The same for the MoE expert launches, for A/Bs: "G,D", the K-steps of gate_up's
# and down's first weight batch at every M-bucket (e.g. ",8": down as in hd.17);
# an empty side, or unset / empty: gate_up one batch of ``unroll`` steps, down
# MOE_DOWN_PREWAIT_STEPS.
MOE_PREWAIT_ENV = "VLLM_HD_MOE_PREWAIT"
MOE_PREWAIT_DEFAULT = (None, MOE_DOWN_PREWAIT_STEPS)


def moe_prewait_from_env(
    environ: dict[str, str] | None = None,
) -> tuple[int | None, int | None]:
    """(gate_up, down) first-batch K-steps (None: ``unroll``) as
    ``MOE_PREWAIT_ENV`` asks, ``MOE_PREWAIT_DEFAULT`` where it is silent; raises,
    naming the variable, on another value."""
    value = (os.environ if environ is None else environ).get(MOE_PREWAIT_ENV)
    if not value:
        return MOE_PREWAIT_DEFAULT
    match = re.fullmatch(r"([0-9]|[1-9][0-9])?,([0-9]|[1-9][0-9])?", value)
    if match is None or match[0] == ",":
        raise ValueError(
            f"{MOE_PREWAIT_ENV}={value!r}: expected G,D, the K-steps (0-99) of "
            "gate_up's and down's first weight batch, either side empty to keep "
            "its default (or unset)"
        )
    return tuple(
        default if side is None else int(side)
        for side, default in zip(match.groups(), MOE_PREWAIT_DEFAULT)
    )


# The MoE expert launches' launch bounds, for A/Bs: "R" lets ptxas use up to R
# registers a thread (64-255; 128 keeps two 8-warp or four 4-warp CTAs an SM), so it
# keeps more of a weight batch's loads ahead of the first MMA; "R:B" at M-buckets 1 to
# B, "R:A-B" at buckets A to B (A <= B, each of 1, 2, 4, 8, 16). Unset, empty or "0":
# none. 128 at buckets 2-8 made the MoE layer 1.4-7.4 us faster in the MoE chain probe
# (one H100, scripts/probe_moe_seams.py), but the engine slower: on one H200
# (2026-12-06, the specialized engine with and without them, one process each) GPU busy
# per median step +11 us at N = 2 and the step +31 / +36 / +17 us at N = 2 / 4 / 8
# (docs/perf/moe_notes.md, "The expert launch bounds in the engine"). The PTX
# instructions are the same: outputs are bit-identical (tests/kernels/test_moe.py).
MOE_EXPERT_REGISTERS_ENV = "VLLM_HD_MOE_EXPERT_REGISTERS"
MOE_EXPERT_REGISTERS_RANGE = (64, 255)
MOE_EXPERT_REGISTERS_BUCKETS = (1, 2, 4, 8, 16)


def moe_expert_registers_from_env(
    environ: dict[str, str] | None = None,
) -> tuple[int, int, int] | None:
    """``(registers, min_bucket, max_bucket)`` of the MoE expert launches' bounds
    as ``MOE_EXPERT_REGISTERS_ENV`` asks (None: no bounds); raises, naming the
    variable, on another value."""
    value = (os.environ if environ is None else environ).get(MOE_EXPERT_REGISTERS_ENV)
    if not value or value == "0":
        return None
    registers, sep, span = value.partition(":")
    every = str(MOE_EXPERT_REGISTERS_BUCKETS[-1])
    buckets = _bucket_span(span if sep else every, MOE_EXPERT_REGISTERS_BUCKETS)
    fewest, most = MOE_EXPERT_REGISTERS_RANGE
    if (
        not re.fullmatch(r"[1-9][0-9]*", registers)
        or not fewest <= int(registers) <= most
        or buckets is None
    ):
        raise ValueError(
            f"{MOE_EXPERT_REGISTERS_ENV}={value!r}: expected 0, R, R:B or R:A-B, the "
            f"registers a thread ({fewest}-{most}) the MoE expert launches of every "
            "M-bucket, of buckets 1 to B or of buckets A to B (A <= B, among "
            f"{', '.join(map(str, MOE_EXPERT_REGISTERS_BUCKETS))}) may use (or unset: "
            "none)"
        )
    return int(registers), *buckets


def _bucket_span(text: str, buckets: tuple[int, ...]) -> tuple[int, int] | None:
    """``(A, B)`` of "B" (the first bucket to B) or "A-B" (A <= B), each among
    ``buckets``; None for anything else."""
    low, sep, high = text.partition("-")
    if not sep:
        low, high = str(buckets[0]), text
    named = {str(b): b for b in buckets}
    if low not in named or high not in named or named[low] > named[high]:
        return None
    return named[low], named[high]


# The M-buckets whose MoE gate_up launch also runs the shared expert's down (its
# weights staged before the PDL wait, while the router runs; the down launch then
# streams the routed experts only): unset (or empty) the default, bucket 2 only (the
# one engine A/B gain: ~0.5 us a MoE layer at 2 tokens on the H200's full model; 1
# token is slower, and 4 and 8 were 50-56 us a step slower there); for A/Bs "0"
# none, "B" buckets 1 to B, "A-B" buckets A to B (A <= B), each of 1, 2, 4 or 8.
# Outputs are bit-identical (tests/kernels/test_moe.py).
MOE_EARLY_SHARED_DOWN_ENV = "VLLM_HD_MOE_EARLY_SHARED_DOWN"
MOE_EARLY_SHARED_DOWN_BUCKETS = (1, 2, 4, 8)
MOE_EARLY_SHARED_DOWN_DEFAULT = (2, 2)


def moe_early_shared_down_from_env(
    environ: dict[str, str] | None = None,
) -> tuple[int, int] | None:
    """``(min_bucket, max_bucket)`` of the early shared down as
    ``MOE_EARLY_SHARED_DOWN_ENV`` asks (None: off); raises, naming the variable,
    on another value."""
    value = (os.environ if environ is None else environ).get(MOE_EARLY_SHARED_DOWN_ENV)
    if not value:
        return MOE_EARLY_SHARED_DOWN_DEFAULT
    if value == "0":
        return None
    buckets = _bucket_span(value, MOE_EARLY_SHARED_DOWN_BUCKETS)
    if buckets is None:
        raise ValueError(
            f"{MOE_EARLY_SHARED_DOWN_ENV}={value!r}: expected 0, B or A-B (A <= B) "
            f"with A and B among {', '.join(map(str, MOE_EARLY_SHARED_DOWN_BUCKETS))}: "
            "the M-buckets whose gate_up runs the shared expert's down (or unset: "
            "bucket 2)"
        )
    return buckets


# The step's first launch: "1" (or unset / empty, the default) fuses the embedding
# lookup and the first input RMSNorm into one PDL launch (cutedsl/embed_norm), so the
# first in_proj loads its pre-wait weights while the rows are gathered (3-5 us of GPU
# busy a step in the engine A/B); "0" keeps torch's index_select and vLLM's rms_norm,
# two launches without PDL.
FUSED_EMBED_NORM_ENV = "VLLM_HD_FUSED_EMBED_NORM"


def fused_embed_norm_from_env(environ: dict[str, str] | None = None) -> bool:
    """Whether ``FUSED_EMBED_NORM_ENV`` asks for the fused first launch; raises,
    naming the variable, on another value than 0 / 1."""
    value = (os.environ if environ is None else environ).get(FUSED_EMBED_NORM_ENV)
    if not value:
        return True
    if value == "0":
        return False
    if value != "1":
        raise ValueError(
            f"{FUSED_EMBED_NORM_ENV}={value!r}: expected 0 or 1 (or unset)"
        )
    return True


# The compiled CuTe DSL kernels kept on disk between engine starts
# (cutedsl/common/compile_cache.py): unset or "1" under vLLM's cache root, as vLLM keeps
# its own compile cache; an absolute path in that directory; "0" off.
# VLLM_DISABLE_COMPILE_CACHE=1, vLLM's switch for its own compile cache, keeps the
# default and "1" off; an absolute directory is an explicit request and stays on (the
# benchmarks set both: they disable vLLM's cache to share one Triton cache between
# engines). A default directory that cannot be used turns the cache off with a warning;
# an asked-for one fails at start.
KERNEL_CACHE_ENV = "VLLM_HD_KERNEL_CACHE"
KERNEL_CACHE_SUBDIR = os.path.join("hopper_decode", "cutedsl")


def kernel_cache_dir_from_env(
    environ: dict[str, str] | None = None, cache_root: str | None = None
) -> str | None:
    """The kernel cache directory ``KERNEL_CACHE_ENV`` asks for (None: off);
    raises, naming the variable, on another value. ``cache_root`` defaults to
    vLLM's ``VLLM_CACHE_ROOT``."""
    env = os.environ if environ is None else environ
    value = env.get(KERNEL_CACHE_ENV, "").strip()
    if value == "0":
        return None
    if value in ("", "1"):
        if cache_root is None:
            import vllm.envs as envs

            cache_root = envs.VLLM_CACHE_ROOT
        path = os.path.join(cache_root, KERNEL_CACHE_SUBDIR)
        if env.get("VLLM_DISABLE_COMPILE_CACHE", "0").strip() not in ("", "0"):
            logger.info(
                "Kimi-Linear specialized decode: VLLM_DISABLE_COMPILE_CACHE is set, so "
                "the kernels compile without the cache under VLLM_CACHE_ROOT (%s); "
                "%s=<absolute directory> would be used",
                path,
                KERNEL_CACHE_ENV,
            )
            return None
        return path
    if os.path.isabs(value):
        return value
    raise ValueError(
        f"{KERNEL_CACHE_ENV}={value!r}: expected 0 (off), 1 (under "
        "VLLM_CACHE_ROOT) or an absolute directory"
    )


def check_environment() -> None:
    """Parse every switch of the executor's environment (each parser raises
    ValueError naming its variable), so that a bad value fails while the model is
    built, before its weights load; the executor parses them again when built."""
    expert_l2_policy_from_env()
    moe_expert_warps_from_env()
    gemm_prewait_from_env()
    gemm_min_ctas_from_env()
    gemm_weight_stages_from_env()
    moe_prewait_from_env()
    moe_expert_registers_from_env()
    moe_early_shared_down_from_env()
    fused_embed_norm_from_env()
    kernel_cache_dir_from_env()


# --------------------------------------------------------------------- kernels
class KernelFactory:
    """Builds the prepared kernels and the stock ops a step uses.

    The default builds the CuTe DSL kernels of ``cutedsl/`` and calls vLLM's own
    ops; CPU tests pass a factory of fakes with the same signatures.
    ``clusters``: whether split GEMMs reduce K and the MoE router gathers its
    logits through thread-block clusters (default: unless an MPS active-thread
    limit is set, ``clusters_allowed``). ``expert_l2_policy``: the MoE experts'
    weight L2 policy and the largest M-bucket that takes it (default:
    ``expert_l2_policy_from_env``). ``moe_expert_warps``: the warps of the MoE's
    gate_up and down CTAs and the largest M-bucket that takes them (default:
    ``moe_expert_warps_from_env``).
    """

    def __init__(
        self,
        clusters: bool | None = None,
        expert_l2_policy: tuple[str | None, int | None] | None = None,
        moe_expert_warps: tuple[int, int, int | None] | None = None,
    ) -> None:
        self.clusters = clusters_allowed() if clusters is None else clusters
        if expert_l2_policy is None:
            expert_l2_policy = expert_l2_policy_from_env()
        self.expert_l2_policy = expert_l2_policy
        if moe_expert_warps is None:
            moe_expert_warps = moe_expert_warps_from_env()
        self.moe_expert_warps = moe_expert_warps
        self.gemm_prewait = gemm_prewait_from_env()
        self.gemm_min_ctas = gemm_min_ctas_from_env()
        self.gemm_weight_stages = gemm_weight_stages_from_env()
        # The weight shapes of the GEMMs built so far: check_gemm_shapes_matched
        # names these when a switch asks for a shape that is not among them.
        self.gemm_shapes: set[tuple[int, int]] = set()
        self.moe_prewait = moe_prewait_from_env()
        self.moe_expert_registers = moe_expert_registers_from_env()
        self.moe_early_shared_down = moe_early_shared_down_from_env()
        self.fused_embed_norm = fused_embed_norm_from_env()
        if self.fused_embed_norm:
            logger.info(
                "Kimi-Linear specialized decode: the embedding and the first input "
                "norm run as one launch (%s)",
                FUSED_EMBED_NORM_ENV,
            )
        if self.moe_early_shared_down:
            logger.info(
                "Kimi-Linear specialized decode: the MoE gate_up launch runs the "
                "shared expert's down at M-buckets %d to %d (%s)",
                *self.moe_early_shared_down,
                MOE_EARLY_SHARED_DOWN_ENV,
            )
        self.kernel_cache = kernel_cache_dir_from_env()
        if self.kernel_cache is not None:
            from ..cutedsl.common import compile_cache

            try:
                compile_cache.configure(self.kernel_cache)
            except ValueError as err:
                if os.environ.get(KERNEL_CACHE_ENV, "").strip():
                    raise ValueError(f"{KERNEL_CACHE_ENV}: {err}") from err
                # The default, not asked for: the engine still runs, compiling every
                # kernel at each start.
                logger.warning(
                    "Kimi-Linear specialized decode: the default kernel cache cannot "
                    "be used (%s), so the kernels compile at every engine start; %s=0 "
                    "turns it off, %s=<absolute directory> puts it elsewhere",
                    err,
                    KERNEL_CACHE_ENV,
                    KERNEL_CACHE_ENV,
                )
                self.kernel_cache = None
        if self.kernel_cache is not None:
            logger.info(
                "Kimi-Linear specialized decode: compiled kernels are kept in %s (%s)",
                self.kernel_cache,
                KERNEL_CACHE_ENV,
            )
        logger.info(
            "Kimi-Linear specialized decode: the MoE expert launches' first weight "
            "batch is %s K-steps (gate_up, down; None: unroll) (%s=%r)",
            self.moe_prewait,
            MOE_PREWAIT_ENV,
            os.environ.get(MOE_PREWAIT_ENV, ""),
        )
        if self.moe_expert_registers is None:
            bounds = "none"
        else:
            registers, low, high = self.moe_expert_registers
            bounds = f"{registers} registers a thread at M-buckets {low}-{high}"
        logger.info(
            "Kimi-Linear specialized decode: the MoE expert launches' launch bounds: "
            "%s (%s=%r)",
            bounds,
            MOE_EXPERT_REGISTERS_ENV,
            os.environ.get(MOE_EXPERT_REGISTERS_ENV, ""),
        )
        if self.gemm_prewait:
            logger.info(
                "Kimi-Linear specialized decode: GEMM warps load %s K-steps before "
                "their PDL wait (%s; the KDA in_proj's default: %d)",
                ", ".join(
                    f"{s} ({n} x {k})" for (n, k), s in self.gemm_prewait.items()
                ),
                GEMM_PREWAIT_ENV,
                KDA_IN_PROJ_PREWAIT_STEPS,
            )

        def staged(stages: dict[int, int]) -> str:
            taken = [f"{c} stages at M-bucket {b}" for b, c in stages.items()]
            return ", ".join(taken) or "none"

        if self.gemm_weight_stages is None:
            gemm_stages = "none"
        else:
            gemm_stages = staged(KDA_IN_PROJ_WEIGHT_STAGES) + " for the KDA in_proj"
            for (n, k), asked in self.gemm_weight_stages.items():
                gemm_stages += f"; {n} x {k}: {staged(asked)}"
        logger.info(
            "Kimi-Linear specialized decode: GEMM weights through shared-memory "
            "stages of 8 rows: %s (%s=%r)",
            gemm_stages,
            GEMM_WEIGHT_STAGES_ENV,
            os.environ.get(GEMM_WEIGHT_STAGES_ENV, ""),
        )

        def ctas(bounds: dict[int, int]) -> str:
            taken = [f"{c} CTAs an SM at M-bucket {b}" for b, c in bounds.items()]
            return ", ".join(taken) or "none"

        if self.gemm_min_ctas is None:
            gemm_bounds = "none"
        else:
            gemm_bounds = ctas(GEMM_MIN_CTAS_BUCKET_16)
            gemm_bounds += " for the KDA in_proj, MLA q/kv_a and dense gate_up"
            for (n, k), asked in self.gemm_min_ctas.items():
                gemm_bounds += f"; {n} x {k}: {ctas(asked)}"
        logger.info(
            "Kimi-Linear specialized decode: GEMM launch bounds: %s (%s=%r)",
            gemm_bounds,
            GEMM_MIN_CTAS_ENV,
            os.environ.get(GEMM_MIN_CTAS_ENV, ""),
        )
        gate_up_warps, down_warps, warps_max_bucket = self.moe_expert_warps
        logger.info(
            "Kimi-Linear specialized decode: MoE expert CTAs of %d (gate_up) and %d "
            "(down) warps at %s (%s=%r)",
            gate_up_warps,
            down_warps,
            "every M-bucket"
            if warps_max_bucket is None
            else f"M-buckets <= {warps_max_bucket} (the kernels' default above)",
            MOE_EXPERT_WARPS_ENV,
            os.environ.get(MOE_EXPERT_WARPS_ENV, ""),
        )
        policy, max_bucket = self.expert_l2_policy
        where = "every M-bucket" if max_bucket is None else f"M-buckets <= {max_bucket}"
        logger.info(
            "Kimi-Linear specialized decode: the MoE experts' weight loads carry %s "
            "(%s=%r)",
            f"the L2 policy {policy} at {where}" if policy else "no L2 policy",
            EXPERT_L2_POLICY_ENV,
            os.environ.get(EXPERT_L2_POLICY_ENV, ""),
        )
        if not self.clusters:
            logger.info(
                "Kimi-Linear specialized decode: %s=%s, so the split GEMMs and the "
                "MoE router go through global memory, not thread-block clusters",
                MPS_THREAD_PERCENTAGE_ENV,
                os.environ.get(MPS_THREAD_PERCENTAGE_ENV),
            )

    def gemm(
        self,
        weight: torch.Tensor,
        epilogue: str = EPILOGUE_PLAIN,
        rmsnorm_weight: torch.Tensor | None = None,
        eps: float = 1e-5,
        prewait_steps: int | None = None,
        min_ctas_per_sm: dict[int, int] | None = None,
        weight_stages: dict[int, int] | None = None,
    ) -> Any:
        """``prewait_steps``: the weight K-steps a warp loads before its PDL wait
        (None: the config's ``unroll``); ``min_ctas_per_sm``: launch bounds by
        M-bucket (None: none; not at the buckets that end up staged unless
        ``GEMM_MIN_CTAS_ENV`` names the shape); ``weight_stages``: the M-buckets
        whose weight streams through shared-memory stages, and how many (None:
        none; the other buckets keep the register stream and its pre-wait
        steps).
        ``GEMM_PREWAIT_ENV``, ``GEMM_MIN_CTAS_ENV`` and ``GEMM_WEIGHT_STAGES_ENV``
        override them by the weight's shape."""
        from ..cutedsl.gemm.prepared import PreparedGemm

        shape = tuple(weight.shape)
        self.gemm_shapes.add(shape)
        asked = self.gemm_prewait.get(shape)
        if self.gemm_min_ctas is None:
            min_ctas_per_sm = None
        asked_bounds = (self.gemm_min_ctas or {}).get(shape)
        if asked_bounds is not None:
            min_ctas_per_sm = asked_bounds
        if self.gemm_weight_stages is None:
            weight_stages = None
        asked_stages = (self.gemm_weight_stages or {}).get(shape)
        if asked_stages is not None:
            weight_stages = asked_stages
        if asked_bounds is None and min_ctas_per_sm and weight_stages:
            # The executor's bounds are for the register stream; a staged bucket
            # runs one CTA an SM at the registers it needs (68-79 for the in_proj).
            min_ctas_per_sm = {
                bucket: ctas
                for bucket, ctas in min_ctas_per_sm.items()
                if bucket not in weight_stages
            }
        stream = {
            "prewait_steps": prewait_steps if asked is None else asked,
            "min_ctas_per_sm": min_ctas_per_sm or None,
            "weight_stages": weight_stages or None,
        }
        try:
            return PreparedGemm(
                weight,
                epilogue,
                rmsnorm_weight=rmsnorm_weight,
                eps=eps,
                cluster_split_k=self.clusters,
                **stream,
            )
        except ValueError as err:
            if asked is None and asked_bounds is None and asked_stages is None:
                raise
            asked_by = (
                (GEMM_PREWAIT_ENV, asked),
                (GEMM_MIN_CTAS_ENV, asked_bounds),
                (GEMM_WEIGHT_STAGES_ENV, asked_stages),
            )
            switches = ", ".join(
                f"{name}={os.environ.get(name, '')!r}"
                for name, value in asked_by
                if value is not None
            )
            raise ValueError(
                f"{switches}: the {shape[0]}x{shape[1]} GEMM cannot take them: {err}"
            ) from err

    def kernel_cache_note(self) -> str:
        """What the kernel cache did so far in this process, for a log line
        ("" when it is off)."""
        if self.kernel_cache is None:
            return ""
        from ..cutedsl.common import compile_cache

        stats = compile_cache.STATS
        return (
            f"; kernel cache {self.kernel_cache}: {stats.loaded} variants loaded, "
            f"{stats.compiled} compiled, {stats.load_failures} failed to load, "
            f"{stats.write_failures} not written (this process)"
        )

    def check_gemm_shapes_matched(self) -> None:
        """Raise if ``GEMM_PREWAIT_ENV``, ``GEMM_MIN_CTAS_ENV`` or
        ``GEMM_WEIGHT_STAGES_ENV`` names a weight shape that no GEMM built by this
        factory has (a mistyped shape would leave an A/B measuring the defaults)."""
        for name, asked in (
            (GEMM_PREWAIT_ENV, self.gemm_prewait),
            (GEMM_MIN_CTAS_ENV, self.gemm_min_ctas or {}),
            (GEMM_WEIGHT_STAGES_ENV, self.gemm_weight_stages or {}),
        ):
            unmatched = sorted(set(asked) - self.gemm_shapes)
            if unmatched:
                raise ValueError(
                    f"{name}={os.environ.get(name, '')!r} names "
                    f"{', '.join(f'{n}x{k}' for n, k in unmatched)}, which no GEMM of "
                    "this model has; its GEMMs' weight shapes are "
                    f"{', '.join(f'{n}x{k}' for n, k in sorted(self.gemm_shapes))}"
                )

    def grouped_gemm(self, weight: torch.Tensor) -> Any:
        from ..cutedsl.gemm.prepared import PreparedGroupedGemm

        return PreparedGroupedGemm(weight, cluster_split_k=self.clusters)

    def kda(
        self,
        conv_weights: Sequence[torch.Tensor],
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        num_heads: int,
        norm_eps: float,
        conv_layout: str,
        gate_weights: tuple[torch.Tensor, torch.Tensor],
    ) -> Any:
        from ..cutedsl.kda.prepared import PreparedKda

        return PreparedKda(
            tuple(conv_weights),
            a_log,
            dt_bias,
            norm_weight,
            conv_state,
            recurrent_state,
            num_heads=num_heads,
            norm_eps=norm_eps,
            conv_layout=conv_layout,
            # Runs only inside the decode graph, where a layer's caches are
            # written by its own step alone and the slot rows are gathered at
            # the graph's start: the state loads may overlap the projections.
            state_loads_before_wait=True,
            gate_weights=gate_weights,
        )

    def moe(self, **kwargs: Any) -> Any:
        from ..cutedsl.moe.prepared import MoeConfig, PreparedMoe

        gate_up_warps, down_warps, warps_max_bucket = self.moe_expert_warps
        early_min_bucket, early_max_bucket = self.moe_early_shared_down or (1, 0)
        bounds = {}
        if self.moe_expert_registers is not None:
            registers, low, high = self.moe_expert_registers
            bounds = dict(
                expert_max_registers=registers,
                expert_registers_min_bucket=low,
                expert_registers_max_bucket=high,
            )
        return PreparedMoe(
            **kwargs,
            config=MoeConfig(
                warps=gate_up_warps,
                down_warps=down_warps,
                warps_max_bucket=warps_max_bucket,
                gate_up_prewait_steps=self.moe_prewait[0],
                down_prewait_steps=self.moe_prewait[1],
                early_shared_down_min_bucket=early_min_bucket,
                early_shared_down_max_bucket=early_max_bucket,
                **bounds,
            ),
            router_cluster=self.clusters,
            expert_weight_l2_policy=self.expert_l2_policy[0],
            expert_weight_l2_policy_max_bucket=self.expert_l2_policy[1],
        )

    def mla_cache_row(
        self, norm_weight: torch.Tensor, eps: float, kv_cache: torch.Tensor, rope: int
    ) -> Any:
        from ..cutedsl.mla.prepared import PreparedMlaCacheRow

        return PreparedMlaCacheRow(norm_weight, eps, kv_cache, rope=rope)

    def mla_attention_workspace(
        self, num_heads: int, lora: int, device: torch.device, max_batch: int
    ) -> torch.Tensor:
        from ..cutedsl.mla.prepared import attention_workspace

        return attention_workspace(num_heads, lora, device, max_batch)

    def mla_attention(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        rope: int,
        workspace: torch.Tensor,
    ) -> Any:
        from ..cutedsl.mla.prepared import PreparedMlaDecodeAttention

        # Inside the decode graph nothing chained before the attention writes
        # the block table, the sequence lengths or any cache row but the
        # step's own (the runner copies the metadata before the replay): the
        # older rows may load while the kernels before it run.
        return PreparedMlaDecodeAttention(
            kv_cache, num_heads, scale, rope=rope, workspace=workspace,
            metadata_before_wait=True,
        )  # fmt: skip

    def rms_norm(
        self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        # The kernel behind vLLM's RMSNorm on CUDA (vllm.kernels.vllm_c); rows of
        # x may be strided (kv_c is a column slice of the qkv_a output).
        torch.ops._C.rms_norm(out, x, weight, eps)

    def embedding(
        self, out: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor
    ) -> None:
        torch.index_select(weight, 0, ids, out=out)

    def embed_norm(
        self, embed_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> Any:
        from ..cutedsl.embed_norm.prepared import PreparedEmbedNorm

        return PreparedEmbedNorm(embed_weight, norm_weight, eps)

    def conv_layout(self) -> str:
        from vllm.model_executor.layers.mamba.mamba_utils import (
            is_conv_state_dim_first,
        )

        return CONV_LAYOUT_DS if is_conv_state_dim_first() else CONV_LAYOUT_SD


# -------------------------------------------------------------- weight binding
@dataclass
class RowFusion:
    """One weight made of the rows of several [N_i, K] weights."""

    weight: torch.Tensor
    offsets: tuple[int, ...]
    """First row of each part."""
    shared: bool
    """The parts' parameters now view ``weight`` (no extra memory)."""


def fuse_rows(params: Sequence[nn.Parameter], share_storage: bool) -> RowFusion:
    """Stack ``params`` ([N_i, K], same K/dtype/device) into one [sum N_i, K]
    tensor. With ``share_storage`` every parameter is re-pointed at its rows of
    the fused tensor (a contiguous row slice, as nn.Linear expects), so the stock
    layers keep working and the old storage is freed: the repack costs one
    layer's fused size transiently and nothing after."""
    first = params[0]
    for p in params[1:]:
        if p.dim() != 2 or p.shape[1] != first.shape[1]:
            raise ValueError(
                f"cannot fuse weights of shapes {[tuple(q.shape) for q in params]}"
            )
        if p.dtype != first.dtype or p.device != first.device:
            raise ValueError("cannot fuse weights of different dtypes or devices")
    fused = torch.cat([p.data for p in params], dim=0)
    offsets, row = [], 0
    for p in params:
        offsets.append(row)
        row += p.shape[0]
    if share_storage:
        for p, start in zip(params, offsets):
            p.data = fused[start : start + p.shape[0]]
    return RowFusion(fused, tuple(offsets), share_storage)


def grouped_rows(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``weight`` [G, R, K] as the grouped GEMM reads it (rows of K contiguous
    elements, groups a whole number of rows apart): itself when it already is,
    else a contiguous copy; and the bytes the copy adds."""
    groups, rows, k = weight.shape
    g_stride, r_stride, k_stride = weight.stride()
    rows_of_k = k_stride == 1 and (rows == 1 or r_stride == k)
    whole_rows_apart = g_stride % k == 0 and (groups == 1 or g_stride >= rows * k)
    if rows_of_k and whole_rows_apart:
        return weight, 0
    copy = weight.contiguous()
    return copy, nbytes(copy)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _require(owner: Any, path: str, where: str) -> Any:
    obj = owner
    for name in path.split("."):
        if not hasattr(obj, name):
            raise ValueError(
                f"{where}: the loaded model has no {path!r} (missing {name!r}); "
                "the specialized decode was written against vLLM 0.26.0's "
                "KimiLinearForCausalLM"
            )
        obj = getattr(obj, name)
    return obj


@dataclass
class Norm:
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: nn.Module, where: str) -> Norm:
        return cls(
            _require(module, "weight", where).data,
            float(_require(module, "variance_epsilon", where)),
        )


@dataclass
class KdaLayer:
    index: int
    module: nn.Module
    """KimiGatedDeltaNetAttention: holds kv_cache (conv, recurrent) and prefix."""
    name: str
    in_proj: RowFusion
    """q | k | v | b | f_a | g_a rows."""
    f_b: torch.Tensor
    """[H*D, rank]: applied to f_a(x) inside the KDA step."""
    g_b: torch.Tensor
    o_proj: torch.Tensor
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    o_norm: Norm
    num_heads: int
    head_dim: int


@dataclass
class MlaLayer:
    index: int
    attn: nn.Module
    """vLLM's MLAAttention (self_attn.mla_attn.mla_attn)."""
    name: str
    qkv_a: RowFusion
    """q_proj | kv_a_proj_with_mqa rows."""
    kv_a_norm: Norm
    w_uk: torch.Tensor
    """[N, L, P]: W_UK per head with P contiguous (the W_UK_T absorption as rows)."""
    w_uv: torch.Tensor
    """[N, V, L]: W_UV^T per head, L contiguous (a view of kv_b_proj.weight)."""
    o_proj: torch.Tensor
    num_heads: int
    qk_nope: int
    qk_rope: int
    kv_lora: int
    v_head: int
    scale: float
    """The attention's softmax scale (the backend impl's)."""


@dataclass
class DenseFfn:
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class MoeFfn:
    gate: torch.Tensor
    bias: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    shared_gate_up: torch.Tensor
    shared_down: torch.Tensor
    top_k: int
    routed_scaling_factor: float
    renormalize: bool


@dataclass
class LayerWeights:
    index: int
    attn: KdaLayer | MlaLayer
    post_attention_norm: Norm
    ffn: DenseFfn | MoeFfn
    next_norm: Norm
    """The next layer's input norm, or the final norm after the last layer."""

    @property
    def kind(self) -> str:
        return "kda" if isinstance(self.attn, KdaLayer) else "mla"


def read_model_weights(
    model: nn.Module, share_storage: bool = True
) -> tuple[torch.Tensor, Norm, list[LayerWeights], int]:
    """(embedding, first input norm, per-layer weights, extra bytes) from a
    loaded KimiLinearForCausalLM; fused copies are made here, once."""
    inner = _require(model, "model", "KimiLinearForCausalLM")
    config = _require(inner, "config", "KimiLinearModel")
    embed = _require(inner, "embed_tokens.weight", "KimiLinearModel").data
    layers = list(_require(inner, "layers", "KimiLinearModel"))
    final_norm = Norm.of(_require(inner, "norm", "KimiLinearModel"), "model.norm")
    first_norm = Norm.of(
        _require(layers[0], "input_layernorm", "layer 0"), "layer 0 input_layernorm"
    )
    extra = 0
    result = []
    for i, layer in enumerate(layers):
        where = f"model.layers.{i}"
        self_attn = _require(layer, "self_attn", where)
        if hasattr(self_attn, "mla_attn"):
            attn, added = _read_mla(i, self_attn, share_storage, where)
        elif hasattr(self_attn, "A_log"):
            attn, added = _read_kda(i, self_attn, share_storage, where)
        else:
            raise ValueError(
                f"{where}.self_attn ({type(self_attn).__name__}) is neither KDA nor MLA"
            )
        extra += added
        mlp = _require(layer, "mlp", where)
        ffn = _read_moe(mlp, config, where) if hasattr(mlp, "experts") else None
        if ffn is None:
            ffn = DenseFfn(
                _require(mlp, "gate_up_proj.weight", where).data,
                _require(mlp, "down_proj.weight", where).data,
            )
        next_norm = (
            Norm.of(
                _require(layers[i + 1], "input_layernorm", f"model.layers.{i + 1}"),
                f"model.layers.{i + 1}.input_layernorm",
            )
            if i + 1 < len(layers)
            else final_norm
        )
        result.append(
            LayerWeights(
                index=i,
                attn=attn,
                post_attention_norm=Norm.of(
                    _require(layer, "post_attention_layernorm", where),
                    f"{where}.post_attention_layernorm",
                ),
                ffn=ffn,
                next_norm=next_norm,
            )
        )
    return embed, first_norm, result, extra


def _read_kda(
    index: int, attn: nn.Module, share_storage: bool, where: str
) -> tuple[KdaLayer, int]:
    w = lambda name: _require(attn, f"{name}.weight", f"{where}.self_attn").data  # noqa: E731
    params = [
        _require(attn, f"{name}.weight", f"{where}.self_attn")
        for name in KDA_IN_PROJ_PARTS
    ]
    in_proj = fuse_rows(params, share_storage)
    extra = 0 if share_storage else nbytes(in_proj.weight)
    layer = KdaLayer(
        index=index,
        module=attn,
        name=_require(attn, "prefix", f"{where}.self_attn"),
        in_proj=in_proj,
        f_b=w("f_b_proj"),
        g_b=w("g_b_proj"),
        o_proj=w("o_proj"),
        conv_weights=(w("q_conv1d"), w("k_conv1d"), w("v_conv1d")),
        a_log=_require(attn, "A_log", where).data,
        dt_bias=_require(attn, "dt_bias", where).data,
        o_norm=Norm(w("o_norm"), float(_require(attn, "o_norm.eps", where))),
        num_heads=int(_require(attn, "local_num_heads", where)),
        head_dim=int(_require(attn, "head_dim", where)),
    )
    return layer, extra


def _read_mla(
    index: int, self_attn: nn.Module, share_storage: bool, where: str
) -> tuple[MlaLayer, int]:
    mla = _require(self_attn, "mla_attn.mla_attn", f"{where}.self_attn")
    for name in ("W_UK_T", "W_UV", "impl", "layer_name"):
        _require(mla, name, f"{where}.self_attn.mla_attn.mla_attn")
    if getattr(mla, "q_pad_num_heads", None) is not None:
        raise ValueError(
            f"{where}: the MLA backend pads the query heads (q_pad_num_heads="
            f"{mla.q_pad_num_heads}); the specialized decode expects "
            "FLASH_ATTN_MLA, which does not"
        )
    qkv_a = fuse_rows(
        [
            _require(self_attn, f"{name}.weight", f"{where}.self_attn")
            for name in ("q_proj", "kv_a_proj_with_mqa")
        ],
        share_storage,
    )
    # The absorptions as [G, R, K] weights of the grouped GEMM: W_UV^T rows are
    # kv_b_proj.weight rows (read in place when vLLM kept the view); W_UK^T has
    # P strided, so W_UK is copied once with P contiguous.
    w_uk, uk_extra = grouped_rows(mla.W_UK_T.detach().transpose(1, 2))
    w_uv, uv_extra = grouped_rows(mla.W_UV.detach().transpose(1, 2))
    layer = MlaLayer(
        index=index,
        attn=mla,
        name=mla.layer_name,
        qkv_a=qkv_a,
        kv_a_norm=Norm.of(
            _require(self_attn, "kv_a_layernorm", where), f"{where}.kv_a_layernorm"
        ),
        w_uk=w_uk,
        w_uv=w_uv,
        o_proj=_require(self_attn, "o_proj.weight", where).data,
        num_heads=int(_require(self_attn, "num_local_heads", where)),
        qk_nope=int(_require(self_attn, "qk_nope_head_dim", where)),
        qk_rope=int(_require(self_attn, "qk_rope_head_dim", where)),
        kv_lora=int(_require(self_attn, "kv_lora_rank", where)),
        v_head=int(_require(self_attn, "v_head_dim", where)),
        scale=float(
            _require(mla, "impl.scale", f"{where}.self_attn.mla_attn.mla_attn")
        ),
    )
    extra = uk_extra + uv_extra
    return layer, extra if share_storage else extra + nbytes(qkv_a.weight)


# Unquantized MoE backends that keep vLLM's [E, 2I, H] (w1 rows, then w3 rows)
# and [E, H, I] layouts, which PreparedMoe reads in place. FlashInfer swaps or
# re-tiles them (oracle/unquantized.py:convert_to_unquantized_kernel_format).
MOE_BACKENDS_IN_VLLM_LAYOUT = ("TRITON", "BATCHED_TRITON")


def _read_moe(mlp: nn.Module, config: Any, where: str) -> MoeFfn:
    experts = _require(mlp, "experts.routed_experts", f"{where}.mlp")
    method = getattr(experts, "quant_method", None)
    backend_name = getattr(getattr(method, "unquantized_backend", None), "name", None)
    if backend_name not in MOE_BACKENDS_IN_VLLM_LAYOUT:
        raise ValueError(
            f"{where}: MoE backend {backend_name} stores the expert weights in a "
            f"layout the specialized decode does not read (needs one of "
            f"{MOE_BACKENDS_IN_VLLM_LAYOUT})"
        )
    return MoeFfn(
        gate=_require(mlp, "gate.weight", where).data,
        bias=_require(mlp, "gate.e_score_correction_bias", where).data,
        w13=_require(experts, "w13_weight", where).data,
        w2=_require(experts, "w2_weight", where).data,
        shared_gate_up=_require(mlp, "shared_experts.gate_up_proj.weight", where).data,
        shared_down=_require(mlp, "shared_experts.down_proj.weight", where).data,
        top_k=int(config.num_experts_per_token),
        routed_scaling_factor=float(_require(mlp, "routed_scaling_factor", where)),
        renormalize=bool(config.moe_renormalize),
    )


# ------------------------------------------------------------ static buffers
class StaticBuffers:
    """Activation buffers of ``max_tokens`` rows, allocated once; a step of B rows
    uses their first B rows, so every captured graph sees the same addresses."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_tokens: int):
        self.device, self.dtype, self.max_tokens = device, dtype, max_tokens
        self._buffers: dict[str, torch.Tensor] = {}

    def add(self, name: str, width: int, dtype: torch.dtype | None = None) -> None:
        current = self._buffers.get(name)
        if current is not None and current.shape[1] >= width:
            return
        self._buffers[name] = torch.zeros(
            self.max_tokens, width, dtype=dtype or self.dtype, device=self.device
        )

    def rows(self, name: str, batch: int, width: int | None = None) -> torch.Tensor:
        """The first ``batch`` rows (contiguous: [batch, width])."""
        buf = self._buffers[name]
        if width is None or width == buf.shape[1]:
            return buf[:batch]
        # A narrower view of a shared buffer, still contiguous.
        return buf.view(-1)[: batch * width].view(batch, width)

    def flat(self, name: str, numel: int) -> torch.Tensor:
        return self._buffers[name].view(-1)[:numel]

    def widths(self) -> dict[str, int]:
        return {name: buf.shape[1] for name, buf in self._buffers.items()}

    @property
    def nbytes(self) -> int:
        return sum(nbytes(b) for b in self._buffers.values())


# --------------------------------------------------------------------- the plan
@dataclass
class StepContext:
    """What one step's launches read: the batch and vLLM's forward context."""

    batch: int
    forward_context: Any
    input_ids: torch.Tensor
    kda_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    """KDA layer index -> its rows' state slots (filled by the kda_state_slots step)."""


@dataclass(frozen=True)
class Step:
    layer: int
    """-1 for the embedding and the first input norm."""
    op: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    launch: KernelLaunch = field(compare=False, repr=False)


class KimiLinearDecodeExecutor:
    """One uniform decode step of KimiLinearForCausalLM as fixed kernel launches.

    Build it once after the weights are final; call ``bind_kv_caches`` every
    time vLLM (re)allocates the KV caches (an empty cache unbinds); ``run`` is
    graph-capturable for every size in ``batch_sizes``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: SpecializedDecodeConfig,
        kernels: KernelFactory | None = None,
        share_storage: bool = True,
    ):
        self.kernels = kernels or KernelFactory()
        self.config = config
        self.batch_sizes = tuple(
            s for s in config.batch_sizes if s <= MAX_PREPARED_TOKENS
        )
        stock_sizes = [s for s in config.batch_sizes if s > MAX_PREPARED_TOKENS]
        if not self.batch_sizes:
            raise ValueError(
                f"no prepared decode batch size <= {MAX_PREPARED_TOKENS} is a FULL "
                f"decode CUDA graph size (sizes {config.batch_sizes}); the "
                "specialized decode would never run"
            )
        self.embed, self.first_norm, self.layers, extra = read_model_weights(
            model, share_storage
        )
        # The model's own logits (lm_head + LogitsProcessor), captured into each
        # decode graph after the final norm: the runner takes them from
        # logits_computed_in_graph instead of running compute_logits, with its
        # host work, after every replay.
        self._compute_logits = _require(
            model, "compute_logits", "KimiLinearForCausalLM"
        )
        self._graph_logits: dict[int, torch.Tensor] = {}
        if not self.layers:
            raise ValueError("KimiLinearForCausalLM has no layers")
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.hidden = self.embed.shape[1]
        self.max_tokens = max(self.batch_sizes)
        self.buffers = StaticBuffers(self.device, self.dtype, self.max_tokens)
        self._kda_kernels: dict[int, Any] = {}
        self._bound = False
        self._padding_slots = torch.zeros(
            self.max_tokens, dtype=torch.int32, device=self.device
        )
        # The MLA cache slots of a warmup launch: every row padding.
        self._no_cache_slots = torch.full(
            (self.max_tokens,), -1, dtype=torch.int64, device=self.device
        )
        self._mla_cache_kernels: dict[int, Any] = {}
        self._mla_attention_kernels: dict[int, Any] = {}
        # The decode attention of a warmup launch: every row padding (length
        # 0, output zeros), so it compiles before capture without a cache row.
        self._no_seq_lens = torch.zeros(
            self.max_tokens, dtype=torch.int32, device=self.device
        )
        self._no_block_table = torch.zeros(
            self.max_tokens, 1, dtype=torch.int32, device=self.device
        )
        # Asked by the runner every step (attention_layers_built_by_model):
        # the KDA layers always, the MLA layers where the own attention runs
        # (FA3 reads the metadata FlashAttnMLA's builder makes).
        kda_names = tuple(kda.name for kda in self._kda_layers())
        mla_names = tuple(mla.name for mla in self._mla_layers())
        self._model_built_layers = {
            b: kda_names + (mla_names if self._own_mla_attention(b) else ())
            for b in self.batch_sizes
        }
        # The split partials of the attention, shared by the MLA layers (they
        # run one after another on one stream).
        own_sizes = [b for b in self.batch_sizes if self._own_mla_attention(b)]
        mla_layers = self._mla_layers()
        self._mla_workspace = (
            self.kernels.mla_attention_workspace(
                mla_layers[0].num_heads,
                mla_layers[0].kv_lora,
                self.device,
                self.max_tokens,
            )  # fmt: skip
            if mla_layers and own_sizes
            else None
        )
        # One row per KDA KV-cache group (at most one per KDA layer): the state
        # slots of the step's rows, gathered from the group's block table.
        self._kda_slot_rows = torch.zeros(
            max(1, len(self._kda_layers())),
            self.max_tokens,
            dtype=torch.int32,
            device=self.device,
        )
        self._kernels: dict[tuple[int, str], Any] = {}
        self.plan: list[Step] = []
        self._output = ""
        self._build_plan()
        self.kernels.check_gemm_shapes_matched()
        kernel_extra = sum(
            int(getattr(k, "extra_bytes", 0)) + int(getattr(k, "workspace_bytes", 0))
            for k in self._kernels.values()
        )
        workspace = self._mla_workspace
        kernel_extra += 0 if workspace is None else workspace.numel() * 4
        self.extra_bytes = extra + kernel_extra + self.buffers.nbytes
        if self.extra_bytes > MAX_EXTRA_BYTES:
            raise ValueError(
                f"the specialized decode needs {self.extra_bytes / 2**30:.2f} GiB "
                f"beyond the model's weights, more than the "
                f"{MAX_EXTRA_BYTES / 2**30:.0f} GiB budget"
            )
        logger.info(
            "Kimi-Linear specialized decode: %d layers, batch sizes %s (stock for "
            "%s), %.1f MiB extra GPU memory (fused weight copies %.1f MiB, kernel "
            "packing and workspaces %.1f MiB, activation buffers %.1f MiB)",
            len(self.layers),
            self.batch_sizes,
            stock_sizes or "none",
            self.extra_bytes / 2**20,
            extra / 2**20,
            kernel_extra / 2**20,
            self.buffers.nbytes / 2**20,
        )

    # ----------------------------------------------------------------- building
    def _kernel(self, layer: int, name: str, build: Callable[[], Any]) -> Any:
        kernel = build()
        self._kernels[(layer, name)] = kernel
        return kernel

    def _step(
        self,
        layer: int,
        op: str,
        reads: tuple[str, ...],
        writes: tuple[str, ...],
        launch: KernelLaunch,
    ) -> None:
        self.plan.append(Step(layer, op, reads, writes, launch))

    def _build_plan(self) -> None:
        bufs, hidden = self.buffers, self.hidden
        for name in ("residual0", "residual1", "x0", "x1"):
            bufs.add(name, hidden)
        # Residual stream and normed activations ping-pong between two buffers,
        # so no launch reads and writes the same buffer.
        state = {"residual": 0, "x": 0}

        def cur(kind: str) -> str:
            return f"{kind}{state[kind]}"

        def nxt(kind: str) -> str:
            return f"{kind}{1 - state[kind]}"

        def advance() -> None:
            state["residual"] ^= 1
            state["x"] ^= 1

        embed, norm = self.embed, self.first_norm

        def embed_launch(ctx: StepContext) -> None:
            self.kernels.embedding(
                bufs.rows("residual0", ctx.batch), embed, ctx.input_ids[: ctx.batch]
            )

        def first_norm_launch(ctx: StepContext) -> None:
            self.kernels.rms_norm(
                bufs.rows("x0", ctx.batch),
                bufs.rows("residual0", ctx.batch),
                norm.weight,
                norm.eps,
            )

        self._step(-1, "kda_state_slots", (), ("kda_slots",), self._gather_kda_slots)
        if self.kernels.fused_embed_norm:
            fused = self.kernels.embed_norm(embed, norm.weight, norm.eps)

            def embed_norm_launch(ctx: StepContext) -> None:
                ids = ctx.input_ids[: ctx.batch]
                if ids.dtype != torch.int32:
                    # The warm-up's int64 padding ids; vLLM's input_ids are int32.
                    ids = self._padding_slots[: ctx.batch]
                fused.run(
                    ids,
                    bufs.rows("residual0", ctx.batch),
                    bufs.rows("x0", ctx.batch),
                )

            self._step(
                -1, "embed_norm", ("input_ids",), ("residual0", "x0"), embed_norm_launch
            )
        else:
            self._step(-1, "embedding", ("input_ids",), ("residual0",), embed_launch)
            self._step(-1, "input_norm", ("residual0",), ("x0",), first_norm_launch)

        for layer in self.layers:
            if isinstance(layer.attn, KdaLayer):
                self._plan_kda(layer, cur("x"))
            else:
                self._plan_mla(layer, cur("x"))
            if isinstance(layer.ffn, DenseFfn):
                self._plan_residual_gemm(
                    layer.index,
                    "o_proj",
                    layer.attn.o_proj,
                    layer.post_attention_norm,
                    "attn_out",
                    cur("residual"),
                    nxt("residual"),
                    nxt("x"),
                )
                advance()
                self._plan_dense(
                    layer, cur("x"), cur("residual"), nxt("residual"), nxt("x")
                )
            else:
                moe = self._moe_kernel(layer)
                self._plan_residual_sums_gemm(
                    layer.index, layer.attn.o_proj, "attn_out", cur("residual"),
                    nxt("residual"), moe.input_sums,
                )  # fmt: skip
                advance()
                self._plan_moe(
                    layer, moe, cur("x"), cur("residual"), nxt("residual"), nxt("x")
                )
            advance()
        self._output = cur("x")

    def _plan_residual_gemm(
        self,
        index: int,
        op: str,
        weight: torch.Tensor,
        norm: Norm,
        src: str,
        residual: str,
        residual_out: str,
        out: str,
    ) -> None:
        gemm = self._kernel(
            index,
            op,
            lambda: self.kernels.gemm(
                weight,
                EPILOGUE_RESIDUAL_RMSNORM,
                rmsnorm_weight=norm.weight,
                eps=norm.eps,
            ),
        )
        bufs = self.buffers
        width = weight.shape[1]

        def launch(ctx: StepContext) -> None:
            b = ctx.batch
            gemm.run(
                bufs.rows(src, b, width),
                bufs.rows(out, b),
                residual=bufs.rows(residual, b),
                residual_out=bufs.rows(residual_out, b),
            )

        self._step(index, op, (src, residual), (residual_out, out), launch)

    def _plan_gemm(
        self,
        index: int,
        op: str,
        weight: torch.Tensor,
        src: str,
        src_width: int,
        out: str,
        out_width: int,
        epilogue: str = EPILOGUE_PLAIN,
        prewait_steps: int | None = None,
        min_ctas_per_sm: dict[int, int] | None = None,
        weight_stages: dict[int, int] | None = None,
    ) -> None:
        gemm = self._kernel(
            index,
            op,
            lambda: self.kernels.gemm(
                weight,
                epilogue,
                prewait_steps=prewait_steps,
                min_ctas_per_sm=min_ctas_per_sm,
                weight_stages=weight_stages,
            ),
        )
        bufs = self.buffers
        bufs.add(out, out_width)

        def launch(ctx: StepContext) -> None:
            b = ctx.batch
            gemm.run(bufs.rows(src, b, src_width), bufs.rows(out, b, out_width))

        self._step(index, op, (src,), (out,), launch)

    def _plan_kda(self, layer: LayerWeights, x: str) -> None:
        kda = layer.attn
        assert isinstance(kda, KdaLayer)
        i, bufs, proj = layer.index, self.buffers, kda.num_heads * kda.head_dim
        bufs.add("attn_out", proj)
        # One GEMM for every projection of x; the KDA step applies f_b / g_b to
        # the f_a / g_a columns, so nothing runs between the two.
        self._plan_gemm(
            i, "kda_in_proj", kda.in_proj.weight, x, self.hidden, "kda_proj",
            kda.in_proj.weight.shape[0], prewait_steps=KDA_IN_PROJ_PREWAIT_STEPS,
            min_ctas_per_sm=GEMM_MIN_CTAS_BUCKET_16,
            weight_stages=KDA_IN_PROJ_WEIGHT_STAGES,
        )  # fmt: skip
        q0, k0, v0, b0, fa0, ga0 = kda.in_proj.offsets
        width = kda.in_proj.weight.shape[0]

        def launch(ctx: StepContext) -> None:
            b = ctx.batch
            kernel = self._kda_kernels.get(i)
            if kernel is None:
                raise RuntimeError(
                    f"{kda.name}: the KV caches are not bound; vLLM must call "
                    "KimiLinearForCausalLM.bind_kv_caches after allocating them"
                )
            p = bufs.rows("kda_proj", b, width)
            kernel.run(
                p[:, q0:k0], p[:, k0:v0], p[:, v0:b0], p[:, fa0:ga0],
                p[:, b0:fa0], p[:, ga0:width],
                self._kda_slots(ctx, kda), bufs.rows("attn_out", b, proj),
            )  # fmt: skip

        self._step(i, "kda_step", ("kda_proj", "kda_slots"), ("attn_out",), launch)

    def _gather_kda_slots(self, ctx: StepContext) -> None:
        """Copy each KDA group's state slots (block-table column 0: with
        mamba_cache_mode "none" a request's only block is its state slot; padded
        rows hold the null block 0) into a static row, one copy per group.
        The runner builds no GDN metadata for these layers
        (attention_layers_built_by_model), so this is the step's only work for
        them outside the kernels."""
        if ctx.forward_context is None:  # warmup: every row is padding
            return
        rows: dict[int, torch.Tensor] = {}
        for kda in self._kda_layers():
            table = _kda_block_table(ctx.forward_context, kda.name, ctx.batch)
            key = table.data_ptr()
            if key not in rows:
                row = self._kda_slot_rows[len(rows)]
                row[: ctx.batch].copy_(table[: ctx.batch, 0])
                rows[key] = row
            ctx.kda_slots[kda.index] = rows[key]

    def _kda_slots(self, ctx: StepContext, kda: KdaLayer) -> torch.Tensor:
        if ctx.forward_context is None:  # warmup: every row is padding
            return self._padding_slots
        return ctx.kda_slots[kda.index]

    def _plan_mla(self, layer: LayerWeights, x: str) -> None:
        mla = layer.attn
        assert isinstance(mla, MlaLayer)
        i, bufs = layer.index, self.buffers
        n, nope, rope = mla.num_heads, mla.qk_nope, mla.qk_rope
        lora, v_head = mla.kv_lora, mla.v_head
        q_width = n * (nope + rope)
        width = mla.qkv_a.weight.shape[0]
        if width != q_width + lora + rope:
            raise ValueError(
                f"{mla.name}: q_proj|kv_a_proj_with_mqa has {width} rows, expected "
                f"{q_width} + {lora} + {rope}"
            )
        bufs.add("attn_out", n * v_head)
        bufs.add("mla_ql_nope", n * lora)
        bufs.add("mla_latent", n * lora)
        self._plan_gemm(
            i, "mla_qkv_a", mla.qkv_a.weight, x, self.hidden, "mla_proj", width,
            min_ctas_per_sm=GEMM_MIN_CTAS_BUCKET_16,
        )  # fmt: skip
        kernels, attn = self.kernels, mla.attn
        w_uk = self._kernel(i, "mla_w_uk", lambda: kernels.grouped_gemm(mla.w_uk))
        w_uv = self._kernel(i, "mla_w_uv", lambda: kernels.grouped_gemm(mla.w_uv))

        def w_uk_launch(ctx: StepContext) -> None:
            # Absorb W_UK into the query first: per head [B, P] x [P, L] -> [B, L].
            # Chained right after the projection (PDL), its weights stream while
            # the projection drains; the stock kernels after it do not overlap.
            b = ctx.batch
            q = bufs.rows("mla_proj", b, width)[:, :q_width].view(b, n, nope + rope)
            w_uk.run(q[..., :nope], bufs.rows("mla_ql_nope", b, n * lora))

        def cache_row_launch(ctx: StepContext) -> None:
            # The request's new latent row, [rmsnorm(kv_c) * w | k_pe], written
            # straight into the paged cache (one PDL launch for vLLM's RMSNorm
            # and concat_and_cache_mla; slot -1 = padding).
            b = ctx.batch
            p = bufs.rows("mla_proj", b, width)
            slots = (
                self._no_cache_slots
                if ctx.forward_context is None
                else _layer_slot_mapping(ctx.forward_context, mla.name)
            )
            self._mla_cache_kernels[i].run(p[:, q_width:], slots)

        def core_launch(ctx: StepContext) -> None:
            b = ctx.batch
            p = bufs.rows("mla_proj", b, width)
            q = p[:, :q_width].view(b, n, nope + rope)
            ql_nope = bufs.rows("mla_ql_nope", b, n * lora)
            up = bufs.rows("attn_out", b, n * v_head)
            if self._own_mla_attention(b):
                latent = own_attention(ctx, q, ql_nope)
            elif ctx.forward_context is None:
                # Warmup: FA3 needs real metadata; W_UV runs on the scratch rows
                # (FA3's output has ql_nope's [B, N, L] strides), so it compiles
                # before capture.
                latent = ql_nope
            else:
                latent = fa3_attention(ctx, q, ql_nope)
            # W_UV: per head [B, L] x [L, V] -> [B, V], stored as [B, N*V]; it
            # lets o_proj (PDL) start streaming its weights while it runs.
            w_uv.run(latent.view(b, n, lora), up)

        def own_attention(
            ctx: StepContext, q: torch.Tensor, ql_nope: torch.Tensor
        ) -> torch.Tensor:
            b = ctx.batch
            latent = bufs.rows("mla_latent", b, n * lora)
            if ctx.forward_context is None:
                # Warmup: every row padding (no cache row is read; the output is
                # zeros), so both launches compile before capture.
                seq_lens, block_table = self._no_seq_lens, self._no_block_table
            else:
                tables = _mla_decode_tables(ctx.forward_context, mla.name)
                if tables is None:
                    raise RuntimeError(f"{mla.name}: not a pure decode batch")
                seq_lens, block_table = tables
            # Attention over the paged latent cache, the step's own row written
            # by mla_cache_row just before: a split pass and a merge (PDL).
            self._mla_attention_kernels[i].run(
                ql_nope, q[..., nope:], seq_lens, block_table, latent
            )
            return latent

        def fa3_attention(
            ctx: StepContext, q: torch.Tensor, ql_nope: torch.Tensor
        ) -> torch.Tensor:
            b = ctx.batch
            metadata = _mla_backend_metadata(ctx.forward_context, mla.name)
            if metadata.num_prefills:
                raise RuntimeError(f"{mla.name}: not a pure decode batch")
            # vLLM's FlashAttention-3 MLA decode over the paged latent cache
            # (the step's own row written by mla_cache_row just before).
            out, _ = attn.impl.forward_mqa(
                (ql_nope.view(b, n, lora), q[..., nope:]), attn.kv_cache, metadata, attn
            )
            return out

        self._step(i, "mla_w_uk", ("mla_proj",), ("mla_ql_nope",), w_uk_launch)
        self._step(i, "mla_cache_row", ("mla_proj",), (), cache_row_launch)
        self._step(
            i, "mla_decode", ("mla_proj", "mla_ql_nope"), ("attn_out",), core_launch
        )

    def _plan_dense(
        self, layer: LayerWeights, x: str, residual: str, residual_out: str, out: str
    ) -> None:
        ffn = layer.ffn
        assert isinstance(ffn, DenseFfn)
        inter = ffn.gate_up.shape[0] // 2
        self._plan_gemm(
            layer.index, "mlp_gate_up", ffn.gate_up, x, self.hidden, "mlp_act",
            inter, EPILOGUE_SILU_MUL, min_ctas_per_sm=GEMM_MIN_CTAS_BUCKET_16,
        )  # fmt: skip
        self._plan_residual_gemm(
            layer.index, "mlp_down", ffn.down, layer.next_norm, "mlp_act",
            residual, residual_out, out,
        )  # fmt: skip

    def _plan_residual_sums_gemm(
        self,
        index: int,
        weight: torch.Tensor,
        src: str,
        residual: str,
        residual_out: str,
        sums: torch.Tensor,
    ) -> None:
        """o_proj before a MoE: the residual add, and the sums of squares into
        the MoE's ``input_sums`` (its router applies the norm)."""
        gemm = self._kernel(
            index, "o_proj", lambda: self.kernels.gemm(weight, EPILOGUE_RESIDUAL_SUMSQ)
        )
        bufs = self.buffers
        width = weight.shape[1]

        def launch(ctx: StepContext) -> None:
            b = ctx.batch
            gemm.run(
                bufs.rows(src, b, width),
                None,
                residual=bufs.rows(residual, b),
                residual_out=bufs.rows(residual_out, b),
                sums=sums,
            )

        self._step(
            index, "o_proj", (src, residual), (residual_out, MOE_INPUT_SUMS), launch
        )

    def _moe_kernel(self, layer: LayerWeights) -> Any:
        ffn = layer.ffn
        assert isinstance(ffn, MoeFfn)
        norm, input_norm = layer.next_norm, layer.post_attention_norm
        return self._kernel(
            layer.index,
            "moe",
            lambda: self.kernels.moe(
                gate_weight=ffn.gate,
                e_score_correction_bias=ffn.bias,
                w13=ffn.w13,
                w2=ffn.w2,
                shared_gate_up=ffn.shared_gate_up,
                shared_down=ffn.shared_down,
                top_k=ffn.top_k,
                routed_scaling_factor=ffn.routed_scaling_factor,
                renormalize=ffn.renormalize,
                rmsnorm_weight=norm.weight,
                eps=norm.eps,
                input_norm_weight=input_norm.weight,
                input_eps=input_norm.eps,
            ),
        )

    def _plan_moe(
        self,
        layer: LayerWeights,
        moe: Any,
        x: str,
        residual: str,
        residual_out: str,
        out: str,
    ) -> None:
        """The MoE block, normalising ``residual`` into ``x`` first (router)."""
        bufs = self.buffers

        def launch(ctx: StepContext) -> None:
            b = ctx.batch
            moe.run(
                bufs.rows(x, b),
                bufs.rows(out, b),
                residual=bufs.rows(residual, b),
                residual_out=bufs.rows(residual_out, b),
            )

        self._step(
            layer.index, "moe", (residual, MOE_INPUT_SUMS), (x, residual_out, out),
            launch,
        )  # fmt: skip

    # ----------------------------------------------------------------- binding
    @property
    def is_bound(self) -> bool:
        return self._bound

    def _kda_layers(self) -> list[KdaLayer]:
        return [la.attn for la in self.layers if isinstance(la.attn, KdaLayer)]

    @staticmethod
    def _own_mla_attention(batch: int) -> bool:
        """Whether the graph of ``batch`` rows runs the MLA attention of
        kernels/mla (else vLLM's FlashAttention-3)."""
        return batch <= MLA_OWN_ATTENTION_MAX_BATCH

    def _mla_layers(self) -> list[MlaLayer]:
        return [la.attn for la in self.layers if isinstance(la.attn, MlaLayer)]

    def bind_kv_caches(self, vllm_config: Any = None) -> bool:
        """Re-read every layer's KV cache. vLLM allocates a small profiling cache,
        frees it, then allocates the real one: call this after each allocation
        and after the profiling cache is freed. Empty caches unbind (so the
        profiling cache can be freed); returns whether the executor is bound.
        With ``vllm_config`` also re-checks the resolved CUDA graph mode."""
        if vllm_config is not None:
            self._check_resolved_graphs(vllm_config)
        states = {kda.index: _kda_state(kda) for kda in self._kda_layers()}
        mla_bound = {m.index: m.attn.kv_cache.numel() > 0 for m in self._mla_layers()}
        bound = [i for i, s in states.items() if s is not None]
        bound += [i for i, ok in mla_bound.items() if ok]
        self._kda_kernels = {}
        self._mla_cache_kernels = {}
        self._mla_attention_kernels = {}
        self._bound = False
        # Graphs captured on the previous caches are captured again.
        self._graph_logits = {}
        if not bound:
            return False
        if len(bound) != len(states) + len(mla_bound):
            missing = sorted((set(states) | set(mla_bound)) - set(bound))
            raise RuntimeError(
                f"KV caches are allocated for some layers but not for layers "
                f"{missing}; the specialized decode binds all or none"
            )
        layout = self.kernels.conv_layout()
        for kda in self._kda_layers():
            conv_state, recurrent_state = states[kda.index]
            self._kda_kernels[kda.index] = self.kernels.kda(
                kda.conv_weights,
                kda.a_log,
                kda.dt_bias,
                kda.o_norm.weight,
                conv_state,
                recurrent_state,
                num_heads=kda.num_heads,
                norm_eps=kda.o_norm.eps,
                conv_layout=layout,
                gate_weights=(kda.f_b, kda.g_b),
            )
        for mla in self._mla_layers():
            _check_mla_cache(mla)
            self._mla_cache_kernels[mla.index] = self.kernels.mla_cache_row(
                mla.kv_a_norm.weight, mla.kv_a_norm.eps, mla.attn.kv_cache, mla.qk_rope
            )
            if self._mla_workspace is not None:
                self._mla_attention_kernels[mla.index] = self.kernels.mla_attention(
                    mla.attn.kv_cache, mla.num_heads, mla.scale, mla.qk_rope,
                    self._mla_workspace,
                )  # fmt: skip
        self._bound = True
        return True

    def _check_resolved_graphs(self, vllm_config: Any) -> None:
        from vllm.config import CUDAGraphMode

        compilation = vllm_config.compilation_config
        mode = compilation.cudagraph_mode or CUDAGraphMode.NONE
        if mode.decode_mode() != CUDAGraphMode.FULL:
            raise ValueError(
                f"decode_backend=latency_specialized: vLLM resolved the CUDA graph "
                f"mode to {mode}, which has no FULL decode graphs (the attention "
                "backends do not support them); the specialized decode would "
                "never run"
            )
        if vllm_config.cache_config.mamba_cache_mode != "none":
            raise ValueError(
                f"decode_backend=latency_specialized: mamba_cache_mode "
                f"{vllm_config.cache_config.mamba_cache_mode!r}; the KDA state slot "
                "must be a request's only block-table entry ('none')"
            )
        captured = set(compilation.cudagraph_capture_sizes or ())
        missing = [s for s in self.batch_sizes if s not in captured]
        if missing:
            raise ValueError(
                f"decode_backend=latency_specialized: batch sizes {missing} are no "
                f"longer CUDA graph capture sizes after vLLM resolved them "
                f"({sorted(captured)})"
            )

    def warmup(self) -> None:
        """Launch every prepared kernel once per batch size on the static
        buffers (KDA rows are padding: no state is touched), so compiling and
        module loading happen before CUDA graph capture. Needs bound caches."""
        if not self.is_bound:
            raise RuntimeError("warmup needs bound KV caches (bind_kv_caches)")
        start = time.perf_counter()
        for batch in self.batch_sizes:
            ctx = StepContext(batch, None, self._padding_slots.long())
            for step in self.plan:
                if step.op != "embedding":
                    step.launch(ctx)
        logger.info(
            "Kimi-Linear specialized decode: warm-up launches (kernel compiles and "
            "module loads) took %.1f s%s",
            time.perf_counter() - start,
            self.kernels.kernel_cache_note(),
        )

    # ------------------------------------------------------------------ running
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        forward_context: Any = None,
    ) -> torch.Tensor:
        """One decode step: ``input_ids`` [B] (one token per request; B a
        prepared size) -> final-normed hidden states [B, hidden], a view of a
        static buffer. Kimi-Linear's MLA uses no positional embedding, so
        ``positions`` is not read. ``forward_context`` defaults to vLLM's."""
        batch = int(input_ids.shape[0])
        if batch not in self.batch_sizes:
            raise ValueError(
                f"batch of {batch} tokens is not a prepared decode size "
                f"{self.batch_sizes}; sizes above {MAX_PREPARED_TOKENS} run the "
                "stock decode"
            )
        if not self.is_bound:
            raise RuntimeError(
                "the specialized decode is not bound to the KV caches; vLLM must "
                "call KimiLinearForCausalLM.bind_kv_caches after allocating them"
            )
        if forward_context is None:
            from vllm.forward_context import get_forward_context

            forward_context = get_forward_context()
        ctx = StepContext(batch, forward_context, input_ids)
        for step in self.plan:
            step.launch(ctx)
        return self.buffers.rows(self._output, batch)

    def serves(self, cudagraph_mode: Any, descriptor: Any) -> bool:
        """Whether a step of this CUDA graph mode and batch descriptor runs the
        executor: a uniform decode batch of a prepared size in a FULL graph."""
        from vllm.config import CUDAGraphMode

        return (
            cudagraph_mode == CUDAGraphMode.FULL
            and descriptor is not None
            and descriptor.uniform
            and descriptor.num_tokens in self.batch_sizes
            and descriptor.num_reqs in (None, descriptor.num_tokens)
        )

    def attention_layers_built_by_model(
        self, cudagraph_mode: Any, descriptor: Any
    ) -> tuple[str, ...]:
        """The KDA layers, and the MLA layers where the step's graph runs the
        attention of kernels/mla (``MLA_OWN_ATTENTION_MAX_BATCH``), for steps
        the executor serves: the runner then skips their metadata builds (host
        time every step; for MLA also FlashAttention-3's scheduling launches,
        which kernels/mla does not read) and hands them their group's common
        metadata: the KDA block table holds the state slots, the MLA one the
        cache blocks with the sequence lengths beside it."""
        if not self.serves(cudagraph_mode, descriptor):
            return ()
        return self._model_built_layers[descriptor.num_tokens]

    def step_applies(
        self,
        forward_context: Any,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        capturing: bool | None = None,
    ) -> bool:
        """Whether this forward is a uniform decode step of a prepared size being
        captured into a FULL CUDA graph (replays never reach Python)."""
        if intermediate_tensors is not None or inputs_embeds is not None:
            return False
        descriptor = forward_context.batch_descriptor
        if not self.serves(forward_context.cudagraph_runtime_mode, descriptor):
            return False
        if capturing is None:
            capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            return False
        for kda in self._kda_layers():
            # Raises, naming the runner patch, if the runner built backend
            # metadata for a layer it was told the model builds itself.
            _kda_block_table(forward_context, kda.name, descriptor.num_tokens)
            metadata = _layer_metadata(forward_context, kda.name)
            if metadata.max_query_len != 1:
                return False
        own_attention = self._own_mla_attention(descriptor.num_tokens)
        for mla in self._mla_layers():
            if not own_attention:
                # Raises if the runner skipped the build FA3 reads.
                _mla_backend_metadata(forward_context, mla.name)
            if _mla_decode_tables(forward_context, mla.name) is None:
                return False
        return True

    def maybe_run(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The specialized step's hidden states, or None: run the stock forward."""
        from vllm.forward_context import (
            get_forward_context,
            is_forward_context_available,
        )

        if not is_forward_context_available():
            return None
        forward_context = get_forward_context()
        if input_ids is None or not self.step_applies(
            forward_context, intermediate_tensors, inputs_embeds
        ):
            descriptor = forward_context.batch_descriptor
            if (
                self.serves(forward_context.cudagraph_runtime_mode, descriptor)
                and torch.cuda.is_current_stream_capturing()
            ):
                # The runner skipped the metadata builds of this graph's KDA (and
                # own-attention MLA) layers (attention_layers_built_by_model), so
                # the stock forward cannot be captured in their place either.
                why = _why_stock(input_ids, intermediate_tensors, inputs_embeds)
                raise RuntimeError(
                    "Kimi-Linear specialized decode: the FULL decode CUDA graph of "
                    f"{descriptor.num_tokens} tokens is being captured for a forward "
                    f"it cannot run ({why}), "
                    "and the runner already left out the attention metadata the "
                    "stock forward would need; run this deployment with "
                    "decode_backend=auto"
                )
            return None
        hidden_states = self.run(input_ids, positions, forward_context)
        # Captured with the step; every replay rewrites them.
        self._graph_logits[int(input_ids.shape[0])] = self._compute_logits(
            hidden_states
        )
        return hidden_states

    def logits_computed_in_graph(
        self, cudagraph_mode: Any, descriptor: Any, num_logits: int
    ) -> torch.Tensor | None:
        """Asked by the runner after the forward of a step whose requests have
        one scheduled token each (logits rows 0..num_logits-1): the logits the
        replayed decode graph computed, or None (compute_logits runs)."""
        if not self.serves(cudagraph_mode, descriptor):
            return None
        logits = self._graph_logits.get(descriptor.num_tokens)
        if logits is None or num_logits > logits.shape[0]:
            return None
        return logits[:num_logits]


# ------------------------------------------------------------- vLLM plumbing
def _layer_metadata(forward_context: Any, name: str) -> Any:
    metadata = forward_context.attn_metadata
    if isinstance(metadata, list):
        raise RuntimeError("per-ubatch / speculative attention metadata (a list)")
    if not isinstance(metadata, dict) or name not in metadata:
        raise RuntimeError(f"{name}: no attention metadata in the forward context")
    return metadata[name]


def _kda_block_table(forward_context: Any, name: str, batch: int) -> torch.Tensor:
    """The block table of a KDA layer's group, from the common metadata the
    runner hands the layers the model builds itself."""
    metadata = _layer_metadata(forward_context, name)
    table = getattr(metadata, "block_table_tensor", None)
    if table is None:
        raise RuntimeError(
            f"{name}: the runner built {type(metadata).__name__} for this layer; "
            "the specialized decode needs the common attention metadata (the v1 "
            "runner patch behind attention_layers_built_by_model)"
        )
    if table.dim() != 2 or table.shape[0] < batch or table.dtype != torch.int32:
        raise RuntimeError(
            f"{name}: block table {tuple(table.shape)} {table.dtype}, expected int32 "
            f"with >= {batch} rows"
        )
    return table


def _why_stock(
    input_ids: torch.Tensor | None,
    intermediate_tensors: Any,
    inputs_embeds: torch.Tensor | None,
) -> str:
    """Why a forward of a served graph size is not the executor's step."""
    if input_ids is None:
        return "no input_ids: prompt embeddings?"
    if inputs_embeds is not None:
        return "inputs_embeds given"
    if intermediate_tensors is not None:
        return "pipeline-parallel intermediate tensors"
    return "its attention metadata is not a one-token decode step"


def _mla_decode_tables(
    forward_context: Any, name: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(seq_lens, block_table) of an MLA layer's pure decode step, or None if
    the step has prefills. The patched runner hands a layer the executor
    builds itself its group's CommonAttentionMetadata (the tables the MLA
    backend's decode metadata would be sliced from); a runner that built the
    backend's metadata anyway hands that, which serves as well."""
    metadata = _layer_metadata(forward_context, name)
    if hasattr(metadata, "block_table_tensor"):  # CommonAttentionMetadata
        if metadata.max_query_len != 1:
            return None
        return metadata.seq_lens, metadata.block_table_tensor
    if metadata.num_prefills or metadata.decode is None:
        return None
    return metadata.decode.seq_lens, metadata.decode.block_table


def _mla_backend_metadata(forward_context: Any, name: str) -> Any:
    """The MLA backend's own metadata of a layer, which FlashAttention-3 reads."""
    metadata = _layer_metadata(forward_context, name)
    if not hasattr(metadata, "decode"):
        raise RuntimeError(
            f"{name}: FlashAttention-3 needs the MLA backend's metadata, got "
            f"{type(metadata).__name__} (the runner skipped the build of a layer "
            "the executor did not name in attention_layers_built_by_model)"
        )
    return metadata


def _layer_slot_mapping(forward_context: Any, name: str) -> torch.Tensor:
    mapping = forward_context.slot_mapping
    if not isinstance(mapping, dict) or mapping.get(name) is None:
        raise RuntimeError(f"{name}: no slot mapping in the forward context")
    return mapping[name]


def _kda_state(kda: KdaLayer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's (conv_state, recurrent_state), or None while unallocated."""
    cache = getattr(kda.module, "kv_cache", None)
    if cache is None or isinstance(cache, torch.Tensor) or len(cache) == 0:
        return None
    if len(cache) != 2:
        raise RuntimeError(
            f"{kda.name}: expected (conv_state, recurrent_state), got "
            f"{len(cache)} state tensors"
        )
    conv_state, recurrent_state = cache
    if conv_state.numel() == 0 or recurrent_state.numel() == 0:
        return None
    return conv_state, recurrent_state


def _check_mla_cache(mla: MlaLayer) -> None:
    cache = mla.attn.kv_cache
    row = mla.kv_lora + mla.qk_rope
    if cache.dim() != 3 or cache.shape[-1] != row:
        raise RuntimeError(
            f"{mla.name}: MLA cache of shape {tuple(cache.shape)}, expected "
            f"[blocks, block_size, {row}]"
        )


class SpecializedDecodeModule(HpcModule):
    """Holds the executor inside KimiLinearForCausalLM (no parameters).

    vLLM calls ``process_weights_after_loading(model)`` on every HpcModule after
    all other weight processing (MLA's W_UK_T / W_UV included), for the default
    and the dummy loader alike: the executor is built there.
    """

    def __init__(
        self, config: SpecializedDecodeConfig, kernels: KernelFactory | None = None
    ):
        super().__init__()
        self.config = config
        self._kernels = kernels
        # Not an nn.Module: the executor refers to the model's own modules, which
        # must not appear twice in named_modules / state_dict.
        self.executor: KimiLinearDecodeExecutor | None = None

    def process_weights_after_loading(self, model: nn.Module) -> None:
        if self.executor is not None:
            raise RuntimeError(
                "Kimi-Linear specialized decode: weights were processed again "
                "(reload_weights?); the fused copies would go stale. Restart the "
                "engine, or run decode_backend=auto"
            )
        self.executor = KimiLinearDecodeExecutor(model, self.config, self._kernels)

    def bind_kv_caches(self, vllm_config: Any = None) -> None:
        if self.executor is None:
            raise RuntimeError(
                "Kimi-Linear specialized decode: KV caches bound before the "
                "executor was built (process_weights_after_loading did not run)"
            )
        if self.executor.bind_kv_caches(vllm_config):
            self.executor.warmup()

    def maybe_run(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        if self.executor is None:
            return None
        return self.executor.maybe_run(*args, **kwargs)

    def attention_layers_built_by_model(
        self, cudagraph_mode: Any, batch_descriptor: Any
    ) -> tuple[str, ...]:
        if self.executor is None:
            return ()
        return self.executor.attention_layers_built_by_model(
            cudagraph_mode, batch_descriptor
        )

    def logits_computed_in_graph(
        self, cudagraph_mode: Any, batch_descriptor: Any, num_logits: int
    ) -> torch.Tensor | None:
        if self.executor is None:
            return None
        return self.executor.logits_computed_in_graph(
            cudagraph_mode, batch_descriptor, num_logits
        )

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("call maybe_run, not the module")

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bind one MoE layer's weights once; launch the small-batch MoE per step.

``PreparedMoe`` takes the layer's tensors as vLLM holds them (router
``[E, H]``, score-correction bias ``[E]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``,
shared expert ``gate_up [2I, H]`` and ``down [H, I]``) without copying or
repacking any weight: the kernels read vLLM's layout in place.  It owns a
small workspace (routing table, FP32 expert outputs, counters the kernels
re-arm themselves) and compiles one kernel set per M-bucket (1, 2, 4, 8, 16)
on first use, cached process-wide.  ``run()`` validates, builds raw pointers
and makes four launches on the current stream: no host sync, no allocation,
so it can be captured in a CUDA graph and replayed.

One ``PreparedMoe`` owns one workspace: do not run the same instance
concurrently on two streams.
"""

import time
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from ..common.compile_cache import compile_kernel
from ..common.host import current_stream, gmem_ptr
from ..common.l2_policy import l2_policy_value
from ..common.skinny_mma import CHUNK, LANES_PER_QUAD, MAX_TOKENS, ceil_div
from .kernel import (
    EARLY_MAX_POLLS,
    STAGE_DOWN,
    STAGE_GATE_UP,
    MoeCombineKernel,
    MoeDownAfterEarlySharedKernel,
    MoeExpertKernel,
    MoeGateUpEarlySharedDownKernel,
    MoeRouterKernel,
    RoutingTable,
    early_sync_words,
    halves_for,
    uses_cluster_logits,
)

M_BUCKETS = (1, 2, 4, 8, 16)
WARPS_PER_CTA = 4
# Each CTA of the expert launches walks the slots lane, lane + SLOT_LANES, ...:
# up to this many CTA columns, so M = 1 (9 experts with the shared one) runs one
# expert per CTA and M = 16 (up to 129) about four (32 beat 8 and 16 by 2-5% at
# M = 16 on the H200, docs/perf/moe.json diagnostics).
MAX_SLOT_LANES = 32
# The router's last CTA runs top-k with one warp per token (serially beyond
# its warp count) and builds the table with one thread per expert, so it is
# wider than the expert CTAs.
ROUTER_WARPS = 8
# The router's weight never depends on the previous kernel: all of a warp's
# K-steps are loaded before griddepcontrol.wait, so under PDL the loads overlap
# the predecessor and only the reduction is left on the critical path.  One
# CTA per 16-expert tile then beats splitting K over CTAs, whose partials cost
# another round of global atomics (H200, M = 1: 8.2 vs 9.4 us per router
# launch, split 1 vs 3).  K is split only when a warp's steps would exceed
# ROUTER_MAX_STEPS (Kimi-Linear: 9 steps, 96-98 registers at M = 1 and 16).
ROUTER_MAX_STEPS = 12
# The router's logits go through a thread-block cluster for these M-buckets
# only: on the H200 (2026-12-02, scripts/ab_router_cluster.py, both paths
# bit-identical) o_proj + MoE took 1.7-2.2 us less per layer at M = 1 and 2
# and 1.0-1.5 us at M = 4 and 8; at M = 16 the MoE layer alone was 0.2-0.4 us
# slower (its 214-register CTAs wait for room beside o_proj), so 16 keeps the
# global logits and ticket.
ROUTER_CLUSTER_MAX_BUCKET = 8
# Elements of a placeholder buffer the kernels never dereference (a valid
# 16-byte aligned pointer for an argument the compiled variant ignores).
PLACEHOLDER_ELEMS = 4

_COMPILED: dict[tuple, object] = {}
COMPILE_SECONDS: dict[tuple, float] = {}


@dataclass(frozen=True)
class MoeConfig:
    """CTA shape of the expert launches (defaults from H200 sweeps)."""

    warps: int = WARPS_PER_CTA
    max_slot_lanes: int = MAX_SLOT_LANES
    # The down launch's warps when they differ from gate_up's (None: ``warps``):
    # its K of 1024 is 4 steps per warp at 8 warps, 8 at 4.
    down_warps: int | None = None
    # The largest M-bucket whose expert launches take ``warps`` and
    # ``down_warps`` (None: every bucket); larger buckets take WARPS_PER_CTA
    # for both.
    warps_max_bucket: int | None = None
    # At M-bucket 1, the router's top-k warp writes the routing table itself
    # (``MoeRouterKernel(warp_table=)``): the same table without the CTA-wide
    # pass's four barriers, 15 us less GPU time per 27-layer step at 1 request
    # on the H200 (``moe_notes.md``). False: the CTA-wide pass, the reference.
    router_warp_table: bool = True
    # The K-steps of the expert launches' first weight batch (the pre-wait one
    # where a unit loads before its wait), at most this many, every M-bucket;
    # None: ``unroll``.
    # The decode executor takes 6 for down (gemm_notes.md, "Fewer weight steps
    # before the PDL wait in the engine").
    gate_up_prewait_steps: int | None = None
    down_prewait_steps: int | None = None
    # The M-buckets min..max whose gate_up launch also runs the shared expert's
    # down (``MoeGateUpEarlySharedDownKernel``: its weights load before the PDL
    # wait, while the router runs; the down launch streams the routed experts
    # only); max 0: none. Buckets of up to 8 tokens only. A min above 1 leaves
    # bucket 1 to the plain pair: on the H200 the early one was ~2.3 us a layer
    # slower at 1 token and 2-9 us faster at 2-8 (moe_notes.md, "The early
    # shared down measured"). ``early_shared_down_polls``: the polls of the
    # shared h's tile count after which a CTA leaves its tiles to the down
    # launch (tests take 0 to run that path).
    early_shared_down_max_bucket: int = 0
    early_shared_down_min_bucket: int = 1
    early_shared_down_polls: int = EARLY_MAX_POLLS
    # Launch bounds of the expert launches of M-buckets min..max: ptxas may use
    # up to this many registers a thread (``MoeExpertKernel(max_registers=)``;
    # 128 keeps two 8-warp or four 4-warp CTAs an SM); None: no bounds, ptxas
    # keeps fewer and sinks part of each weight batch below its first MMAs.
    expert_max_registers: int | None = None
    expert_registers_min_bucket: int = M_BUCKETS[0]
    expert_registers_max_bucket: int = M_BUCKETS[-1]

    def early_shared_down(self, bucket: int) -> bool:
        """Whether M-bucket ``bucket``'s gate_up runs the shared expert's down."""
        low, high = self.early_shared_down_min_bucket, self.early_shared_down_max_bucket
        return low <= bucket <= high and halves_for(bucket) == 1

    def expert_registers(self, bucket: int) -> int | None:
        """The register bound of M-bucket ``bucket``'s expert launches (None: none)."""
        low, high = self.expert_registers_min_bucket, self.expert_registers_max_bucket
        return self.expert_max_registers if low <= bucket <= high else None

    @property
    def down_stage_warps(self) -> int:
        return self.warps if self.down_warps is None else self.down_warps

    def expert_warps(self, bucket: int) -> tuple[int, int]:
        """(gate_up, down) warps per CTA of M-bucket ``bucket``'s launches."""
        if self.warps_max_bucket is not None and bucket > self.warps_max_bucket:
            return (WARPS_PER_CTA, WARPS_PER_CTA)
        return (self.warps, self.down_stage_warps)


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    inter: int
    num_experts: int
    top_k: int


def m_bucket_for(m: int) -> int:
    for bucket in M_BUCKETS:
        if m <= bucket:
            return bucket
    raise ValueError(f"M={m} is outside 1..{MAX_TOKENS} (small-batch MoE)")


def router_split(hidden: int, warps: int = ROUTER_WARPS) -> tuple[int, int]:
    """(CTAs per 16-expert tile, K-steps per warp) for the router: the
    smallest split whose warps have at most ``ROUTER_MAX_STEPS`` K-steps
    each, every warp with some K work."""
    total = ceil_div(hidden // CHUNK, LANES_PER_QUAD)
    split = 1
    while True:
        slices = split * warps
        steps = ceil_div(total, slices)
        if steps <= ROUTER_MAX_STEPS and steps * (slices - 1) < total:
            return split, steps
        if steps == 1:
            raise ValueError(f"no router split keeps every warp busy for K={hidden}")
        split += 1


def slot_lanes_for(
    bucket: int, shape: MoeShape, max_lanes: int = MAX_SLOT_LANES
) -> int:
    return min(1 + min(shape.num_experts, bucket * shape.top_k), max_lanes)


def _ptr(t: torch.Tensor, dtype) -> cute.Pointer:
    return gmem_ptr(t, dtype, assumed_align=16)


def _check(name: str, t, shape: tuple, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the experts on {device}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned for vector loads")


def expert_l2_policy_for_bucket(
    bucket: int, policy: str | None, max_bucket: int | None
) -> str | None:
    """The expert weight L2 policy the kernels of M-bucket ``bucket`` take:
    ``policy`` up to ``max_bucket`` (None: every bucket), else plain loads."""
    return policy if max_bucket is None or bucket <= max_bucket else None


class PreparedMoe:
    """Kimi-style MoE block for M <= 16 tokens on SM90.

    ``y = shared(x) + sum_k w_k * expert_k(x)`` with sigmoid routing: scores
    ``sigmoid(x @ gate_weight^T)`` (logits rounded to bf16), experts chosen on
    ``scores + e_score_correction_bias`` (top-k, ties to the lower id),
    weights = chosen scores, renormalised to sum 1 when ``renormalize``,
    times ``routed_scaling_factor``.  Experts: ``SiLU(x Wg^T) * (x Wu^T) W2^T``.

    With ``rmsnorm_weight`` the block also adds ``residual`` and normalises:
    ``residual_out = residual + y`` (bf16), ``out = rmsnorm(residual_out) *
    rmsnorm_weight`` (the MoE -> next-layer input-norm seam); else
    ``out = y``.

    With ``input_norm_weight`` (needs ``rmsnorm_weight``) the block also does
    the norm before it (the attention -> MoE seam): the router reads
    ``residual`` and ``input_sums`` (per-token sums of squares of
    ``residual``, which a ``residual_sumsq`` GEMM adds up; the router re-arms
    them to zero) and writes ``x = rmsnorm(residual) * input_norm_weight``,
    which the experts then read: ``x`` is an output of ``run`` then.

    ``router_cluster`` (default): for M-buckets up to
    ``router_cluster_max_bucket`` (default ``ROUTER_CLUSTER_MAX_BUCKET``; tests
    and the A/B raise it to take the cluster path at every M), the router's
    CTAs (one per 16 experts, when K is not split and E <= 256) form one
    thread-block cluster and gather their logits in the first CTA's shared
    memory, which routes from there; False, a larger bucket or a shape outside
    that range takes the global logits and an atomic ticket.  Same routing bit for bit.
    ``router_cluster_for(m)`` says which one a run of ``m`` tokens takes;
    ``self.logits`` (FP32 [16 * E]) holds the bf16-rounded logits of the last
    run that took the ticket path (the cluster path does not write them).

    ``expert_weight_l2_policy``: None (default, plain loads), ``"evict_first"``
    or ``"evict_last"``: the L2 cache policy of the gate_up and down launches'
    expert weight loads (routed and shared); the router's loads keep none.
    ``expert_weight_l2_policy_max_bucket``: the largest M-bucket whose kernels
    take that policy (None: every bucket); larger buckets keep plain loads.
    """

    def __init__(
        self,
        gate_weight: torch.Tensor,
        e_score_correction_bias: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        shared_gate_up: torch.Tensor,
        shared_down: torch.Tensor,
        top_k: int,
        routed_scaling_factor: float,
        renormalize: bool = True,
        rmsnorm_weight: torch.Tensor | None = None,
        eps: float = 1e-5,
        use_pdl: bool = True,
        config: MoeConfig | None = None,
        input_norm_weight: torch.Tensor | None = None,
        input_eps: float = 1e-5,
        router_cluster: bool = True,
        router_cluster_max_bucket: int = ROUTER_CLUSTER_MAX_BUCKET,
        expert_weight_l2_policy: str | None = None,
        expert_weight_l2_policy_max_bucket: int | None = None,
    ):
        l2_policy_value(expert_weight_l2_policy)  # raises on an unknown name
        self.expert_weight_l2_policy = expert_weight_l2_policy
        self.expert_weight_l2_policy_max_bucket = expert_weight_l2_policy_max_bucket
        if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
            raise ValueError("w13 must be a 3-D [E, 2*I, H] torch.Tensor")
        if not w13.is_cuda:
            raise ValueError(f"w13 must be on a CUDA device, got {w13.device}")
        num_experts, two_inter, hidden = w13.shape
        if two_inter % 2:
            raise ValueError(f"w13 must be [E, 2*I, H], got {tuple(w13.shape)}")
        inter = two_inter // 2
        self.shape = MoeShape(hidden, inter, num_experts, top_k)
        self.device = w13.device
        bf16 = torch.bfloat16
        _check("w13", w13, (num_experts, 2 * inter, hidden), bf16, self.device)
        _check("w2", w2, (num_experts, hidden, inter), bf16, self.device)
        _check("gate_weight", gate_weight, (num_experts, hidden), bf16, self.device)
        _check(
            "shared_gate_up (one shared expert of the routed experts' size)",
            shared_gate_up,
            (2 * inter, hidden),
            bf16,
            self.device,
        )
        _check("shared_down", shared_down, (hidden, inter), bf16, self.device)
        if not 1 <= top_k <= min(num_experts, 32):
            raise ValueError(f"top_k={top_k} must be in 1..min(E, 32)")
        if hidden % 16 or inter % 8:
            raise ValueError(
                f"need H % 16 == 0 and I % 8 == 0, got H={hidden}, I={inter}"
            )
        # The router's table pass gives each of its threads the same number of
        # experts.
        router_threads = ROUTER_WARPS * 32
        if num_experts % router_threads or num_experts > 1024:
            raise ValueError(
                f"num_experts={num_experts} must be a multiple of {router_threads} "
                "and <= 1024"
            )
        if e_score_correction_bias is None or tuple(e_score_correction_bias.shape) != (
            num_experts,
        ):
            raise ValueError(
                f"e_score_correction_bias must have shape ({num_experts},)"
            )
        self.top_k, self.scale, self.renormalize = (
            top_k,
            routed_scaling_factor,
            renormalize,
        )
        self.eps, self.use_pdl = eps, use_pdl
        self.config = config or MoeConfig()
        self.w13, self.w2 = w13, w2
        self.gate_weight = gate_weight
        self.shared_gate_up, self.shared_down = shared_gate_up, shared_down
        # FP32 copy of the bias (1 KiB): the router adds it in FP32.
        self.bias = e_score_correction_bias.detach().to(torch.float32).contiguous()
        if rmsnorm_weight is not None:
            _check("rmsnorm_weight", rmsnorm_weight, (hidden,), bf16, self.device)
        self.gamma = rmsnorm_weight
        if input_norm_weight is not None:
            if rmsnorm_weight is None:
                raise ValueError(
                    "input_norm_weight needs rmsnorm_weight: the block's residual "
                    "is the input it normalises"
                )
            _check("input_norm_weight", input_norm_weight, (hidden,), bf16, self.device)
        self.input_gamma, self.input_eps = input_norm_weight, input_eps
        # The producer's per-token sums of squares (zero between launches).
        self.input_sums = torch.zeros(
            MAX_TOKENS if input_norm_weight is not None else 4,
            dtype=torch.float32,
            device=self.device,
        )

        table = RoutingTable(num_experts, top_k)
        self.split_k, self.router_steps = router_split(hidden)
        tiles = num_experts // 16
        self.router_cluster = uses_cluster_logits(tiles, self.split_k, router_cluster)
        self.router_cluster_max_bucket = router_cluster_max_bucket
        # Workspace: router partials + logits (written on the ticket path
        # only: the cluster path keeps them in shared memory), counters,
        # routing table and weights, the gate_up output h and the FP32 expert
        # outputs y.
        partial_elems = (
            tiles * self.split_k * 32 * 8 if self.split_k > 1 else PLACEHOLDER_ELEMS
        )
        f32, i32 = torch.float32, torch.int32
        dev = self.device
        self.partials = torch.empty(partial_elems, dtype=f32, device=dev)
        self.logits = torch.empty(MAX_TOKENS * num_experts, dtype=f32, device=dev)
        self.counters = torch.zeros(tiles + 1, dtype=i32, device=dev)
        self.table = torch.zeros(table.size, dtype=i32, device=dev)
        self.route_weights = torch.zeros(MAX_TOKENS * top_k, dtype=f32, device=dev)
        self.h = torch.empty(table.max_rows, inter, dtype=bf16, device=dev)
        self.y = torch.empty(table.max_rows, hidden, dtype=f32, device=dev)
        # The early shared down's count and per-tile flags (re-armed by down).
        self.early_sync = torch.zeros(early_sync_words(hidden), dtype=i32, device=dev)
        buffers = (
            self.partials, self.logits, self.counters, self.table,
            self.route_weights, self.h, self.y, self.bias, self.input_sums,
            self.early_sync,
        )  # fmt: skip
        self.workspace_bytes = sum(b.numel() * b.element_size() for b in buffers)
        # No weight is copied or repacked.
        self.extra_bytes = 0
        self._fns: dict[int, tuple] = {}

    def _router_cluster_bucket(self, bucket: int) -> bool:
        return self.router_cluster and bucket <= self.router_cluster_max_bucket

    def _expert_l2_policy(self, bucket: int) -> str | None:
        policy = self.expert_weight_l2_policy
        max_bucket = self.expert_weight_l2_policy_max_bucket
        return expert_l2_policy_for_bucket(bucket, policy, max_bucket)

    def router_cluster_for(self, m: int) -> bool:
        """Whether a run of ``m`` tokens gathers the router's logits through
        the cluster (else the global logits and the ticket)."""
        return self._router_cluster_bucket(m_bucket_for(m))

    # ------------------------------------------------------------- compiling
    def _kernels(self, bucket: int) -> tuple:
        s = self.shape
        lanes = slot_lanes_for(bucket, s, self.config.max_slot_lanes)
        gate_up_warps, down_warps = self.config.expert_warps(bucket)
        fused = self.gamma is not None
        policy = self._expert_l2_policy(bucket)
        registers = self.config.expert_registers(bucket)
        if self.config.early_shared_down(bucket):
            gate_up = MoeGateUpEarlySharedDownKernel(
                s.hidden, s.inter, s.num_experts, s.top_k, bucket, lanes,
                gate_up_warps, down_warps, self.use_pdl, policy,
                self.config.gate_up_prewait_steps, self.config.early_shared_down_polls,
                registers,
            )  # fmt: skip
            down = MoeDownAfterEarlySharedKernel(
                s.hidden, s.inter, s.num_experts, s.top_k, bucket, lanes, down_warps,
                self.use_pdl, policy, self.config.down_prewait_steps, registers,
            )  # fmt: skip
        else:
            gate_up = MoeExpertKernel(
                STAGE_GATE_UP, s.hidden, s.inter, s.num_experts, s.top_k, bucket,
                lanes, gate_up_warps, self.use_pdl, policy,
                self.config.gate_up_prewait_steps, registers,
            )  # fmt: skip
            down = MoeExpertKernel(
                STAGE_DOWN, s.hidden, s.inter, s.num_experts, s.top_k, bucket,
                lanes, down_warps, self.use_pdl, policy, self.config.down_prewait_steps,
                registers,
            )  # fmt: skip
        return (
            MoeRouterKernel(
                s.hidden, s.num_experts, s.top_k, bucket, self.split_k,
                ROUTER_WARPS, self.router_steps, self.scale, self.renormalize,
                self.use_pdl, self.input_gamma is not None, self.input_eps,
                self._router_cluster_bucket(bucket), self.config.router_warp_table,
            ),
            gate_up,
            down,
            MoeCombineKernel(
                s.hidden, s.num_experts, s.top_k, bucket, fused, self.eps,
                self.use_pdl,
            ),
        )  # fmt: skip

    def _key(self, bucket: int) -> tuple:
        return (
            self.shape, bucket, self.split_k, self.scale, self.renormalize,
            self.gamma is not None, self.eps, self.use_pdl, self.config,
            self.input_gamma is not None, self.input_eps,
            self._router_cluster_bucket(bucket), self._expert_l2_policy(bucket),
        )  # fmt: skip

    def compile(self, buckets=M_BUCKETS) -> dict[int, float]:
        """Compile (or fetch from the process cache); seconds per bucket."""
        seconds = {}
        bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
        for bucket in buckets:
            key = self._key(bucket)
            if key not in _COMPILED:
                router, gate_up, down, combine = self._kernels(bucket)
                w13, w2 = _ptr(self.w13, bf16), _ptr(self.w2, bf16)
                x = _ptr(self.h, bf16)
                tab, wts = _ptr(self.table, i32), _ptr(self.route_weights, f32)
                y = _ptr(self.y, f32)
                m, stream = cutlass.Int32(1), cuda.CUstream(0)
                if self.config.early_shared_down(bucket):
                    sync = _ptr(self.early_sync, i32)
                    gate_up_args = (x, w13, w13, tab, x, w2, y, sync, m, stream)
                    down_args = (x, w2, w2, tab, y, sync, m, stream)
                else:
                    gate_up_args = (x, w13, w13, tab, x, m, stream)
                    down_args = (x, w2, w2, tab, y, m, stream)
                start = time.perf_counter()
                _COMPILED[key] = (
                    compile_kernel(
                        "moe_router", key, router, x, _ptr(self.gate_weight, bf16),
                        _ptr(self.bias, f32), _ptr(self.partials, f32),
                        _ptr(self.logits, f32), _ptr(self.counters, i32), tab,
                        wts, _ptr(self.input_sums, f32), x, x, m, stream,
                    ),
                    compile_kernel("moe_gate_up", key, gate_up, *gate_up_args),
                    compile_kernel("moe_down", key, down, *down_args),
                    compile_kernel(
                        "moe_combine", key, combine, y, tab, wts, x, x, x, x, m,
                        stream,
                    ),
                )  # fmt: skip
                COMPILE_SECONDS[key] = time.perf_counter() - start
            self._fns[bucket] = _COMPILED[key]
            seconds[bucket] = COMPILE_SECONDS[key]
        return seconds

    # --------------------------------------------------------------- running
    def run(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        residual: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Launch on the current stream; returns ``out``.  Raises before launch
        on wrong dtype/shape/device, non-contiguous or misaligned tensors."""
        for launch in self.launches(x, out, residual, residual_out):
            launch()
        return out

    def launches(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        residual: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
    ) -> tuple:
        """The four launches of ``run`` (router, gate_up, down, combine) as
        callables, validated and bound; benchmarks time prefixes of them.
        With ``input_norm_weight``, ``x`` is written (the normalised
        ``residual``) before the experts read it."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a 2-D [M, H] torch.Tensor")
        m, hidden = x.shape[0], self.shape.hidden
        if not 1 <= m <= MAX_TOKENS:
            raise ValueError(f"M={m} is outside 1..{MAX_TOKENS} (small-batch MoE)")
        bucket = m_bucket_for(m)
        if x.shape[1] != hidden:
            raise ValueError(f"hidden mismatch: x has {x.shape[1]}, experts {hidden}")
        bf16 = torch.bfloat16
        _check("x", x, (m, hidden), bf16, self.device)
        _check("out", out, (m, hidden), bf16, self.device)
        if self.gamma is not None:
            if residual is None or residual_out is None:
                raise ValueError("a fused RMSNorm needs residual and residual_out")
            _check("residual", residual, (m, hidden), bf16, self.device)
            _check("residual_out", residual_out, (m, hidden), bf16, self.device)
            gamma = _ptr(self.gamma, cutlass.BFloat16)
            res = _ptr(residual, cutlass.BFloat16)
            res_out = _ptr(residual_out, cutlass.BFloat16)
        else:
            if residual is not None or residual_out is not None:
                raise ValueError("residual needs the fused RMSNorm (rmsnorm_weight)")
            gamma = res = res_out = _ptr(out, cutlass.BFloat16)  # never touched
        fns = self._fns.get(bucket)
        if fns is None:
            self.compile((bucket,))
            fns = self._fns[bucket]
        router, gate_up, down, combine = fns
        bf, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
        stream = current_stream(self.device)
        x_ptr, tab = _ptr(x, bf), _ptr(self.table, i32)
        wts, h, y = _ptr(self.route_weights, f32), _ptr(self.h, bf), _ptr(self.y, f32)
        w13, w2 = _ptr(self.w13, bf), _ptr(self.w2, bf)
        shared_gate_up, shared_down = (
            _ptr(self.shared_gate_up, bf),
            _ptr(self.shared_down, bf),
        )
        if self.input_gamma is not None:
            if x.data_ptr() == residual.data_ptr():
                raise ValueError("x (written) must not alias residual")
            router_in = res
            input_norm = (
                _ptr(self.input_sums, f32), _ptr(self.input_gamma, bf), x_ptr,
            )  # fmt: skip
        else:
            router_in = x_ptr
            input_norm = (_ptr(self.input_sums, f32), x_ptr, x_ptr)  # never touched
        router_args = (
            router_in, _ptr(self.gate_weight, bf), _ptr(self.bias, f32),
            _ptr(self.partials, f32), _ptr(self.logits, f32),
            _ptr(self.counters, i32), tab, wts, *input_norm, m, stream,
        )  # fmt: skip
        out_ptr = _ptr(out, bf)
        if self.config.early_shared_down(bucket):
            sync = _ptr(self.early_sync, i32)
            gate_up_args = (x_ptr, w13, shared_gate_up, tab, h, shared_down, y, sync)
            down_args = (h, w2, shared_down, tab, y, sync)
        else:
            gate_up_args = (x_ptr, w13, shared_gate_up, tab, h)
            down_args = (h, w2, shared_down, tab, y)
        return (
            lambda: router(*router_args),
            lambda: gate_up(*gate_up_args, m, stream),
            lambda: down(*down_args, m, stream),
            lambda: combine(y, tab, wts, res, res_out, gamma, out_ptr, m, stream),
        )

    def routing(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [m, top_k] int64, weights [m, top_k] fp32) of the last
        run, read back from the routing table (for tests and benchmarks)."""
        t = RoutingTable(self.shape.num_experts, self.top_k)
        table = self.table.cpu()
        rows = table[t.route_row : t.route_row + m * self.top_k].view(m, self.top_k)
        count = int(table[t.count])
        row0 = table[t.row0 : t.row0 + count]
        experts = table[t.expert : t.expert + count]
        slot_of_row = torch.searchsorted(row0, rows.flatten(), right=True) - 1
        ids = experts[slot_of_row].view(m, self.top_k).long()
        weights = self.route_weights.cpu()[: m * self.top_k].view(m, self.top_k)
        return ids, weights

    def distinct_experts(self) -> int:
        """Distinct routed experts of the last run (host sync: not in graphs)."""
        return int(self.table[0].item())

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bind a decode weight once; launch the skinny CuTe DSL GEMM per step.

``PreparedGemm(weight, epilogue=...)`` validates and (for ``silu_mul``) packs
the weight once, allocates the atomic counters the kernel re-arms itself (and
the small FP32 split-K workspace, when a split is reduced through global
memory rather than a thread-block cluster), and compiles one kernel per
M-bucket on first use (cached process-wide per (N, K, M-bucket, epilogue,
config)).
``run()`` then only validates its inputs, builds raw pointers and launches on
the current stream: no host sync, no allocation, so it can be captured in a
CUDA graph and replayed.

One ``PreparedGemm`` owns one workspace: do not run the same instance
concurrently on two streams.
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from ..common.compile_cache import compile_kernel
from ..common.host import gmem_ptr
from ..common.l2_policy import l2_policy_value
from .kernel import (
    BARRIER_MAX_POLLS,
    CHUNK,
    EPILOGUE_PLAIN,
    EPILOGUE_RESIDUAL_RMSNORM,
    EPILOGUE_RESIDUAL_SUMSQ,
    EPILOGUE_SILU_MUL,
    EPILOGUES,
    LANES_PER_QUAD,
    MAX_TOKENS,
    NORM_COUNTERS,
    RESIDUAL_EPILOGUES,
    ROWS_PER_TILE,
    STAGED_EPILOGUES,
    STAGES_PER_TILE,
    SUMSQ_BUFFERS,
    TOKENS_PER_MMA,
    WARP_THREADS,
    RowGroups,
    SkinnyGemmKernel,
    StagedSkinnyGemmKernel,
    uses_cluster_split_k,
)

# Launch heuristic, from config sweeps on the H200 (docs/perf/gemm_sweep.md):
# * 4-warp CTAs beat 8-warp CTAs at equal split-K on every swept shape
#   (e.g. N=2304, K=4096: 7.7 vs 9.7 us at M=1, 8.5 vs 12.6 us at M=16): a
#   warp that streams more K-steps amortises its start-up and reduction;
# * a grid split-K costs ~1.5 us (partials to L2, fence, ticket, re-read), so
#   shapes with enough 16-row tiles run unsplit (N=2304, K=1024: 2.3 us
#   unsplit vs 3.7 us split 2); only few-tile or long-K shapes are split, to
#   ~TARGET_WARPS_PER_SM resident warps (N=2304, K=4096/9216; N=576).
#   Those sweeps timed the global-workspace reduction; the cluster reduction
#   (kernel.uses_cluster_split_k, the default since) is not re-swept yet.
TARGET_WARPS_PER_SM = 16
WARPS_PER_CTA = 4
# Unsplit needs at least this many tiles (half the SMs busy with 1 CTA) and
# at most this many K-steps per warp.
UNSPLIT_MIN_TILES_PER_SM = 0.5
UNSPLIT_MAX_STEPS_PER_WARP = 24
# K-steps per warp issued before their MMAs; 8 (M<=8) or 6 (M<=16) keeps the
# staged fragments at ~96 registers per thread.
UNROLL_BY_BUCKET = {TOKENS_PER_MMA: 8, MAX_TOKENS: 6}
# Every warp gets at least this many K-steps, so the split-K reduction does
# not cost more than the loads it parallelises.
MIN_STEPS_PER_WARP = 3
# CTAs of at most 8 warps always fit two per SM (255 registers x 256 threads
# fill the register file once; the shared memory is a few KiB), so a grid of
# at most this many 16-row tiles per SM can hold one waiting CTA per tile
# while the others still get scheduled: the RMSNorm grid barrier's wait is
# short.  Where fewer SMs are usable than the device has (MPS, green
# contexts), the waiting tiles time out instead (kernel.BARRIER_MAX_POLLS).
BARRIER_MAX_TILES_PER_SM = 2
BARRIER_MAX_WARPS = 8
# From this many tokens on the barrier beats the last tile's whole-row pass
# (H200, N=2304, K=1024/4096/9216, chained launches: 0.3-0.5 us slower at M=1-2,
# equal at 4, 0.6-1.0 us faster at 8, 3-4 us at 16; docs/perf/gemm_notes.md).
BARRIER_MIN_TOKENS = 4

# The weight stream staged through shared memory (``weight_stages``): CTAs of 8
# warps splitting K (one CTA an SM walks ~6 tiles of the KDA in_proj; at 1-8
# tokens its warps' activations stay in registers, at 9-16 they come from L1),
# shared-memory reads of 3 K-steps before their MMAs (the data is on chip: a
# short batch covers its latency and keeps the registers for the activations),
# one CTA an SM.
STAGED_WARPS = 8
STAGED_UNROLL = 3
STAGED_CTAS_PER_SM = 1

_COMPILED: dict[tuple, object] = {}
COMPILE_SECONDS: dict[tuple, float] = {}


@dataclass(frozen=True)
class GemmConfig:
    warps_k: int
    split_k: int
    unroll: int
    # Weight steps a warp loads before griddepcontrol.wait (None: ``unroll``).
    prewait_steps: int | None = None
    # Launch bounds: the CTAs an SM is promised to hold, so that ptxas may use
    # the registers they leave (None: no bounds; ``SkinnyGemmKernel``).
    min_ctas_per_sm: int | None = None
    # Shared-memory stages of 8 weight rows (``StagedSkinnyGemmKernel``; None:
    # the register stream).
    weight_stages: int | None = None


def m_bucket_for(m: int) -> int:
    return TOKENS_PER_MMA if m <= TOKENS_PER_MMA else MAX_TOKENS


def _by_bucket(
    value: int | dict[int, int] | None, buckets: Iterable[int], name: str
) -> dict[int, int]:
    """{M-bucket: v} of ``value``: one v for every one of ``buckets``, or
    {bucket: v} for some of them (a bucket not among ``buckets`` raises, naming
    ``name``); {} for None."""
    buckets = sorted(buckets)
    if value is None:
        return {}
    if isinstance(value, int):
        return dict.fromkeys(buckets, value)
    unknown = sorted(set(value) - set(buckets))
    if unknown:
        raise ValueError(f"{name} names M-buckets {unknown}; the GEMM's are {buckets}")
    return dict(value)


def launch_bounds_by_bucket(
    min_ctas_per_sm: int | dict[int, int] | None, buckets: Iterable[int]
) -> dict[int, int]:
    """{M-bucket: CTAs an SM} of ``min_ctas_per_sm``: one bound for every one of
    ``buckets``, or {bucket: bound} for some of them (a bucket not among
    ``buckets`` raises); {} for None."""
    return _by_bucket(min_ctas_per_sm, buckets, "min_ctas_per_sm")


def choose_config(n: int, k: int, m_bucket: int, num_sms: int) -> GemmConfig:
    """4-warp CTAs; split K across CTAs only for few-tile or long-K shapes."""
    tiles = -(-n // ROWS_PER_TILE)
    total_steps = -(-(k // CHUNK) // LANES_PER_QUAD)
    max_slices = max(1, total_steps // MIN_STEPS_PER_WARP)
    # Tiny K (f_b/g_b: K=128, 4 steps) still gets 2 warps of 2 steps each.
    warps_k = min(WARPS_PER_CTA, max(max_slices, min(2, total_steps // 2)))
    unsplit_steps = -(-total_steps // warps_k)
    if (
        tiles >= num_sms * UNSPLIT_MIN_TILES_PER_SM
        and unsplit_steps <= UNSPLIT_MAX_STEPS_PER_WARP
    ):
        split_k = 1
    else:
        wanted = num_sms * TARGET_WARPS_PER_SM / (tiles * warps_k)
        split_k = max(1, min(round(wanted), max_slices // warps_k))
    # Drop slices that would be left without K work after rounding up.
    while split_k > 1 or warps_k > 1:
        slices = warps_k * split_k
        steps = -(-total_steps // slices)
        if steps * (slices - 1) < total_steps:
            break
        if split_k > 1:
            split_k -= 1
        else:
            warps_k -= 1
    return GemmConfig(warps_k, split_k, UNROLL_BY_BUCKET[m_bucket])


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """Interleave a stacked ``[gate; up]`` weight ``[2I, K]`` in 8-row blocks.

    Packed 16-row tile ``i`` holds gate rows ``8i..8i+7`` then up rows
    ``8i..8i+7``, so the lane that accumulates gate row ``j`` also holds up row
    ``j`` and the SiLU-and-mul epilogue needs no data exchange.  I is padded to
    a multiple of 8 with zero rows (their outputs are never stored).
    Returns a new contiguous ``[2 * ceil(I/8)*8, K]`` tensor.
    """
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(
            f"gate_up weight must be [2*I, K], got shape {tuple(weight.shape)}"
        )
    inter, k = weight.shape[0] // 2, weight.shape[1]
    padded = -(-inter // TOKENS_PER_MMA) * TOKENS_PER_MMA
    gate = weight.new_zeros(padded, k)
    up = weight.new_zeros(padded, k)
    gate[:inter] = weight[:inter]
    up[:inter] = weight[inter:]
    blocks = padded // TOKENS_PER_MMA
    packed = torch.stack(
        (
            gate.view(blocks, TOKENS_PER_MMA, k),
            up.view(blocks, TOKENS_PER_MMA, k),
        ),
        dim=1,
    )
    return packed.reshape(2 * padded, k).contiguous()


def _ptr(t: torch.Tensor, dtype) -> cute.Pointer:
    return gmem_ptr(t, dtype, assumed_align=16)


# Elements of the placeholder partials buffer when no config reduces a split
# through global memory (a valid 16-byte aligned pointer, never dereferenced).
PLACEHOLDER_PARTIALS = 4
# FP32 values a lane holds at 16 tokens: two 8-token C fragments of 4.
PARTIAL_VALUES_PER_LANE = 4 * (MAX_TOKENS // TOKENS_PER_MMA)


def _partial_elems(tiles: int, configs, cluster_split_k: bool) -> int:
    """FP32 partials [tile, split, lane, 8 values] for the configs whose split
    goes through the global workspace (the ticket path); else a placeholder."""
    ticket_splits = [
        c.split_k
        for c in configs
        if c.split_k > 1 and not uses_cluster_split_k(c.split_k, cluster_split_k)
    ]
    if not ticket_splits:
        return PLACEHOLDER_PARTIALS
    return tiles * max(ticket_splits) * WARP_THREADS * PARTIAL_VALUES_PER_LANE


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the weight on {device}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned for vector loads")


class PreparedGemm:
    """``y = x @ weight.T`` (+ epilogue) for M <= 16 on SM90.

    epilogue:
      ``"plain"``: ``out[M, N] = x @ W^T``.
      ``"silu_mul"``: ``weight`` is the stacked ``[gate; up]`` ``[2I, K]``;
        ``out[M, I] = silu(x @ gate^T) * (x @ up^T)``.  Packed once here
        (``extra_bytes`` reports the copy; the caller may drop the original).
      ``"residual_rmsnorm"``: ``h = x @ W^T + residual`` (bf16) is written to
        ``residual_out`` (may alias ``residual``) and
        ``out = rmsnorm(h) * rmsnorm_weight`` with ``eps``.
      ``"residual_sumsq"``: ``h`` as above to ``residual_out``; no ``out``:
        ``sum(h[t]**2)`` is added to ``sums[t]`` (FP32 ``[16]``, zero before
        the launch), and the consumer of ``h`` normalises it and re-arms
        ``sums`` (``PreparedMoe(input_norm_weight=...)``).

    use_pdl: launch with programmatic dependent launch (default): the kernel
    starts loading weights while the preceding kernel of the stream drains and
    waits for it (``griddepcontrol.wait``) before reading ``x`` or writing.

    cluster_split_k: reduce a grid split-K (2..8 CTAs per tile) through a
    thread-block cluster's distributed shared memory (default); False keeps
    the global workspace and per-tile atomic tickets (A/B, larger splits).

    weight_l2_policy: None (default, plain loads), ``"evict_first"`` or
    ``"evict_last"``: the L2 cache policy of the weight's loads (probes of
    what a streamed-once weight displaces from L2).

    prewait_steps: None (default) or the K-steps of weight a warp loads before
    ``griddepcontrol.wait`` in every M-bucket's config (``GemmConfig``; the
    configs' own default is one batch of ``unroll`` steps).

    min_ctas_per_sm: None (default), the launch bounds of every M-bucket's
    config (``GemmConfig.min_ctas_per_sm``), or {M-bucket: bound} for some of
    them (buckets TOKENS_PER_MMA and MAX_TOKENS).  The RMSNorm's grid barrier
    needs BARRIER_MAX_TILES_PER_SM CTAs an SM, so a smaller bound is refused
    there.

    weight_stages: None (default, the register stream), or the shared-memory
    stages of 8 weight rows a CTA keeps in flight with bulk copies
    (``StagedSkinnyGemmKernel``; ``plain`` and ``silu_mul`` only;
    STAGED_WARPS-warp CTAs, STAGED_CTAS_PER_SM an SM) at every M-bucket, or
    {M-bucket: stages} for some of them.  The stages fill before the PDL wait:
    ``prewait_steps`` and ``weight_l2_policy`` apply to the register-stream
    buckets only (``min_ctas_per_sm`` to every bucket it names).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        epilogue: str = EPILOGUE_PLAIN,
        rmsnorm_weight: torch.Tensor | None = None,
        eps: float = 1e-5,
        config: dict[int, GemmConfig] | None = None,
        use_pdl: bool = True,
        barrier_max_polls: int = BARRIER_MAX_POLLS,
        cluster_split_k: bool = True,
        weight_l2_policy: str | None = None,
        prewait_steps: int | None = None,
        min_ctas_per_sm: int | dict[int, int] | None = None,
        weight_stages: int | dict[int, int] | None = None,
    ):
        if epilogue not in EPILOGUES:
            raise ValueError(
                f"unknown epilogue {epilogue!r}; expected one of {EPILOGUES}"
            )
        l2_policy_value(weight_l2_policy)  # raises on an unknown name
        buckets = (TOKENS_PER_MMA, MAX_TOKENS)
        stages = _by_bucket(weight_stages, buckets, "weight_stages")
        if any(count < STAGES_PER_TILE for count in stages.values()):
            raise ValueError(
                f"weight_stages: a tile takes {STAGES_PER_TILE} stages, got "
                f"{weight_stages!r}"
            )
        if stages and epilogue not in STAGED_EPILOGUES:
            raise ValueError(
                f"weight_stages: the staged weight stream supports the "
                f"{STAGED_EPILOGUES} epilogues, not {epilogue!r}"
            )
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError("weight must be a 2-D [N, K] torch.Tensor")
        if not weight.is_cuda:
            raise ValueError(f"weight must be on a CUDA device, got {weight.device}")
        if weight.dtype != torch.bfloat16:
            raise TypeError(f"weight must be bfloat16, got {weight.dtype}")
        if not weight.is_contiguous():
            raise ValueError("weight must be contiguous (nn.Linear [N, K] layout)")
        n, k = weight.shape
        if k % CHUNK:
            raise ValueError(f"K={k} must be a multiple of {CHUNK} (16-byte rows)")
        self.epilogue, self.k, self.eps = epilogue, k, eps
        self.use_pdl = use_pdl
        self.cluster_split_k = cluster_split_k
        self.weight_l2_policy = weight_l2_policy
        # Tests pass 0 to take the RMSNorm barrier's time-out path.
        self.barrier_max_polls = barrier_max_polls
        # Bytes this binding holds beyond the caller's weight: the packed copy
        # for silu_mul (extra_bytes) and the split-K/RMSNorm workspace.
        self.device = weight.device
        self.extra_bytes = 0
        if epilogue == EPILOGUE_SILU_MUL:
            if n % 2:
                raise ValueError(f"silu_mul weight must have an even N, got {n}")
            self.out_features = n // 2
            weight = pack_gate_up(weight)
            self.extra_bytes = weight.numel() * weight.element_size()
        else:
            self.out_features = n
        if epilogue == EPILOGUE_RESIDUAL_RMSNORM:
            if rmsnorm_weight is None:
                raise ValueError("residual_rmsnorm needs rmsnorm_weight")
            if n % CHUNK:
                raise ValueError(f"residual_rmsnorm needs N % {CHUNK} == 0, got {n}")
            _check_tensor("rmsnorm_weight", rmsnorm_weight, (n,), self.device)
            self.gamma = rmsnorm_weight
        elif epilogue == EPILOGUE_RESIDUAL_SUMSQ:
            if rmsnorm_weight is not None:
                raise ValueError("residual_sumsq leaves the norm to its consumer")
            if n % CHUNK:
                raise ValueError(f"residual_sumsq needs N % {CHUNK} == 0, got {n}")
            self.gamma = weight  # never read; any valid pointer
        elif rmsnorm_weight is not None:
            raise ValueError(
                f"rmsnorm_weight is only used by {EPILOGUE_RESIDUAL_RMSNORM}"
            )
        else:
            self.gamma = weight  # never read; any valid pointer
        if weight.data_ptr() % 16:
            raise ValueError("weight must be 16-byte aligned")
        self.weight = weight
        self.n_packed = weight.shape[0]
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sms = num_sms
        self.configs = {
            b: (config or {}).get(b) or choose_config(self.n_packed, k, b, num_sms)
            for b in (TOKENS_PER_MMA, MAX_TOKENS)
        }
        if prewait_steps is not None:
            self.configs = {
                b: replace(c, prewait_steps=prewait_steps)
                for b, c in self.configs.items()
            }
        for bucket, count in stages.items():
            self.configs[bucket] = GemmConfig(
                STAGED_WARPS, 1, STAGED_UNROLL, weight_stages=count
            )
        bounds = launch_bounds_by_bucket(min_ctas_per_sm, self.configs)
        self.configs = {
            b: replace(c, min_ctas_per_sm=bounds[b]) if b in bounds else c
            for b, c in self.configs.items()
        }
        tiles = -(-self.n_packed // ROWS_PER_TILE)
        # The RMSNorm's grid barrier needs every tile of the grid able to wait
        # on the GPU at once.
        self.grid_barrier_fits = (
            epilogue == EPILOGUE_RESIDUAL_RMSNORM
            and tiles <= BARRIER_MAX_TILES_PER_SM * num_sms
            and max(c.warps_k for c in self.configs.values()) <= BARRIER_MAX_WARPS
        )
        fewest = min(
            (c.min_ctas_per_sm for c in self.configs.values() if c.min_ctas_per_sm),
            default=None,
        )
        if self.grid_barrier_fits and fewest and fewest < BARRIER_MAX_TILES_PER_SM:
            raise ValueError(
                f"min_ctas_per_sm={fewest} would let fewer than "
                f"{BARRIER_MAX_TILES_PER_SM} CTAs an SM wait at the RMSNorm's grid "
                "barrier"
            )
        # FP32 partials [tile, split, lane, 8 values], only read or written
        # when K is split across CTAs through global memory (else a 16-byte
        # placeholder pointer); counters[tile] for split-K tickets (kept in
        # cluster mode too: the RMSNorm's words follow them) plus the
        # RMSNorm's grid ticket and barrier epoch; the RMSNorm's two buffers of
        # per-token sums of squares.
        partial_elems = _partial_elems(tiles, self.configs.values(), cluster_split_k)
        self.partials = torch.empty(
            partial_elems, dtype=torch.float32, device=self.device
        )
        self.counters = torch.zeros(
            tiles + NORM_COUNTERS, dtype=torch.int32, device=self.device
        )
        self.sumsq = torch.zeros(
            SUMSQ_BUFFERS * MAX_TOKENS, dtype=torch.float32, device=self.device
        )
        self.workspace_bytes = 4 * (
            partial_elems + self.counters.numel() + self.sumsq.numel()
        )
        self._static_ptrs = (
            _ptr(self.weight, cutlass.BFloat16),
            _ptr(self.gamma, cutlass.BFloat16),
            _ptr(self.partials, cutlass.Float32),
            _ptr(self.counters, cutlass.Int32),
            _ptr(self.sumsq, cutlass.Float32),
        )
        self._fns: dict[tuple[int, bool], object] = {}

    def norm_by_every_tile(self, m: int) -> bool:
        """Whether a launch for ``m`` tokens normalises through the grid barrier
        (else the last tile normalises every row)."""
        return self.grid_barrier_fits and m >= BARRIER_MIN_TOKENS

    def _variants(self, bucket: int) -> list[bool]:
        low = 1 if bucket == TOKENS_PER_MMA else TOKENS_PER_MMA + 1
        return sorted({self.norm_by_every_tile(m) for m in range(low, bucket + 1)})

    # ------------------------------------------------------------- compiling
    def _key(self, bucket: int, barrier: bool) -> tuple:
        c = self.configs[bucket]
        return (
            self.n_packed, self.k, self.out_features, bucket, self.epilogue, c,
            self.eps, self.use_pdl, barrier, self.barrier_max_polls,
            uses_cluster_split_k(c.split_k, self.cluster_split_k),
            self.weight_l2_policy, c.weight_stages and self._staged_grid(),
        )  # fmt: skip

    def _staged_grid(self) -> int:
        return STAGED_CTAS_PER_SM * self.num_sms

    def compile(self, buckets=(TOKENS_PER_MMA, MAX_TOKENS)) -> dict[int, float]:
        """Compile (or fetch from the process cache) every variant the buckets
        use; returns seconds per bucket."""
        seconds = {}
        for bucket in buckets:
            seconds[bucket] = sum(
                self._compile(bucket, barrier) for barrier in self._variants(bucket)
            )
        return seconds

    def _compile(self, bucket: int, barrier: bool) -> float:
        key = self._key(bucket, barrier)
        if key not in _COMPILED:
            c = self.configs[bucket]
            if c.weight_stages is not None:
                kern = StagedSkinnyGemmKernel(
                    self.n_packed, self.k, bucket, self.epilogue, c.warps_k,
                    c.unroll, c.weight_stages, self._staged_grid(),
                    out_cols=self.out_features, use_pdl=self.use_pdl,
                    min_ctas_per_sm=c.min_ctas_per_sm,
                )  # fmt: skip
            else:
                kern = SkinnyGemmKernel(
                    self.n_packed, self.k, bucket, self.epilogue,
                    c.warps_k, c.split_k, c.unroll, self.eps,
                    out_cols=self.out_features, use_pdl=self.use_pdl,
                    norm_by_every_tile=barrier,
                    barrier_max_polls=self.barrier_max_polls,
                    cluster_split_k=self.cluster_split_k,
                    weight_l2_policy=self.weight_l2_policy,
                    prewait_steps=c.prewait_steps,
                    min_ctas_per_sm=c.min_ctas_per_sm,
                )  # fmt: skip
            bf16 = _ptr(self.weight, cutlass.BFloat16)
            w, g, p, cnt, sq = self._static_ptrs
            start = time.perf_counter()
            _COMPILED[key] = compile_kernel(
                "gemm", key, kern, bf16, w, bf16, bf16, bf16, g, p, cnt, sq,
                cutlass.Int32(1), cuda.CUstream(0),
            )  # fmt: skip
            COMPILE_SECONDS[key] = time.perf_counter() - start
        self._fns[(bucket, barrier)] = _COMPILED[key]
        return COMPILE_SECONDS[key]

    # --------------------------------------------------------------- running
    def run(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None,
        residual: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        sums: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Launch on the current stream; returns ``out`` (``residual_out`` for
        residual_sumsq, whose ``out`` is None).  Raises before launch on wrong
        dtype/shape/device, non-contiguous or misaligned tensors."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a 2-D [M, K] torch.Tensor")
        m = x.shape[0]
        if not 1 <= m <= MAX_TOKENS:
            raise ValueError(f"M={m} is outside 1..{MAX_TOKENS} (skinny decode GEMM)")
        if x.shape[1] != self.k:
            raise ValueError(f"K mismatch: x has K={x.shape[1]}, weight K={self.k}")
        _check_tensor("x", x, (m, self.k), self.device)
        w, g, p, cnt, sq = self._static_ptrs
        if self.epilogue == EPILOGUE_RESIDUAL_SUMSQ:
            if out is not None:
                raise ValueError("residual_sumsq writes no out: pass out=None")
            if not isinstance(sums, torch.Tensor) or sums.dtype != torch.float32:
                raise TypeError("residual_sumsq needs sums, a float32 tensor")
            if tuple(sums.shape) != (MAX_TOKENS,) or not sums.is_contiguous():
                raise ValueError(f"sums must be a contiguous [{MAX_TOKENS}] tensor")
            if sums.device != self.device:
                raise ValueError(
                    f"sums is on {sums.device}, the weight on {self.device}"
                )
            sq = _ptr(sums, cutlass.Float32)
        else:
            if sums is not None:
                raise ValueError(f"sums is only used by {EPILOGUE_RESIDUAL_SUMSQ}")
            _check_tensor("out", out, (m, self.out_features), self.device)
        if self.epilogue in RESIDUAL_EPILOGUES:
            if residual is None or residual_out is None:
                raise ValueError(f"{self.epilogue} needs residual and residual_out")
            _check_tensor("residual", residual, (m, self.out_features), self.device)
            _check_tensor(
                "residual_out", residual_out, (m, self.out_features), self.device
            )
            res_ptr = _ptr(residual, cutlass.BFloat16)
            res_out_ptr = _ptr(residual_out, cutlass.BFloat16)
        else:
            if residual is not None or residual_out is not None:
                raise ValueError(f"residual is only used by {RESIDUAL_EPILOGUES}")
            res_ptr = res_out_ptr = w  # never read or written
        out_ptr = res_out_ptr if out is None else _ptr(out, cutlass.BFloat16)
        variant = (m_bucket_for(m), self.norm_by_every_tile(m))
        fn = self._fns.get(variant)
        if fn is None:
            self._compile(*variant)
            fn = self._fns[variant]
        stream = cuda.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        fn(
            _ptr(x, cutlass.BFloat16), w, out_ptr, res_ptr, res_out_ptr, g, p, cnt,
            sq, m, stream,
        )  # fmt: skip
        return residual_out if out is None else out


class PreparedGroupedGemm:
    """G per-group products in one launch, for M <= 16 on SM90:
    ``out[:, g, :] = x[:, g, :] @ weight[g].T`` (plain epilogue).

    weight: bf16 ``[G, R, K]`` with rows of K contiguous elements (``stride(1)
      == K``, ``stride(2) == 1``) and any group stride that is a whole number
      of rows, so a strided view into a larger matrix is read in place (MLA's
      ``W_UV`` is such a view of ``kv_b_proj.weight``).  R % 16 == 0.
    run(x, out): x bf16 ``[M, G, K]`` with the last dim contiguous and 16-byte
      aligned rows/groups (strided views are fine; one kernel is compiled per
      stride pair); out bf16 ``[M, G * R]`` contiguous.
    cluster_split_k: as for ``PreparedGemm``.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        config: dict[int, GemmConfig] | None = None,
        use_pdl: bool = True,
        cluster_split_k: bool = True,
    ):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise ValueError("weight must be a 3-D [G, R, K] torch.Tensor")
        if not weight.is_cuda:
            raise ValueError(f"weight must be on a CUDA device, got {weight.device}")
        if weight.dtype != torch.bfloat16:
            raise TypeError(f"weight must be bfloat16, got {weight.dtype}")
        groups, rows, k = weight.shape
        g_stride, r_stride, k_stride = weight.stride()
        if k_stride != 1 or (rows > 1 and r_stride != k) or g_stride % k:
            raise ValueError(
                f"weight [G, R, K] must have contiguous rows of K={k} and a group "
                f"stride of whole rows, got strides {weight.stride()}"
            )
        if g_stride < rows * k and groups > 1:
            raise ValueError(f"weight groups overlap (strides {weight.stride()})")
        if k % CHUNK:
            raise ValueError(f"K={k} must be a multiple of {CHUNK} (16-byte rows)")
        if rows % ROWS_PER_TILE:
            raise ValueError(f"R={rows} must be a multiple of {ROWS_PER_TILE}")
        if weight.data_ptr() % 16:
            raise ValueError("weight must be 16-byte aligned")
        self.weight, self.device, self.use_pdl = weight, weight.device, use_pdl
        self.cluster_split_k = cluster_split_k
        self.groups, self.rows, self.k = groups, rows, k
        self.w_group_rows = g_stride // k if groups > 1 else rows
        self.out_features = groups * rows
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.configs = {
            b: (config or {}).get(b) or choose_config(self.out_features, k, b, num_sms)
            for b in (TOKENS_PER_MMA, MAX_TOKENS)
        }
        tiles = self.out_features // ROWS_PER_TILE
        partial_elems = _partial_elems(tiles, self.configs.values(), cluster_split_k)
        self.partials = torch.empty(
            partial_elems, dtype=torch.float32, device=self.device
        )
        self.counters = torch.zeros(tiles + 1, dtype=torch.int32, device=self.device)
        self.workspace_bytes = 4 * (partial_elems + tiles + 1)
        self.extra_bytes = 0
        self._static_ptrs = (
            _ptr(self.weight, cutlass.BFloat16),
            _ptr(self.partials, cutlass.Float32),
            _ptr(self.counters, cutlass.Int32),
        )
        self._fns: dict[tuple, object] = {}

    def _key(self, bucket: int, x_strides: tuple[int, int]) -> tuple:
        return (
            "grouped", self.groups, self.rows, self.k, self.w_group_rows, x_strides,
            bucket, self.configs[bucket], self.use_pdl,
            uses_cluster_split_k(self.configs[bucket].split_k, self.cluster_split_k),
        )  # fmt: skip

    def compile(
        self, x_strides: tuple[int, int], buckets=(TOKENS_PER_MMA, MAX_TOKENS)
    ) -> dict[int, float]:
        """Compile (or fetch) the variants for x's (row, group) strides; returns
        seconds per bucket."""
        seconds = {}
        for bucket in buckets:
            key = self._key(bucket, x_strides)
            if key not in _COMPILED:
                c = self.configs[bucket]
                groups = RowGroups(
                    self.groups, self.rows, self.w_group_rows, *x_strides
                )
                kern = SkinnyGemmKernel(
                    self.out_features, self.k, bucket, EPILOGUE_PLAIN,
                    c.warps_k, c.split_k, c.unroll, use_pdl=self.use_pdl,
                    row_groups=groups, cluster_split_k=self.cluster_split_k,
                )  # fmt: skip
                w, p, cnt = self._static_ptrs
                start = time.perf_counter()
                _COMPILED[key] = compile_kernel(
                    "grouped_gemm", key, kern, w, w, w, w, w, w, p, cnt, p,
                    cutlass.Int32(1), cuda.CUstream(0),
                )  # fmt: skip
                COMPILE_SECONDS[key] = time.perf_counter() - start
            self._fns[(bucket, x_strides)] = _COMPILED[key]
            seconds[bucket] = COMPILE_SECONDS[key]
        return seconds

    def run(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Launch on the current stream; returns ``out``.  Raises before launch
        on a wrong dtype, shape, device, layout or alignment."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError("x must be a 3-D [M, G, K] torch.Tensor")
        m = x.shape[0]
        if not 1 <= m <= MAX_TOKENS:
            raise ValueError(f"M={m} is outside 1..{MAX_TOKENS} (skinny decode GEMM)")
        if tuple(x.shape[1:]) != (self.groups, self.k):
            raise ValueError(
                f"x must be [M, {self.groups}, {self.k}], got {tuple(x.shape)}"
            )
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x must be bfloat16, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the weight on {self.device}")
        row_stride, group_stride, k_stride = x.stride()
        if m == 1:
            row_stride = self.groups * group_stride  # never used for one row
        if (
            k_stride != 1
            or row_stride % CHUNK
            or group_stride % CHUNK
            or x.data_ptr() % 16
        ):
            raise ValueError(
                "x needs a contiguous last dim and 16-byte aligned rows and groups "
                f"(strides {x.stride()}, address {x.data_ptr():#x})"
            )
        _check_tensor("out", out, (m, self.out_features), self.device)
        bucket = m_bucket_for(m)
        strides = (row_stride, group_stride)
        fn = self._fns.get((bucket, strides))
        if fn is None:
            self.compile(strides, (bucket,))
            fn = self._fns[(bucket, strides)]
        w, p, cnt = self._static_ptrs
        stream = cuda.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        fn(
            _ptr(x, cutlass.BFloat16), w, _ptr(out, cutlass.BFloat16),
            w, w, w, p, cnt, p, m, stream,
        )  # fmt: skip
        return out

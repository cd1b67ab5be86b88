# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Skinny CuTe DSL GEMM (kernels/gemm) against a pure-torch FP32 reference.

Every Kimi-Linear-48B-A3B decode shape x M = 1..16 x each epilogue.  Needs an
SM90 GPU and nvidia-cutlass-dsl; skips with the reason otherwise.

Tolerances (bf16 output of an FP32-accumulated product; inputs drawn so every
output is O(1)):
  * elementwise |got - ref| <= ATOL + RTOL * |ref| with RTOL = 2e-2,
    ATOL = 2e-2 (bf16 rounding of the output is 2^-9 relative; FP32
    accumulation-order differences are ~1e-6 relative; RMSNorm and SiLU*up add
    one more bf16 rounding of an intermediate, as the stock kernels do);
  * normwise ||got - ref|| / ||ref|| <= 5e-3 (bf16 operands with FP32
    accumulation land at ~2e-3 by METHOD.md's scale).
"""

import zlib

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the skinny GEMM runs on SM90 only", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip(
        f"needs an SM90 GPU, found {torch.cuda.get_device_name()}",
        allow_module_level=True,
    )

from kernels.gemm.kernel import (  # noqa: E402
    BARRIER_EPOCH,
    NORM_COUNTERS,
    uses_cluster_split_k,
)
from kernels.gemm.prepared import (  # noqa: E402
    STAGED_UNROLL,
    STAGED_WARPS,
    GemmConfig,
    PreparedGemm,
    PreparedGroupedGemm,
    choose_config,
    pack_gate_up,
)

pytestmark = pytest.mark.gpu

RTOL = 2e-2
ATOL = 2e-2
NORM_RTOL = 5e-3
EPS = 1e-5

# (name, N, K) of every decode projection of Kimi-Linear-48B-A3B, and the
# epilogues each uses in the decode (all get "plain" too).
SHAPES = {
    "kda_in_qkv_b_fa_ga": (3 * 4096 + 32 + 128 + 128, 2304, ()),
    "kda_f_b_g_b": (4096, 128, ()),
    "kda_o_proj": (2304, 4096, ("residual_rmsnorm",)),
    "mla_q_proj": (6144, 2304, ()),
    "mla_kv_a_proj": (576, 2304, ()),
    "mla_o_proj": (2304, 4096, ("residual_rmsnorm",)),
    "shared_gate_up": (2048, 2304, ("silu_mul",)),
    "shared_down": (2304, 1024, ("residual_rmsnorm",)),
    "dense_gate_up": (18432, 2304, ("silu_mul",)),
    "dense_down": (2304, 9216, ("residual_rmsnorm",)),
    "lm_head": (163840, 2304, ()),
}
CASES = [
    (name, ep)
    for name, (_, _, eps) in SHAPES.items()
    for ep in ("plain",) + eps
    if name != "mla_o_proj"  # same (N, K) and epilogue as kda_o_proj
] + [
    # Every epilogue on one shape whose N is not a multiple of the 16-row tile
    # and one whose K is not a multiple of the 32-wide K step.
    ("ragged_n", "plain"),
    ("ragged_n", "silu_mul"),
    ("ragged_n", "residual_rmsnorm"),
    ("ragged_k", "plain"),
    # silu_mul through the grid split-K path (N=576 is split across CTAs).
    ("mla_kv_a_proj", "silu_mul"),
    # More 16-row tiles than two per SM: the RMSNorm by the last tile.
    ("wide_residual", "residual_rmsnorm"),
]
EXTRA_SHAPES = {
    "ragged_n": (2 * 1000 + 8, 2304 + 8),
    "ragged_k": (1000, 2304 + 24),
    "wide_residual": (4608, 1024),  # 288 tiles > 2 x 132 SMs of the H200
}

_weights: dict = {}


def _weight(name: str) -> torch.Tensor:
    if name not in _weights:
        n, k = EXTRA_SHAPES[name] if name in EXTRA_SHAPES else SHAPES[name][:2]
        g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        _weights.clear()  # keep at most one (lm_head is 755 MB) resident
        _weights[name] = w.to(torch.bfloat16)
    return _weights[name]


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got = got.float()
    assert not torch.isnan(got).any(), f"{what}: NaN (unwritten output?)"
    err = (got - ref).abs()
    bad = err > ATOL + RTOL * ref.abs()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements out of tolerance, worst "
        f"{float(err.max()):.3e} at {tuple(int(i) for i in (err == err.max()).nonzero()[0])}"
    )
    rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    assert rel <= NORM_RTOL, f"{what}: normwise relative error {rel:.2e}"


def _reference(ep, x, w, residual=None, gamma=None):
    y = x.float() @ w.float().t()
    if ep == "plain":
        return y, None
    if ep == "silu_mul":
        inter = w.shape[0] // 2
        return torch.nn.functional.silu(y[:, :inter]) * y[:, inter:], None
    hidden = (y + residual.float()).to(torch.bfloat16).float()
    rstd = torch.rsqrt(hidden.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return hidden * rstd * gamma.float(), hidden


def _inputs(ep, m, n, k, gen):
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    out_n = n // 2 if ep == "silu_mul" else n
    out = torch.full((m, out_n), float("nan"), device="cuda", dtype=torch.bfloat16)
    residual = gamma = None
    if ep == "residual_rmsnorm":
        residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        gamma = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)
    return x, out, residual, gamma


@pytest.mark.parametrize("name,epilogue", CASES)
def test_matches_fp32_reference_all_m(name, epilogue):
    w = _weight(name)
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(1234)
    gamma = None
    if epilogue == "residual_rmsnorm":
        gamma = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)
    prepared = PreparedGemm(w, epilogue, rmsnorm_weight=gamma, eps=EPS)
    prepared.compile()
    for m in range(1, 17):
        x, out, residual, _ = _inputs(epilogue, m, n, k, gen)
        what = f"{name} {epilogue} M={m}"
        if epilogue == "residual_rmsnorm":
            residual_out = torch.full_like(residual, float("nan"))
            prepared.run(x, out, residual=residual, residual_out=residual_out)
            ref, ref_hidden = _reference(epilogue, x, w, residual, gamma)
            torch.cuda.synchronize()
            _close(residual_out, ref_hidden, what + " residual_out")
            _close(out, ref, what + " normed")
        else:
            prepared.run(x, out)
            ref, _ = _reference(epilogue, x, w)
            torch.cuda.synchronize()
            _close(out, ref, what)


def _gamma(n: int, gen: torch.Generator) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)


def test_rmsnorm_scheme_follows_the_grid_size_and_m():
    """The grid barrier only where every tile can wait on the GPU at once, and
    from 4 tokens on (the last tile's whole-row pass is faster below)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ("kda_o_proj", "wide_residual"):
        w = _weight(name)
        prepared = PreparedGemm(w, "residual_rmsnorm", rmsnorm_weight=_gamma(w.shape[0], gen))
        tiles = -(-w.shape[0] // 16)
        fits = tiles <= 2 * sms
        assert prepared.grid_barrier_fits == fits, (name, tiles, sms)
        assert [prepared.norm_by_every_tile(m) for m in range(1, 17)] == [
            fits and m >= 4 for m in range(1, 17)
        ]


@pytest.mark.parametrize("name", ["kda_o_proj", "wide_residual"])
def test_residual_rmsnorm_in_place_and_repeated(name):
    """residual_out may alias residual; tickets and sums re-arm between launches
    (for the barrier: the epoch counts launches and the next launch's buffer of
    sums is zero)."""
    w = _weight(name)
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(7)
    gamma = _gamma(n, gen)
    prepared = PreparedGemm(w, "residual_rmsnorm", rmsnorm_weight=gamma, eps=EPS)
    launches = (1, 5, 16, 3, 8, 2)
    for m in launches:
        x, out, residual, _ = _inputs("residual_rmsnorm", m, n, k, gen)
        ref, ref_hidden = _reference("residual_rmsnorm", x, w, residual, gamma)
        prepared.run(x, out, residual=residual, residual_out=residual)
        torch.cuda.synchronize()
        _close(residual, ref_hidden, f"{name} in-place residual M={m}")
        _close(out, ref, f"{name} in-place normed M={m}")
    counters = prepared.counters.clone()
    epoch_index = counters.numel() - NORM_COUNTERS + BARRIER_EPOCH
    epoch = int(counters[epoch_index])
    counters[epoch_index] = 0
    assert int(counters.abs().sum()) == 0  # every ticket re-armed
    # The barrier advances the epoch and leaves its own buffer of sums for the
    # next barrier launch to zero; the next launch's buffer is always zero.
    assert epoch == sum(prepared.norm_by_every_tile(m) for m in launches)
    assert float(prepared.sumsq.view(2, 16)[epoch % 2].abs().sum()) == 0.0


@pytest.mark.parametrize("name", ["kda_o_proj", "shared_down", "ragged_n"])
def test_residual_sumsq_writes_the_residual_and_adds_the_squares(name):
    """The residual add alone, its per-token sums of squares added into the
    caller's buffer (split-K for o_proj, one CTA per tile for 2304 x 1024, a
    ragged N); nothing else is written and the tickets re-arm."""
    w = _weight(name)
    n, k = w.shape  # ragged_n: N a multiple of 8, not of the 16-row tile
    gen = torch.Generator(device="cuda").manual_seed(11)
    prepared = PreparedGemm(w, "residual_sumsq")
    sums = torch.zeros(16, dtype=torch.float32, device="cuda")
    for m in (1, 4, 16, 2):
        x, _, _, _ = _inputs("plain", m, n, k, gen)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        residual_out = torch.full_like(residual, float("nan"))
        sums.zero_()
        sums[m:] = 7.0  # rows past M are not touched
        got = prepared.run(x, None, residual=residual, residual_out=residual_out, sums=sums)
        assert got is residual_out
        _, ref_hidden = _reference("residual_rmsnorm", x, w, residual, torch.ones(n, device="cuda"))
        torch.cuda.synchronize()
        _close(residual_out, ref_hidden, f"{name} residual_sumsq M={m}")
        # The sums are of the stored bf16 residual, in FP32 (any order).
        ref_sums = residual_out.float().pow(2).sum(dim=-1)
        torch.testing.assert_close(sums[:m], ref_sums, rtol=1e-5, atol=0.0)
        assert bool((sums[m:] == 7.0).all())
    assert int(prepared.counters.abs().sum()) == 0


def test_residual_sumsq_checks_its_arguments():
    w = _weight("shared_down")
    prepared = PreparedGemm(w, "residual_sumsq")
    x = torch.zeros(2, w.shape[1], device="cuda", dtype=torch.bfloat16)
    res = torch.zeros(2, w.shape[0], device="cuda", dtype=torch.bfloat16)
    sums = torch.zeros(16, device="cuda")
    with pytest.raises(ValueError, match="writes no out"):
        prepared.run(x, res, residual=res, residual_out=res.clone(), sums=sums)
    with pytest.raises(TypeError, match="needs sums"):
        prepared.run(x, None, residual=res, residual_out=res.clone())
    with pytest.raises(ValueError, match=r"contiguous \[16\]"):
        prepared.run(x, None, residual=res, residual_out=res.clone(), sums=sums[:8])
    with pytest.raises(ValueError, match="needs residual"):
        prepared.run(x, None, sums=sums)
    with pytest.raises(ValueError, match="leaves the norm"):
        PreparedGemm(w, "residual_sumsq", rmsnorm_weight=torch.ones_like(res[0]))
    plain = PreparedGemm(w)
    with pytest.raises(ValueError, match="sums is only used"):
        plain.run(x, res.clone(), sums=sums)


def test_plain_is_deterministic_with_split_k():
    w = _weight("mla_kv_a_proj")  # small N: split across CTAs
    cfg = choose_config(
        w.shape[0],
        w.shape[1],
        8,
        torch.cuda.get_device_properties(0).multi_processor_count,
    )
    assert cfg.split_k > 1, f"expected grid split-K for N=576, got {cfg}"
    prepared = PreparedGemm(w)
    x = torch.randn(4, w.shape[1], device="cuda").to(torch.bfloat16)
    outs = [
        prepared.run(x, torch.empty(4, w.shape[0], device="cuda", dtype=torch.bfloat16))
        for _ in range(5)
    ]
    torch.cuda.synchronize()
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


# Token counts of the split-K comparisons: both M-buckets and both RMSNorm schemes.
SPLIT_MS = (1, 2, 4, 8, 16)


def _split_cases():
    """(name, epilogue) of every decode shape whose launch splits K across CTAs
    in some M-bucket, with each epilogue it uses (and residual_sumsq where it
    uses residual_rmsnorm), plus silu_mul on the split kv_a shape."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    for name, (n, k, eps) in SHAPES.items():
        if name == "mla_o_proj" or all(choose_config(n, k, b, sms).split_k == 1 for b in (8, 16)):
            continue
        sums = ("residual_sumsq",) if "residual_rmsnorm" in eps else ()
        cases += [(name, ep) for ep in ("plain",) + eps + sums]
    return cases + [("mla_kv_a_proj", "silu_mul")]


def _run_epilogue(prepared, epilogue, x, residual):
    """One launch into fresh NaN-filled outputs; returns (out, residual_out,
    sums), None where the epilogue has no such output."""
    n = prepared.out_features
    out = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    residual_out = sums = None
    if epilogue in ("residual_rmsnorm", "residual_sumsq"):
        residual_out = torch.full_like(residual, float("nan"))
    if epilogue == "residual_sumsq":
        out = None
        sums = torch.zeros(16, dtype=torch.float32, device="cuda")
        prepared.run(x, None, residual=residual, residual_out=residual_out, sums=sums)
    elif residual_out is not None:
        prepared.run(x, out, residual=residual, residual_out=residual_out)
    else:
        prepared.run(x, out)
    return out, residual_out, sums


def _bits_equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert not got.isnan().any() and not want.isnan().any(), f"{what}: NaN (unwritten output?)"
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits)), (
        f"{what}: {int((got != want).sum())} elements differ"
    )


def _small_integers(shape, gen, magnitude, density):
    """Integers in [-magnitude, magnitude], zero with probability 1 - density,
    as bf16 (exact)."""
    values = torch.randint(-magnitude, magnitude + 1, shape, device="cuda", generator=gen)
    keep = torch.rand(shape, device="cuda", generator=gen) < density
    return (values * keep).to(torch.bfloat16)


@pytest.mark.parametrize("name,epilogue", _split_cases())
def test_cluster_split_k_is_bit_identical_to_the_ticket_path(name, epilogue):
    """The cluster reduction adds the splits' partials in the ticket path's
    order (0, 1, ...), so both give the same bits.

    Random data: every output the split reduction alone determines (out of
    plain and silu_mul, residual_out of the residual epilogues) is compared bit
    for bit.  The sums of squares, and the RMSNorm's out that divides by them,
    also add every tile's squares with float atomics in arrival order, which
    varies from launch to launch on either path, so they are compared on
    integer data instead: small-integer x, W and residual make every partial,
    residual, square and sum an integer below 2^24, exact in FP32, so no
    addition order can change a bit and every output must match exactly."""
    w = _weight(name)
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{name}/{epilogue}".encode()))
    gamma = _gamma(n, gen) if epilogue == "residual_rmsnorm" else None
    integer_w = _small_integers(w.shape, gen, 1, 0.25)
    paths = {}
    for weight, regime in ((w, "random"), (integer_w, "integer")):
        paths[regime] = [
            PreparedGemm(weight, epilogue, rmsnorm_weight=gamma, eps=EPS, cluster_split_k=flag)
            for flag in (True, False)
        ]
    cluster, ticket = paths["random"]
    assert any(uses_cluster_split_k(c.split_k, True) for c in cluster.configs.values())
    # No global partials for the cluster path; the counters (RMSNorm words) stay.
    assert cluster.partials.numel() < ticket.partials.numel()
    assert cluster.counters.numel() == ticket.counters.numel()
    for m in SPLIT_MS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        got = _run_epilogue(cluster, epilogue, x, residual)
        want = _run_epilogue(ticket, epilogue, x, residual)
        what = f"{name} {epilogue} M={m} random"
        if epilogue in ("plain", "silu_mul"):
            _bits_equal(got[0], want[0], what + " out")
        else:
            _bits_equal(got[1], want[1], what + " residual_out")
        x = _small_integers((m, k), gen, 1, 0.25)
        residual = _small_integers((m, n), gen, 8, 1.0)
        got = _run_epilogue(paths["integer"][0], epilogue, x, residual)
        want = _run_epilogue(paths["integer"][1], epilogue, x, residual)
        torch.cuda.synchronize()
        if want[1] is not None:  # the premise: every sum of squares is exact
            assert float(want[1].float().pow(2).sum(dim=-1).max()) < 2**24
        for a, b, output in zip(got, want, ("out", "residual_out", "sums")):
            if b is not None:
                _bits_equal(a, b, f"{name} {epilogue} M={m} integer {output}")
    # The cluster path never touches the per-tile tickets.
    for prepared in (cluster, paths["integer"][0]):
        tickets = prepared.counters[: prepared.counters.numel() - NORM_COUNTERS]
        assert int(tickets.abs().sum()) == 0


# One shape per launch kind: split K at every M (kv_a), the stacked gate_up with
# silu_mul, the widest in_proj, and o_proj's residual + RMSNorm epilogue.
L2_POLICY_CASES = [
    ("mla_kv_a_proj", "plain"),
    ("shared_gate_up", "silu_mul"),
    ("kda_in_qkv_b_fa_ga", "plain"),
    ("kda_o_proj", "residual_rmsnorm"),
]


@pytest.mark.parametrize("policy", ["evict_first", "evict_last"])
@pytest.mark.parametrize("name,epilogue", L2_POLICY_CASES)
def test_weight_l2_policy_is_bit_identical(name, epilogue, policy):
    """An L2 cache policy on the weight loads changes what stays in L2, not a
    loaded value: the outputs the weights alone determine (out of plain and
    silu_mul, residual_out of the RMSNorm epilogue, whose normed out also adds
    squares with float atomics in arrival order) match the plain loads bit for
    bit at every M-bucket; the normed out is checked against the reference."""
    w = _weight(name)
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"l2/{name}/{policy}".encode()))
    gamma = _gamma(n, gen) if epilogue == "residual_rmsnorm" else None
    plain, hinted = (
        PreparedGemm(w, epilogue, rmsnorm_weight=gamma, eps=EPS, weight_l2_policy=p)
        for p in (None, policy)
    )
    for m in SPLIT_MS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        want = _run_epilogue(plain, epilogue, x, residual)
        got = _run_epilogue(hinted, epilogue, x, residual)
        torch.cuda.synchronize()
        what = f"{name} {epilogue} {policy} M={m}"
        if epilogue == "residual_rmsnorm":
            _bits_equal(got[1], want[1], what + " residual_out")
            ref, _ = _reference(epilogue, x, w, residual, gamma)
            _close(got[0], ref, what + " out")
        else:
            _bits_equal(got[0], want[0], what + " out")


@pytest.mark.parametrize("prewait_steps", [0, 3, 6])
@pytest.mark.parametrize(
    "name,epilogue", [("kda_in_qkv_b_fa_ga", "plain"), ("kda_o_proj", "residual_sumsq")]
)
def test_prewait_steps_are_bit_identical(name, epilogue, prewait_steps):
    """Loading fewer weight steps before the PDL wait moves loads, not MMAs:
    out (plain) and residual_out (residual_sumsq) match the default batches
    bit for bit at every M-bucket, plain launches and PDL-chained in a graph."""
    w = _weight(name)
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(
        zlib.crc32(f"pre/{name}/{prewait_steps}".encode())
    )
    base, moved = (PreparedGemm(w, epilogue, prewait_steps=p) for p in (None, prewait_steps))
    for m in SPLIT_MS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        want = _run_epilogue(base, epilogue, x, residual)
        what = f"{name} {epilogue} prewait {prewait_steps} M={m}"
        index = 1 if epilogue == "residual_sumsq" else 0
        for launch, label in _eager_and_chained(moved, epilogue, x, residual):
            _bits_equal(launch[index], want[index], what + label)


def _eager_and_chained(prepared, epilogue, x, residual):
    """One eager launch, then three PDL-chained in a graph replayed once: each
    launch's (out, residual_out, sums) with a label for messages."""
    eager = _run_epilogue(prepared, epilogue, x, residual)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chained = [_run_epilogue(prepared, epilogue, x, residual) for _ in range(3)]
    graph.replay()
    torch.cuda.synchronize()
    return [(eager, ""), *((launch, " (graph)") for launch in chained)]


@pytest.mark.parametrize(
    "name,epilogue,ctas,prewait",
    [("kda_in_qkv_b_fa_ga", "plain", 6, 3), ("kda_in_qkv_b_fa_ga", "plain", 4, 3),
     ("kda_in_qkv_b_fa_ga", "plain", 6, None), ("kda_o_proj", "residual_sumsq", 4, None),
     ("kda_o_proj", "residual_rmsnorm", 2, None), ("mla_kv_a_proj", "silu_mul", 8, None),
     ("kda_in_qkv_b_fa_ga", "plain", {16: 4}, 3), ("dense_gate_up", "silu_mul", {16: 4}, None)],
)  # fmt: skip
def test_launch_bounds_are_bit_identical(name, epilogue, ctas, prewait):
    """Launch bounds (``min_ctas_per_sm``) give ptxas registers, not other
    instructions: out, residual_out and the sums match the unbounded launch bit
    for bit at every M-bucket, plain launches and PDL-chained in a graph (the
    RMSNorm's normed out, whose tiles' sums meet in any order, within the
    reference's tolerance; through the grid barrier from M = 4). The KDA in_proj
    also as the executor runs it, 3 weight K-steps before its PDL wait, and
    bounds at M-bucket 16 only ({bucket: C}, the executor's for in_proj and the
    dense gate_up)."""
    w = _weight(name)
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"lb/{name}/{ctas}".encode()))
    gamma = _gamma(n, gen) if epilogue == "residual_rmsnorm" else None
    base, bounded = (
        PreparedGemm(
            w, epilogue, rmsnorm_weight=gamma, eps=EPS, prewait_steps=prewait, min_ctas_per_sm=c
        )
        for c in (None, ctas)
    )
    want = ctas if isinstance(ctas, dict) else dict.fromkeys(bounded.configs, ctas)
    assert {b: c.min_ctas_per_sm for b, c in bounded.configs.items()} == {
        b: want.get(b) for b in bounded.configs
    }
    for m in SPLIT_MS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        want = _run_epilogue(base, epilogue, x, residual)
        what = f"{name} {epilogue} min_ctas_per_sm {ctas} M={m}"
        for launch, label in _eager_and_chained(bounded, epilogue, x, residual):
            if epilogue == "residual_rmsnorm":
                _bits_equal(launch[1], want[1], what + label + " residual_out")
                ref, _ = _reference(epilogue, x, w, residual, gamma)
                _close(launch[0], ref, what + label + " out")
            elif epilogue == "residual_sumsq":
                _bits_equal(launch[1], want[1], what + label + " residual_out")
                # Tiles add their squares atomically, in any order.
                torch.testing.assert_close(
                    launch[2][:m], want[2][:m], rtol=1e-5, atol=0.0, msg=what + label + " sums"
                )
            else:
                _bits_equal(launch[0], want[0], what + label)


def test_launch_bounds_of_an_m_bucket_the_gemm_has_not_are_refused():
    with pytest.raises(ValueError, match=r"min_ctas_per_sm names M-buckets \[4\]; the GEMM's"):
        PreparedGemm(_weight("kda_o_proj"), min_ctas_per_sm={4: 4, 16: 4})


def test_launch_bounds_below_what_the_grid_barrier_needs_are_refused():
    w = _weight("kda_o_proj")
    gamma = _gamma(w.shape[0], torch.Generator(device="cuda").manual_seed(5))
    with pytest.raises(ValueError, match="min_ctas_per_sm=1 would let fewer than 2 CTAs"):
        PreparedGemm(w, "residual_rmsnorm", rmsnorm_weight=gamma, min_ctas_per_sm=1)
    # Without the grid barrier (more tiles than two an SM) any bound is taken.
    wide = _weight("wide_residual")
    gamma = _gamma(wide.shape[0], torch.Generator(device="cuda").manual_seed(5))
    assert PreparedGemm(wide, "residual_rmsnorm", rmsnorm_weight=gamma, min_ctas_per_sm=1)


# (shape, epilogue, shared-memory stages of 8 rows) of the staged weight stream:
# the decode's one-token-heavy products, ragged N and K, a long K (o_proj's 4096,
# fewer stages fit), odd stage counts (a tile's two stages in different rounds).
STAGED_CASES = [
    ("kda_in_qkv_b_fa_ga", "plain", 4),
    ("kda_in_qkv_b_fa_ga", "plain", 5),
    ("mla_q_proj", "plain", 2),
    ("shared_gate_up", "silu_mul", 4),
    ("dense_gate_up", "silu_mul", 3),
    ("kda_o_proj", "plain", 3),
    ("ragged_n", "plain", 3),
    ("ragged_n", "silu_mul", 4),
    ("ragged_k", "plain", 4),
    # Staged at 1-8 tokens, the register stream (its pre-wait steps) at 9-16.
    ("kda_in_qkv_b_fa_ga", "plain", {8: 2}),
]


@pytest.mark.parametrize("name,epilogue,stages", STAGED_CASES)
def test_staged_weight_stream_matches_fp32_reference_all_m(name, epilogue, stages, capfd):
    w = _weight(name)
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"st/{name}".encode()))
    prepared = PreparedGemm(w, epilogue, weight_stages=stages, prewait_steps=3)
    want = stages if isinstance(stages, dict) else dict.fromkeys((8, 16), stages)
    assert {b: c.weight_stages for b, c in prepared.configs.items()} == {
        b: want.get(b) for b in (8, 16)
    }
    # The pre-wait steps reach the register-stream buckets only.
    assert {b: c.prewait_steps for b, c in prepared.configs.items()} == {
        b: None if b in want else 3 for b in (8, 16)
    }
    for m in range(1, 17):
        x, out, _, _ = _inputs(epilogue, m, n, k, gen)
        prepared.run(x, out)
        ref, _ = _reference(epilogue, x, w)
        torch.cuda.synchronize()
        _close(out, ref, f"{name} {epilogue} {stages} stages M={m}")
    # The launch reserves all the shared memory the kernel lays out (CuTe DSL
    # reports a shortfall at load time; odd stage counts once fell 8 bytes short).
    printed = capfd.readouterr()
    assert "exceed available memory" not in printed.out + printed.err


@pytest.mark.parametrize(
    "name,epilogue,stages",
    [("kda_in_qkv_b_fa_ga", "plain", 4), ("shared_gate_up", "silu_mul", 5),
     ("ragged_k", "plain", 2)],
)  # fmt: skip
def test_staged_weight_stream_is_bit_identical_to_the_register_stream(name, epilogue, stages):
    """Same MMAs in the same fragment order, same warp reduction: the staged
    stream matches the register stream of as many warps bit for bit at every
    M-bucket, eager and PDL-chained in a graph (each launch refills the ring
    from scratch; graph replays re-arm nothing)."""
    w = _weight(name)
    k = w.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"stb/{name}".encode()))
    same_warps = GemmConfig(STAGED_WARPS, 1, STAGED_UNROLL)
    base = PreparedGemm(w, epilogue, config=dict.fromkeys((8, 16), same_warps))
    staged = PreparedGemm(w, epilogue, weight_stages=stages)
    assert {c.weight_stages for c in staged.configs.values()} == {stages}
    for m in SPLIT_MS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        want = _run_epilogue(base, epilogue, x, None)
        for launch, label in _eager_and_chained(staged, epilogue, x, None):
            _bits_equal(launch[0], want[0], f"{name} {stages} stages M={m}{label}")


def test_staged_weight_stream_bad_arguments_are_refused():
    w = _weight("kda_o_proj")
    gamma = _gamma(w.shape[0], torch.Generator(device="cuda").manual_seed(6))
    with pytest.raises(ValueError, match="supports the .* epilogues, not 'residual_rmsnorm'"):
        PreparedGemm(w, "residual_rmsnorm", rmsnorm_weight=gamma, weight_stages=2)
    with pytest.raises(ValueError, match="a tile takes 2 stages"):
        PreparedGemm(w, weight_stages={8: 1})
    with pytest.raises(ValueError, match=r"weight_stages names M-buckets \[4\]"):
        PreparedGemm(w, weight_stages={4: 2})
    # Four stages of 8 rows of K = 4096 do not fit one CTA's shared memory:
    # refused when the kernel is built, before any launch.
    too_deep = PreparedGemm(w, weight_stages=4)
    with pytest.raises(ValueError, match="bytes of shared memory a CTA"):
        too_deep.compile()


def test_pack_gate_up_layout():
    inter, k = 20, 16  # I not a multiple of 8: padded with zero rows
    w = torch.arange(2 * inter * k, dtype=torch.float32).reshape(2 * inter, k)
    w = w.to(torch.bfloat16)
    packed = pack_gate_up(w)
    assert packed.shape == (2 * 24, k) and packed.is_contiguous()
    for block in range(3):
        for r in range(8):
            j = block * 8 + r
            gate_row = packed[block * 16 + r]
            up_row = packed[block * 16 + 8 + r]
            if j < inter:
                assert torch.equal(gate_row, w[j]) and torch.equal(up_row, w[inter + j])
            else:
                assert not gate_row.any() and not up_row.any()
    with pytest.raises(ValueError, match="2\\*I"):
        pack_gate_up(w[:-1])


@pytest.mark.parametrize("name", ["kda_o_proj", "wide_residual"])
def test_residual_rmsnorm_chained_launches_in_a_graph(name):
    """32 launches of one binding back to back in a graph (under PDL each starts
    while the previous drains), M cycling so both RMSNorm schemes alternate,
    replayed three times: every launch matches the reference, so the tickets,
    the barrier's epoch and the double-buffered sums re-arm between chained
    launches of either scheme."""
    w = _weight(name)
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(11)
    gamma = _gamma(n, gen)
    prepared = PreparedGemm(w, "residual_rmsnorm", rmsnorm_weight=gamma, eps=EPS)
    ms = [(1, 4, 2, 8, 16, 3, 12, 5)[i % 8] for i in range(32)]

    def buffers(cols):
        return [torch.empty(m, cols, device="cuda", dtype=torch.bfloat16) for m in ms]

    xs, residuals, residual_outs, outs = buffers(k), buffers(n), buffers(n), buffers(n)

    def chain():
        for x, res, res_out, out in zip(xs, residuals, residual_outs, outs):
            prepared.run(x, out, residual=res, residual_out=res_out)

    prepared.compile()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for replay in range(3):
        for t in xs + residuals:
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
        for t in outs + residual_outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, m in enumerate(ms):
            ref, ref_hidden = _reference("residual_rmsnorm", xs[i], w, residuals[i], gamma)
            what = f"{name} replay {replay} launch {i} M={m}"
            _close(residual_outs[i], ref_hidden, what + " residual_out")
            _close(outs[i], ref, what + " normed")


def test_rmsnorm_barrier_time_out_falls_back_to_the_last_tile_pass():
    """With no polls allowed the waiting tiles abandon the barrier at once and the
    last tile normalises every row (what a grid that cannot be resident at once,
    e.g. an MPS client on part of the SMs, does instead of hanging): results equal
    the reference, eager and chained in a graph, and the workspace re-arms."""
    w = _weight("kda_o_proj")
    n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(13)
    gamma = _gamma(n, gen)
    prepared = PreparedGemm(
        w, "residual_rmsnorm", rmsnorm_weight=gamma, eps=EPS, barrier_max_polls=0
    )
    assert prepared.norm_by_every_tile(4)
    launches = (4, 16, 1, 8, 5)
    for m in launches:
        x, out, residual, _ = _inputs("residual_rmsnorm", m, n, k, gen)
        ref, ref_hidden = _reference("residual_rmsnorm", x, w, residual, gamma)
        residual_out = torch.full_like(residual, float("nan"))
        prepared.run(x, out, residual=residual, residual_out=residual_out)
        torch.cuda.synchronize()
        _close(residual_out, ref_hidden, f"time-out residual_out M={m}")
        _close(out, ref, f"time-out normed M={m}")
    counters = prepared.counters.clone()
    epoch_index = counters.numel() - NORM_COUNTERS + BARRIER_EPOCH
    epoch = int(counters[epoch_index])
    counters[epoch_index] = 0
    assert int(counters.abs().sum()) == 0
    # The abandoned flag is cleared when the last tile opens the barrier.
    assert epoch == sum(prepared.norm_by_every_tile(m) for m in launches)
    assert float(prepared.sumsq.view(2, 16)[epoch % 2].abs().sum()) == 0.0

    m = 8
    xs = [torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(8)]
    res = [torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(8)]
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    res_outs = [torch.empty_like(r) for r in res]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in zip(xs, outs, res, res_outs):
            prepared.run(*args)
    for replay in range(2):
        for t in outs + res_outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(8):
            ref, ref_hidden = _reference("residual_rmsnorm", xs[i], w, res[i], gamma)
            _close(res_outs[i], ref_hidden, f"time-out graph {replay}/{i} residual_out")
            _close(outs[i], ref, f"time-out graph {replay}/{i} normed")


@pytest.mark.parametrize("cluster_split_k", [True, False], ids=["cluster", "ticket"])
@pytest.mark.parametrize("use_pdl", [True, False], ids=["pdl", "no_pdl"])
def test_graph_capture_and_replay(use_pdl, cluster_split_k):
    """Three launches captured once, replayed with fresh inputs each time; kv_a
    and o_proj split K across CTAs (through a cluster or the tickets)."""
    gen = torch.Generator(device="cuda").manual_seed(99)
    w_kv = _weight("mla_kv_a_proj").clone()
    w_gu = _weight("shared_gate_up").clone()
    w_o = _weight("kda_o_proj").clone()
    gamma = (1 + 0.1 * torch.randn(w_o.shape[0], device="cuda", generator=gen)).to(torch.bfloat16)
    flags = dict(use_pdl=use_pdl, cluster_split_k=cluster_split_k)
    p_kv = PreparedGemm(w_kv, **flags)
    p_gu = PreparedGemm(w_gu, "silu_mul", **flags)
    p_o = PreparedGemm(w_o, "residual_rmsnorm", rmsnorm_weight=gamma, eps=EPS, **flags)
    for p in (p_kv, p_o):
        assert uses_cluster_split_k(p.configs[8].split_k, True), p.configs
    m = 3
    x_kv = torch.empty(m, w_kv.shape[1], device="cuda", dtype=torch.bfloat16)
    x_gu = torch.empty(m, w_gu.shape[1], device="cuda", dtype=torch.bfloat16)
    x_o = torch.empty(m, w_o.shape[1], device="cuda", dtype=torch.bfloat16)
    res = torch.empty(m, w_o.shape[0], device="cuda", dtype=torch.bfloat16)
    y_kv = torch.empty(m, w_kv.shape[0], device="cuda", dtype=torch.bfloat16)
    y_gu = torch.empty(m, w_gu.shape[0] // 2, device="cuda", dtype=torch.bfloat16)
    y_o = torch.empty(m, w_o.shape[0], device="cuda", dtype=torch.bfloat16)
    res_out = torch.empty_like(res)
    for t in (x_kv, x_gu, x_o, res):
        t.normal_()

    def step():
        p_kv.run(x_kv, y_kv)
        p_gu.run(x_gu, y_gu)
        p_o.run(x_o, y_o, residual=res, residual_out=res_out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(4):
        for t in (x_kv, x_gu, x_o, res):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
        for t in (y_kv, y_gu, y_o, res_out):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _close(y_kv, _reference("plain", x_kv, w_kv)[0], f"replay {replay} kv_a")
        _close(y_gu, _reference("silu_mul", x_gu, w_gu)[0], f"replay {replay} gate_up")
        ref, ref_hidden = _reference("residual_rmsnorm", x_o, w_o, res, gamma)
        _close(res_out, ref_hidden, f"replay {replay} residual_out")
        _close(y_o, ref, f"replay {replay} normed")


def _bad_input_cases():
    return [
        ("x fp16", lambda x, o: (x.half(), o), TypeError, "bfloat16"),
        (
            "x non-contiguous",
            lambda x, o: (x.t().contiguous().t(), o),
            ValueError,
            "contiguous",
        ),
        (
            "K mismatch",
            lambda x, o: (x[:, :-8].contiguous(), o),
            ValueError,
            "K mismatch",
        ),
        (
            "M > 16",
            lambda x, o: (
                x.repeat(5, 1)[:17].contiguous(),
                o.repeat(5, 1)[:17].contiguous(),
            ),
            ValueError,
            "M=17",
        ),
        ("M = 0", lambda x, o: (x[:0], o[:0]), ValueError, "M=0"),
        (
            "out wrong shape",
            lambda x, o: (x, o[:, :-1].contiguous()),
            ValueError,
            "out must have shape",
        ),
        ("x on cpu", lambda x, o: (x.cpu(), o), ValueError, "is on cpu"),
    ]


@pytest.mark.parametrize("case", _bad_input_cases(), ids=lambda c: c[0])
def test_bad_input_raises_before_launch(case):
    _, mutate, exc, match = case
    w = _weight("mla_kv_a_proj")
    prepared = PreparedGemm(w)
    x = torch.randn(4, w.shape[1], device="cuda").to(torch.bfloat16)
    out = torch.zeros(4, w.shape[0], device="cuda", dtype=torch.bfloat16)
    bad_x, bad_out = mutate(x, out)
    sentinel = bad_out.clone()
    with pytest.raises(exc, match=match):
        prepared.run(bad_x, bad_out)
    torch.cuda.synchronize()
    assert torch.equal(bad_out, sentinel), "output touched although the input was refused"


def test_bad_weight_and_epilogue_arguments():
    w = _weight("mla_kv_a_proj")
    with pytest.raises(TypeError, match="bfloat16"):
        PreparedGemm(w.float())
    with pytest.raises(ValueError, match="contiguous"):
        PreparedGemm(w.t())
    with pytest.raises(ValueError, match="multiple of 8"):
        PreparedGemm(w[:, :-4].contiguous())
    with pytest.raises(ValueError, match="unknown epilogue"):
        PreparedGemm(w, "gelu")
    with pytest.raises(ValueError, match="needs rmsnorm_weight"):
        PreparedGemm(w, "residual_rmsnorm")
    prepared = PreparedGemm(
        w,
        "residual_rmsnorm",
        rmsnorm_weight=torch.ones(w.shape[0], device="cuda", dtype=torch.bfloat16),
    )
    x = torch.randn(2, w.shape[1], device="cuda").to(torch.bfloat16)
    out = torch.empty(2, w.shape[0], device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs residual and residual_out"):
        prepared.run(x, out)


# ----------------------------------------------------------------- row groups
# MLA's per-head absorptions of Kimi-Linear (32 heads, P = 128, V = 128, L = 512).
HEADS, NOPE, ROPE, V_HEAD, LORA = 32, 128, 64, 128, 512
Q_ROW = HEADS * (NOPE + ROPE) + LORA + ROPE  # the fused q_proj | kv_a_proj row


def _grouped_case(name, gen):
    """(weight [G, R, K], x maker) as the executor passes them."""
    if name == "w_uv":
        # W_UV^T rows in place: rows h*(P+V)+P .. of kv_b_proj.weight [N*(P+V), L].
        kv_b = (torch.randn(HEADS * (NOPE + V_HEAD), LORA, device="cuda", generator=gen)
                / LORA**0.5).to(torch.bfloat16)  # fmt: skip
        weight = kv_b.view(HEADS, NOPE + V_HEAD, LORA)[:, NOPE:, :]

        def x_of(m):  # the attention output [M, N, L]
            return torch.randn(m, HEADS, LORA, device="cuda", generator=gen).to(torch.bfloat16)

    else:
        # W_UK as [N, L, P] (copied once); x = q_nope, strided inside the q rows.
        weight = (torch.randn(HEADS, LORA, NOPE, device="cuda", generator=gen)
                  / NOPE**0.5).to(torch.bfloat16)  # fmt: skip

        def x_of(m):
            rows = torch.randn(m, Q_ROW, device="cuda", generator=gen).to(torch.bfloat16)
            return rows[:, : HEADS * (NOPE + ROPE)].view(m, HEADS, NOPE + ROPE)[..., :NOPE]

    return weight, x_of


def _grouped_reference(x, weight):
    return torch.einsum("mgk,grk->mgr", x.float(), weight.float()).reshape(x.shape[0], -1)


@pytest.mark.parametrize("name", ["w_uv", "w_uk"])
def test_row_groups_match_fp32_reference_all_m(name):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    weight, x_of = _grouped_case(name, gen)
    prepared = PreparedGroupedGemm(weight)
    groups, rows, _ = weight.shape
    for m in range(1, 17):
        x = x_of(m)
        out = torch.full((m, groups * rows), float("nan"), device="cuda", dtype=torch.bfloat16)
        prepared.run(x, out)
        torch.cuda.synchronize()
        _close(out, _grouped_reference(x, weight), f"{name} M={m}")


def test_row_groups_graph_replay_and_split_k_are_bit_identical():
    """100 replays of a captured launch equal the eager result bit for bit, and a
    grid split-K configuration gives the same values (fixed summation order)."""
    from kernels.gemm.prepared import GemmConfig

    gen = torch.Generator(device="cuda").manual_seed(3)
    weight, x_of = _grouped_case("w_uv", gen)
    x = x_of(5)
    eager = torch.empty(5, HEADS * V_HEAD, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedGroupedGemm(weight)
    prepared.run(x, eager)
    split = PreparedGroupedGemm(weight, config={8: GemmConfig(2, 2, 8), 16: GemmConfig(2, 2, 6)})
    split_out = torch.empty_like(eager)
    split.run(x, split_out)
    torch.cuda.synchronize()
    _close(split_out, _grouped_reference(x, weight), "split-K")
    out = torch.full_like(eager, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prepared.run(x, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared.run(x, out)
    out.fill_(float("nan"))
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


def test_row_groups_bad_input_raises_before_launch():
    gen = torch.Generator(device="cuda").manual_seed(4)
    weight, x_of = _grouped_case("w_uk", gen)
    prepared = PreparedGroupedGemm(weight)
    x = x_of(2)
    out = torch.full((2, HEADS * LORA), float("nan"), device="cuda", dtype=torch.bfloat16)
    odd = torch.zeros(2, HEADS * 100 + 64, device="cuda", dtype=torch.bfloat16)
    cases = [
        (x.reshape(2, -1), ValueError, "3-D"),
        (x[:, :16], ValueError, "must be \\[M, 32, 128\\]"),
        (x.float(), TypeError, "bfloat16"),
        # Groups 100 elements apart at a 4-byte offset: not 16-byte loads.
        (odd[:, 2:].as_strided((2, HEADS, NOPE), (HEADS * 100 + 64, 100, 1)), ValueError,
         "16-byte aligned"),
    ]  # fmt: skip
    for bad, exc, match in cases:
        with pytest.raises(exc, match=match):
            prepared.run(bad, out)
    with pytest.raises(ValueError, match="out must have shape"):
        prepared.run(x, out[:, :-8])
    with pytest.raises(ValueError, match="M=17"):
        prepared.run(x_of(17), out)
    torch.cuda.synchronize()
    assert out.isnan().all(), "output touched although the input was refused"
    with pytest.raises(ValueError, match="contiguous rows"):
        PreparedGroupedGemm(weight.transpose(1, 2))
    with pytest.raises(ValueError, match="multiple of 16"):
        PreparedGroupedGemm(weight[:, :40])
    with pytest.raises(TypeError, match="bfloat16"):
        PreparedGroupedGemm(weight.float())

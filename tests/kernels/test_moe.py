# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small-batch CuTe DSL MoE (kernels/moe) against a pure-torch FP32 reference.

Kimi-Linear-48B-A3B shape (256 experts, top-8, H = 2304, I = 1024, one shared
expert), M = 1..16, random and adversarial routing.  Needs an SM90 GPU and
nvidia-cutlass-dsl; skips with the reason otherwise.

Routing is checked exactly: the kernel's bf16 logits must equal the FP64
logits rounded to bf16 up to one bf16 ulp plus the FP32 accumulation error,
and the expert ids (in choice order) must equal the reference top-k computed
from the kernel's own logits; the weights to 1e-5 relative.  The router
gathers its logits either through a thread-block cluster (the default, kept
in shared memory) or through global memory and a ticket; the key routing
tests run both, and both must give the same table, weights and outputs bit
for bit.

Output tolerances (bf16 output; the kernel rounds the SiLU*up intermediate to
bf16 as vLLM's fused_moe does, the reference keeps FP32):
  * elementwise |got - ref| <= ATOL + RTOL * |ref|, ATOL = RTOL = 3e-2
    (outputs are O(1); bf16 output rounding is 2^-9 relative);
  * normwise ||got - ref|| / ||ref|| <= 8e-3 (bf16 operands + one bf16
    intermediate land at ~3e-3).
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the MoE kernels run on SM90 only", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip(f"needs an SM90 GPU, found {torch.cuda.get_device_name()}", allow_module_level=True)

from moe_reference import moe_reference, router_logits, select_experts  # noqa: E402

from kernels.moe.kernel import MoeGateUpEarlySharedDownKernel  # noqa: E402
from kernels.moe.prepared import (  # noqa: E402
    M_BUCKETS,
    ROUTER_CLUSTER_MAX_BUCKET,
    MoeConfig,
    PreparedMoe,
    m_bucket_for,
)

pytestmark = pytest.mark.gpu

HIDDEN, INTER, EXPERTS, TOP_K, SCALE = 2304, 1024, 256, 8, 2.446
ATOL = RTOL = 3e-2
NORM_RTOL = 8e-3
EPS = 1e-5
ONE_SET = [5, 40, 77, 100, 128, 200, 254, 255]
# The "cluster" cases take the cluster path at every M-bucket (the default stops
# at ROUTER_CLUSTER_MAX_BUCKET, whose runs the other tests' defaults cover).
ALL_BUCKETS = max(M_BUCKETS)
# The router's logits through a cluster (PreparedMoe's router_cluster) or
# through global memory and an atomic ticket.
ROUTER_PATHS = pytest.mark.parametrize("router_cluster", [True, False], ids=["cluster", "ticket"])


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, std):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(bf16)

    return {
        "w13": randn(EXPERTS, 2 * INTER, HIDDEN, std=HIDDEN**-0.5),
        "w2": randn(EXPERTS, HIDDEN, INTER, std=INTER**-0.5),
        "shared_gate_up": randn(2 * INTER, HIDDEN, std=HIDDEN**-0.5),
        "shared_down": randn(HIDDEN, INTER, std=INTER**-0.5),
        "gamma": (1.0 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).to(bf16),
        "input_gamma": (1.0 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).to(bf16),
    }


def _routing_case(regime: str, m: int, seed: int):
    """(x [m, H], gate [E, H], bias [E]) for a routing regime."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(m, HIDDEN, generator=g, device=dev).to(bf16)
    bias = torch.zeros(EXPERTS, device=dev)
    if regime == "random":
        gate = torch.randn(EXPERTS, HIDDEN, generator=g, device=dev) * HIDDEN**-0.5
        bias = 0.1 * torch.randn(EXPERTS, generator=g, device=dev)
    elif regime == "balanced":  # bench_moe's: logits ~ N(0, 1), no bias
        gate = torch.randn(EXPERTS, HIDDEN, generator=g, device=dev) * HIDDEN**-0.5
    elif regime == "dummy":  # vLLM's dummy loader: U(-1e-3, 1e-3) everywhere
        gate = (torch.rand(EXPERTS, HIDDEN, generator=g, device=dev) - 0.5) * 2e-3
        bias = (torch.rand(EXPERTS, generator=g, device=dev) - 0.5) * 2e-3
    elif regime == "one_set":  # every token on the same 8 experts
        gate = torch.randn(EXPERTS, HIDDEN, generator=g, device=dev) * HIDDEN**-0.5
        bias[ONE_SET] = 10.0
    elif regime == "distinct":  # token t on experts 8t..8t+7: 8m distinct
        x = torch.zeros(m, HIDDEN, device=dev)
        x[torch.arange(m), torch.arange(m)] = 8.0
        x = x.to(bf16)
        gate = torch.zeros(EXPERTS, HIDDEN, device=dev)
        gate[torch.arange(EXPERTS), torch.arange(EXPERTS) // TOP_K] = 1.0
    elif regime == "signed":  # biased scores of both signs, many near zero
        gate = torch.randn(EXPERTS, HIDDEN, generator=g, device=dev) * HIDDEN**-0.5
        bias = -0.5 + 0.3 * torch.randn(EXPERTS, generator=g, device=dev)
    elif regime == "ties":  # every score equal: experts 0..7 for every token
        gate = torch.zeros(EXPERTS, HIDDEN, device=dev)
    elif regime == "bias_ties":  # 64 experts share the best biased score
        gate = torch.zeros(EXPERTS, HIDDEN, device=dev)
        bias = (torch.arange(EXPERTS, device=dev) % 4).float() * 0.1
    else:
        raise AssertionError(regime)
    return x, gate.to(bf16).contiguous(), bias


def _prepare(experts, gate, bias, fused=False, router_cluster=True):
    moe = PreparedMoe(
        gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
        experts["shared_down"], TOP_K, SCALE,
        rmsnorm_weight=experts["gamma"] if fused else None, eps=EPS,
        router_cluster=router_cluster, router_cluster_max_bucket=ALL_BUCKETS,
    )  # fmt: skip
    assert moe.router_cluster == router_cluster  # 16 tiles, K not split
    return moe


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str):
    got, ref = got.float(), ref.float()
    err = (got - ref).abs()
    bound = ATOL + RTOL * ref.abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: max excess over tolerance {worst:.3e}"
    norm = (err.norm() / ref.norm()).item()
    assert norm <= NORM_RTOL, f"{what}: normwise error {norm:.3e} > {NORM_RTOL}"


def _kernel_logits(moe: PreparedMoe, x, m):
    """The router's bf16-rounded logits [m, E] of the last run on ``x``.

    The ticket path leaves them in ``moe.logits``.  The cluster path (M-buckets
    up to ROUTER_CLUSTER_MAX_BUCKET) keeps them in shared memory only, so they
    are taken from a ticket-path twin on the same x and gate weight: the same
    MMAs and rounding, hence the same bits (the twin's routing is compared with
    the cluster's bit for bit in test_router_paths_are_bit_identical)."""
    if not moe.router_cluster_for(m):
        return moe.logits[: m * EXPERTS].view(m, EXPERTS)
    twin = PreparedMoe(
        moe.gate_weight, moe.bias, moe.w13, moe.w2, moe.shared_gate_up,
        moe.shared_down, moe.top_k, moe.scale, moe.renormalize, router_cluster=False,
    )  # fmt: skip
    twin.run(x, torch.empty_like(x))
    torch.cuda.synchronize()
    return twin.logits[: m * EXPERTS].view(m, EXPERTS)


def _check_routing(moe: PreparedMoe, x, gate, bias, m):
    """Kernel logits vs FP64 within 1 bf16 ulp; ids exact; weights 1e-5."""
    got_logits = _kernel_logits(moe, x, m)
    ref_logits = router_logits(x, gate)
    # One bf16 ulp of the value, plus the FP32 accumulation error of a
    # K = 2304 dot product (~sqrt(K) * 2^-24 of the sum of |terms|, taken
    # with 8x margin): near-cancelling logits may round to a neighbour.
    terms = x.abs().double() @ gate.abs().double().T
    bound = torch.finfo(torch.bfloat16).eps * ref_logits.abs() + 8 * 48 * 2**-24 * terms
    excess = ((got_logits - ref_logits).abs() - bound.float()).max().item()
    assert excess <= 0, f"router logits off by more than 1 ulp + FP32 error ({excess:.2e})"
    ids, weights = moe.routing(m)
    ref_ids, ref_weights = select_experts(got_logits, bias, TOP_K, SCALE)
    assert torch.equal(ids, ref_ids.cpu()), f"expert ids differ:\n{ids}\n{ref_ids}"
    torch.testing.assert_close(weights, ref_weights.cpu(), rtol=1e-5, atol=1e-7)
    assert moe.distinct_experts() == ref_ids.unique().numel()
    return ref_ids, ref_weights


def _check_fused_output(experts, x, ids, weights, residual, residual_out, out):
    """residual_out and the normed output of a fused-RMSNorm MoE run against
    the fp32 reference on the same x, routing and residual."""
    w = experts
    normed, hidden = moe_reference(
        x, ids, weights, w["w13"], w["w2"], w["shared_gate_up"], w["shared_down"],
        residual, w["gamma"], EPS,
    )  # fmt: skip
    _assert_close(residual_out, hidden, "residual_out")
    _assert_close(out, normed, "normed output")


def _run_and_check(experts, regime, m, seed, fused=False, router_cluster=True):
    x, gate, bias = _routing_case(regime, m, seed)
    moe = _prepare(experts, gate, bias, fused, router_cluster)
    out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
    if fused:
        residual = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
        residual_out = torch.empty_like(residual)
        moe.run(x, out, residual, residual_out)
    else:
        moe.run(x, out)
    torch.cuda.synchronize()
    ids, weights = _check_routing(moe, x, gate, bias, m)
    w = experts
    if fused:
        _check_fused_output(experts, x, ids, weights, residual, residual_out, out)
    else:
        ref = moe_reference(
            x, ids, weights, w["w13"], w["w2"], w["shared_gate_up"], w["shared_down"]
        )
        _assert_close(out, ref, "moe output")
    return ids


@ROUTER_PATHS
@pytest.mark.parametrize("m", range(1, 17))
def test_random_routing(experts, m, router_cluster):
    _run_and_check(experts, "random", m, seed=m, router_cluster=router_cluster)


@ROUTER_PATHS
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_dummy_loader_routing(experts, m, router_cluster):
    _run_and_check(experts, "dummy", m, seed=100 + m, router_cluster=router_cluster)


@ROUTER_PATHS
@pytest.mark.parametrize("m", [1, 7, 16])
def test_negative_biased_scores(experts, m, router_cluster):
    # top-k compares integer keys of the biased scores: negative ones must
    # order as the floats do.
    x, gate, bias = _routing_case("signed", m, seed=150 + m)
    biased = torch.sigmoid(router_logits(x, gate).float()) + bias
    assert (biased < 0).any() and (biased > 0).any()
    _run_and_check(experts, "signed", m, seed=150 + m, router_cluster=router_cluster)


@pytest.mark.parametrize("m", [1, 16])
def test_all_tokens_on_one_expert_set(experts, m):
    ids = _run_and_check(experts, "one_set", m, seed=200 + m)
    assert sorted(ids.unique().tolist()) == ONE_SET


@pytest.mark.parametrize("m", [2, 9, 16])
def test_all_tokens_on_distinct_experts(experts, m):
    ids = _run_and_check(experts, "distinct", m, seed=300 + m)
    assert ids.unique().numel() == TOP_K * m


@ROUTER_PATHS
@pytest.mark.parametrize("m", [1, 16])
def test_ties_go_to_lower_expert_ids(experts, m, router_cluster):
    ids = _run_and_check(experts, "ties", m, seed=400 + m, router_cluster=router_cluster)
    assert (ids.cpu() == torch.arange(TOP_K)).all()
    ids = _run_and_check(experts, "bias_ties", m, seed=500 + m, router_cluster=router_cluster)
    assert (ids.cpu() == torch.arange(3, 4 * TOP_K, 4)).all()


@pytest.mark.parametrize("m", [1, 5, 16])
def test_fused_residual_rmsnorm(experts, m):
    _run_and_check(experts, "random", m, seed=600 + m, fused=True)


@ROUTER_PATHS
@pytest.mark.parametrize("m", [1, 16])
def test_graph_replays_are_bit_identical(experts, m, router_cluster):
    x, gate, bias = _routing_case("random", m, seed=700 + m)
    moe = _prepare(experts, gate, bias, fused=True, router_cluster=router_cluster)
    out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
    residual_out = torch.empty_like(residual)
    moe.run(x, out, residual, residual_out)  # compile + warm up outside the graph
    torch.cuda.synchronize()
    first_out, first_res = out.clone(), residual_out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.run(x, out, residual, residual_out)
    for i in range(300):
        out.zero_()
        residual_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first_out), f"replay {i}: output changed"
        assert torch.equal(residual_out, first_res), f"replay {i}: residual changed"


def _prepare_input_norm(experts, gate, bias, router_cluster=True):
    moe = PreparedMoe(
        gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
        experts["shared_down"], TOP_K, SCALE, rmsnorm_weight=experts["gamma"],
        eps=EPS, input_norm_weight=experts["input_gamma"], input_eps=EPS,
        router_cluster=router_cluster, router_cluster_max_bucket=ALL_BUCKETS,
    )  # fmt: skip
    assert moe.router_cluster == router_cluster
    return moe


def _normed_reference(residual, gamma):
    """RMSNorm rounded as the kernels round it: bf16 after the scale, then
    after gamma (vLLM's rms_norm does the same)."""
    r = residual.float()
    rstd = torch.rsqrt(r.pow(2).sum(dim=-1, keepdim=True) / HIDDEN + EPS)
    return ((r * rstd).to(torch.bfloat16).float() * gamma.float()).to(torch.bfloat16)


def _assert_within_one_bf16_ulp(got, ref, what):
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(2**-20)
    excess = ((got.float() - ref.float()).abs() - ulp).max().item()
    assert excess <= 0, f"{what}: off by more than one bf16 ulp ({excess:.2e})"


@ROUTER_PATHS
@pytest.mark.parametrize("m", [1, 5, 8, 16])
def test_router_normalises_the_residual_itself(experts, m, router_cluster):
    """input_norm: the router reads the residual and the producer's sums of
    squares, writes x = rmsnorm(residual) * gamma (one bf16 ulp of the
    reference; the rsqrt is the hardware's), routes on it, and re-arms the
    sums; the block's output matches the reference from that x."""
    _, gate, bias = _routing_case("random", m, seed=900 + m)
    moe = _prepare_input_norm(experts, gate, bias, router_cluster)
    g = torch.Generator(device="cuda").manual_seed(950 + m)
    residual = (2 * torch.randn(m, HIDDEN, generator=g, device="cuda")).to(torch.bfloat16)
    moe.input_sums[:m] = residual.float().pow(2).sum(dim=-1)
    x = torch.full_like(residual, float("nan"))
    out = torch.empty_like(residual)
    residual_out = torch.empty_like(residual)
    moe.run(x, out, residual, residual_out)
    torch.cuda.synchronize()
    _assert_within_one_bf16_ulp(x, _normed_reference(residual, experts["input_gamma"]), "x")
    assert float(moe.input_sums.abs().sum()) == 0.0, "sums not re-armed"
    ids, weights = _check_routing(moe, x, gate, bias, m)
    _check_fused_output(experts, x, ids, weights, residual, residual_out, out)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_residual_sumsq_then_router_norm_equals_the_gemm_norm(experts, m):
    """The seam as the executor runs it: o_proj (2304 x 4096) with
    residual_sumsq into the MoE's input_sums, then the MoE normalising, against
    o_proj with the residual + RMSNorm epilogue and the MoE on its output."""
    from kernels.gemm.prepared import PreparedGemm

    _, gate, bias = _routing_case("random", m, seed=1000 + m)
    g = torch.Generator(device="cuda").manual_seed(1050 + m)
    bf16 = torch.bfloat16
    w_o = (torch.randn(HIDDEN, 4096, generator=g, device="cuda") / 64).to(bf16)
    attn = torch.randn(m, 4096, generator=g, device="cuda").to(bf16)
    residual = torch.randn(m, HIDDEN, generator=g, device="cuda").to(bf16)

    o_sums = PreparedGemm(w_o, "residual_sumsq")
    moe_norm = _prepare_input_norm(experts, gate, bias)
    res_a, x_a, out_a, res_out_a = (torch.empty_like(residual) for _ in range(4))
    o_sums.run(attn, None, residual, res_a, sums=moe_norm.input_sums)
    moe_norm.run(x_a, out_a, res_a, res_out_a)

    o_norm = PreparedGemm(w_o, "residual_rmsnorm", rmsnorm_weight=experts["input_gamma"])
    moe = _prepare(experts, gate, bias, fused=True)
    res_b, x_b, out_b, res_out_b = (torch.empty_like(residual) for _ in range(4))
    o_norm.run(attn, x_b, residual, res_b)
    moe.run(x_b, out_b, res_b, res_out_b)
    torch.cuda.synchronize()
    assert torch.equal(res_a, res_b), "o_proj's residual differs between epilogues"
    # Same formula; only the order of the atomically added sums may differ.
    _assert_within_one_bf16_ulp(x_a, x_b, "normed x")
    _assert_close(out_a, out_b, "output")
    _assert_close(res_out_a, res_out_b, "residual_out")


@ROUTER_PATHS
@pytest.mark.parametrize("m", [1, 16])
def test_input_norm_graph_replays_are_bit_identical(experts, m, router_cluster):
    _, gate, bias = _routing_case("random", m, seed=1100 + m)
    moe = _prepare_input_norm(experts, gate, bias, router_cluster)
    g = torch.Generator(device="cuda").manual_seed(1150 + m)
    residual = torch.randn(m, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    sums = residual.float().pow(2).sum(dim=-1)
    x, out, residual_out = (torch.empty_like(residual) for _ in range(3))

    def step():
        moe.input_sums[:m].copy_(sums)  # what the producing GEMM adds
        moe.run(x, out, residual, residual_out)

    step()  # compile + warm up outside the graph
    torch.cuda.synchronize()
    first = (x.clone(), out.clone(), residual_out.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(300):
        for t in (x, out, residual_out):
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, want, what in zip((x, out, residual_out), first, ("x", "out", "residual")):
            assert torch.equal(got, want), f"replay {i}: {what} changed"


def _bits_equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert not got.isnan().any(), f"{what}: NaN (unwritten output?)"
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(got.dtype)
    a, b = (got, want) if bits is None else (got.view(bits), want.view(bits))
    assert torch.equal(a, b), f"{what}: {int((got != want).sum())} elements differ"


def _bit_identity_case(regime: str, m: int, base_seed: int):
    """(x, gate, bias, residual [m, H]) of one bit-identity comparison."""
    seed = base_seed + 10 * m + (regime == "balanced")
    x, gate, bias = _routing_case(regime, m, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    residual = torch.randn(m, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    return x, gate, bias, residual


@pytest.mark.parametrize("input_norm", [False, True], ids=["plain", "input_norm"])
@pytest.mark.parametrize("regime", ["dummy", "balanced"])
@pytest.mark.parametrize("m", M_BUCKETS)
def test_router_paths_are_bit_identical(experts, m, regime, input_norm):
    """The cluster path (logits in tile 0's shared memory) and the ticket path
    (global logits, atomic ticket) route from the same bf16 logits with the
    same code: the same table, route weights, normalised x and MoE output bit
    for bit.  The cluster path never touches the ticket counters."""
    x, gate, bias, residual = _bit_identity_case(regime, m, 1200)
    results = {}
    for router_cluster in (True, False):
        if input_norm:
            moe = _prepare_input_norm(experts, gate, bias, router_cluster)
            moe.input_sums[:m] = residual.float().pow(2).sum(dim=-1)
            x = torch.full_like(residual, float("nan"))
        else:
            moe = _prepare(experts, gate, bias, router_cluster=router_cluster)
        assert moe.router_cluster_for(m) == router_cluster
        out = torch.full((m, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
        if input_norm:
            residual_out = torch.full_like(out, float("nan"))
            moe.run(x, out, residual, residual_out)
        else:
            residual_out = None
            moe.run(x, out)
        torch.cuda.synchronize()
        if input_norm:
            assert float(moe.input_sums.abs().sum()) == 0.0, "sums not re-armed"
        assert int(moe.counters.abs().sum()) == 0
        results[router_cluster] = {
            "table": moe.table.clone(),
            "route_weights": moe.route_weights[: m * TOP_K].clone(),
            "x": x.clone(),
            "out": out,
            "residual_out": residual_out,
        }
    cluster, ticket = results[True], results[False]
    for what in ("table", "route_weights", "x", "out", "residual_out"):
        if ticket[what] is not None:
            _bits_equal(cluster[what], ticket[what], f"{regime} M={m} {what}")


@pytest.mark.parametrize("input_norm", [False, True], ids=["plain", "input_norm"])
@ROUTER_PATHS
@pytest.mark.parametrize("regime", ["dummy", "balanced", "random", "ties", "bias_ties"])
def test_router_warp_table_is_bit_identical(experts, regime, router_cluster, input_norm):
    """``MoeConfig(router_warp_table=True)`` (the default): at M = 1 the top-k
    warp writes the routing table (its k experts ranked by id in registers)
    instead of the CTA-wide pass: the same whole table, route weights, normalised x and
    outputs bit for bit, run after run on one prepared block (three tokens in
    turn: every run rewrites what the next reads).  M-bucket 2 keeps the CTA
    pass."""
    _, gate, bias = _routing_case(regime, 1, seed=2000)
    g = torch.Generator(device="cuda").manual_seed(2050)
    rows = [torch.randn(1, HIDDEN, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)]
    blocks = {}
    for warp_table in (False, True):
        config = MoeConfig(router_warp_table=warp_table)
        blocks[warp_table] = PreparedMoe(
            gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
            experts["shared_down"], TOP_K, SCALE, rmsnorm_weight=experts["gamma"], eps=EPS,
            input_norm_weight=experts["input_gamma"] if input_norm else None, input_eps=EPS,
            router_cluster=router_cluster, router_cluster_max_bucket=ALL_BUCKETS, config=config,
        )  # fmt: skip
    assert blocks[True]._kernels(1)[0].warp_table and not blocks[True]._kernels(2)[0].warp_table
    assert not blocks[False]._kernels(1)[0].warp_table
    for n, row in enumerate(rows):
        results = {}
        for warp_table, moe in blocks.items():
            residual = row
            x = torch.full_like(row, float("nan")) if input_norm else row.clone()
            if input_norm:
                moe.input_sums[:1] = residual.float().pow(2).sum(dim=-1)
            out = torch.full_like(row, float("nan"))
            residual_out = torch.full_like(row, float("nan"))
            moe.run(x, out, residual, residual_out)
            torch.cuda.synchronize()
            assert int(moe.counters.abs().sum()) == 0
            results[warp_table] = {
                "table": moe.table.clone(),
                "route_weights": moe.route_weights[:TOP_K].clone(),
                "x": x,
                "out": out,
                "residual_out": residual_out,
            }
        for what, want in results[False].items():
            _bits_equal(results[True][what], want, f"{regime} run {n} {what}")
    ids, weights = _check_routing(blocks[True], x, gate, bias, 1)
    _check_fused_output(experts, x, ids, weights, residual, residual_out, out)


@pytest.mark.parametrize("policy", ["evict_first", "evict_last"])
@pytest.mark.parametrize("regime", ["dummy", "balanced"])
def test_expert_weight_l2_policy_is_bit_identical(experts, regime, policy):
    """An L2 cache policy on the expert weight loads (evict_first: the
    executor's default at M-buckets 1-4, VLLM_HD_EXPERT_L2_POLICY) changes what
    stays in L2, not a loaded value: the same table, route weights and output
    bit for bit as the plain loads, at every M-bucket and with the fused
    residual + RMSNorm epilogue."""
    for m in M_BUCKETS:
        x, gate, bias, residual = _bit_identity_case(regime, m, 1500)
        results = {}
        for l2_policy in (None, policy):
            moe = PreparedMoe(
                gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
                experts["shared_down"], TOP_K, SCALE, rmsnorm_weight=experts["gamma"],
                eps=EPS, expert_weight_l2_policy=l2_policy,
            )  # fmt: skip
            out = torch.full((m, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
            residual_out = torch.full_like(out, float("nan"))
            moe.run(x, out, residual, residual_out)
            torch.cuda.synchronize()
            results[l2_policy] = {
                "table": moe.table.clone(),
                "route_weights": moe.route_weights[: m * TOP_K].clone(),
                "out": out,
                "residual_out": residual_out,
            }
        for what, want in results[None].items():
            _bits_equal(results[policy][what], want, f"{regime} {policy} M={m} {what}")


@pytest.mark.parametrize(
    "fields",
    [
        {"gate_up_prewait_steps": 4},
        {"down_prewait_steps": 4},
        {"gate_up_prewait_steps": 0, "down_prewait_steps": 6},
    ],
    ids=["gate_up_4", "down_4", "gate_up_0_down_6"],
)
def test_prewait_steps_are_bit_identical(experts, fields):
    """The expert launches' first weight batch of fewer K-steps moves loads, not
    arithmetic: the same table, route weights and output bit for bit as the
    executor's configuration (8 + 4 warps at M-bucket 1), at every M-bucket and
    with the fused residual + RMSNorm epilogue."""
    base = {"warps": 8, "down_warps": 4, "warps_max_bucket": 1}
    for m in M_BUCKETS:
        x, gate, bias, residual = _bit_identity_case("dummy", m, 1600)
        results = []
        for config in (MoeConfig(**base), MoeConfig(**base, **fields)):
            moe = PreparedMoe(
                gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
                experts["shared_down"], TOP_K, SCALE, rmsnorm_weight=experts["gamma"],
                eps=EPS, config=config, expert_weight_l2_policy="evict_first",
            )  # fmt: skip
            out = torch.full((m, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
            residual_out = torch.full_like(out, float("nan"))
            moe.run(x, out, residual, residual_out)
            torch.cuda.synchronize()
            results.append(
                {
                    "table": moe.table.clone(),
                    "route_weights": moe.route_weights[: m * TOP_K].clone(),
                    "out": out,
                    "residual_out": residual_out,
                }
            )
        for what, want in results[0].items():
            _bits_equal(results[1][what], want, f"{fields} M={m} {what}")


@pytest.mark.parametrize("down_warps", [None, 4], ids=["down_8", "down_4"])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_expert_ctas_of_8_warps(experts, m, down_warps):
    """``MoeConfig(warps=8)`` (each warp a K slice of 9 steps for gate_up, 4 for
    down), with down at 8 warps or 4 (the executor's default): the routing and
    the output against the fp32 reference."""
    x, gate, bias = _routing_case("random", m, seed=1800 + m)
    config = MoeConfig(warps=8, down_warps=down_warps)
    moe = PreparedMoe(
        gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
        experts["shared_down"], TOP_K, SCALE, eps=EPS, config=config,
    )  # fmt: skip
    assert (config.warps, config.down_stage_warps) == (8, down_warps or 8)
    out = torch.full((m, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe.run(x, out)
    torch.cuda.synchronize()
    ids, weights = _check_routing(moe, x, gate, bias, m)
    w = experts
    ref = moe_reference(x, ids, weights, w["w13"], w["w2"], w["shared_gate_up"], w["shared_down"])
    _assert_close(out, ref, "moe output (8-warp experts)")


def test_expert_warps_up_to_one_m_bucket(experts):
    """``MoeConfig(warps=8, down_warps=4, warps_max_bucket=1)`` (the executor's
    default): M-bucket 1 launches 8 + 4 warps, bucket 2 the default 4 + 4, and
    one prepared block is right at both."""
    config = MoeConfig(warps=8, down_warps=4, warps_max_bucket=1)
    x, gate, bias = _routing_case("random", 2, seed=1850)
    moe = PreparedMoe(
        gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
        experts["shared_down"], TOP_K, SCALE, eps=EPS, config=config,
    )  # fmt: skip
    for bucket, warps in ((1, (8, 4)), (2, (4, 4))):
        _, gate_up, down, _ = moe._kernels(bucket)
        assert (gate_up.warps, down.warps) == warps, bucket
    w = experts
    for m in (1, 2):
        out = torch.full((m, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe.run(x[:m], out)
        torch.cuda.synchronize()
        ids, weights = _check_routing(moe, x[:m], gate, bias, m)
        ref = moe_reference(
            x[:m], ids, weights, w["w13"], w["w2"], w["shared_gate_up"], w["shared_down"]
        )
        _assert_close(out, ref, f"moe output (8 + 4 warps up to bucket 1), M={m}")


def test_input_norm_bad_arguments(experts):
    _, gate, bias = _routing_case("random", 1, seed=1)
    with pytest.raises(ValueError, match="needs rmsnorm_weight"):
        PreparedMoe(
            gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
            experts["shared_down"], TOP_K, SCALE, input_norm_weight=experts["gamma"],
        )  # fmt: skip
    moe = _prepare_input_norm(experts, gate, bias)
    r = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must not alias residual"):
        moe.run(r, torch.empty_like(r), r, torch.empty_like(r))


def test_binds_weights_in_place(experts):
    x, gate, bias = _routing_case("random", 1, seed=1)
    moe = _prepare(experts, gate, bias)
    assert moe.extra_bytes == 0
    assert moe.w13.data_ptr() == experts["w13"].data_ptr()
    assert moe.w2.data_ptr() == experts["w2"].data_ptr()
    assert moe.workspace_bytes < 4 << 20


def test_bad_inputs_raise_before_launch(experts):
    x, gate, bias = _routing_case("random", 4, seed=2)
    moe = _prepare(experts, gate, bias)
    out = torch.empty(4, HIDDEN, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TypeError, match="bfloat16"):
        moe.run(x.half(), out)
    with pytest.raises(ValueError, match="outside 1..16"):
        moe.run(torch.zeros(17, HIDDEN, dtype=torch.bfloat16, device="cuda"), out)
    with pytest.raises(ValueError, match="outside 1..16"):
        moe.run(x[:0], out[:0])
    with pytest.raises(ValueError, match="hidden mismatch"):
        moe.run(x[:, :1024], out)
    with pytest.raises(ValueError, match="contiguous"):
        moe.run(torch.zeros(HIDDEN, 4, dtype=torch.bfloat16, device="cuda").T, out)
    with pytest.raises(ValueError, match="needs the fused RMSNorm"):
        moe.run(x, out, residual=x, residual_out=out)
    with pytest.raises(ValueError, match="w2 must have shape"):
        PreparedMoe(
            gate, bias, experts["w13"], experts["w13"], experts["shared_gate_up"],
            experts["shared_down"], TOP_K, SCALE,
        )  # fmt: skip


def test_default_router_cluster_stops_at_its_measured_buckets(experts):
    """By default only the M-buckets measured on the H200 take the cluster."""
    _, gate, bias = _routing_case("random", 1, seed=1)
    moe = PreparedMoe(
        gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
        experts["shared_down"], TOP_K, SCALE,
    )  # fmt: skip
    for m in M_BUCKETS:
        assert moe.router_cluster_for(m) == (m <= ROUTER_CLUSTER_MAX_BUCKET), m
    assert not PreparedMoe(
        gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
        experts["shared_down"], TOP_K, SCALE, router_cluster=False,
    ).router_cluster_for(1)  # fmt: skip


def _normed_run(moe, m, residual) -> dict:
    """One run of an input-normalising MoE with the fused residual + RMSNorm
    on NaN-filled outputs: what the bit-identity tests compare."""
    moe.input_sums[:m] = residual.float().pow(2).sum(dim=-1)
    moe.y.fill_(float("nan"))
    x_out = torch.full((m, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(x_out, float("nan"))
    residual_out = torch.full_like(x_out, float("nan"))
    moe.run(x_out, out, residual, residual_out)
    torch.cuda.synchronize()
    return {
        "table": moe.table.clone(),
        "route_weights": moe.route_weights[: m * TOP_K].clone(),
        "x": x_out,
        # The shared expert's rows of y (row 0 onwards).
        "shared_y": moe.y[:m].clone(),
        "out": out,
        "residual_out": residual_out,
    }


@pytest.mark.parametrize("polls", [None, 0], ids=["polled", "left_to_down"])
@pytest.mark.parametrize("regime", ["dummy", "balanced"])
def test_early_shared_down_is_bit_identical(experts, regime, polls):
    """gate_up's shared-expert CTAs running the shared down (weights staged
    before the wait, the down launch's K split) give the executor's table,
    route weights, expert rows and output bit for bit, at every M-bucket it
    covers, with the input norm and the fused residual + RMSNorm as the decode
    runs them. ``polls`` 0: a CTA that finds the shared h incomplete at its first
    look leaves its tiles to the down launch, so both paths run in one launch.
    Three launches in a row: the flags and the count re-arm."""
    base = {"warps": 8, "down_warps": 4, "warps_max_bucket": 1, "down_prewait_steps": 6}
    early = {"early_shared_down_max_bucket": 8}
    if polls is not None:
        early["early_shared_down_polls"] = polls
    for m in (1, 2, 3, 4, 8):
        x, gate, bias, residual = _bit_identity_case(regime, m, 2000)
        results = []
        for config in (MoeConfig(**base), MoeConfig(**base, **early)):
            moe = PreparedMoe(
                gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
                experts["shared_down"], TOP_K, SCALE, rmsnorm_weight=experts["gamma"],
                eps=EPS, config=config, input_norm_weight=experts["input_gamma"],
                input_eps=EPS, expert_weight_l2_policy="evict_first",
                expert_weight_l2_policy_max_bucket=4,
            )  # fmt: skip
            _, gate_up, _, _ = moe._kernels(m_bucket_for(m))
            early_kernel = isinstance(gate_up, MoeGateUpEarlySharedDownKernel)
            assert early_kernel == (config.early_shared_down_max_bucket > 0), m
            runs = [_normed_run(moe, m, residual) for _ in range(3)]
            assert not moe.early_sync.any(), "the flags and the count are re-armed"
            results.append(runs)
        for run in range(3):
            for what, want in results[0][run].items():
                _bits_equal(results[1][run][what], want, f"{regime} M={m} run {run} {what}")


def test_early_shared_down_graph_replays_are_bit_identical(experts):
    """The executor's graph of one token with the early shared down: 300 replays
    give the eager run's output bit for bit (the flags and the count re-arm
    inside the graph)."""
    m = 1
    x, gate, bias, residual = _bit_identity_case("dummy", m, 2100)
    config = MoeConfig(
        warps=8, down_warps=4, warps_max_bucket=1, down_prewait_steps=6,
        early_shared_down_max_bucket=1,
    )  # fmt: skip
    moe = PreparedMoe(
        gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
        experts["shared_down"], TOP_K, SCALE, rmsnorm_weight=experts["gamma"], eps=EPS,
        config=config,
    )  # fmt: skip
    out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
    residual_out = torch.empty_like(out)
    moe.run(x, out, residual, residual_out)  # compile + warm up outside the graph
    torch.cuda.synchronize()
    first_out, first_res = out.clone(), residual_out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.run(x, out, residual, residual_out)
    for i in range(300):
        out.zero_()
        residual_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _bits_equal(out, first_out, f"replay {i}: out")
        _bits_equal(residual_out, first_res, f"replay {i}: residual_out")
    assert not moe.early_sync.any(), "the flags and the count are re-armed"


@pytest.mark.parametrize("regime", ["dummy", "balanced"])
def test_expert_launch_bounds_are_bit_identical(experts, regime):
    """Launch bounds on the expert launches (``expert_max_registers=128``: ptxas
    schedules the same instructions in more registers) give the executor's
    table, route weights, expert rows and output bit for bit at M = 1, 2 (the
    early shared down), 3, 8 and 16, with the input norm and the fused residual
    + RMSNorm."""
    base = {
        "warps": 8, "down_warps": 4, "warps_max_bucket": 1, "down_prewait_steps": 6,
        "early_shared_down_min_bucket": 2, "early_shared_down_max_bucket": 2,
    }  # fmt: skip
    for m in (1, 2, 3, 8, 16):
        x, gate, bias, residual = _bit_identity_case(regime, m, 2600)
        results = []
        for registers in (None, 128):
            moe = PreparedMoe(
                gate, bias, experts["w13"], experts["w2"], experts["shared_gate_up"],
                experts["shared_down"], TOP_K, SCALE, rmsnorm_weight=experts["gamma"],
                eps=EPS, config=MoeConfig(**base, expert_max_registers=registers),
                input_norm_weight=experts["input_gamma"], input_eps=EPS,
                expert_weight_l2_policy="evict_first", expert_weight_l2_policy_max_bucket=4,
            )  # fmt: skip
            results.append(_normed_run(moe, m, residual))
        for what, want in results[0].items():
            _bits_equal(results[1][what], want, f"{regime} M={m} {what}")

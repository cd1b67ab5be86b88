# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused KDA decode step (kernels/kda) against the pure-torch FP32 reference.

Kimi-Linear-48B-A3B shapes (H = 32 heads, D = 128).  The caches are strided
views into per-slot pages as vLLM allocates them (conv state and recurrent
state share a page), slot 0 is the null block, and batches mix padding rows
(slot 0 or -1) with non-contiguous slot indices.

Tolerances:
  * conv state: bit-identical (it only stores bf16 inputs);
  * recurrent state, normwise relative error per active slot:
    <= 1e-4 after 1 and 16 steps, <= 1e-3 after 256 (FP32 with a different
    summation order: ~1e-6 per step; bf16 rounding of a conv output can flip
    on an FP32 ulp and is carried by the state);
  * output (bf16, O(1) after the gated norm): elementwise
    |got - ref| <= 2e-2 + 2e-2 |ref| and normwise <= 5e-3;
  * padding rows: output rows keep their NaN poison, their slots (and every
    slot not in the batch) stay bit-identical.
With low-rank gates (``gate_weights``) the kernel takes f_a(x), g_a(x) and
applies f_b, g_b itself; the reference forms g1, g2 in FP32, rounded to bf16
as the stock projections' outputs, and the same tolerances apply.
Needs an SM90 GPU and nvidia-cutlass-dsl; skips with the reason otherwise.
The comparison with vLLM 0.26.0's own Triton path runs only where vLLM is
importable (skipped with the reason otherwise).
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the KDA kernel runs on SM90 only", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip(
        f"needs an SM90 GPU, found {torch.cuda.get_device_name()}",
        allow_module_level=True,
    )

from kda_reference import (  # noqa: E402
    HEAD_DIM,
    gate_projection,
    reference_step,
    vectorized_step,
)

from kernels.kda.kernel import GATE_RANK  # noqa: E402
from kernels.kda.prepared import PreparedKda  # noqa: E402

pytestmark = pytest.mark.gpu

HEADS = 32
PROJ = HEADS * HEAD_DIM
SLOTS = 80
OUT_RTOL = OUT_ATOL = 2e-2
OUT_NORM_RTOL = 5e-3
STATE_RTOL = {1: 1e-4, 16: 1e-4, 256: 1e-3}


class Layer:
    """Weights + cache pages of one KDA layer, with a deep copy for the
    reference.  ``state_row_pad`` pads each state row (strided row view)."""

    def __init__(
        self, seed, state_row_pad=0, use_pdl=True, warps=8, state_early=False,
        low_rank=False,
    ):  # fmt: skip
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.gen = gen
        dev = "cuda"
        self.conv_weight = torch.randn(3, PROJ, 4, device=dev, generator=gen) * 0.5
        self.a_log = (torch.rand(HEADS, device=dev, generator=gen) * 2 - 1.5).view(1, 1, HEADS, 1)
        self.dt_bias = torch.randn(PROJ, device=dev, generator=gen) * 0.2 - 2.0
        self.norm_weight = (1 + 0.1 * torch.randn(HEAD_DIM, device=dev, generator=gen)).to(
            torch.bfloat16
        )
        # One page per slot: [conv (bf16) | gap | state (FP32 rows, maybe padded)].
        row = HEAD_DIM + state_row_pad
        conv_floats = 3 * 3 * PROJ // 2
        state_off = conv_floats + 64
        page = state_off + HEADS * HEAD_DIM * row + 32
        self.pages = torch.empty(SLOTS, page, device=dev)
        words = self.pages.view(torch.bfloat16)
        self.conv_state = words[:, : 2 * conv_floats].view(SLOTS, 3, 3 * PROJ)
        self.state = self.pages[:, state_off : state_off + HEADS * HEAD_DIM * row].view(
            SLOTS, HEADS, HEAD_DIM, row
        )[..., :HEAD_DIM]
        self.conv_state.copy_(
            torch.randn(SLOTS, 3, 3 * PROJ, device=dev, generator=gen).to(torch.bfloat16)
        )
        self.state.copy_(
            torch.randn(SLOTS, HEADS, HEAD_DIM, HEAD_DIM, device=dev, generator=gen) * 0.1
        )
        self.ref_conv = self.conv_state.clone()
        self.ref_state = self.state.clone()
        # f_b, g_b [H*D, 128]: std 1/sqrt(128), so g1 and g2 are O(1) like the
        # full-width inputs of the other tests.
        self.gate_weights = None
        if low_rank:
            self.gate_weights = tuple(
                (torch.randn(PROJ, GATE_RANK, device=dev, generator=gen) * GATE_RANK**-0.5).to(
                    torch.bfloat16
                )
                for _ in range(2)
            )
        self.prepared = PreparedKda(
            tuple(w.view(PROJ, 1, 4) for w in self.conv_weight),
            self.a_log, self.dt_bias, self.norm_weight, self.conv_state, self.state,
            num_heads=HEADS, use_pdl=use_pdl, warps=warps,
            state_loads_before_wait=state_early, gate_weights=self.gate_weights,
        )  # fmt: skip

    def full_gates(self, g1, g2):
        """The reference's g1, g2: the inputs, or f_b f_a(x), g_b g_a(x)."""
        if self.gate_weights is None:
            return g1, g2
        f_b, g_b = self.gate_weights
        return gate_projection(g1, f_b), gate_projection(g2, g_b)

    def ref_kwargs(self):
        return dict(
            conv_weight=self.conv_weight, a_log=self.a_log.view(HEADS),
            dt_bias=self.dt_bias, norm_weight=self.norm_weight, num_heads=HEADS,
        )  # fmt: skip

    def inputs(self, batch, qkv_pitch=None):
        """q, k, v, g1, beta_logits, g2; q/k/v are column blocks of one packed
        projection when ``qkv_pitch`` is given (strided rows).  With low-rank
        gates g1, g2 are f_a(x), g_a(x): columns of the same packed rows when
        ``qkv_pitch`` is given (as in the executor's fused in_proj)."""
        gen = self.gen
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
        if qkv_pitch:
            packed = rnd(batch, qkv_pitch).to(torch.bfloat16)
            q, k, v = (packed[:, i * PROJ : (i + 1) * PROJ] for i in range(3))
        else:
            q, k, v = (rnd(batch, PROJ).to(torch.bfloat16) for _ in range(3))
        beta = rnd(batch, HEADS).to(torch.bfloat16)
        if self.gate_weights is None:
            g1, g2 = (rnd(batch, PROJ).to(torch.bfloat16) for _ in range(2))
        elif qkv_pitch:
            low = 3 * PROJ + HEADS
            g1, g2 = (packed[:, low + i * GATE_RANK : low + (i + 1) * GATE_RANK] for i in range(2))
        else:
            g1, g2 = (rnd(batch, GATE_RANK).to(torch.bfloat16) for _ in range(2))
        return q, k, v, g1, beta, g2


def _slots(batch, pads, gen):
    """Distinct, non-contiguous slots in 1..SLOTS-1, with padding rows (0/-1)
    at the given positions."""
    perm = torch.randperm(SLOTS - 1, generator=gen)[:batch] + 1
    slots = perm.to(torch.int32)
    for i, pos in enumerate(pads):
        if pos < batch:
            slots[pos] = 0 if i % 2 == 0 else -1
    return slots.cuda()


def _batched_reference(q, k, v, g1, beta, g2, slots, conv, state, **layer):
    """The batched formulation on the active rows (selected on the host; the
    per-row loop and this one are checked against each other on the CPU)."""
    rows = [i for i, s in enumerate(slots.tolist()) if s > 0]
    out = torch.full((q.shape[0], PROJ), float("nan"), device="cuda", dtype=torch.bfloat16)
    if rows:
        idx = torch.tensor(rows, device="cuda")
        part = torch.empty(len(rows), PROJ, device="cuda", dtype=torch.bfloat16)
        pick = lambda t: t.index_select(0, idx)  # noqa: E731
        vectorized_step(
            pick(q), pick(k), pick(v), pick(g1), pick(beta), pick(g2), pick(slots),
            conv, state, out=part, **layer,
        )  # fmt: skip
        out[idx] = part
    return out


def _check_out(got, ref, active, what):
    got, ref = got.float(), ref.float()
    assert got[~active].isnan().all(), f"{what}: a padding row's output was written"
    g, r = got[active], ref[active]
    assert not g.isnan().any(), f"{what}: NaN in an active row (unwritten output?)"
    err = (g - r).abs()
    bad = err > OUT_ATOL + OUT_RTOL * r.abs()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} outputs out of tolerance, worst {float(err.max()):.3e}"
    )
    rel = float((g - r).norm() / r.norm())
    assert rel <= OUT_NORM_RTOL, f"{what}: normwise output error {rel:.2e}"


def _state_rel_err(layer, slots):
    active = [int(s) for s in slots.tolist() if s > 0]
    got, ref = layer.state[active], layer.ref_state[active]
    return float((got - ref).norm() / ref.norm())


def _check_caches(layer, slots, step, what):
    assert torch.equal(layer.conv_state, layer.ref_conv), f"{what}: conv state differs"
    # Every slot outside the batch (and padding) must be bit-identical.
    active = {int(s) for s in slots.tolist() if s > 0}
    idle = [s for s in range(SLOTS) if s not in active]
    assert torch.equal(layer.state[idle], layer.ref_state[idle]), (
        f"{what}: a slot outside the batch was written"
    )
    if step in STATE_RTOL:
        rel = _state_rel_err(layer, slots)
        assert rel <= STATE_RTOL[step], f"{what}: state rel err {rel:.2e} after {step}"


def _run_steps(layer, batch, steps, pads, qkv_pitch=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = _slots(batch, pads, gen)
    active = (slots > 0).cpu()
    # The per-row loop for small batches, the batched form for large ones.
    ref_fn = reference_step if batch <= 8 else _batched_reference
    for step in range(1, steps + 1):
        q, k, v, g1, beta, g2 = layer.inputs(batch, qkv_pitch)
        out = torch.full((batch, PROJ), float("nan"), device="cuda", dtype=torch.bfloat16)
        layer.prepared.run(q, k, v, g1, beta, g2, slots, out)
        f1, f2 = layer.full_gates(g1, g2)
        ref = ref_fn(
            q, k, v, f1, beta, f2, slots, layer.ref_conv, layer.ref_state,
            **layer.ref_kwargs(),
        )  # fmt: skip
        torch.cuda.synchronize()
        what = f"batch={batch} step={step}"
        _check_out(out.cpu(), ref.cpu(), active, what)
        _check_caches(layer, slots, step, what)
    return slots


@pytest.mark.parametrize(
    "batch,steps,warps,state_early,low_rank",
    [
        (1, 256, 8, False, False),
        (2, 16, 8, False, False),
        (3, 16, 8, False, False),
        (8, 16, 8, False, False),
        (16, 256, 8, False, False),
        (33, 16, 8, False, False),
        (64, 256, 8, False, False),
        (5, 16, 16, False, False),
        (64, 256, 16, False, False),
        # The decode executor's variant (state loads before the wait, f_b /
        # g_b inside); every launch here follows torch kernels (the inputs),
        # which PDL does not overlap.
        (1, 256, 8, True, False),
        (3, 16, 8, True, False),
        (16, 16, 8, True, False),
        (64, 256, 8, True, False),
        (1, 256, 8, True, True),
        (2, 16, 8, True, True),
        (3, 16, 8, True, True),
        (8, 16, 8, True, True),
        (16, 256, 8, True, True),
        (64, 16, 8, True, True),
        (4, 16, 8, False, True),
        (5, 16, 16, False, True),
    ],
)
def test_steps_match_reference(batch, steps, warps, state_early, low_rank):
    layer = Layer(seed=batch, warps=warps, state_early=state_early, low_rank=low_rank)
    # Padding rows at positions 0 and 2 for batches that have room for them.
    pads = (0, 2) if batch >= 3 else ()
    _run_steps(layer, batch, steps, pads, seed=batch)


def test_strided_activations_and_state_rows():
    """q/k/v as column blocks of a packed projection (row pitch > H*D) and
    state rows padded to 132 floats (strided value rows)."""
    layer = Layer(seed=7, state_row_pad=4)
    assert layer.state.stride(2) == HEAD_DIM + 4
    _run_steps(layer, 16, 16, pads=(5,), qkv_pitch=3 * PROJ + 256, seed=7)


def test_low_rank_gates_from_the_fused_projection_rows():
    """The executor's layout: q | k | v | b | f_a | g_a columns of one
    [B, 12576] in_proj output, f_b / g_b applied in the kernel."""
    layer = Layer(seed=9, state_early=True, low_rank=True)
    _run_steps(layer, 8, 16, pads=(2,), qkv_pitch=3 * PROJ + HEADS + 2 * GATE_RANK, seed=9)


def test_padding_only_batch_touches_nothing():
    layer = Layer(seed=11)
    slots = torch.tensor([0, -1, 0, -5], dtype=torch.int32, device="cuda")
    q, k, v, g1, beta, g2 = layer.inputs(4)
    out = torch.full((4, PROJ), float("nan"), device="cuda", dtype=torch.bfloat16)
    pages = layer.pages.clone()
    layer.prepared.run(q, k, v, g1, beta, g2, slots, out)
    torch.cuda.synchronize()
    assert out.isnan().all()
    assert torch.equal(layer.pages.view(torch.int32), pages.view(torch.int32))


@pytest.mark.parametrize(
    "use_pdl,warps,state_early,low_rank",
    [
        (True, 8, False, False),
        (False, 8, False, False),
        (True, 16, False, False),
        (True, 8, True, False),
        (True, 8, True, True),
    ],
    ids=["pdl", "no_pdl", "pdl_w16", "pdl_state_early", "pdl_state_early_low_rank"],
)
def test_graph_replays_bit_identical(use_pdl, warps, state_early, low_rank):
    """300 replays of a captured step equal 300 eager launches bit for bit
    (and stay within tolerance of the reference).  With state loads before
    the PDL wait, eager launches on one layer must not be chained (they would
    read a state the previous launch is still writing): a torch kernel
    separates them, as graph launches separate the replays."""
    layer = Layer(seed=21, use_pdl=use_pdl, warps=warps, state_early=state_early, low_rank=low_rank)
    separator = torch.zeros(1, device="cuda")
    batch, replays = 8, 300
    gen = torch.Generator().manual_seed(21)
    slots = _slots(batch, (3,), gen)
    q, k, v, g1, beta, g2 = layer.inputs(batch)
    out = torch.full((batch, PROJ), float("nan"), device="cuda", dtype=torch.bfloat16)
    pages0 = layer.pages.clone()

    def step():
        layer.prepared.run(q, k, v, g1, beta, g2, slots, out)

    for _ in range(replays):
        step()
        if state_early:
            separator.add_(1)
    torch.cuda.synchronize()
    eager_pages, eager_out = layer.pages.clone(), out.clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiled already; warm the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    layer.pages.copy_(pages0)
    out.fill_(float("nan"))
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(layer.pages.view(torch.int32), eager_pages.view(torch.int32))
    assert torch.equal(out.view(torch.int16), eager_out.view(torch.int16))

    f1, f2 = layer.full_gates(g1, g2)
    for _ in range(replays):
        ref = _batched_reference(
            q, k, v, f1, beta, f2, slots, layer.ref_conv, layer.ref_state,
            **layer.ref_kwargs(),
        )  # fmt: skip
    _check_out(out.cpu(), ref.cpu(), (slots > 0).cpu(), "after 300 replays")
    rel = _state_rel_err(layer, slots)
    assert rel <= STATE_RTOL[256], f"state rel err {rel:.2e} after {replays} replays"


@pytest.mark.parametrize("low_rank", [False, True], ids=["full_gates", "low_rank_gates"])
def test_matches_vllm_triton_path(low_rank):
    """Same inputs through vLLM 0.26.0's own decode kernels, where importable
    (low-rank gates: f_b / g_b as stock applies them, bf16 F.linear)."""
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
            causal_conv1d_update,
        )
        from vllm.third_party.flash_linear_attention.ops.kda import (
            fused_kda_gate,
            fused_recurrent_kda,
            rms_norm_gated,
        )
    except Exception as exc:  # vLLM absent or not importable on this host
        pytest.skip(f"vLLM's Triton KDA path is not importable here: {exc!r}")
    layer = Layer(seed=31, low_rank=low_rank)
    batch = 6
    gen = torch.Generator().manual_seed(31)
    slots = _slots(batch, (1,), gen)
    active = (slots > 0).cpu()
    conv_v = layer.ref_conv.transpose(-1, -2)  # (slots, dim, 3) as vLLM's kernels
    cq, ck, cv = conv_v.chunk(3, dim=-2)
    for step in range(1, 17):
        q, k, v, g1, beta_logits, g2 = layer.inputs(batch)
        out = torch.full((batch, PROJ), float("nan"), device="cuda", dtype=torch.bfloat16)
        layer.prepared.run(q, k, v, g1, beta_logits, g2, slots, out)
        if low_rank:
            f_b, g_b = layer.gate_weights
            g1, g2 = torch.nn.functional.linear(g1, f_b), torch.nn.functional.linear(g2, g_b)
        convs = []
        for x, cs, w in zip((q, k, v), (cq, ck, cv), layer.conv_weight):
            convs.append(
                causal_conv1d_update(x, cs, w, None, activation="silu", conv_state_indices=slots)
            )
        qs, ks, vs = (t.view(1, batch, HEADS, HEAD_DIM) for t in convs)
        g = fused_kda_gate(g1, layer.a_log, HEAD_DIM, g_bias=layer.dt_bias).unsqueeze(0)
        beta = beta_logits.float().sigmoid().unsqueeze(0)
        cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        o, _ = fused_recurrent_kda(
            q=qs, k=ks, v=vs, g=g, beta=beta, initial_state=layer.ref_state,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu, ssm_state_indices=slots,
        )  # fmt: skip
        ref = rms_norm_gated(
            o[0], g2.view(batch, HEADS, HEAD_DIM), layer.norm_weight, None,
            activation="sigmoid", eps=1e-5,
        ).reshape(batch, PROJ)  # fmt: skip
        ref[~active.cuda()] = float("nan")
        torch.cuda.synchronize()
        _check_out(out.cpu(), ref.cpu(), active, f"vs vLLM step {step}")
        _check_caches(layer, slots, step, f"vs vLLM step {step}")


def _bad_run_cases():
    def replace(i, f):
        return lambda args: tuple(f(a) if j == i else a for j, a in enumerate(args))

    return [
        ("q fp16", replace(0, lambda t: t.half()), TypeError, "q must be torch.bfloat16"),
        ("k wrong width", replace(1, lambda t: t[:, :-8]), ValueError, "k must have shape"),
        (
            "v non-contiguous last dim",
            replace(2, lambda t: t.t().contiguous().t()),
            ValueError,
            "contiguous in its last dim",
        ),
        ("g1 on cpu", replace(3, lambda t: t.cpu()), ValueError, "is on cpu"),
        ("beta fp32", replace(4, lambda t: t.float()), TypeError, "beta_logits"),
        ("slots int64", replace(6, lambda t: t.long()), TypeError, "slot_indices"),
        ("slots too short", replace(6, lambda t: t[:2]), ValueError, ">= 4 entries"),
        ("out wrong shape", replace(7, lambda t: t[:3]), ValueError, "out must have shape"),
    ]


@pytest.mark.parametrize("case", _bad_run_cases(), ids=lambda c: c[0])
def test_bad_input_raises_before_launch(case):
    _, mutate, exc, match = case
    layer = Layer(seed=41)
    q, k, v, g1, beta, g2 = layer.inputs(4)
    slots = torch.tensor([3, 5, 9, 11], dtype=torch.int32, device="cuda")
    out = torch.full((4, PROJ), float("nan"), device="cuda", dtype=torch.bfloat16)
    args = mutate((q, k, v, g1, beta, g2, slots, out))
    pages = layer.pages.clone()
    with pytest.raises(exc, match=match):
        layer.prepared.run(*args)
    torch.cuda.synchronize()
    assert torch.equal(layer.pages.view(torch.int32), pages.view(torch.int32))
    assert out.isnan().all(), "output touched although the input was refused"


def test_low_rank_gates_refuse_full_width_inputs():
    layer = Layer(seed=45, low_rank=True)
    q, k, v, _, beta, _ = layer.inputs(2)
    full = torch.zeros(2, PROJ, device="cuda", dtype=torch.bfloat16)
    low = torch.zeros(2, GATE_RANK, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([3, 5], dtype=torch.int32, device="cuda")
    out = torch.full((2, PROJ), float("nan"), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="g1 must have shape"):
        layer.prepared.run(q, k, v, full, beta, low, slots, out)
    with pytest.raises(ValueError, match="g2 must have shape"):
        layer.prepared.run(q, k, v, low, beta, full, slots, out)
    assert out.isnan().all()


def test_bad_gate_weights():
    layer = Layer(seed=47)
    w = tuple(x.view(PROJ, 1, 4) for x in layer.conv_weight)
    args = (w, layer.a_log, layer.dt_bias, layer.norm_weight, layer.conv_state, layer.state)
    good = torch.zeros(PROJ, GATE_RANK, device="cuda", dtype=torch.bfloat16)
    cases = [
        ((good,), ValueError, "the \\(f_b, g_b\\) weights"),
        ((good.float(), good), TypeError, "f_b must be torch.bfloat16"),
        ((good, good[:, :64]), ValueError, "g_b must have shape"),
        ((good, good.t().contiguous().t()), ValueError, "g_b must be contiguous"),
        ((good.cpu(), good), ValueError, "f_b is on cpu"),
    ]
    for gates, exc, match in cases:
        with pytest.raises(exc, match=match):
            PreparedKda(*args, gate_weights=gates)


def test_bad_layer_arguments():
    layer = Layer(seed=43)
    w = tuple(x.view(PROJ, 1, 4) for x in layer.conv_weight)
    args = (w, layer.a_log, layer.dt_bias, layer.norm_weight)
    with pytest.raises(TypeError, match="recurrent_state must be torch.float32"):
        PreparedKda(*args, layer.conv_state, layer.state.to(torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous along keys"):
        PreparedKda(*args, layer.conv_state, layer.state.transpose(2, 3))
    with pytest.raises(ValueError, match="recurrent_state must be"):
        PreparedKda(*args, layer.conv_state, layer.state[:, :16])
    with pytest.raises(ValueError, match="conv_state"):
        PreparedKda(*args, layer.conv_state[:, :2], layer.state)
    with pytest.raises(ValueError, match="conv_weights"):
        PreparedKda(w[:2], *args[1:], layer.conv_state, layer.state)
    with pytest.raises(ValueError, match="a_log"):
        PreparedKda(w, layer.a_log.double(), *args[2:], layer.conv_state, layer.state)
    with pytest.raises(ValueError, match="conv_layout"):
        PreparedKda(*args, layer.conv_state, layer.state, conv_layout="XY")
    with pytest.raises(ValueError, match="warps must be one of"):
        PreparedKda(*args, layer.conv_state, layer.state, warps=4)

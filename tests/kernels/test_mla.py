# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MLA latent-cache row and decode attention (kernels/mla) against pure-torch FP32
references.

Kimi-Linear-48B-A3B's MLA: kv_a output rows of 512 latent + 64 rope columns, read as
columns of the q | kv_a projection (row stride 6720); vLLM's bf16 cache [blocks,
block_size, 576]. M = 1..16, slots in any order, padding rows (slot -1). Needs an SM90
GPU and nvidia-cutlass-dsl; skips with the reason otherwise.

Tolerance: the written latent must be within one bf16 rounding of the FP32 reference
(|got - ref| <= 2^-8 |ref| + 1e-6: the kernel rounds once, like vLLM's RMSNorm kernel;
the FP32 sum of squares differs from the reference's in the last bits only). k_pe is
copied bit for bit, and no other cache row may change.

Attention: 32 heads, the absorbed query [ql_nope (512) | q_pe (64)] per head (q_pe read
as strided columns of the projection), softmax scale 192^-0.5, the paged cache through a
shuffled block table, B = 1..16, sequence lengths from 1 to several tiles per split and
more splits than one round of the merge,
padding rows (seq_len 0 -> zeros). Tolerance per element, from the kernel's roundings:
P is rounded to bf16 before P V (relative 2^-8 per weight) and the output to bf16, so
|got - ref| <= 2^-7 (softmax @ |V| + |ref|) + 1e-5.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the MLA kernel runs on SM90 only", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip(f"needs an SM90 GPU, found {torch.cuda.get_device_name()}", allow_module_level=True)

from kernels.mla.prepared import (  # noqa: E402
    PreparedMlaCacheRow,
    PreparedMlaDecodeAttention,
    attention_workspace,
)

pytestmark = pytest.mark.gpu

LORA, ROPE, Q_WIDTH, EPS = 512, 64, 6144, 1e-6
WIDTH = LORA + ROPE
BLOCKS = 12


def reference_rows(kv: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """FP32: [rmsnorm(kv[:, :lora]) * gamma | kv[:, lora:]]."""
    x = kv[:, :LORA].float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()
    return torch.cat([normed, kv[:, LORA:].float()], dim=-1)


def projection(m: int, gen: torch.Generator) -> torch.Tensor:
    """kv rows as the executor passes them: columns of the [M, 6720] projection."""
    proj = torch.randn(m, Q_WIDTH + WIDTH, generator=gen, device="cuda") * 3
    return proj.to(torch.bfloat16)[:, Q_WIDTH:]


def check_rows(cache, before, kv, slots, gamma, block_size):
    ref = reference_rows(kv, gamma)
    written = set()
    flat_now = cache.view(-1, WIDTH)
    for i, slot in enumerate(slots.tolist()[: kv.shape[0]]):
        if slot < 0:
            continue
        written.add(slot)
        got = flat_now[slot]
        assert torch.equal(got[LORA:], kv[i, LORA:]), f"row {i}: k_pe not copied exactly"
        err = (got[:LORA].float() - ref[i, :LORA]).abs()
        limit = 2**-8 * ref[i, :LORA].abs() + 1e-6
        assert bool((err <= limit).all()), f"row {i}: latent off by {float(err.max()):.3g}"
    untouched = [r for r in range(flat_now.shape[0]) if r not in written]
    assert torch.equal(flat_now[untouched], before.view(-1, WIDTH)[untouched])


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 13, 16])
def test_rows_land_in_their_slots(block_size, m):
    gen = torch.Generator(device="cuda").manual_seed(m * 100 + block_size)
    cache = torch.randn(BLOCKS, block_size, WIDTH, generator=gen, device="cuda").to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(LORA, generator=gen, device="cuda")).to(torch.bfloat16)
    kv = projection(m, gen)
    # Distinct slots in any order; rows 1, 4, 7, ... are padding.
    slots = torch.randperm(BLOCKS * block_size, generator=torch.Generator().manual_seed(m))[:m]
    slots[1::3] = -1
    slots = slots.to("cuda")
    before = cache.clone()
    PreparedMlaCacheRow(gamma, EPS, cache, rope=ROPE).run(kv, slots)
    torch.cuda.synchronize()
    check_rows(cache, before, kv, slots, gamma, block_size)


def test_a_strided_cache_view_is_written_in_place():
    """vLLM's per-layer cache is a view into the layer's pages: strides are read."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    pages = torch.randn(BLOCKS, 2, 16, WIDTH, generator=gen, device="cuda").to(torch.bfloat16)
    cache = pages[:, 1]  # block stride 2 * 16 * 576
    gamma = torch.ones(LORA, device="cuda", dtype=torch.bfloat16)
    kv = projection(4, gen)
    slots = torch.tensor([5, 40, -1, 191], device="cuda")
    before = cache.clone()
    other = pages[:, 0].clone()
    PreparedMlaCacheRow(gamma, EPS, cache, rope=ROPE).run(kv, slots)
    torch.cuda.synchronize()
    check_rows(cache.contiguous(), before, kv, slots, gamma, 16)
    assert torch.equal(pages[:, 0], other)


def test_graph_replays_rewrite_the_same_rows_bit_identically():
    gen = torch.Generator(device="cuda").manual_seed(3)
    cache = torch.zeros(BLOCKS, 16, WIDTH, device="cuda", dtype=torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(LORA, generator=gen, device="cuda")).to(torch.bfloat16)
    kv = projection(8, gen)
    slots = torch.arange(8, device="cuda") * 7
    prepared = PreparedMlaCacheRow(gamma, EPS, cache, rope=ROPE)
    prepared.run(kv, slots)
    torch.cuda.synchronize()
    first = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared.run(kv, slots)
    for _ in range(300):
        cache.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cache, first)


def test_bad_input_is_refused_before_launch():
    cache = torch.zeros(BLOCKS, 16, WIDTH, device="cuda", dtype=torch.bfloat16)
    gamma = torch.ones(LORA, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedMlaCacheRow(gamma, EPS, cache, rope=ROPE)
    kv = torch.zeros(4, WIDTH, device="cuda", dtype=torch.bfloat16)
    slots = torch.zeros(4, device="cuda", dtype=torch.int64)
    with pytest.raises(ValueError, match="outside"):
        prepared.run(torch.zeros(17, WIDTH, device="cuda", dtype=torch.bfloat16), slots)
    with pytest.raises(TypeError, match="bfloat16"):
        prepared.run(kv.float(), slots)
    with pytest.raises(ValueError, match="int64"):
        prepared.run(kv, slots.int())
    with pytest.raises(ValueError, match=r"\[M, 576\]"):
        prepared.run(kv[:, :500], slots)
    with pytest.raises(TypeError, match="bfloat16"):
        PreparedMlaCacheRow(gamma, EPS, cache.float(), rope=ROPE)
    with pytest.raises(ValueError, match=r"norm_weight must be \[512\]"):
        PreparedMlaCacheRow(gamma[:100], EPS, cache, rope=ROPE)


# ---- decode attention

HEADS, NOPE = 32, 128
SCALE = (NOPE + ROPE) ** -0.5
PROJ_WIDTH = Q_WIDTH + WIDTH


def attention_reference(q_nope, q_pe, cache, block_table, seq_lens, block_size):
    """FP32 softmax(scale q K^T) V per request over its gathered cache rows; also
    softmax @ |V| (the tolerance's scale)."""
    b = q_nope.shape[0]
    out = torch.zeros(b, HEADS, LORA, device="cuda")
    spread = torch.zeros_like(out)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pos = torch.arange(n, device="cuda")
        blocks = block_table[i, pos // block_size].long()
        rows = cache[blocks, pos % block_size].float()  # [n, 576]
        q = torch.cat([q_nope[i].view(HEADS, LORA), q_pe[i]], dim=-1).float()
        p = torch.softmax(SCALE * q @ rows.T, dim=-1)
        out[i] = p @ rows[:, :LORA]
        spread[i] = p @ rows[:, :LORA].abs()
    return out, spread


def attention_inputs(b, seq_lens, block_size, gen, pages=1):
    """Query views as the executor passes them, a cache with room for every request
    (pages > 1: the cache is a strided view of one page of several), a block table
    whose blocks are shuffled over the cache."""
    per_req = max(1, -(-max(seq_lens) // block_size))
    blocks = b * per_req + 3
    store = torch.randn(blocks, pages, block_size, WIDTH, generator=gen, device="cuda")
    cache = store.to(torch.bfloat16)[:, pages - 1]
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(b))[: b * per_req]
    block_table = torch.zeros(b, per_req + 5, dtype=torch.int32)
    block_table[:, :per_req] = order.view(b, per_req).int()
    q_nope = torch.randn(b, HEADS * LORA, generator=gen, device="cuda").to(torch.bfloat16)
    proj = torch.randn(b, PROJ_WIDTH, generator=gen, device="cuda").to(torch.bfloat16)
    q_pe = proj[:, : HEADS * (NOPE + ROPE)].view(b, HEADS, NOPE + ROPE)[..., NOPE:]
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q_nope, q_pe, cache, block_table.cuda(), seq


def check_attention(out, q_nope, q_pe, cache, block_table, seq, block_size, uniform=False):
    """Per element within the rounding bound (``uniform``: the query is zero, so every
    weight is exactly 1 in bf16 and only the output's rounding is left: a model of the
    kernel's roundings reaches 0.38-0.48 of that limit). Otherwise also per row the RMS
    error within 0.35 of the bound's RMS (the model: 0.04-0.17 for 33-20000 tokens; a
    dropped tile gives ~0.5), which catches errors a long context's wide per-element
    bound would hide."""
    ref, spread = attention_reference(q_nope, q_pe, cache, block_table, seq, block_size)
    got = out.view(-1, HEADS, LORA).float()
    assert bool(torch.isfinite(got).all())
    err = (got - ref).abs()
    bound = ref.abs() if uniform else spread + ref.abs()
    limit = 2**-7 * bound + 1e-5
    if not uniform:
        rms = lambda t: t.pow(2).mean(dim=(1, 2)).sqrt()  # noqa: E731
        row_ratio = rms(err) / (rms(2**-8 * bound) + 1e-12)
        busy = seq > 0
        assert bool((row_ratio[busy] <= 0.35).all()), f"RMS error / bound per row: {row_ratio}"
    bad = err > limit
    assert not bool(bad.any()), (
        f"{int(bad.sum())} elements off; worst {float((err - limit).max()):.3g} over the "
        f"limit (rows {sorted(set(bad.nonzero()[:, 0].tolist()))})"
    )
    for i, n in enumerate(seq.tolist()):
        if n == 0:
            assert bool((got[i] == 0).all()), f"padding row {i} is not zeros"


SEQ_CASES = {
    # 20000 tokens: 4 tiles a split, 157 splits (more than the merge's 128 threads and
    # than one round of its loads).
    1: [[1], [31], [32], [33], [700], [2049], [5000], [20000]],
    2: [[1, 1000], [64, 0], [9000, 3]],
    3: [[5, 0, 300]],
    4: [[1, 32, 33, 1024]],
    8: [[17, 250, 0, 512, 1025, 3, 96, 2000]],
    16: [[(i * 131) % 1500 + (i % 3) for i in range(16)]],
}


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("b,seq_lens", [(b, s) for b, cases in SEQ_CASES.items() for s in cases])
def test_attention_matches_the_fp32_reference(b, seq_lens, block_size):
    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + sum(seq_lens) + block_size)
    q_nope, q_pe, cache, block_table, seq = attention_inputs(b, seq_lens, block_size, gen)
    out = torch.full((b, HEADS * LORA), float("nan"), device="cuda", dtype=torch.bfloat16)
    attn = PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE)
    attn.run(q_nope, q_pe, seq, block_table, out)
    torch.cuda.synchronize()
    check_attention(out, q_nope, q_pe, cache, block_table, seq, block_size)


@pytest.mark.parametrize(
    "b,seq_lens", [(1, [700]), (1, [5000]), (1, [20000]), (2, [9000, 3]), (4, [1, 32, 33, 1024])]
)
def test_a_zero_query_averages_every_row(b, seq_lens):
    """q = 0: every weight is exactly 1, the output the mean of the request's latent
    rows, so a tile or split left out (or counted twice) shows even at 20000 tokens."""
    gen = torch.Generator(device="cuda").manual_seed(b * 7 + sum(seq_lens))
    q_nope, q_pe, cache, block_table, seq = attention_inputs(b, seq_lens, 64, gen)
    q_nope.zero_()
    q_pe.zero_()
    out = torch.empty(b, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
    PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE).run(
        q_nope, q_pe, seq, block_table, out
    )
    torch.cuda.synchronize()
    check_attention(out, q_nope, q_pe, cache, block_table, seq, 64, uniform=True)


def test_block_tables_of_any_width_share_one_compile():
    """The table's row stride is a launch argument: the executor's warmup table (one
    column) and vLLM's (max blocks per request) must not compile twice, or the second
    compile would happen inside graph capture."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    q_nope, q_pe, cache, block_table, seq = attention_inputs(2, [100, 40], 16, gen)
    attn = PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE)
    out = torch.empty(2, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
    attn.run(q_nope, q_pe, torch.zeros_like(seq), block_table[:, :1].contiguous(), out)
    wide = torch.zeros(2, 1300, dtype=torch.int32, device="cuda")
    wide[:, : block_table.shape[1]] = block_table
    attn.run(q_nope, q_pe, seq, wide, out)
    torch.cuda.synchronize()
    assert len(attn._fns) == 1
    check_attention(out, q_nope, q_pe, cache, wide, seq, 16)


def test_attention_reads_a_strided_cache_view():
    gen = torch.Generator(device="cuda").manual_seed(11)
    q_nope, q_pe, cache, block_table, seq = attention_inputs(4, [40, 1, 600, 129], 16, gen, 2)
    assert not cache.is_contiguous()
    out = torch.empty(4, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
    PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE).run(
        q_nope, q_pe, seq, block_table, out
    )
    torch.cuda.synchronize()
    check_attention(out, q_nope, q_pe, cache, block_table, seq, 16)


def test_the_newest_row_is_read_after_the_cache_row_kernel_wrote_it():
    """The decode chain: the cache-row kernel (PDL) writes each request's newest row,
    the attention (PDL, older rows loaded before its wait) must see it."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, block_size = 8, 16
    seq_lens = [1, 2, 33, 200, 64, 0, 999, 17]
    q_nope, q_pe, cache, block_table, seq = attention_inputs(b, seq_lens, block_size, gen)
    proj = (torch.randn(b, PROJ_WIDTH, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    slots = torch.full((b,), -1, dtype=torch.int64)
    for i, n in enumerate(seq_lens):
        if n:
            pos = n - 1
            slots[i] = int(block_table[i, pos // block_size]) * block_size + pos % block_size
    slots = slots.cuda()
    cache.view(-1, WIDTH)[slots[slots >= 0]] = float("nan")  # stale until written
    gamma = (1 + 0.1 * torch.randn(LORA, generator=gen, device="cuda")).to(torch.bfloat16)
    row_kernel = PreparedMlaCacheRow(gamma, EPS, cache, rope=ROPE)
    attn = PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE)
    out = torch.empty(b, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
    # Warm both up (compiles) on the same inputs, then check a chained graph replay.
    row_kernel.run(proj[:, Q_WIDTH:], slots)
    attn.run(q_nope, q_pe, seq, block_table, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row_kernel.run(proj[:, Q_WIDTH:], slots)
        attn.run(q_nope, q_pe, seq, block_table, out)
    for _ in range(20):
        cache.view(-1, WIDTH)[slots[slots >= 0]] = float("nan")
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_attention(out, q_nope, q_pe, cache, block_table, seq, block_size)


def test_attention_graph_replays_are_bit_identical():
    gen = torch.Generator(device="cuda").manual_seed(9)
    q_nope, q_pe, cache, block_table, seq = attention_inputs(4, [1000, 33, 0, 4000], 64, gen)
    out = torch.empty(4, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
    attn = PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE)
    attn.run(q_nope, q_pe, seq, block_table, out)
    torch.cuda.synchronize()
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_nope, q_pe, seq, block_table, out)
    for _ in range(300):
        out.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    # The lengths are read on the device at every replay: a longer step is attended.
    seq[0] = 1001
    graph.replay()
    torch.cuda.synchronize()
    check_attention(out, q_nope, q_pe, cache, block_table, seq, 64)


def test_layers_may_share_one_workspace():
    gen = torch.Generator(device="cuda").manual_seed(13)
    ws = attention_workspace(HEADS, LORA, torch.device("cuda"))
    runs = []
    for layer in range(3):
        q_nope, q_pe, cache, block_table, seq = attention_inputs(2, [300 + layer, 77], 16, gen)
        out = torch.empty(2, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
        attn = PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE, workspace=ws)
        attn.run(q_nope, q_pe, seq, block_table, out)
        runs.append((out, q_nope, q_pe, cache, block_table, seq))
    torch.cuda.synchronize()
    for run in runs:
        check_attention(*run, 16)


def test_attention_matches_vllms_flashattention_mla():
    """The kernel it replaces, on the same cache and query (skips without vLLM)."""
    fa = pytest.importorskip("vllm.vllm_flash_attn", reason="vLLM is not installed")
    gen = torch.Generator(device="cuda").manual_seed(17)
    b, block_size, seq_lens = 4, 64, [1, 513, 1024, 77]
    q_nope, q_pe, cache, block_table, seq = attention_inputs(b, seq_lens, block_size, gen)
    out = torch.empty(b, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
    PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE).run(
        q_nope, q_pe, seq, block_table, out
    )
    theirs = fa.flash_attn_varlen_func(
        q=q_pe.contiguous(),
        k=cache[..., LORA:].unsqueeze(-2),
        v=cache[..., :LORA].unsqueeze(-2),
        q_v=q_nope.view(b, HEADS, LORA),
        max_seqlen_q=1,
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
        max_seqlen_k=max(seq_lens),
        seqused_k=seq,
        block_table=block_table,
        softmax_scale=SCALE,
        causal=True,
        fa_version=3,
    )
    torch.cuda.synchronize()
    ref, spread = attention_reference(q_nope, q_pe, cache, block_table, seq, block_size)
    got, fa_out = out.view(b, HEADS, LORA).float(), theirs.view(b, HEADS, LORA).float()
    # Both within the rounding bound of the FP32 reference, and of each other.
    limit = 2**-7 * (spread + ref.abs()) + 1e-5
    assert bool(((fa_out - ref).abs() <= limit).all()), "FlashAttention-3 itself is off"
    assert bool(((got - fa_out).abs() <= 2 * limit).all())


def test_attention_refuses_bad_input_before_launch():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_nope, q_pe, cache, block_table, seq = attention_inputs(2, [10, 20], 16, gen)
    attn = PreparedMlaDecodeAttention(cache, HEADS, SCALE, rope=ROPE)
    out = torch.empty(2, HEADS * LORA, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside 1..16"):
        attn.run(q_nope.new_zeros(17, HEADS * LORA), q_pe, seq, block_table, out)
    with pytest.raises(TypeError, match="bfloat16"):
        attn.run(q_nope.float(), q_pe, seq, block_table, out)
    with pytest.raises(ValueError, match="q_pe must be"):
        attn.run(q_nope, q_pe[:, :, :32], seq, block_table, out)
    with pytest.raises(ValueError, match="seq_lens must be"):
        attn.run(q_nope, q_pe, seq.long(), block_table, out)
    with pytest.raises(ValueError, match="block_table must be"):
        attn.run(q_nope, q_pe, seq, block_table.long(), out)
    with pytest.raises(ValueError, match="out must be"):
        attn.run(q_nope, q_pe, seq, block_table, out[:1])
    with pytest.raises(ValueError, match="workspace must be"):
        PreparedMlaDecodeAttention(cache, HEADS, SCALE, workspace=torch.empty(8, device="cuda"))
    with pytest.raises(ValueError, match="built for 32 heads"):
        PreparedMlaDecodeAttention(cache, 16, SCALE).run(
            q_nope[:, : 16 * LORA], q_pe[:, :16], seq, block_table, out[:, : 16 * LORA]
        )

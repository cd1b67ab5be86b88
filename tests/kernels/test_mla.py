# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MLA latent-cache row (kernels/mla) against a pure-torch FP32 reference.

Kimi-Linear-48B-A3B's MLA: kv_a output rows of 512 latent + 64 rope columns, read as
columns of the q | kv_a projection (row stride 6720); vLLM's bf16 cache [blocks,
block_size, 576]. M = 1..16, slots in any order, padding rows (slot -1). Needs an SM90
GPU and nvidia-cutlass-dsl; skips with the reason otherwise.

Tolerance: the written latent must be within one bf16 rounding of the FP32 reference
(|got - ref| <= 2^-8 |ref| + 1e-6: the kernel rounds once, like vLLM's RMSNorm kernel;
the FP32 sum of squares differs from the reference's in the last bits only). k_pe is
copied bit for bit, and no other cache row may change.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the MLA kernel runs on SM90 only", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip(f"needs an SM90 GPU, found {torch.cuda.get_device_name()}", allow_module_level=True)

from kernels.mla.prepared import PreparedMlaCacheRow  # noqa: E402

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

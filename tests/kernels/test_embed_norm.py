# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused embedding + first RMSNorm launch (kernels/embed_norm) against torch.

``residual`` must be the embedding rows bit for bit; ``x`` within one bf16 ulp of
the norm rounded as the package's kernels round it (bf16 after the 1/rms scale,
again after gamma; the sum of squares' order and the rsqrt are the kernel's).
The compile check runs anywhere CuTe DSL is installed; the rest needs an SM90
GPU and skips with the reason otherwise.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ptx  # noqa: E402

from kernels.embed_norm.kernel import EmbedRmsNormKernel  # noqa: E402

HIDDEN, VOCAB, EPS = 2304, 163840, 1e-5
needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 GPU (H200) to launch the kernel",
)


def _ptr(dtype, align=16):
    # Any aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)


def _compile():
    kern = EmbedRmsNormKernel(HIDDEN, EPS)
    bf16 = _ptr(cutlass.BFloat16)
    ids = _ptr(cutlass.Int32, 4)
    return cute.compile(kern, ids, bf16, bf16, bf16, bf16, cutlass.Int32(1), cuda.CUstream(0))


def test_compiles_and_lets_its_dependent_launch_first(tmp_path):
    """launch_dependents before anything else; the ids read after the wait; one
    16-byte load per thread for the row and the gamma chunk; no local memory."""
    assert _compile()
    ptx = compiled_ptx(tmp_path, "test_embed_norm", "_compile()")
    first, trigger, rest = ptx.partition("griddepcontrol.launch_dependents;")
    assert trigger and "ld.global" not in first
    before, wait, after = rest.partition("griddepcontrol.wait;")
    assert wait and "ld.global.b32" not in before and "ld.global.b32" in after
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_a_row_that_is_not_whole_chunks_is_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        EmbedRmsNormKernel(2300, EPS)


def _reference(rows, gamma):
    r = rows.float()
    rstd = torch.rsqrt(r.pow(2).sum(dim=-1, keepdim=True) / HIDDEN + EPS)
    return ((r * rstd).to(torch.bfloat16).float() * gamma.float()).to(torch.bfloat16)


def _within_one_bf16_ulp(got, ref, what):
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(2**-20)
    excess = ((got.float() - ref.float()).abs() - ulp).max().item()
    assert excess <= 0, f"{what}: {excess:.3e} beyond one bf16 ulp"


@pytest.fixture(scope="module")
def weights():
    from kernels.embed_norm.prepared import PreparedEmbedNorm

    g = torch.Generator(device="cuda").manual_seed(0)
    embed = (torch.rand(VOCAB, HIDDEN, generator=g, device="cuda") * 2e-3 - 1e-3).to(torch.bfloat16)
    embed[7] = (torch.randn(HIDDEN, generator=g, device="cuda") * 30).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).to(torch.bfloat16)
    return embed, gamma, PreparedEmbedNorm(embed, gamma, EPS)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 64])
def test_rows_and_their_norm(weights, rows):
    embed, gamma, prepared = weights
    ids = torch.randint(0, VOCAB, (rows,), dtype=torch.int32, device="cuda")
    ids[0] = 7  # a row of large values
    ids[-1] = VOCAB - 1
    residual = torch.full((rows, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    x = torch.full_like(residual, float("nan"))
    prepared.run(ids, residual, x)
    torch.cuda.synchronize()
    assert torch.equal(residual, embed[ids.long()]), "residual is not the embedding rows"
    _within_one_bf16_ulp(x, _reference(embed[ids.long()], gamma), "x")


@needs_sm90
@pytest.mark.gpu
def test_graph_replays_follow_the_ids(weights):
    embed, gamma, prepared = weights
    ids = torch.tensor([3, 9], dtype=torch.int32, device="cuda")
    residual = torch.empty(2, HIDDEN, dtype=torch.bfloat16, device="cuda")
    x = torch.empty_like(residual)
    prepared.run(ids, residual, x)  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared.run(ids, residual, x)
    for step in range(50):
        ids.copy_(torch.tensor([step, VOCAB - 1 - step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(residual, embed[ids.long()]), step
        _within_one_bf16_ulp(x, _reference(embed[ids.long()], gamma), f"x, replay {step}")


@needs_sm90
@pytest.mark.gpu
def test_bad_inputs_raise_before_launch(weights):
    _, _, prepared = weights
    out = torch.empty(2, HIDDEN, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="int32"):
        prepared.run(torch.zeros(2, dtype=torch.int64, device="cuda"), out, out.clone())
    with pytest.raises(ValueError, match="shape"):
        prepared.run(torch.zeros(3, dtype=torch.int32, device="cuda"), out, out.clone())

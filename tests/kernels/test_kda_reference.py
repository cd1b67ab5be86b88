# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of the KDA reference itself (tests/kernels/kda_reference.py).

Two independent formulations (per-row loop vs batched ops) must agree, the
conv window must shift exactly, padding rows must be untouched, and the delta
rule must write v along k when beta = 1.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from kda_reference import (  # noqa: E402
    HEAD_DIM,
    gate_projection,
    reference_step,
    vectorized_step,
)

HEADS = 4
PROJ = HEADS * HEAD_DIM
SLOTS = 9


def _layer(gen):
    return dict(
        conv_weight=torch.randn(3, PROJ, 4, generator=gen) * 0.5,
        a_log=torch.rand(HEADS, generator=gen) * 2 - 1.5,
        dt_bias=torch.randn(PROJ, generator=gen) * 0.2 - 2.0,
        norm_weight=(1 + 0.1 * torch.randn(HEAD_DIM, generator=gen)).to(torch.bfloat16),
        num_heads=HEADS,
    )


def _inputs(batch, gen):
    bf = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    return (
        bf(batch, PROJ),
        bf(batch, PROJ),
        bf(batch, PROJ),
        bf(batch, PROJ),
        bf(batch, HEADS),
        bf(batch, PROJ),
    )


def _caches(gen):
    conv = torch.randn(SLOTS, 3, 3 * PROJ, generator=gen).to(torch.bfloat16)
    state = torch.randn(SLOTS, HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.1
    return conv, state


@pytest.mark.parametrize("steps", [1, 5])
def test_loop_and_batched_formulations_agree(steps):
    gen = torch.Generator().manual_seed(0)
    layer = _layer(gen)
    conv_a, state_a = _caches(gen)
    conv_b, state_b = conv_a.clone(), state_a.clone()
    slots = torch.tensor([3, 1, 7], dtype=torch.int32)
    for _ in range(steps):
        args = _inputs(3, gen)
        out_a = reference_step(*args, slots, conv_a, state_a, **layer)
        out_b = torch.empty_like(out_a)
        vectorized_step(*args, slots, conv_b, state_b, out=out_b, **layer)
        assert torch.equal(conv_a, conv_b)
        torch.testing.assert_close(state_a, state_b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out_a.float(), out_b.float(), rtol=1e-2, atol=1e-2)


def test_conv_shift_padding_rows_and_untouched_slots():
    gen = torch.Generator().manual_seed(1)
    layer = _layer(gen)
    conv, state = _caches(gen)
    conv0, state0 = conv.clone(), state.clone()
    slots = torch.tensor([0, 4, -1, 2], dtype=torch.int32)
    q, k, v, g1, b, g2 = _inputs(4, gen)
    out = reference_step(q, k, v, g1, b, g2, slots, conv, state, **layer)
    assert out[0].isnan().all() and out[2].isnan().all()
    assert not out[1].isnan().any() and not out[3].isnan().any()
    for row, slot in ((1, 4), (3, 2)):
        assert torch.equal(conv[slot, 0:2], conv0[slot, 1:3])
        assert torch.equal(conv[slot, 2], torch.cat((q[row], k[row], v[row])))
    untouched = [s for s in range(SLOTS) if s not in (2, 4)]
    assert torch.equal(conv[untouched], conv0[untouched])
    assert torch.equal(state[untouched], state0[untouched])


def test_beta_one_writes_v_along_k():
    """With beta = 1 the updated state maps the normalised key to the value:
    S' k = S_d k + (v - S_d k) |k|^2 = v for |k| = 1 (up to the 1e-6 eps)."""
    gen = torch.Generator().manual_seed(2)
    layer = _layer(gen)
    conv, state = _caches(gen)
    slots = torch.tensor([5], dtype=torch.int32)
    q, k, v, g1, _, g2 = _inputs(1, gen)
    beta_logits = torch.full((1, HEADS), 60.0).to(torch.bfloat16)  # sigmoid -> 1
    history = conv[5].clone().float()
    reference_step(q, k, v, g1, beta_logits, g2, slots, conv, state, **layer)
    proj = PROJ

    def conv_out(s, x):
        w = layer["conv_weight"][s]
        acc = w[:, 3] * x[0].float()
        for t in range(3):
            acc = acc + w[:, t] * history[t, s * proj : (s + 1) * proj]
        return torch.nn.functional.silu(acc).to(torch.bfloat16).float()

    ks = conv_out(1, k).view(HEADS, HEAD_DIM)
    vs = conv_out(2, v).view(HEADS, HEAD_DIM)
    kn = ks / torch.sqrt((ks * ks).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(torch.einsum("hvk,hk->hv", state[5], kn), vs, rtol=1e-4, atol=1e-4)


def test_gate_projection_is_the_linear_rounded_to_bf16():
    gen = torch.Generator().manual_seed(5)
    low = torch.randn(3, HEAD_DIM, generator=gen).to(torch.bfloat16)
    weight = torch.randn(PROJ, HEAD_DIM, generator=gen).to(torch.bfloat16)
    got = gate_projection(low, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (3, PROJ)
    exact = low.double() @ weight.double().t()
    # One bf16 rounding of an FP32 sum: within half a bf16 ulp (2^-9 relative) + FP32 noise.
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()
    assert not torch.equal(got.float(), (low.float() @ weight.float().t())), "not rounded"

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pure-torch FP32 reference of one KDA decode step (vLLM 0.26.0 semantics).

Follows the stock decode branch of ``KimiGatedDeltaNetAttention`` op by op:
``causal_conv1d_update`` (width 4, SiLU, bf16 output) on q, k, v;
``fused_kda_gate`` (``-exp(A_log) * softplus(g1 + dt_bias)``, threshold 20);
``beta = sigmoid(b)``; ``fused_recurrent_kda`` with in-kernel L2 norm
(eps 1e-6), scale D^-0.5 and a bf16 output; ``FusedRMSNormGated`` (sigmoid,
eps 1e-5).  Rows whose slot is <= 0 are skipped (nothing read or written).

Also used as the benchmark's baseline sequence (``vectorized_step``), which
needs no host sync and so can be captured in a CUDA graph.
"""

import torch

HEAD_DIM = 128


def gate_projection(low_rank: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``f_b(f_a(x))`` from ``f_a(x)`` [B, R] and f_b's weight [H*D, R] (or the
    same for g): FP32 products, rounded to bf16 as the stock linear's output."""
    return (low_rank.float() @ weight.float().t()).to(torch.bfloat16)


def conv_view(conv_state: torch.Tensor, layout: str = "SD") -> torch.Tensor:
    """[slots, 3 taps, channels] view of vLLM's conv state."""
    return conv_state if layout == "SD" else conv_state.transpose(1, 2)


def reference_step(
    q, k, v, g1, beta_logits, g2, slots, conv_state, state,
    conv_weight, a_log, dt_bias, norm_weight, num_heads,
    conv_layout="SD", norm_eps=1e-5,
):  # fmt: skip
    """One step, in place on ``conv_state`` (bf16) and ``state`` (FP32).

    conv_weight: [3, H*D, 4] FP32 (q, k, v).  Returns ``out`` [B, H*D] bf16,
    with NaN in padding rows (the kernel leaves those untouched).
    """
    batch, proj = q.shape
    d = HEAD_DIM
    conv = conv_view(conv_state, conv_layout)
    out = torch.full((batch, proj), float("nan"), dtype=torch.bfloat16, device=q.device)
    for row in range(batch):
        slot = int(slots[row])
        if slot <= 0:
            continue
        streams = []
        for s, x in enumerate((q, k, v)):
            channels = slice(s * proj, (s + 1) * proj)
            history = conv[slot, :, channels].float()  # [3, proj]
            w = conv_weight[s].float()  # [proj, 4]
            acc = w[:, 3] * x[row].float()
            for t in range(3):
                acc = acc + w[:, t] * history[t]
            conv[slot, 0:2, channels] = conv[slot, 1:3, channels].clone()
            conv[slot, 2, channels] = x[row]
            streams.append(torch.nn.functional.silu(acc).to(torch.bfloat16).float())
        qs, ks, vs = (t.view(num_heads, d) for t in streams)
        pre = g1[row].float() + dt_bias.float()
        softplus = torch.where(pre > 20.0, pre, torch.log(1.0 + torch.exp(pre)))
        gate = -torch.exp(a_log.float().view(num_heads, 1)) * softplus.view(num_heads, d)
        beta = torch.sigmoid(beta_logits[row].float())  # [H]
        qn = qs / torch.sqrt((qs * qs).sum(-1, keepdim=True) + 1e-6) * d**-0.5
        kn = ks / torch.sqrt((ks * ks).sum(-1, keepdim=True) + 1e-6)
        s_mat = state[slot].float() * torch.exp(gate)[:, None, :]  # [H, V, K]
        kv = torch.einsum("hvk,hk->hv", s_mat, kn)
        delta = beta[:, None] * (vs - kv)
        s_mat = s_mat + delta[:, :, None] * kn[:, None, :]
        o = torch.einsum("hvk,hk->hv", s_mat, qn)
        state[slot] = s_mat
        o = o.to(torch.bfloat16).float()
        rstd = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps)
        y = o * rstd * norm_weight.float() * torch.sigmoid(g2[row].float().view(num_heads, d))
        out[row] = y.reshape(proj).to(torch.bfloat16)
    return out


def vectorized_step(
    q, k, v, g1, beta_logits, g2, slots, conv_state, state,
    conv_weight, a_log, dt_bias, norm_weight, num_heads, out, norm_eps=1e-5,
):  # fmt: skip
    """The same step as batched torch ops for rows that are all active
    (slots > 0, distinct); no host sync, so it can be graph-captured.  The
    stock sequence's structure: three convs, gate, recurrence, gated norm."""
    batch, proj = q.shape
    d = HEAD_DIM
    idx = slots[:batch].long()
    streams = []
    for s, x in enumerate((q, k, v)):
        channels = slice(s * proj, (s + 1) * proj)
        history = conv_state[idx, :, channels]  # [B, 3, proj]
        window = torch.cat((history, x[:, None, :]), dim=1)  # [B, 4, proj]
        acc = (window.float() * conv_weight[s].t()[None]).sum(1)
        conv_state[idx, :, channels] = window[:, 1:]
        streams.append(torch.nn.functional.silu(acc).to(torch.bfloat16).float())
    qs, ks, vs = (t.view(batch, num_heads, d) for t in streams)
    pre = g1.float() + dt_bias
    gate = -torch.exp(a_log.view(1, num_heads, 1)) * torch.nn.functional.softplus(
        pre, threshold=20.0
    ).view(batch, num_heads, d)
    beta = torch.sigmoid(beta_logits.float())
    qn = qs / torch.sqrt((qs * qs).sum(-1, keepdim=True) + 1e-6) * d**-0.5
    kn = ks / torch.sqrt((ks * ks).sum(-1, keepdim=True) + 1e-6)
    s_mat = state[idx] * torch.exp(gate)[:, :, None, :]
    kv = torch.einsum("bhvk,bhk->bhv", s_mat, kn)
    delta = beta[..., None] * (vs - kv)
    s_mat = s_mat + delta[..., None] * kn[:, :, None, :]
    o = torch.einsum("bhvk,bhk->bhv", s_mat, qn)
    state[idx] = s_mat
    o = o.to(torch.bfloat16).float()
    rstd = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps)
    y = o * rstd * norm_weight.float() * torch.sigmoid(g2.float().view(batch, num_heads, d))
    out.copy_(y.reshape(batch, proj))
    return out

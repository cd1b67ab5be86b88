# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pure-torch FP32 reference of the Kimi MoE block (vLLM 0.26.0 semantics).

``KimiMoE`` + ``GroupedTopKRouter`` (one group, sigmoid scoring, score
correction bias, renormalise, routed scaling) + the unquantized experts + the
shared expert, optionally followed by the residual add and RMSNorm of the next
layer's input norm.
"""

import torch
import torch.nn.functional as F

RENORM_EPS = 1e-20


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """FP64 logits rounded to bf16 (the stock gate is a bf16 GEMM), as fp32."""
    exact = x.double() @ gate_weight.double().T
    return exact.to(torch.bfloat16).float()


def select_experts(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    scale: float,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [M, k] int64 in choice order, weights [M, k] fp32); ties in the
    biased score go to the lower expert id."""
    scores = torch.sigmoid(logits.float())
    biased = scores + bias.float()
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return ids, weights * scale


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SiLU(x Wg^T) * (x Wu^T) W2^T in FP32; ``w13`` is ``[2I, H]``."""
    inter = w13.shape[0] // 2
    gate_up = x.float() @ w13.float().T
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return h @ w2.float().T


def moe_reference(
    x, ids, weights, w13, w2, shared_gate_up, shared_down,
    residual=None, rmsnorm_weight=None, eps=1e-5,
):  # fmt: skip
    """FP32 MoE output for the given routing; with ``rmsnorm_weight`` returns
    ``(normed, new_residual)`` of ``residual + moe``, else the MoE output."""
    out = expert_mlp(x, shared_gate_up, shared_down)
    for e in ids.unique().tolist():
        token, choice = (ids == e).nonzero(as_tuple=True)
        y = expert_mlp(x[token], w13[e], w2[e])
        out.index_add_(0, token, y * weights[token, choice].unsqueeze(1))
    if rmsnorm_weight is None:
        return out
    hidden = out + residual.float()
    rstd = torch.rsqrt(hidden.pow(2).mean(dim=-1, keepdim=True) + eps)
    return hidden * rstd * rmsnorm_weight.float(), hidden

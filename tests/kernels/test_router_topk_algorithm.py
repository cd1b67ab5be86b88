# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The router's top-k selection, simulated in torch on CPU (the algorithm, not
the kernel): each lane sorts its experts' keys with ``lane_sort_network``, then
every round takes the max of the lanes' heads and the lowest head id holding
it, and the winning lane shifts its list.  It must give exactly a stable
descending sort's first top-k ids (ties to the lower expert id).
"""

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

from kernels.moe.kernel import REMOVED_KEY, lane_sort_network  # noqa: E402

LANES = 32
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _lane_topk(keys: torch.Tensor, top_k: int) -> torch.Tensor:
    """The kernel's selection for keys ``[tokens, E]``: ids ``[tokens, top_k]``."""
    tokens, e = keys.shape
    per_lane = e // LANES
    ids = torch.arange(e).expand(tokens, e).reshape(tokens, LANES, per_lane)
    # Slot per_lane: the sentinel a lane shifts in once its experts are taken.
    k = torch.cat([keys.reshape(tokens, LANES, per_lane),
                   torch.full((tokens, LANES, 1), REMOVED_KEY)], dim=2)  # fmt: skip
    i = torch.cat([ids, torch.full((tokens, LANES, 1), e)], dim=2)
    for a, b in lane_sort_network(per_lane, min(per_lane, top_k)):
        ka, kb, ia, ib = k[..., a], k[..., b], i[..., a], i[..., b]
        swap = (kb > ka) | ((kb == ka) & (ib < ia))
        k[..., a], k[..., b] = torch.maximum(ka, kb), torch.minimum(ka, kb)
        i[..., a], i[..., b] = torch.where(swap, ib, ia), torch.where(swap, ia, ib)
    chosen = []
    for r in range(top_k):
        best = k[..., 0].max(dim=1, keepdim=True).values
        winner = torch.where(k[..., 0] == best, i[..., 0], e).min(dim=1).values
        chosen.append(winner)
        won = i[..., 0] == winner[:, None]
        for j in range(min(per_lane, top_k - 1 - r)):
            k[..., j] = torch.where(won, k[..., j + 1], k[..., j])
            i[..., j] = torch.where(won, i[..., j + 1], i[..., j])
    return torch.stack(chosen, dim=1)


@pytest.mark.parametrize(
    "e, top_k",
    [(256, 8), (256, 1), (256, 32), (32, 8), (64, 8), (128, 4), (512, 8), (1024, 32)],
)
@pytest.mark.parametrize("regime", ["full_range", "heavy_ties", "all_equal"])
def test_lane_sorted_rounds_match_a_stable_sort(e, top_k, regime):
    g = torch.Generator().manual_seed(e * 100 + top_k)
    if regime == "full_range":  # every key an ordered float can have
        keys = torch.randint(INT32_MIN + 1, INT32_MAX, (64, e), generator=g)
    elif regime == "heavy_ties":  # 5 keys (odd tokens 2), extremes included
        pick = torch.randint(0, 5, (64, e), generator=g)
        pick[1::2] %= 2
        keys = torch.tensor([INT32_MAX, 7, 0, -5, INT32_MIN + 1])[pick]
    else:
        keys = torch.full((64, e), 12345)
    want = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(_lane_topk(keys, top_k), want)


def test_the_network_of_8_is_batchers_19():
    net = lane_sort_network(8, 8)
    assert len(net) == 19
    # 0-1 principle: sorts every 0/1 input, so it sorts everything.
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    for a, b in net:
        hi, lo = torch.maximum(bits[:, a], bits[:, b]), torch.minimum(bits[:, a], bits[:, b])
        bits[:, a], bits[:, b] = hi, lo
    assert torch.equal(bits, bits.sort(dim=1, descending=True).values)

"""The benchmark's spread routing (scripts/bench_routing.py) against vLLM's own dummy loader,
on a stand-in module tree with Kimi-Linear's names (CPU).

The engines of `bench_decode.py --routing spread` load through it; what they must show on the
H200 (each worker's summary, the distinct experts near the uniform expectation) is checked
there by bench_decode.py itself."""

from __future__ import annotations

import bench_routing
import pytest
import torch
from torch import nn

from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.weight_utils import initialize_dummy_weights

HIDDEN, EXPERTS, TOP_K = 256, 64, 8


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(HIDDEN, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight.float()


class Moe(nn.Module):
    """KimiMoE's names: ``gate`` (weight [experts, hidden]) carrying the correction bias."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False, dtype=torch.bfloat16)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(EXPERTS, dtype=torch.bfloat16))

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """The top-k experts per row (sigmoid scores plus the bias, as Kimi routes)."""
        logits = x @ self.gate.weight.float().t()
        scores = torch.sigmoid(logits) + self.gate.e_score_correction_bias.float()
        return scores.topk(TOP_K, dim=-1).indices


class Layer(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.post_attention_layernorm = Norm()
        if moe:
            self.block_sparse_moe = Moe()
            self.mlp = self.block_sparse_moe
        else:
            self.mlp = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(moe=False), Layer(moe=True), Layer(moe=True)])


def dummy_model() -> Model:
    model = Model()
    initialize_dummy_weights(model, model_config=None)
    return model


def distinct_experts(layer: Layer, tokens: torch.Tensor) -> int:
    x = layer.post_attention_layernorm(tokens)
    return layer.block_sparse_moe.route(x).unique().numel()


def tokens(count: int) -> torch.Tensor:
    """Residual rows as the dummy model's are: its embedding rows, uniform in +-1e-3."""
    generator = torch.Generator().manual_seed(0)
    return (torch.rand(count, HIDDEN, generator=generator) * 2 - 1) * 1e-3


def test_dummy_weights_route_every_token_to_the_same_experts():
    """What the regime is for: vLLM's dummy init gives every token the same top-k."""
    model = dummy_model()
    assert distinct_experts(model.layers[1], tokens(64)) <= TOP_K + 2


def test_spread_routing_routes_tokens_apart():
    model = dummy_model()
    summary = bench_routing.spread_routing(model)
    n = 16
    uniform = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** n)
    for layer in model.layers[1:]:
        assert distinct_experts(layer, tokens(n)) >= 0.85 * uniform
    assert summary["moe_layers"] == 2 and summary["layers_differ"]
    assert summary["bias_abs_max"] == 0.0
    assert summary["router_weight_std"] == pytest.approx(HIDDEN**-0.5, rel=0.05)


def test_spread_routing_changes_only_the_routers_and_their_norms():
    model, before = dummy_model(), dummy_model()
    bench_routing.spread_routing(model)
    changed = {
        name
        for (name, p), (_, q) in zip(model.named_parameters(), before.named_parameters())
        if not torch.equal(p, q)
    }
    assert changed == {
        f"layers.{i}.{part}"
        for i in (1, 2)
        for part in (
            "post_attention_layernorm.weight",
            "block_sparse_moe.gate.weight",
            "block_sparse_moe.gate.e_score_correction_bias",
        )
    }
    assert torch.all(model.layers[1].post_attention_layernorm.weight == 1)


def test_spread_routing_is_the_same_in_every_engine():
    first, second = dummy_model(), dummy_model()
    bench_routing.spread_routing(first)
    bench_routing.spread_routing(second)
    for p, q in zip(first.parameters(), second.parameters()):
        assert torch.equal(p, q)


def test_a_model_without_moe_layers_is_refused():
    model = nn.Module()
    model.layers = nn.ModuleList([Layer(moe=False)])
    with pytest.raises(RuntimeError, match="no MoE layer"):
        bench_routing.spread_routing(model)


def test_the_load_format_is_registered_with_vllm():
    loader = get_model_loader(LoadConfig(load_format=bench_routing.SPREAD_LOAD_FORMAT))
    assert isinstance(loader, bench_routing.SpreadRoutingLoader)
    model = dummy_model()
    loader.load_weights(model, model_config=None)
    assert bench_routing.SpreadRoutingWorker().hd_routing_summary()["moe_layers"] == 2


def test_the_worker_extension_adds_no_name_vllms_worker_has():
    """vLLM refuses an extension whose attributes the worker class already has."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu_worker import Worker

    extension = resolve_obj_by_qualname(bench_routing.WORKER_EXTENSION)
    assert extension is bench_routing.SpreadRoutingWorker
    added = [a for a in dir(extension) if not a.startswith("__")]
    assert added == ["hd_routing_summary"]
    assert not hasattr(Worker, "hd_routing_summary")

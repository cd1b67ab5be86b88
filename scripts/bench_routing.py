# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmark's "spread" routing regime, imported inside each engine's worker process.

With ``load_format="dummy"`` every parameter is uniform in +-1e-3 (each one drawn from the
same seed, so every layer's router is the same matrix): the router's input ``x * gamma``
has an RMS of ~6e-4, its logits vary by ~1e-5 and the correction bias (+-1e-3), added to
the sigmoid scores before the top-k, picks the experts. Every token of every step routes to
the same 8 experts (``decode_notes.md``, "The benchmark's routing"), so the N > 1 steps read
8 experts' weights per layer where real routing reads up to N x 8.

``SpreadRoutingLoader`` (load format ``hd_spread_routing``) is vLLM's dummy loader followed,
before ``process_weights_after_loading`` (where the specialized executor copies what it
needs, the router's bias among them), by three changes in every MoE layer:

* the router's weight from N(0, 1 / hidden_size), seeded by the parameter's name, so each
  layer routes on its own and the logits have unit variance for a unit-RMS input;
* the correction bias zeroed;
* the norm in front of the router (``post_attention_layernorm``) at 1, so its output has
  unit RMS and the routing follows the token.

Everything else keeps the dummy values, so the step's other bytes are unchanged; a token's
experts then depend on the token (the dummy model's residual stream is its embedding row,
RMS ~6e-4, plus ~1e-5 a layer from the MoE outputs: ~10% after 26 layers) and N requests at
different tokens route apart, as the expert counter of ``bench_decode.py`` checks
(``expected_uniform_experts``).

How it gets into the engine: ``bench_decode.py --routing spread`` starts every engine with
``load_format=SPREAD_LOAD_FORMAT`` and ``worker_extension_cls=WORKER_EXTENSION``; vLLM
imports this module in the worker process to resolve the extension (before it loads the
model), which registers the loader there, and ``collective_rpc("hd_routing_summary")``
returns what the loader changed, so a run that did not get the regime cannot pass for one.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

SPREAD_LOAD_FORMAT = "hd_spread_routing"
WORKER_EXTENSION = f"{__name__}.SpreadRoutingWorker"
# Seeds the router weights (with each parameter's name); any fixed value does.
ROUTER_SEED = 20261205

# Filled by the loader in this process; read back through the worker extension.
_SUMMARY: dict[str, Any] = {}


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """Every (layer name, router, the norm in front of it) of the model's MoE layers: the
    decoder layers with a ``block_sparse_moe`` whose ``gate`` carries the correction bias
    (Kimi-Linear's ``KimiMoE``)."""
    found = []
    for name, layer in model.named_modules():
        moe = getattr(layer, "block_sparse_moe", None)
        norm = getattr(layer, "post_attention_layernorm", None)
        gate = getattr(moe, "gate", None)
        if gate is None or norm is None:
            continue
        if not isinstance(getattr(gate, "e_score_correction_bias", None), torch.Tensor):
            raise RuntimeError(f"{name}: the MoE router has no e_score_correction_bias")
        found.append((name, gate, norm))
    return found


@torch.no_grad()
def spread_routing(model: nn.Module, seed: int = ROUTER_SEED) -> dict[str, Any]:
    """Re-draw every MoE router for routing that follows the token (module docstring);
    returns what changed. Raises when the model has no MoE layer."""
    layers = moe_layers(model)
    if not layers:
        raise RuntimeError(
            "spread routing: the model has no MoE layer (block_sparse_moe with a gate)"
        )
    for name, gate, norm in layers:
        weight = gate.weight
        generator = torch.Generator(device=weight.device)
        generator.manual_seed(seed ^ zlib.crc32(f"{name}.gate.weight".encode()))
        hidden = weight.shape[1]
        drawn = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        drawn.normal_(0.0, hidden**-0.5, generator=generator)
        weight.copy_(drawn)
        gate.e_score_correction_bias.zero_()
        norm.weight.fill_(1.0)
    first = layers[0][1].weight.float()
    return {
        "load_format": SPREAD_LOAD_FORMAT,
        "moe_layers": len(layers),
        "router_weight_std": float(first.std()),
        "router_weight_expected_std": first.shape[1] ** -0.5,
        "bias_abs_max": max(float(g.e_score_correction_bias.abs().max()) for _, g, _ in layers),
        "layers_differ": len(layers) == 1
        or not torch.equal(layers[0][1].weight, layers[1][1].weight),
    }


@register_model_loader(SPREAD_LOAD_FORMAT)
class SpreadRoutingLoader(DummyModelLoader):
    """load_format="dummy", then the spread routers (module docstring)."""

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        super().load_weights(model, model_config)
        _SUMMARY.clear()
        _SUMMARY.update(spread_routing(model))


class SpreadRoutingWorker:
    """Worker extension (``worker_extension_cls``): its import registers the loader in the
    worker's process; ``hd_routing_summary`` says what the loader changed there."""

    def hd_routing_summary(self) -> dict[str, Any]:
        return dict(_SUMMARY)

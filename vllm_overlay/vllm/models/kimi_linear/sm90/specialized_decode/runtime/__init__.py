# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether and how a deployment runs the latency-specialized Kimi-Linear decode.

``additional_config={"decode_backend": "latency_specialized"}`` asks for it; the
default ``"auto"`` keeps the stock decode. ``specialized_decode_config`` is called
while the model is constructed, so an unknown backend or a deployment the
specialized decode cannot serve fails at engine start, naming every reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

import vllm.envs as envs
from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
from vllm.platforms.interface import Platform
from vllm.utils.torch_utils import (
    kv_cache_dtype_str_to_dtype,
    resolve_kv_cache_dtype_string,
)

DECODE_BACKEND_KEY = "decode_backend"
STOCK_DECODE = "auto"
LATENCY_SPECIALIZED_DECODE = "latency_specialized"
DECODE_BACKENDS = (STOCK_DECODE, LATENCY_SPECIALIZED_DECODE)

# Decode batch sizes (requests of one token each) the executor prepares its kernels
# for. It runs only where such a size is also a FULL decode CUDA graph size: vLLM
# pads every other batch to the next captured size.
PREPARED_BATCH_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
# The kernels take at most this many rows: larger prepared sizes (32, 64) run the
# stock decode until they have an M <= 64 variant.
MAX_PREPARED_TOKENS = 16

MODEL_NAME = "Kimi-Linear-48B-A3B"

# kernel_config.moe_backend values under which the routed experts keep vLLM's
# stacked w13 [E, 2I, H] / w2 [E, H, I] layout.
MOE_BACKENDS_IN_TRITON_LAYOUT = ("auto", "triton")

# The shapes the kernels are built for, from the published config.json of
# moonshotai/Kimi-Linear-48B-A3B-Instruct. Keys are KimiLinearConfig attributes;
# "linear_attn_config.x" is key x of its linear_attn_config dict. Scalars a kernel
# takes as an argument (rms_norm_eps, routed_scaling_factor) are not listed.
MODEL_SHAPES: Mapping[str, Any] = MappingProxyType(
    {
        "hidden_size": 2304,
        "vocab_size": 163840,
        "hidden_act": "silu",
        # KDA (Kimi Delta Attention) layers
        "linear_attn_config.num_heads": 32,
        "linear_attn_config.head_dim": 128,
        "linear_attn_config.short_conv_kernel_size": 4,
        # MLA layers
        "num_attention_heads": 32,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        # Feed-forward: a dense MLP in the first layer, MoE in the others
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "intermediate_size": 9216,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "moe_intermediate_size": 1024,
        "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
    }
)

# Which layers (1-based, as linear_attn_config numbers them) use MLA; the others
# use KDA. A model may have any first N of these 27 layers: the GPU tests run a few
# layers of this pattern, the benchmark all of them.
MODEL_NUM_LAYERS = 27
MODEL_MLA_LAYERS = (4, 8, 12, 16, 20, 24, 27)


@dataclass(frozen=True)
class SpecializedDecodeConfig:
    """What the specialized decode executor needs from the deployment."""

    batch_sizes: tuple[int, ...]
    """Prepared batch sizes that are also FULL decode CUDA graph sizes."""
    max_model_len: int
    """Longest sequence (prompt + output) any request may reach."""
    max_num_seqs: int
    """Most requests in one step; bounds the KDA state slots a step indexes."""
    dtype: torch.dtype
    """Weights, activations, the MLA KV cache and the KDA conv state."""
    recurrent_state_dtype: torch.dtype
    """The KDA recurrent state."""


def requested_decode_backend(vllm_config: VllmConfig) -> str:
    """The decode backend additional_config asks for; ValueError if unknown."""
    extra = vllm_config.additional_config
    if not isinstance(extra, Mapping):
        return STOCK_DECODE
    backend = extra.get(DECODE_BACKEND_KEY, STOCK_DECODE)
    if backend not in DECODE_BACKENDS:
        allowed = ", ".join(repr(b) for b in DECODE_BACKENDS)
        raise ValueError(
            f"additional_config[{DECODE_BACKEND_KEY!r}] = {backend!r} is not a "
            f"decode backend; allowed values: {allowed} (default {STOCK_DECODE!r})"
        )
    return backend


def specialized_decode_config(
    vllm_config: VllmConfig, platform: Platform | None = None
) -> SpecializedDecodeConfig | None:
    """The specialized decode's settings, or None for the stock decode.

    Raises ValueError for an unknown decode backend, and for a deployment the
    specialized decode does not support (listing every reason). ``platform``
    defaults to ``vllm.platforms.current_platform``.
    """
    if requested_decode_backend(vllm_config) == STOCK_DECODE:
        return None
    reasons = unsupported(vllm_config, platform)
    if reasons:
        listed = "".join(f"\n  - {reason}" for reason in reasons)
        raise ValueError(
            f"{DECODE_BACKEND_KEY}={LATENCY_SPECIALIZED_DECODE} does not support "
            f"this deployment:{listed}\nChange the deployment, or run the stock "
            f"decode ({DECODE_BACKEND_KEY}={STOCK_DECODE}, the default)."
        )
    # The executor's VLLM_HD_* switches, parsed now (each raises naming its
    # variable) rather than once the weights are loaded.
    from .decode import check_environment

    check_environment()
    return SpecializedDecodeConfig(
        batch_sizes=prepared_batch_sizes(vllm_config),
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        dtype=vllm_config.model_config.dtype,
        recurrent_state_dtype=kda_state_dtypes(vllm_config)[1],
    )


def prepared_batch_sizes(vllm_config: VllmConfig) -> tuple[int, ...]:
    """Prepared sizes that get a FULL decode CUDA graph: vLLM captures decode graphs
    for the capture sizes up to max_num_seqs (one token per request)."""
    captured = vllm_config.compilation_config.cudagraph_capture_sizes or ()
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    return tuple(s for s in PREPARED_BATCH_SIZES if s in captured and s <= max_num_seqs)


def served_batch_sizes(vllm_config: VllmConfig) -> tuple[int, ...]:
    """The prepared sizes the kernels take (``MAX_PREPARED_TOKENS``): the decode
    graphs the executor runs."""
    prepared = prepared_batch_sizes(vllm_config)
    return tuple(s for s in prepared if s <= MAX_PREPARED_TOKENS)


def kda_state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """(conv, recurrent) KDA state dtypes, derived as KimiLinearForCausalLM does."""
    conv, recurrent = MambaStateDtypeCalculator.kda_state_dtype(
        vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype
    )
    return conv, recurrent


def kv_cache_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The MLA KV cache dtype, resolved as the MLA layers resolve it."""
    model_config = vllm_config.model_config
    name = resolve_kv_cache_dtype_string(
        vllm_config.cache_config.cache_dtype, model_config
    )
    return kv_cache_dtype_str_to_dtype(name, model_config)


def unsupported(vllm_config: VllmConfig, platform: Platform | None = None) -> list[str]:
    """Every reason the specialized decode cannot serve this deployment (empty if
    it can). ``platform`` defaults to ``vllm.platforms.current_platform``."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    compilation = vllm_config.compilation_config
    graphs = compilation.cudagraph_mode or CUDAGraphMode.NONE
    full_decode_graphs = graphs.decode_mode() == CUDAGraphMode.FULL
    conv_dtype, recurrent_dtype = kda_state_dtypes(vllm_config)
    kv_dtype = kv_cache_dtype(vllm_config)
    moe_backend = vllm_config.kernel_config.moe_backend

    checks = [
        (not is_sm90(platform), f"GPU is not SM90 (Hopper): {gpu_name(platform)}"),
        *shape_checks(model.hf_text_config),
        (
            parallel.tensor_parallel_size != 1,
            f"tensor parallel size {parallel.tensor_parallel_size} (only 1)",
        ),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism"),
        # DP shards the MoE layers over all ranks even without expert parallelism.
        (parallel.data_parallel_size > 1, "data parallelism"),
        (parallel.enable_expert_parallel, "expert parallelism"),
        (parallel.use_ubatching, "dual batch overlap (DBO / micro-batching)"),
        (vllm_config.lora_config is not None, "LoRA"),
        (vllm_config.speculative_config is not None, "speculative decoding"),
        (model.enable_sleep_mode, "sleep mode"),
        # The runner records each step's routed experts from vLLM's router; the
        # executor routes with its own kernels, so they would read as zeros.
        (
            model.enable_return_routed_experts,
            "returning the routed experts (enable_return_routed_experts)",
        ),
        # The runner then calls the forward without input_ids, so the decode graphs
        # would capture the stock forward without the attention metadata it needs.
        (model.enable_prompt_embeds, "prompt embeddings (enable_prompt_embeds)"),
        # The executor's kernels and split-K reductions differ by batch size.
        (envs.VLLM_BATCH_INVARIANT, "VLLM_BATCH_INVARIANT=1"),
        # It runs only inside FULL decode graphs; eager and PIECEWISE steps run
        # stock, so without FULL decode graphs it would never run.
        (
            not full_decode_graphs,
            "no FULL decode CUDA graphs ("
            + ("enforce_eager" if model.enforce_eager else f"cudagraph_mode {graphs}")
            + ")",
        ),
        # Compiles the whole model, dispatch included, into one graph.
        (
            compilation.mode == CompilationMode.STOCK_TORCH_COMPILE,
            "compilation mode STOCK_TORCH_COMPILE",
        ),
        # Captures through a different wrapper than the FULL graphs it hooks into.
        (envs.VLLM_USE_BREAKABLE_CUDAGRAPH, "VLLM_USE_BREAKABLE_CUDAGRAPH=1"),
        # The runner hooks it needs are in the V1 model runner.
        (vllm_config.use_v2_model_runner, "the V2 model runner"),
        (model.dtype != torch.bfloat16, f"model dtype {model.dtype} (needs bf16)"),
        (model.quantization is not None, f"quantized weights ({model.quantization})"),
        (
            kv_dtype != model.dtype,
            f"KV cache dtype {cache.cache_dtype} ({kv_dtype}) is not the model "
            f"dtype {model.dtype}",
        ),
        (
            conv_dtype != torch.bfloat16,
            f"KDA conv state dtype {conv_dtype} (needs bf16; mamba_cache_dtype "
            f"{cache.mamba_cache_dtype})",
        ),
        (
            recurrent_dtype != torch.float32,
            f"KDA recurrent state dtype {recurrent_dtype} (needs fp32)",
        ),
        # Without it vLLM keeps mamba_cache_mode "none": a request's KDA state slot
        # is its only block-table entry, which the executor reads.
        (cache.enable_prefix_caching, "prefix caching"),
        # The MoE kernel reads vLLM's Triton layout of w13/w2 in place; FlashInfer
        # swaps or re-tiles them at load. On SM90 "auto" picks Triton.
        (
            moe_backend not in MOE_BACKENDS_IN_TRITON_LAYOUT,
            f"MoE backend {moe_backend!r} (needs 'auto' or 'triton': the expert "
            "weights are read in vLLM's Triton layout)",
        ),
        (
            full_decode_graphs and not served_batch_sizes(vllm_config),
            "no prepared batch size the kernels take ("
            + ", ".join(
                str(s) for s in PREPARED_BATCH_SIZES if s <= MAX_PREPARED_TOKENS
            )
            + ") is a FULL decode CUDA graph size (capture sizes "
            f"{compilation.cudagraph_capture_sizes}, max_num_seqs "
            f"{vllm_config.scheduler_config.max_num_seqs})",
        ),
    ]
    return [reason for failed, reason in checks if failed]


def is_sm90(platform: Platform) -> bool:
    return platform.is_cuda() and platform.get_device_capability() == (9, 0)


def gpu_name(platform: Platform) -> str:
    if not platform.is_cuda():
        return f"platform {platform.device_type or 'unknown'}"
    capability = platform.get_device_capability()
    if capability is None:
        return "unknown capability"
    return f"SM{capability.major}{capability.minor}"


_MISSING = "<missing>"


def shape_checks(text_config: Any) -> list[tuple[bool, str]]:
    """One (failed, reason) pair per model shape, then one for the layer pattern."""
    checks = []
    for name, expected in MODEL_SHAPES.items():
        actual = config_value(text_config, name)
        checks.append(
            (
                actual != expected,
                f"not the {MODEL_NAME} shapes: {name} is {actual!r}, "
                f"expected {expected!r}",
            )
        )
    checks.append(layer_pattern_check(text_config))
    return checks


def config_value(text_config: Any, name: str) -> Any:
    owner, _, key = name.rpartition(".")
    if not owner:
        return getattr(text_config, name, _MISSING)
    parent = getattr(text_config, owner, None)
    if not isinstance(parent, Mapping):
        return _MISSING
    return parent.get(key, _MISSING)


def layer_pattern_check(text_config: Any) -> tuple[bool, str]:
    """The model's layers must be the first N layers of the reference model."""
    num_layers = getattr(text_config, "num_hidden_layers", None)
    linear = getattr(text_config, "linear_attn_config", None)
    if not isinstance(linear, Mapping):
        linear = {}
    kda = sorted(linear.get("kda_layers") or ())
    mla = sorted(linear.get("full_attn_layers") or ())
    matches = isinstance(num_layers, int) and 1 <= num_layers <= MODEL_NUM_LAYERS
    if matches:
        expected_mla = [i for i in MODEL_MLA_LAYERS if i <= num_layers]
        expected_kda = [
            i for i in range(1, num_layers + 1) if i not in MODEL_MLA_LAYERS
        ]
        matches = mla == expected_mla and kda == expected_kda
    return (
        not matches,
        f"not the {MODEL_NAME} layer pattern: {num_layers} layers with MLA layers "
        f"{mla} and KDA layers {kda}; expected the first N <= {MODEL_NUM_LAYERS} "
        f"layers of MLA at {list(MODEL_MLA_LAYERS)} and KDA elsewhere",
    )

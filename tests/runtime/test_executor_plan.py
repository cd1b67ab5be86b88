"""CPU tests of the specialized decode executor's binding and step plan.

The executor is built from a stand-in module tree with the attribute names and weight
layouts of vLLM 0.26.0's KimiLinearForCausalLM (model.layers[i].self_attn / mlp / norms,
KimiGatedDeltaNetAttention, KimiMLAAttention -> mla_attn.mla_attn = MLAAttention, KimiMoE
-> experts.routed_experts), at toy sizes, with a kernel factory of fakes that record every
launch and check the shapes the real kernels would. What they cannot check (the kernels'
numerics, vLLM's real modules, graph capture) is the GPU session's job: docs/design/
executor.md lists it.

Run with the wheel venv; until the wheel carries runtime/decode.py the module is loaded from
vllm_overlay/ under its package name.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

DECODE_MODULE = "vllm.models.kimi_linear.sm90.specialized_decode.runtime.decode"
OVERLAY_FILE = (
    Path(__file__).resolve().parents[2]
    / "vllm_overlay/vllm/models/kimi_linear/sm90/specialized_decode/runtime/decode.py"
)


def load_decode_module() -> Any:
    try:
        return importlib.import_module(DECODE_MODULE)
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(DECODE_MODULE, OVERLAY_FILE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[DECODE_MODULE] = module
        spec.loader.exec_module(module)
        return module


decode = load_decode_module()

from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.forward_context import BatchDescriptor  # noqa: E402
from vllm.models.kimi_linear.sm90.specialized_decode.runtime import (  # noqa: E402
    SpecializedDecodeConfig,
)

# Toy sizes; the per-head structure is the 48B model's (KDA H*D == MLA N*V).
HIDDEN, HEADS, HEAD_DIM = 64, 2, 16
PROJ = HEADS * HEAD_DIM
NOPE, ROPE, LORA, V_HEAD = 16, 8, 32, 16
INTER, MOE_INTER, EXPERTS, TOP_K = 48, 16, 8, 2
VOCAB, EPS = 100, 1e-6
# 0-based: layer 3 is MLA (the 48B model's layer 4), layer 0 dense, others MoE.
KINDS = ("kda", "kda", "kda", "mla")


def linear(out_features: int, in_features: int) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(out_features, in_features), False)
    return module


def rms_norm(width: int) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(torch.rand(width) + 0.5, False)
    module.variance_epsilon = EPS
    return module


def kda_attention(prefix: str) -> nn.Module:
    attn = nn.Module()
    attn.prefix, attn.head_dim, attn.local_num_heads = prefix, HEAD_DIM, HEADS
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, linear(PROJ, HIDDEN))
    attn.b_proj = linear(HEADS, HIDDEN)
    attn.f_a_proj, attn.g_a_proj = linear(HEAD_DIM, HIDDEN), linear(HEAD_DIM, HIDDEN)
    attn.f_b_proj, attn.g_b_proj = linear(PROJ, HEAD_DIM), linear(PROJ, HEAD_DIM)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = nn.Module()
        conv.weight = nn.Parameter(torch.randn(PROJ, 1, 4), False)
        setattr(attn, name, conv)
    attn.A_log = nn.Parameter(torch.randn(1, 1, HEADS, 1), False)
    attn.dt_bias = nn.Parameter(torch.randn(PROJ), False)
    attn.o_norm = nn.Module()
    attn.o_norm.weight = nn.Parameter(torch.rand(HEAD_DIM), False)
    attn.o_norm.eps = 1e-5
    attn.o_proj = linear(HIDDEN, PROJ)
    attn.kv_cache = []  # vLLM's value before a cache is bound / after cleanup
    return attn


# The softmax scale vLLM's MLA backend impl holds (qk_head_dim^-0.5).
MLA_SCALE = (NOPE + ROPE) ** -0.5


class FakeMlaImpl:
    """vLLM's backend impl: the executor reads its scale and calls only
    FlashAttention-3's decode on it (graphs above MLA_OWN_ATTENTION_MAX_BATCH)."""

    def __init__(self) -> None:
        self.scale = MLA_SCALE
        self.calls: list[tuple] = []
        self.log: list | None = None  # a FakeKernels log, to see the launch order

    def forward_mqa(self, q, kv_cache, metadata, layer):
        ql_nope, q_pe = q
        batch = ql_nope.shape[0]
        assert ql_nope.shape == (batch, HEADS, LORA) and q_pe.shape == (batch, HEADS, ROPE)
        assert layer.impl is self and kv_cache is layer.kv_cache
        out = torch.ones(batch, HEADS, LORA)
        self.calls.append(("forward_mqa", (ql_nope, q_pe), metadata, out))
        if self.log is not None:
            self.log.append(("forward_mqa", None, (), {}))
        return out, None

    def __getattr__(self, name):
        raise AssertionError(f"the executor used the stock MLA impl's {name!r}")


def mla_attention(prefix: str) -> nn.Module:
    self_attn = nn.Module()
    self_attn.num_local_heads, self_attn.kv_lora_rank = HEADS, LORA
    self_attn.qk_nope_head_dim, self_attn.qk_rope_head_dim = NOPE, ROPE
    self_attn.v_head_dim = V_HEAD
    self_attn.q_proj = linear(HEADS * (NOPE + ROPE), HIDDEN)
    self_attn.kv_a_proj_with_mqa = linear(LORA + ROPE, HIDDEN)
    self_attn.kv_a_layernorm = rms_norm(LORA)
    self_attn.o_proj = linear(HIDDEN, HEADS * V_HEAD)
    mla = nn.Module()
    mla.layer_name = f"{prefix}.attn"
    # As vLLM 0.26.0's process_weights_after_loading derives them from kv_b_proj.
    kv_b = torch.randn(HEADS * (NOPE + V_HEAD), LORA)
    self_attn.kv_b_proj = nn.Module()
    self_attn.kv_b_proj.weight = nn.Parameter(kv_b, False)
    w_uk, w_uv = kv_b.T.view(LORA, HEADS, NOPE + V_HEAD).split([NOPE, V_HEAD], dim=-1)
    mla.W_UK_T = w_uk.permute(1, 2, 0)
    mla.W_UV = w_uv.transpose(0, 1)
    mla.impl = FakeMlaImpl()
    mla.kv_cache = torch.tensor([])
    mla.kv_cache_dtype = "auto"
    mla._k_scale = torch.tensor(1.0)
    self_attn.mla_attn = nn.Module()
    self_attn.mla_attn.mla_attn = mla
    return self_attn


def moe_block(backend: str = "TRITON") -> nn.Module:
    moe = nn.Module()
    moe.gate = linear(EXPERTS, HIDDEN)
    moe.gate.e_score_correction_bias = nn.Parameter(torch.randn(EXPERTS), False)
    moe.routed_scaling_factor = 2.5
    moe.shared_experts = nn.Module()
    moe.shared_experts.gate_up_proj = linear(2 * MOE_INTER, HIDDEN)
    moe.shared_experts.down_proj = linear(HIDDEN, MOE_INTER)
    routed = nn.Module()
    routed.w13_weight = nn.Parameter(torch.randn(EXPERTS, 2 * MOE_INTER, HIDDEN), False)
    routed.w2_weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN, MOE_INTER), False)
    routed.quant_method = SimpleNamespace(unquantized_backend=SimpleNamespace(name=backend))
    moe.experts = nn.Module()
    moe.experts.routed_experts = routed
    return moe


def dense_mlp() -> nn.Module:
    mlp = nn.Module()
    mlp.gate_up_proj = linear(2 * INTER, HIDDEN)
    mlp.down_proj = linear(HIDDEN, INTER)
    return mlp


def stand_in_model(moe_backend: str = "TRITON") -> nn.Module:
    torch.manual_seed(0)
    inner = nn.Module()
    inner.config = SimpleNamespace(num_experts_per_token=TOP_K, moe_renormalize=True)
    inner.embed_tokens = linear(VOCAB, HIDDEN)
    layers = []
    for i, kind in enumerate(KINDS):
        layer = nn.Module()
        prefix = f"model.layers.{i}.self_attn"
        layer.self_attn = kda_attention(prefix) if kind == "kda" else mla_attention(prefix)
        layer.mlp = dense_mlp() if i == 0 else moe_block(moe_backend)
        layer.input_layernorm = rms_norm(HIDDEN)
        layer.post_attention_layernorm = rms_norm(HIDDEN)
        layers.append(layer)
    inner.layers = nn.ModuleList(layers)
    inner.norm = rms_norm(HIDDEN)
    model = nn.Module()
    model.model = inner
    model.lm_head = linear(VOCAB, HIDDEN)
    model.compute_logits = lambda hidden: hidden @ model.lm_head.weight.t()
    return model


class Recorder:
    """A fake kernel: records its launches, checks what the real one checks first."""

    def __init__(self, log: list, kind: str, **bound: Any):
        self.log, self.kind, self.bound = log, kind, bound
        self.extra_bytes = 0
        self.workspace_bytes = 0

    def run(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> None:
        self.log.append((self.kind, self.bound.get("label"), args, kwargs))


class FakeGemm(Recorder):
    def run(self, x, out, residual=None, residual_out=None, sums=None):
        weight, epilogue = self.bound["weight"], self.bound["epilogue"]
        assert x.shape == (x.shape[0], weight.shape[1]) and x.is_contiguous()
        assert 1 <= x.shape[0] <= decode.MAX_PREPARED_TOKENS
        expected = weight.shape[0] // (2 if epilogue == "silu_mul" else 1)
        if epilogue == "residual_sumsq":
            # No normed output: the sums of squares go to the consumer's buffer.
            assert out is None and self.bound["norm"] is None
            assert sums.shape == (16,) and sums.dtype == torch.float32
        else:
            assert sums is None
            assert out.shape == (x.shape[0], expected) and out.is_contiguous()
        if epilogue in ("residual_rmsnorm", "residual_sumsq"):
            assert residual.shape == residual_out.shape == (x.shape[0], expected)
            assert residual.data_ptr() != residual_out.data_ptr()
        else:
            assert residual is None and residual_out is None
        super().run(x, out, residual=residual, residual_out=residual_out, sums=sums)


class FakeKda(Recorder):
    def run(self, q, k, v, g1, beta, g2, slots, out):
        # g1, g2: f_a(x), g_a(x) (the kernel applies f_b, g_b: gate_weights).
        batch = q.shape[0]
        for t in (q, k, v, out):
            assert t.shape == (batch, PROJ) and t.stride(1) == 1
        for t in (g1, g2):
            assert t.shape == (batch, HEAD_DIM) and t.stride(1) == 1
        assert beta.shape == (batch, HEADS) and slots.shape[0] >= batch
        super().run(q, k, v, g1, beta, g2, slots, out)


class FakeGroupedGemm(Recorder):
    def run(self, x, out):
        groups, rows, k = self.bound["weight"].shape
        assert x.dim() == 3 and x.shape[1:] == (groups, k) and x.stride(2) == 1
        assert out.shape == (x.shape[0], groups * rows) and out.is_contiguous()
        super().run(x, out)


class FakeMoe(Recorder):
    def __init__(self, log: list, kind: str, **bound: Any):
        super().__init__(log, kind, **bound)
        self.input_sums = torch.zeros(16, dtype=torch.float32)

    def run(self, x, out, residual=None, residual_out=None):
        assert x.shape == out.shape == residual.shape == residual_out.shape
        # x is written (the router's normed residual): it aliases no input.
        buffers = {t.data_ptr() for t in (x, out, residual, residual_out)}
        assert len(buffers) == 4
        super().run(x, out, residual=residual, residual_out=residual_out)


class FakeMlaCacheRow(Recorder):
    def run(self, kv, slots):
        width = self.bound["kv_cache"].shape[-1]
        assert kv.shape[1] == width and kv.stride(1) == 1
        assert slots.dtype == torch.int64 and slots.shape[0] >= kv.shape[0]
        super().run(kv, slots)


class FakeMlaAttention(Recorder):
    def run(self, q_nope, q_pe, seq_lens, block_table, out):
        batch = q_nope.shape[0]
        assert q_nope.shape == out.shape == (batch, HEADS * LORA)
        assert q_nope.is_contiguous() and out.is_contiguous()
        assert q_pe.shape == (batch, HEADS, ROPE) and q_pe.stride(2) == 1
        assert seq_lens.dtype == block_table.dtype == torch.int32
        assert seq_lens.shape[0] >= batch and block_table.shape[0] >= batch
        super().run(q_nope, q_pe, seq_lens, block_table, out)


class FakeKernels(decode.KernelFactory):
    def __init__(self) -> None:
        super().__init__(clusters=True)
        self.log: list = []
        self.built: list = []

    def gemm(self, weight, epilogue="plain", rmsnorm_weight=None, eps=1e-5, prewait_steps=None,
             min_ctas_per_sm=None, weight_stages=None):  # fmt: skip
        self.gemm_shapes.add(tuple(weight.shape))
        kernel = FakeGemm(
            self.log, "gemm", weight=weight, epilogue=epilogue, norm=rmsnorm_weight, eps=eps,
            prewait_steps=prewait_steps, min_ctas_per_sm=min_ctas_per_sm,
            weight_stages=weight_stages,
        )  # fmt: skip
        self.built.append(kernel)
        return kernel

    def grouped_gemm(self, weight):
        kernel = FakeGroupedGemm(self.log, "grouped_gemm", weight=weight)
        self.built.append(kernel)
        return kernel

    def kda(self, conv_weights, a_log, dt_bias, norm_weight, conv_state, recurrent_state,
            num_heads, norm_eps, conv_layout, gate_weights):  # fmt: skip
        kernel = FakeKda(
            self.log, "kda", conv_state=conv_state, recurrent_state=recurrent_state,
            conv_weights=conv_weights, a_log=a_log, layout=conv_layout,
            gate_weights=gate_weights,
        )  # fmt: skip
        self.built.append(kernel)
        return kernel

    def moe(self, **kwargs):
        kernel = FakeMoe(self.log, "moe", **kwargs)
        self.built.append(kernel)
        return kernel

    def mla_cache_row(self, norm_weight, eps, kv_cache, rope):
        assert kv_cache.shape[-1] == norm_weight.shape[0] + rope
        kernel = FakeMlaCacheRow(self.log, "mla_cache_row", kv_cache=kv_cache, eps=eps)
        self.built.append(kernel)
        return kernel

    def mla_attention_workspace(self, num_heads, lora, device, max_batch):
        assert (num_heads, lora, max_batch) == (HEADS, LORA, 16)
        return torch.empty(64, dtype=torch.float32, device=device)

    def mla_attention(self, kv_cache, num_heads, scale, rope, workspace):
        kernel = FakeMlaAttention(
            self.log, "mla_attention", kv_cache=kv_cache, num_heads=num_heads, scale=scale,
            rope=rope, workspace=workspace,
        )  # fmt: skip
        self.built.append(kernel)
        return kernel

    def rms_norm(self, out, x, weight, eps):
        assert out.shape == x.shape and weight.shape == (x.shape[1],)
        self.log.append(("rms_norm", None, (out, x, weight), {}))

    def embedding(self, out, weight, ids):
        self.log.append(("embedding", None, (out, weight, ids), {}))

    def embed_norm(self, embed_weight, norm_weight, eps):
        log = self.log

        class FakeEmbedNorm:
            def run(self, ids, residual, x):
                assert ids.dtype == torch.int32 and ids.shape[0] == x.shape[0]
                assert residual.shape == x.shape == (ids.shape[0], embed_weight.shape[1])
                log.append(("embed_norm", None, (ids, residual, x), {}))

        assert norm_weight.shape == (embed_weight.shape[1],)
        return FakeEmbedNorm()

    def conv_layout(self):
        return decode.CONV_LAYOUT_SD


def spec_config(batch_sizes=(1, 2, 4, 8, 16, 32, 64)) -> SpecializedDecodeConfig:
    return SpecializedDecodeConfig(
        batch_sizes=tuple(batch_sizes),
        max_model_len=4096,
        max_num_seqs=256,
        dtype=torch.bfloat16,
        recurrent_state_dtype=torch.float32,
    )


def build(model=None, batch_sizes=None, **kwargs):
    kernels = FakeKernels()
    model = model or stand_in_model()
    config = spec_config() if batch_sizes is None else spec_config(batch_sizes)
    executor = decode.KimiLinearDecodeExecutor(model, config, kernels, **kwargs)
    return model, executor, kernels


def own_attention(batch: int) -> bool:
    return batch <= decode.MLA_OWN_ATTENTION_MAX_BATCH


def allocate_caches(model: nn.Module, slots: int = 5, blocks: int = 3) -> None:
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "mla_attn"):
            layer.self_attn.mla_attn.mla_attn.kv_cache = torch.zeros(blocks, 16, LORA + ROPE)
        else:
            layer.self_attn.kv_cache = [
                torch.zeros(slots, 3, 3 * PROJ),
                torch.zeros(slots, HEADS, HEAD_DIM, HEAD_DIM),
            ]


def free_caches(model: nn.Module) -> None:
    """What GPUModelRunner._cleanup_profiling_kv_cache leaves behind."""
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "mla_attn"):
            layer.self_attn.mla_attn.mla_attn.kv_cache = torch.tensor([])
        else:
            layer.self_attn.kv_cache = []


# KDA layers -> KV-cache group, as vLLM groups equal-sized layer sets: two groups here.
KDA_GROUP = {0: 0, 1: 0, 2: 1}


def kda_common_metadata(group: int, batch: int) -> SimpleNamespace:
    """What the patched runner hands a KDA layer it does not build for: its group's
    CommonAttentionMetadata; block-table column 0 holds each row's state slot."""
    table = torch.zeros(max(16, batch), 4, dtype=torch.int32)
    table[:batch, 0] = torch.arange(1, batch + 1, dtype=torch.int32) + 100 * group
    table[:batch, 1:] = -7  # the other columns are never read
    return SimpleNamespace(block_table_tensor=table[:batch], max_query_len=1)


def mla_metadata(batch: int, common: bool) -> SimpleNamespace:
    """What the MLA layer gets: its group's CommonAttentionMetadata from the patched
    runner (the executor builds the layer itself), or FlashAttnMLA's own metadata."""
    seq_lens = torch.arange(batch, dtype=torch.int32) + 5
    table = torch.zeros(batch, 3, dtype=torch.int32)
    if common:
        return SimpleNamespace(seq_lens=seq_lens, block_table_tensor=table, max_query_len=1)
    decode = SimpleNamespace(seq_lens=seq_lens, block_table=table)
    return SimpleNamespace(num_prefills=0, decode=decode)


def forward_context(
    model: nn.Module, batch: int, mla_common: bool | None = None, **overrides: Any
) -> SimpleNamespace:
    """The step's forward context as the patched runner sets it: by default the
    MLA layer gets the common metadata where the executor names it (graphs of
    the own attention) and FlashAttnMLA's metadata otherwise."""
    if mla_common is None:
        mla_common = own_attention(batch)
    metadata, slot_mapping = {}, {}
    groups = [kda_common_metadata(g, batch) for g in sorted(set(KDA_GROUP.values()))]
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.self_attn, "mla_attn"):
            name = layer.self_attn.mla_attn.mla_attn.layer_name
            metadata[name] = mla_metadata(batch, mla_common)
            slot_mapping[name] = torch.arange(batch)
        else:
            metadata[layer.self_attn.prefix] = groups[KDA_GROUP[i]]
    fields = dict(
        attn_metadata=metadata,
        slot_mapping=slot_mapping,
        cudagraph_runtime_mode=CUDAGraphMode.FULL,
        batch_descriptor=BatchDescriptor(num_tokens=batch, num_reqs=batch, uniform=True),
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


# ------------------------------------------------------------------------ binding
def test_kda_input_projections_become_one_weight_the_stock_layers_view():
    model = stand_in_model()
    attn = model.model.layers[1].self_attn
    originals = {n: getattr(attn, n).weight.clone() for n in decode.KDA_IN_PROJ_PARTS}
    _, executor, _ = build(model)
    fused = executor.layers[1].attn.in_proj.weight
    assert fused.shape == (3 * PROJ + HEADS + 2 * HEAD_DIM, HIDDEN)
    row_bytes = HIDDEN * fused.element_size()
    for start, name in zip(executor.layers[1].attn.in_proj.offsets, originals):
        param = getattr(attn, name).weight
        assert param.data_ptr() == fused.data_ptr() + start * row_bytes
        assert param.is_contiguous() and torch.equal(param, originals[name])


def test_without_shared_storage_the_copies_are_counted_and_the_stock_weights_untouched():
    model = stand_in_model()
    q_ptr = model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    _, shared, _ = build(stand_in_model())
    _, copied, _ = build(model, share_storage=False)
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == q_ptr
    kda_copy = (3 * PROJ + HEADS + 2 * HEAD_DIM) * HIDDEN * 4  # fp32 toy weights
    mla_copy = (HEADS * (NOPE + ROPE) + LORA + ROPE) * HIDDEN * 4
    assert copied.extra_bytes - shared.extra_bytes == 3 * kda_copy + mla_copy


def test_mla_moe_dense_and_norm_tensors_are_the_models_own():
    model, executor, kernels = build()
    layers = model.model.layers
    mla = executor.layers[3].attn
    assert mla.attn is layers[3].self_attn.mla_attn.mla_attn
    assert mla.o_proj.data_ptr() == layers[3].self_attn.o_proj.weight.data_ptr()
    moe = next(k for k in kernels.built if k.kind == "moe")
    block = layers[1].mlp
    for name, tensor in (
        ("w13", block.experts.routed_experts.w13_weight),
        ("w2", block.experts.routed_experts.w2_weight),
        ("gate_weight", block.gate.weight),
        ("shared_gate_up", block.shared_experts.gate_up_proj.weight),
        ("shared_down", block.shared_experts.down_proj.weight),
        # MoE -> the next layer's input norm.
        ("rmsnorm_weight", layers[2].input_layernorm.weight),
    ):
        assert moe.bound[name].data_ptr() == tensor.data_ptr(), name
    assert moe.bound["top_k"] == TOP_K and moe.bound["routed_scaling_factor"] == 2.5
    last_moe = [k for k in kernels.built if k.kind == "moe"][-1]
    assert last_moe.bound["rmsnorm_weight"].data_ptr() == model.model.norm.weight.data_ptr()
    gate_up = next(k for k in kernels.built if k.bound.get("epilogue") == "silu_mul")
    assert gate_up.bound["weight"].data_ptr() == layers[0].mlp.gate_up_proj.weight.data_ptr()
    o_proj = next(
        k for k in kernels.built
        if k.kind == "gemm" and k.bound["weight"].data_ptr()
        == layers[0].self_attn.o_proj.weight.data_ptr()
    )  # fmt: skip
    assert o_proj.bound["epilogue"] == "residual_rmsnorm"
    assert o_proj.bound["norm"].data_ptr() == layers[0].post_attention_layernorm.weight.data_ptr()


def test_only_the_kda_in_proj_loads_fewer_weight_steps_before_its_wait():
    model, executor, kernels = build()
    in_projs = {id(layer.attn.in_proj.weight) for layer in executor.layers
                if isinstance(layer.attn, decode.KdaLayer)}  # fmt: skip
    gemms = [k for k in kernels.built if k.kind == "gemm"]
    assert len(in_projs) == 3
    for gemm in gemms:
        want = decode.KDA_IN_PROJ_PREWAIT_STEPS if id(gemm.bound["weight"]) in in_projs else None
        assert gemm.bound["prewait_steps"] == want


def test_the_kda_in_proj_mla_qkv_a_and_dense_gate_up_take_launch_bounds_at_m_bucket_16():
    model, executor, kernels = build()
    bounded = {id(layer.attn.in_proj.weight) for layer in executor.layers
               if isinstance(layer.attn, decode.KdaLayer)}  # fmt: skip
    bounded |= {id(layer.attn.qkv_a.weight) for layer in executor.layers
                if isinstance(layer.attn, decode.MlaLayer)}  # fmt: skip
    bounded |= {id(layer.ffn.gate_up) for layer in executor.layers
                if isinstance(layer.ffn, decode.DenseFfn)}  # fmt: skip
    assert len(bounded) == 5  # the stand-in model: 3 KDA, 1 MLA, 1 dense layer
    gemms = [k for k in kernels.built if k.kind == "gemm"]
    for gemm in gemms:
        want = {16: 4} if id(gemm.bound["weight"]) in bounded else None
        assert gemm.bound["min_ctas_per_sm"] == want
    assert sum(g.bound["min_ctas_per_sm"] is not None for g in gemms) == len(bounded)


def test_only_the_kda_in_proj_streams_its_weight_through_shared_memory_at_m_bucket_8():
    model, executor, kernels = build()
    in_projs = {id(layer.attn.in_proj.weight) for layer in executor.layers
                if isinstance(layer.attn, decode.KdaLayer)}  # fmt: skip
    for gemm in (k for k in kernels.built if k.kind == "gemm"):
        want = {8: 2} if id(gemm.bound["weight"]) in in_projs else None
        assert gemm.bound["weight_stages"] == want
    assert decode.KDA_IN_PROJ_WEIGHT_STAGES == {8: 2}


def test_o_proj_before_a_moe_leaves_the_norm_to_the_router():
    """Before a MoE, o_proj adds the residual and sums its squares into that
    MoE's input_sums; the MoE normalises with the post-attention norm of its
    own layer and writes the normed input it reads."""
    model, executor, kernels = build()
    layers = model.model.layers
    moes = [k for k in kernels.built if k.kind == "moe"]
    for index, moe in zip((1, 2, 3), moes):
        norm = layers[index].post_attention_layernorm
        assert moe.bound["input_norm_weight"].data_ptr() == norm.weight.data_ptr()
        assert moe.bound["input_eps"] == norm.variance_epsilon
        o_proj = next(
            k for k in kernels.built
            if k.kind == "gemm" and k.bound["weight"].data_ptr()
            == layers[index].self_attn.o_proj.weight.data_ptr()
        )  # fmt: skip
        assert o_proj.bound["epilogue"] == "residual_sumsq"
    allocate_caches(model)
    executor.bind_kv_caches()
    kernels.log.clear()
    executor.run(torch.arange(2), torch.arange(2), forward_context(model, 2))
    launches = [e for e in kernels.log if e[0] in ("gemm", "moe")]
    pairs = [(a, b) for a, b in zip(launches, launches[1:]) if b[0] == "moe"]
    assert len(pairs) == len(moes) == 3
    for moe, (o_proj_launch, moe_launch) in zip(moes, pairs):
        assert o_proj_launch[3]["sums"] is moe.input_sums
        residual_out, residual = o_proj_launch[3]["residual_out"], moe_launch[3]["residual"]
        assert residual_out.data_ptr() == residual.data_ptr()


def test_kda_step_gets_f_b_g_b_in_place_and_the_f_a_g_a_columns():
    model, executor, kernels = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    attn = model.model.layers[0].self_attn
    kda = next(k for k in kernels.built if k.kind == "kda")
    f_b, g_b = kda.bound["gate_weights"]
    assert f_b.data_ptr() == attn.f_b_proj.weight.data_ptr()
    assert g_b.data_ptr() == attn.g_b_proj.weight.data_ptr()
    kernels.log.clear()
    executor.run(torch.arange(2), torch.arange(2), forward_context(model, 2))
    q, k, v, g1, beta, g2, *_ = next(args for op, _, args, _ in kernels.log if op == "kda")
    proj = executor.buffers.rows("kda_proj", 2, 3 * PROJ + HEADS + 2 * HEAD_DIM)
    row = proj.element_size()
    columns = {"beta": 3 * PROJ, "f_a": 3 * PROJ + HEADS, "g_a": 3 * PROJ + HEADS + HEAD_DIM}
    for view, column in zip((beta, g1, g2), columns.values()):
        assert view.data_ptr() == proj.data_ptr() + column * row


def test_mla_absorptions_read_w_uv_in_place_and_w_uk_as_rows_of_p():
    model, executor, _ = build()
    self_attn = model.model.layers[3].self_attn
    mla = executor.layers[3].attn
    kv_b = self_attn.kv_b_proj.weight
    # W_UV^T of head h: kv_b_proj rows h*(P+V)+P .. +V-1, no copy.
    assert mla.w_uv.shape == (HEADS, V_HEAD, LORA)
    assert mla.w_uv.data_ptr() == kv_b.data_ptr() + NOPE * LORA * kv_b.element_size()
    assert torch.equal(mla.w_uv[1], kv_b[(NOPE + V_HEAD) + NOPE : 2 * (NOPE + V_HEAD)])
    # W_UK: a [N, L, P] copy, P contiguous, equal to W_UK_T transposed.
    assert mla.w_uk.shape == (HEADS, LORA, NOPE) and mla.w_uk.is_contiguous()
    assert torch.equal(mla.w_uk, self_attn.mla_attn.mla_attn.W_UK_T.transpose(1, 2))


def test_grouped_rows_copies_only_what_the_kernel_cannot_read():
    base = torch.randn(4 * 24, 16)
    view = base.view(4, 24, 16)[:, 8:, :]  # 16 of each group's 24 rows
    same, extra = decode.grouped_rows(view)
    assert same is view and extra == 0
    copy, extra = decode.grouped_rows(view.transpose(1, 2))
    assert copy.is_contiguous() and torch.equal(copy, view.transpose(1, 2))
    assert extra == copy.numel() * copy.element_size()


def test_bind_reads_every_kda_state_and_an_empty_cache_unbinds():
    model, executor, kernels = build()
    assert not executor.bind_kv_caches()
    allocate_caches(model)
    assert executor.bind_kv_caches() and executor.is_bound
    kda = [k for k in kernels.built if k.kind == "kda"]
    assert len(kda) == 3
    for kernel, layer in zip(kda, model.model.layers):
        conv, recurrent = layer.self_attn.kv_cache
        assert kernel.bound["conv_state"] is conv
        assert kernel.bound["recurrent_state"] is recurrent
    # Profiling cache freed: no reference may survive in the executor.
    mla_cache = model.model.layers[3].self_attn.mla_attn.mla_attn.kv_cache
    assert [k.kind for k in kernels.built[-2:]] == ["mla_cache_row", "mla_attention"]
    assert all(k.bound["kv_cache"] is mla_cache for k in kernels.built[-2:])
    attention = kernels.built[-1].bound
    assert attention["scale"] == MLA_SCALE and attention["num_heads"] == HEADS
    assert attention["workspace"] is executor._mla_workspace is not None
    free_caches(model)
    assert not executor.bind_kv_caches() and not executor.is_bound
    assert executor._kda_kernels == {} and executor._mla_cache_kernels == {}
    assert executor._mla_attention_kernels == {}
    # The real cache: bound again, to the new tensors.
    allocate_caches(model, slots=9)
    assert executor.bind_kv_caches()
    kda = [k for k in kernels.built if k.kind == "kda"]
    assert kda[-1].bound["recurrent_state"].shape[0] == 9
    new_cache = model.model.layers[3].self_attn.mla_attn.mla_attn.kv_cache
    assert kernels.built[-1].bound["kv_cache"] is new_cache


def test_without_graphs_for_the_own_attention_it_is_neither_built_nor_given_memory():
    model, executor, kernels = build(batch_sizes=(4, 8))
    assert executor._mla_workspace is None
    allocate_caches(model)
    assert executor.bind_kv_caches()
    assert [k.kind for k in kernels.built].count("mla_attention") == 0
    assert executor._mla_attention_kernels == {} and len(executor._mla_cache_kernels) == 1
    kernels.log.clear()
    fc = forward_context(model, 8)
    executor.run(torch.arange(8), torch.arange(8), fc)
    assert len(model.model.layers[3].self_attn.mla_attn.mla_attn.impl.calls) == 1


def test_partially_allocated_caches_are_refused():
    model, executor, _ = build()
    allocate_caches(model)
    model.model.layers[3].self_attn.mla_attn.mla_attn.kv_cache = torch.tensor([])
    with pytest.raises(RuntimeError, match=r"not for layers \[3\]"):
        executor.bind_kv_caches()


def test_moe_backend_that_repacks_the_experts_is_refused():
    with pytest.raises(ValueError, match="FLASHINFER_CUTLASS"):
        build(stand_in_model(moe_backend="FLASHINFER_CUTLASS"))


# --------------------------------------------------------------------------- plan
def test_plan_is_the_op_sequence_of_each_layer_kind():
    _, executor, _ = build()
    ops = [(s.layer, s.op) for s in executor.plan]
    kda = ["kda_in_proj", "kda_step", "o_proj"]
    mla = ["mla_qkv_a", "mla_w_uk", "mla_cache_row", "mla_decode", "o_proj"]
    expected = [(-1, "kda_state_slots"), (-1, "embed_norm")]
    expected += [(0, op) for op in kda + ["mlp_gate_up", "mlp_down"]]
    expected += [(1, op) for op in kda + ["moe"]]
    expected += [(2, op) for op in kda + ["moe"]]
    expected += [(3, op) for op in mla + ["moe"]]
    assert ops == expected


def test_every_buffer_a_step_reads_was_written_earlier_in_its_layer():
    # Scratch buffers are reused by every layer: a read must see this layer's write,
    # the residual stream and the normed input may come from the layer before.
    _, executor, _ = build()
    last_writer = {"input_ids": -1}
    for step in executor.plan:
        for name in step.reads:
            assert name in last_writer, step
            if name in ("input_ids", "kda_slots"):  # written once per step, up front
                assert last_writer[name] == -1, (step, name)
                continue
            carried = name.startswith(("residual", "x"))
            allowed = (step.layer, step.layer - 1) if carried else (step.layer,)
            assert last_writer[name] in allowed, (step, name, last_writer[name])
        last_writer.update(dict.fromkeys(step.writes, step.layer))


def test_residual_and_activation_buffers_alternate_and_the_output_is_the_last_write():
    _, executor, _ = build()
    for step in executor.plan:
        assert not set(step.reads) & set(step.writes), step
    seams = [s for s in executor.plan if s.op in ("o_proj", "mlp_down", "moe")]
    for before, after in zip(seams, seams[1:]):
        residual_out = next(w for w in before.writes if w.startswith("residual"))
        assert residual_out in after.reads
    assert executor._output in seams[-1].writes


def test_buffers_are_sized_for_the_largest_prepared_batch():
    _, executor, _ = build()
    assert executor.batch_sizes == (1, 2, 4, 8, 16)
    widths = executor.buffers.widths()
    assert widths["kda_proj"] == 3 * PROJ + HEADS + 2 * HEAD_DIM
    assert "kda_g12" not in widths
    assert widths["mla_proj"] == HEADS * (NOPE + ROPE) + LORA + ROPE
    assert widths["attn_out"] == PROJ
    assert widths["mlp_act"] == INTER
    assert all(b.shape[0] == 16 for b in executor.buffers._buffers.values())


# ------------------------------------------------------------------------ running
@pytest.mark.parametrize("mla_common", [True, False], ids=["mla-common", "mla-backend"])
@pytest.mark.parametrize("batch", [1, 2])
def test_run_launches_the_plan_on_static_buffers(batch, mla_common):
    assert own_attention(batch)
    model, executor, kernels = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    kernels.log.clear()
    fc = forward_context(model, batch, mla_common)
    out = executor.run(torch.arange(batch), torch.arange(batch), fc)
    assert out.shape == (batch, HIDDEN)
    assert out.data_ptr() == executor.buffers.rows(executor._output, batch).data_ptr()
    kinds = [entry[0] for entry in kernels.log]
    assert model.model.layers[3].self_attn.mla_attn.mla_attn.impl.calls == []
    # the embedding and the first norm in one launch; 3 KDA layers' in_proj + o_proj,
    # layer 0's MLP, the MLA layer's qkv_a + o_proj; 3 KDA steps; 3 MoE.
    assert kinds.count("embed_norm") == 1 and kinds.count("kda") == 3
    assert kinds.count("moe") == 3 and kinds.count("rms_norm") == 0
    assert kinds.count("gemm") == 3 * 2 + 2 + 2
    # Each group's slots are gathered once into a static row the group's layers share.
    kda_slots = [entry[2][6] for entry in kernels.log if entry[0] == "kda"]
    for i, slots in enumerate(kda_slots):
        table = fc.attn_metadata[f"model.layers.{i}.self_attn"].block_table_tensor
        assert torch.equal(slots[:batch], table[:batch, 0])
        assert slots.is_contiguous()
    assert kda_slots[0] is kda_slots[1] and kda_slots[1] is not kda_slots[2]
    # The MLA layer: qkv_a, W_UK (chained to qkv_a), the cache row, the attention,
    # W_UV, o_proj, MoE.
    mla_kinds = kinds[kinds.index("grouped_gemm") - 1 : kinds.index("grouped_gemm") + 6]
    assert mla_kinds == [
        "gemm", "grouped_gemm", "mla_cache_row", "mla_attention", "grouped_gemm", "gemm", "moe"
    ]  # fmt: skip
    # The attention reads the absorbed query, the q_pe columns of the projection and
    # the layer's own decode metadata, and writes what W_UV reads.
    (attention,) = [e for e in kernels.log if e[0] == "mla_attention"]
    q_nope, q_pe, seq_lens, block_table, latent = attention[2]
    metadata = fc.attn_metadata["model.layers.3.self_attn.attn"]
    if mla_common:  # the group's CommonAttentionMetadata
        assert seq_lens is metadata.seq_lens and block_table is metadata.block_table_tensor
    else:  # FlashAttnMLA's decode metadata (a runner that built it anyway)
        assert seq_lens is metadata.decode.seq_lens
        assert block_table is metadata.decode.block_table
    proj = executor.buffers.rows("mla_proj", batch, executor.buffers.widths()["mla_proj"])
    assert q_pe.data_ptr() == proj.data_ptr() + NOPE * proj.element_size()
    assert q_pe.stride()[1:] == (NOPE + ROPE, 1)
    w_uk_out = [e for e in kernels.log if e[0] == "grouped_gemm"][0][2][1]
    w_uv_in = [e for e in kernels.log if e[0] == "grouped_gemm"][1][2][0]
    assert q_nope.data_ptr() == w_uk_out.data_ptr()
    assert latent.data_ptr() == w_uv_in.data_ptr() and w_uv_in.shape == (batch, HEADS, LORA)
    # The new latent row: the kv_a columns of the projection, the layer's slot mapping.
    (cache_row,) = [e for e in kernels.log if e[0] == "mla_cache_row"]
    kv, slots = cache_row[2]
    assert kv.shape == (batch, LORA + ROPE)
    assert slots is fc.slot_mapping["model.layers.3.self_attn.attn"]


@pytest.mark.parametrize("batch", [4, 16])
def test_larger_graphs_run_flash_attention_3_between_the_absorptions(batch):
    assert not own_attention(batch)
    model, executor, kernels = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    impl = model.model.layers[3].self_attn.mla_attn.mla_attn.impl
    kernels.log.clear()
    impl.log = kernels.log
    fc = forward_context(model, batch)
    executor.run(torch.arange(batch), torch.arange(batch), fc)
    kinds = [entry[0] for entry in kernels.log]
    assert "mla_attention" not in kinds
    # qkv_a, W_UK, the cache row, FA3, W_UV, o_proj, MoE.
    mla_kinds = kinds[kinds.index("grouped_gemm") - 1 : kinds.index("grouped_gemm") + 6]
    assert mla_kinds == [
        "gemm", "grouped_gemm", "mla_cache_row", "forward_mqa", "grouped_gemm", "gemm", "moe"
    ]  # fmt: skip
    ((_, (ql_nope, q_pe), metadata, out),) = impl.calls
    assert metadata is fc.attn_metadata["model.layers.3.self_attn.attn"]
    w_uk_out = [e for e in kernels.log if e[0] == "grouped_gemm"][0][2][1]
    w_uv_in = [e for e in kernels.log if e[0] == "grouped_gemm"][1][2][0]
    assert ql_nope.data_ptr() == w_uk_out.data_ptr()
    proj = executor.buffers.rows("mla_proj", batch, executor.buffers.widths()["mla_proj"])
    assert q_pe.data_ptr() == proj.data_ptr() + NOPE * proj.element_size()
    assert w_uv_in.data_ptr() == out.data_ptr() and w_uv_in.shape == (batch, HEADS, LORA)
    (cache_row,) = [e for e in kernels.log if e[0] == "mla_cache_row"]
    assert cache_row[2][1] is fc.slot_mapping["model.layers.3.self_attn.attn"]


def test_flash_attention_3_without_the_backend_metadata_is_named_in_the_error():
    model, executor, _ = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    fc = forward_context(model, 4, mla_common=True)
    with pytest.raises(RuntimeError, match="FlashAttention-3 needs the MLA backend's metadata"):
        executor.run(torch.arange(4), None, fc)
    # The dispatch test raises too, rather than letting the stock forward run.
    with pytest.raises(RuntimeError, match="FlashAttention-3 needs the MLA backend's metadata"):
        executor.step_applies(fc, capturing=True)
    # Graphs of the own attention take either form.
    assert executor.step_applies(forward_context(model, 2, mla_common=True), capturing=True)
    assert executor.step_applies(forward_context(model, 2, mla_common=False), capturing=True)


def test_run_refuses_unprepared_sizes_and_unbound_caches():
    model, executor, _ = build()
    with pytest.raises(RuntimeError, match="not bound"):
        executor.run(torch.arange(4), None, forward_context(model, 4))
    allocate_caches(model)
    executor.bind_kv_caches()
    for batch in (3, 32):
        with pytest.raises(ValueError, match="not a prepared decode size"):
            executor.run(torch.arange(batch), None, forward_context(model, batch))


def test_no_prepared_size_within_the_kernels_limit_is_refused():
    with pytest.raises(ValueError, match="would never run"):
        decode.KimiLinearDecodeExecutor(stand_in_model(), spec_config((32, 64)), FakeKernels())


def test_warmup_launches_every_kernel_on_padding_rows_only():
    model, executor, kernels = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    kernels.log.clear()
    executor.warmup()
    kda_slots = [entry[2][6] for entry in kernels.log if entry[0] == "kda"]
    assert len(kda_slots) == 3 * len(executor.batch_sizes)
    assert all(int(s.abs().sum()) == 0 for s in kda_slots)
    # The attention compiles on padding rows (length 0): it reads no cache row.
    # FA3 (larger graphs) needs real metadata and is left out; W_UV still runs.
    own_sizes = [b for b in executor.batch_sizes if own_attention(b)]
    assert 0 < len(own_sizes) < len(executor.batch_sizes)
    attention = [e[2] for e in kernels.log if e[0] == "mla_attention"]
    assert len(attention) == len(own_sizes)
    assert model.model.layers[3].self_attn.mla_attn.mla_attn.impl.calls == []
    assert [e[0] for e in kernels.log].count("grouped_gemm") == 2 * len(executor.batch_sizes)
    assert all(int(seq_lens.abs().sum()) == 0 for _, _, seq_lens, _, _ in attention)
    # The cache row compiles on padding slots: it writes nothing.
    cache_rows = [e[2][1] for e in kernels.log if e[0] == "mla_cache_row"]
    assert len(cache_rows) == len(executor.batch_sizes)
    assert all(bool((slots == -1).all()) for slots in cache_rows)


# ----------------------------------------------------------------------- dispatch
@pytest.mark.parametrize(
    ("change", "applies"),
    [
        ({}, True),
        ({"cudagraph_runtime_mode": CUDAGraphMode.PIECEWISE}, False),
        ({"cudagraph_runtime_mode": CUDAGraphMode.NONE}, False),
        ({"batch_descriptor": BatchDescriptor(num_tokens=4, num_reqs=4)}, False),
        ({"batch_descriptor": BatchDescriptor(num_tokens=32, num_reqs=32, uniform=True)}, False),
        ({"batch_descriptor": BatchDescriptor(num_tokens=3, num_reqs=3, uniform=True)}, False),
        ({"batch_descriptor": None}, False),
    ],
)
def test_step_applies_only_to_uniform_full_graph_decode_of_a_prepared_size(change, applies):
    model, executor, _ = build()
    fc = forward_context(model, 4, **change)
    assert executor.step_applies(fc, capturing=True) is applies


def test_step_does_not_apply_outside_capture_or_with_prefills():
    model, executor, _ = build()
    assert not executor.step_applies(forward_context(model, 4), capturing=False)
    fc = forward_context(model, 4)
    fc.attn_metadata["model.layers.1.self_attn"].max_query_len = 2
    assert not executor.step_applies(fc, capturing=True)
    fc = forward_context(model, 4)
    assert not executor.step_applies(fc, inputs_embeds=torch.zeros(4, HIDDEN), capturing=True)
    # The MLA layer's metadata says the step has a prefill, in either form.
    fc = forward_context(model, 2, mla_common=True)
    fc.attn_metadata["model.layers.3.self_attn.attn"].max_query_len = 2
    assert not executor.step_applies(fc, capturing=True)
    fc = forward_context(model, 4, mla_common=False)
    assert executor.step_applies(fc, capturing=True)
    fc.attn_metadata["model.layers.3.self_attn.attn"].num_prefills = 1
    assert not executor.step_applies(fc, capturing=True)
    fc = forward_context(model, 4, mla_common=False)
    fc.attn_metadata["model.layers.3.self_attn.attn"].decode = None
    assert not executor.step_applies(fc, capturing=True)


def test_the_runner_builds_no_kda_or_mla_metadata_for_the_steps_the_executor_serves():
    model, executor, _ = build()
    full = CUDAGraphMode.FULL
    kda = [f"model.layers.{i}.self_attn" for i in KDA_GROUP]
    for batch in executor.batch_sizes:
        served = BatchDescriptor(num_tokens=batch, num_reqs=batch, uniform=True)
        # FA3 reads FlashAttnMLA's metadata: the MLA layer is named only where
        # the own attention runs.
        mla = ["model.layers.3.self_attn.attn"] if own_attention(batch) else []
        assert list(executor.attention_layers_built_by_model(full, served)) == kda + mla
    served = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    for mode, descriptor in [
        (CUDAGraphMode.PIECEWISE, served),
        (full, BatchDescriptor(num_tokens=4, num_reqs=4)),
        (full, BatchDescriptor(num_tokens=32, num_reqs=32, uniform=True)),
        (full, None),
    ]:
        assert executor.attention_layers_built_by_model(mode, descriptor) == ()


def test_a_runner_that_built_gdn_metadata_is_named_in_the_error():
    model, executor, _ = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    fc = forward_context(model, 4)
    fc.attn_metadata["model.layers.0.self_attn"] = SimpleNamespace(
        num_prefills=0, non_spec_state_indices_tensor=torch.ones(4, dtype=torch.int32)
    )
    with pytest.raises(RuntimeError, match="needs the common attention metadata"):
        executor.run(torch.arange(4), None, fc)
    # The dispatch test raises too, rather than letting the stock forward run.
    with pytest.raises(RuntimeError, match="needs the common attention metadata"):
        executor.step_applies(fc, capturing=True)


# --------------------------------------------------------------- logits in the graph
def capture(monkeypatch: pytest.MonkeyPatch, fc: Any) -> None:
    """Make maybe_run see ``fc`` as the forward context of a graph capture."""
    import vllm.forward_context as vllm_forward_context

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(vllm_forward_context, "get_forward_context", lambda: fc)
    monkeypatch.setattr(vllm_forward_context, "is_forward_context_available", lambda: True)


def test_a_captured_step_leaves_its_logits_for_the_runner(monkeypatch):
    model, executor, _ = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    served = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    assert executor.logits_computed_in_graph(CUDAGraphMode.FULL, served, 3) is None
    capture(monkeypatch, forward_context(model, 4))
    hidden = executor.maybe_run(torch.arange(4), torch.arange(4))
    logits = executor.logits_computed_in_graph(CUDAGraphMode.FULL, served, 3)
    assert torch.equal(logits, model.compute_logits(hidden)[:3])
    for mode, descriptor, rows in [
        (CUDAGraphMode.PIECEWISE, served, 3),
        (CUDAGraphMode.FULL, BatchDescriptor(num_tokens=2, num_reqs=2, uniform=True), 2),
        (CUDAGraphMode.FULL, served, 5),
    ]:
        assert executor.logits_computed_in_graph(mode, descriptor, rows) is None


def test_a_served_graph_captured_for_a_forward_it_cannot_run_fails_naming_why(monkeypatch):
    """The runner left out the KDA metadata of a served graph size, so the stock forward
    cannot be captured there instead: the capture fails, saying why, rather than in the
    stock layer's assertion."""
    model, executor, _ = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    fc = forward_context(model, 4)
    capture(monkeypatch, fc)
    with pytest.raises(RuntimeError, match=r"graph of 4 tokens .* \(no input_ids"):
        executor.maybe_run(None, torch.arange(4), inputs_embeds=torch.zeros(4, HIDDEN))
    with pytest.raises(RuntimeError, match=r"\(inputs_embeds given\)"):
        executor.maybe_run(torch.arange(4), torch.arange(4), inputs_embeds=torch.zeros(4, HIDDEN))
    fc.attn_metadata["model.layers.1.self_attn"].max_query_len = 2  # not a decode step
    with pytest.raises(RuntimeError, match="not a one-token decode step"):
        executor.maybe_run(torch.arange(4), torch.arange(4))
    # A graph the executor does not serve captures the stock forward, as before.
    capture(monkeypatch, forward_context(model, 4, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE))
    assert executor.maybe_run(None, torch.arange(4), inputs_embeds=torch.zeros(4, HIDDEN)) is None


def test_new_kv_caches_drop_the_logits_of_earlier_captures(monkeypatch):
    model, executor, _ = build()
    allocate_caches(model)
    executor.bind_kv_caches()
    served = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    capture(monkeypatch, forward_context(model, 4))
    executor.maybe_run(torch.arange(4), torch.arange(4))
    executor.bind_kv_caches()
    assert executor.logits_computed_in_graph(CUDAGraphMode.FULL, served, 4) is None


@pytest.mark.parametrize(
    "environ,allowed",
    [
        ({}, True),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}, True),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}, False),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "ten"}, False),
    ],
)
def test_clusters_only_without_an_mps_thread_limit(environ, allowed):
    """An MPS client limited to part of the GPU may not fit a cluster on one
    GPC: the split GEMMs and the MoE router then go through global memory."""
    assert decode.clusters_allowed(environ) is allowed


def test_kernel_factory_reads_the_mps_limit_when_built(monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")
    assert decode.KernelFactory().clusters is False
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    assert decode.KernelFactory().clusters is True
    assert decode.KernelFactory(clusters=False).clusters is False


@pytest.mark.parametrize(
    ("environ", "policy"),
    [
        ({}, ("evict_first", 4)),
        ({"VLLM_HD_EXPERT_L2_POLICY": ""}, ("evict_first", 4)),
        ({"VLLM_HD_EXPERT_L2_POLICY": "none"}, (None, None)),
        ({"VLLM_HD_EXPERT_L2_POLICY": "evict_first"}, ("evict_first", None)),
        ({"VLLM_HD_EXPERT_L2_POLICY": "evict_last"}, ("evict_last", None)),
    ],
)
def test_the_expert_l2_policy_switch(environ, policy):
    """Unset: evict_first up to M-bucket 4 (measured faster there, slower at 8);
    the switch turns it off or applies a policy at every bucket."""
    assert decode.expert_l2_policy_from_env(environ) == policy


@pytest.fixture
def moe_prepared(monkeypatch):
    """The MoE's ``prepared`` module with ``PreparedMoe`` returning the keyword
    arguments the kernel factory gives it."""
    prepared = pytest.importorskip(
        "vllm.models.kimi_linear.sm90.specialized_decode.cutedsl.moe.prepared",
        reason="CuTe DSL is not installed",
    )
    monkeypatch.setattr(prepared, "PreparedMoe", lambda **kwargs: kwargs)
    return prepared


@pytest.mark.usefixtures("moe_prepared")
def test_the_kernel_factory_hands_the_expert_l2_policy_to_the_moe(monkeypatch):
    monkeypatch.delenv("VLLM_HD_EXPERT_L2_POLICY", raising=False)
    kwargs = decode.KernelFactory(clusters=True).moe(top_k=8)
    assert kwargs["expert_weight_l2_policy"] == "evict_first"
    assert kwargs["expert_weight_l2_policy_max_bucket"] == 4
    monkeypatch.setenv("VLLM_HD_EXPERT_L2_POLICY", "none")
    kwargs = decode.KernelFactory(clusters=True).moe(top_k=8)
    assert kwargs["expert_weight_l2_policy"] is None


@pytest.mark.parametrize(
    ("environ", "warps"),
    [
        ({}, (8, 4, 1)),
        ({"VLLM_HD_MOE_EXPERT_WARPS": ""}, (8, 4, 1)),
        ({"VLLM_HD_MOE_EXPERT_WARPS": "4"}, (4, 4, None)),
        ({"VLLM_HD_MOE_EXPERT_WARPS": "8"}, (8, 8, None)),
        ({"VLLM_HD_MOE_EXPERT_WARPS": "4,8"}, (4, 8, None)),
        ({"VLLM_HD_MOE_EXPERT_WARPS": "8,4@1"}, (8, 4, 1)),
        ({"VLLM_HD_MOE_EXPERT_WARPS": "8@16"}, (8, 8, 16)),
    ],
)
def test_the_moe_expert_warps_switch(environ, warps):
    """Unset: gate_up in 8-warp CTAs, down in 4, at M-bucket 1; the switch
    gives both launches one count or each its own, at every bucket or up to
    the one after ``@``."""
    assert decode.moe_expert_warps_from_env(environ) == warps


@pytest.mark.parametrize(
    "value",
    ["6", "8,6", "8,4,4", "8,", " 8", "eight", "8@", "8,4@0", "8@x", "8@\u00b2", "@1", "8@1@2"],
)
def test_other_moe_expert_warps_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_MOE_EXPERT_WARPS", value)
    with pytest.raises(ValueError, match=f"VLLM_HD_MOE_EXPERT_WARPS={value!r}"):
        decode.KernelFactory()


def test_the_kernel_factory_hands_the_expert_warps_to_the_moe(monkeypatch, moe_prepared):
    monkeypatch.delenv("VLLM_HD_MOE_EXPERT_WARPS", raising=False)
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    # The executor's MoE also runs the shared expert's down early at M-bucket 2; its
    # expert launches take no launch bounds.
    early = dict(early_shared_down_min_bucket=2, early_shared_down_max_bucket=2)
    assert config == moe_prepared.MoeConfig(
        warps=8, down_warps=4, warps_max_bucket=1,
        down_prewait_steps=decode.MOE_DOWN_PREWAIT_STEPS, **early,
    )  # fmt: skip
    assert config.expert_warps(1) == (8, 4)
    assert [config.expert_warps(b) for b in (2, 4, 8, 16)] == [(4, 4)] * 4
    monkeypatch.setenv("VLLM_HD_MOE_EXPERT_WARPS", "4")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert config == moe_prepared.MoeConfig(
        warps=4, down_warps=4, down_prewait_steps=decode.MOE_DOWN_PREWAIT_STEPS, **early
    )
    assert {config.expert_warps(b) for b in moe_prepared.M_BUCKETS} == {(4, 4)}
    explicit = decode.KernelFactory(clusters=True, moe_expert_warps=(4, 8, 2))
    config = explicit.moe(top_k=8)["config"]
    assert [config.expert_warps(b) for b in (1, 2, 4)] == [(4, 8), (4, 8), (4, 4)]


@pytest.mark.parametrize(
    ("environ", "steps"),
    [
        ({}, {}),
        ({"VLLM_HD_GEMM_PREWAIT": ""}, {}),
        ({"VLLM_HD_GEMM_PREWAIT": "12576x2304:6"}, {(12576, 2304): 6}),
        (
            {"VLLM_HD_GEMM_PREWAIT": "12576x2304:0,2304x4096:12"},
            {(12576, 2304): 0, (2304, 4096): 12},
        ),
    ],
)
def test_the_gemm_prewait_switch(environ, steps):
    """Unset: no GEMM changes its pre-wait loads; the switch names GEMMs by
    their weight shape."""
    assert decode.gemm_prewait_from_env(environ) == steps


@pytest.mark.parametrize(
    "value",
    ["12576:6", "12576x2304", "12576x2304:", "x2304:6", "0x2304:6", "12576x0:6",
     "012576x2304:6", "12576x2304:6,12576x2304:4", "12576x2304:100", "12576x2304:-1",
     " 12576x2304:6", "12576x2304:6,", "axb:c", "12576x2304:06", "12576X2304:6"],
)  # fmt: skip
def test_other_gemm_prewait_values_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_GEMM_PREWAIT", value)
    with pytest.raises(ValueError, match=f"VLLM_HD_GEMM_PREWAIT={value!r}"):
        decode.KernelFactory()


def test_the_kernel_factory_hands_the_prewait_to_the_named_gemm(monkeypatch):
    prepared = pytest.importorskip(
        "vllm.models.kimi_linear.sm90.specialized_decode.cutedsl.gemm.prepared",
        reason="CuTe DSL is not installed",
    )
    monkeypatch.setattr(prepared, "PreparedGemm", lambda *args, **kwargs: kwargs)
    factory = decode.KernelFactory(clusters=True)
    assert factory.gemm(torch.empty(12576, 2304), prewait_steps=3)["prewait_steps"] == 3
    assert factory.gemm(torch.empty(12576, 2304))["prewait_steps"] is None
    monkeypatch.setenv("VLLM_HD_GEMM_PREWAIT", "12576x2304:8")
    factory = decode.KernelFactory(clusters=True)
    assert factory.gemm(torch.empty(12576, 2304), prewait_steps=3)["prewait_steps"] == 8
    assert factory.gemm(torch.empty(12576, 1024), prewait_steps=3)["prewait_steps"] == 3
    assert factory.gemm(torch.empty(2304, 4096))["prewait_steps"] is None


def test_the_kernel_factory_names_the_switch_when_a_gemm_cannot_take_its_steps(
    monkeypatch,
):
    prepared = pytest.importorskip(
        "vllm.models.kimi_linear.sm90.specialized_decode.cutedsl.gemm.prepared",
        reason="CuTe DSL is not installed",
    )

    def refuse(weight, *args, prewait_steps=None, **kwargs):
        if prewait_steps is not None and prewait_steps > 18:
            raise ValueError(f"prewait_steps={prewait_steps} outside 0..18")
        return prewait_steps

    monkeypatch.setattr(prepared, "PreparedGemm", refuse)
    monkeypatch.setenv("VLLM_HD_GEMM_PREWAIT", "12576x2304:20")
    factory = decode.KernelFactory(clusters=True)
    with pytest.raises(
        ValueError,
        match=r"VLLM_HD_GEMM_PREWAIT='12576x2304:20': the 12576x2304 GEMM cannot take "
        r"them: prewait_steps=20 outside 0..18",
    ):
        factory.gemm(torch.empty(12576, 2304))
    # Without the switch the kernel's own message is not rewritten.
    monkeypatch.delenv("VLLM_HD_GEMM_PREWAIT")
    with pytest.raises(ValueError, match=r"^prewait_steps=20 outside 0\.\.18$"):
        decode.KernelFactory(clusters=True).gemm(torch.empty(12576, 2304), prewait_steps=20)


@pytest.mark.parametrize(
    ("environ", "stages"),
    [({}, {}), ({"VLLM_HD_GEMM_WEIGHT_STAGES": ""}, {}),
     ({"VLLM_HD_GEMM_WEIGHT_STAGES": "0"}, None),
     ({"VLLM_HD_GEMM_WEIGHT_STAGES": "12576x2304:4"}, {(12576, 2304): {8: 4, 16: 4}}),
     ({"VLLM_HD_GEMM_WEIGHT_STAGES": "12576x2304:0"}, {(12576, 2304): {}}),
     ({"VLLM_HD_GEMM_WEIGHT_STAGES": "12576x2304:5@8,6720x2304:2"},
      {(12576, 2304): {8: 5}, (6720, 2304): {8: 2, 16: 2}})],
)  # fmt: skip
def test_the_gemm_weight_stages_switch(environ, stages):
    assert decode.gemm_weight_stages_from_env(environ) == stages


@pytest.mark.parametrize(
    "value",
    ["12576x2304:1", "12576x2304:10", "12576x2304", "12576x2304:4,12576x2304:5", "4",
     "12576x2304:4@4", "12576x2304:@8", "00"],
)  # fmt: skip
def test_other_gemm_weight_stages_values_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_GEMM_WEIGHT_STAGES", value)
    with pytest.raises(
        ValueError,
        match=f"VLLM_HD_GEMM_WEIGHT_STAGES={re.escape(repr(value))}: expected 0 or NxK:S",
    ):
        decode.check_environment()


def test_the_kernel_factory_hands_the_weight_stages_to_the_gemm(monkeypatch):
    """The executor's stages unless the switch names the shape (its stages, or
    none for S = 0) or is 0 (none anywhere); the pre-wait steps go along
    (PreparedGemm applies them to the register-stream buckets), the executor's
    launch bounds only to buckets left unstaged."""
    prepared = pytest.importorskip(
        "vllm.models.kimi_linear.sm90.specialized_decode.cutedsl.gemm.prepared",
        reason="CuTe DSL is not installed",
    )
    monkeypatch.setattr(prepared, "PreparedGemm", lambda *args, **kwargs: kwargs)
    in_proj, other = torch.empty(12576, 2304), torch.empty(6720, 2304)
    executor_choice = {"prewait_steps": 3, "min_ctas_per_sm": {16: 4}, "weight_stages": {8: 2}}
    taken = decode.KernelFactory(clusters=True).gemm(in_proj, **executor_choice)
    assert {k: taken[k] for k in executor_choice} == executor_choice
    assert decode.KernelFactory(clusters=True).gemm(other)["weight_stages"] is None
    monkeypatch.setenv("VLLM_HD_GEMM_WEIGHT_STAGES", "12576x2304:4,6720x2304:2@8")
    factory = decode.KernelFactory(clusters=True)
    taken = factory.gemm(in_proj, **executor_choice)
    # The executor's bounds leave the buckets that are now staged.
    assert taken["weight_stages"] == {8: 4, 16: 4} and taken["min_ctas_per_sm"] is None
    assert factory.gemm(other)["weight_stages"] == {8: 2}
    # Bounds the switch asks for stay, staged or not.
    monkeypatch.setenv("VLLM_HD_GEMM_MIN_CTAS", "12576x2304:2@16")
    taken = decode.KernelFactory(clusters=True).gemm(in_proj, **executor_choice)
    assert taken["weight_stages"] == {8: 4, 16: 4} and taken["min_ctas_per_sm"] == {16: 2}
    monkeypatch.delenv("VLLM_HD_GEMM_MIN_CTAS")
    monkeypatch.setenv("VLLM_HD_GEMM_WEIGHT_STAGES", "12576x2304:0")
    taken = decode.KernelFactory(clusters=True).gemm(in_proj, **executor_choice)
    assert taken["weight_stages"] is None and taken["prewait_steps"] == 3
    monkeypatch.setenv("VLLM_HD_GEMM_WEIGHT_STAGES", "0")
    assert (
        decode.KernelFactory(clusters=True).gemm(in_proj, **executor_choice)["weight_stages"]
        is None
    )


def test_a_gemm_that_cannot_be_staged_fails_naming_the_switch(monkeypatch):
    prepared = pytest.importorskip(
        "vllm.models.kimi_linear.sm90.specialized_decode.cutedsl.gemm.prepared",
        reason="CuTe DSL is not installed",
    )

    def refuse(weight, epilogue="plain", *args, weight_stages=None, **kwargs):
        if weight_stages is not None and epilogue != "plain":
            raise ValueError(f"the staged weight stream supports plain, not {epilogue!r}")
        return weight_stages

    monkeypatch.setattr(prepared, "PreparedGemm", refuse)
    monkeypatch.setenv("VLLM_HD_GEMM_WEIGHT_STAGES", "2304x4096:2")
    with pytest.raises(
        ValueError,
        match=r"VLLM_HD_GEMM_WEIGHT_STAGES='2304x4096:2': the 2304x4096 GEMM cannot take "
        r"them: the staged weight stream supports plain, not 'residual_sumsq'",
    ):
        decode.KernelFactory(clusters=True).gemm(torch.empty(2304, 4096), "residual_sumsq")


def test_a_gemm_weight_stages_shape_no_gemm_has_fails_at_start(monkeypatch):
    monkeypatch.setenv("VLLM_HD_GEMM_WEIGHT_STAGES", "12345x2304:4")
    with pytest.raises(ValueError, match=r"VLLM_HD_GEMM_WEIGHT_STAGES='12345x2304:4' names"):
        build()


def test_a_gemm_prewait_shape_no_gemm_has_fails_at_start(monkeypatch):
    monkeypatch.setenv("VLLM_HD_GEMM_PREWAIT", "12576x2304:3")
    with pytest.raises(ValueError) as failure:
        build()
    message = str(failure.value)
    assert message.startswith(
        "VLLM_HD_GEMM_PREWAIT='12576x2304:3' names 12576x2304, which no GEMM of this "
        "model has; its GEMMs' weight shapes are "
    )
    # The stand-in model's own shapes are listed, the asked one is not.
    listed = message.rsplit("are ", 1)[1].split(", ")
    assert listed and "12576x2304" not in listed


@pytest.mark.parametrize(
    ("environ", "ctas"),
    [({}, {}), ({"VLLM_HD_GEMM_MIN_CTAS": ""}, {}), ({"VLLM_HD_GEMM_MIN_CTAS": "0"}, None),
     ({"VLLM_HD_GEMM_MIN_CTAS": "12576x2304:6"}, {(12576, 2304): {8: 6, 16: 6}}),
     ({"VLLM_HD_GEMM_MIN_CTAS": "12576x2304:4@16"}, {(12576, 2304): {16: 4}}),
     ({"VLLM_HD_GEMM_MIN_CTAS": "12576x2304:0"}, {(12576, 2304): {}}),
     ({"VLLM_HD_GEMM_MIN_CTAS": "12576x2304:16@8,2304x4096:1"},
      {(12576, 2304): {8: 16}, (2304, 4096): {8: 1, 16: 1}})],
)  # fmt: skip
def test_the_gemm_min_ctas_switch(environ, ctas):
    assert decode.gemm_min_ctas_from_env(environ) == ctas


@pytest.mark.parametrize(
    "value",
    ["12576x2304:17", "12576x2304:06", "12576x2304", "12576x2304:6,", "00", "0,12576x2304:4",
     "12576x2304:6,12576x2304:4", "x2304:6", "6", "12576x2304:4@4", "12576x2304:4@",
     "12576x2304:@16", "12576x2304:4@16@8"],
)  # fmt: skip
def test_other_gemm_min_ctas_values_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_GEMM_MIN_CTAS", value)
    with pytest.raises(
        ValueError, match=f"VLLM_HD_GEMM_MIN_CTAS={re.escape(repr(value))}: expected 0 or NxK:C"
    ):
        decode.check_environment()
    with pytest.raises(ValueError, match="VLLM_HD_GEMM_MIN_CTAS"):
        decode.KernelFactory()


def test_the_kernel_factory_hands_the_min_ctas_to_the_gemm(monkeypatch):
    """The executor's bounds unless the switch names the shape (its bounds, or
    none for C = 0) or is 0 (none anywhere)."""
    prepared = pytest.importorskip(
        "vllm.models.kimi_linear.sm90.specialized_decode.cutedsl.gemm.prepared",
        reason="CuTe DSL is not installed",
    )
    monkeypatch.setattr(prepared, "PreparedGemm", lambda *args, **kwargs: kwargs)
    in_proj, other = torch.empty(12576, 2304), torch.empty(2304, 4096)
    factory = decode.KernelFactory()
    assert factory.gemm(in_proj)["min_ctas_per_sm"] is None
    assert factory.gemm(in_proj, min_ctas_per_sm={16: 4})["min_ctas_per_sm"] == {16: 4}
    monkeypatch.setenv("VLLM_HD_GEMM_MIN_CTAS", "12576x2304:6")
    factory = decode.KernelFactory(clusters=True)
    taken = factory.gemm(in_proj, prewait_steps=3, min_ctas_per_sm={16: 4})
    assert (taken["min_ctas_per_sm"], taken["prewait_steps"]) == ({8: 6, 16: 6}, 3)
    assert factory.gemm(other)["min_ctas_per_sm"] is None
    assert factory.gemm(other, min_ctas_per_sm={16: 4})["min_ctas_per_sm"] == {16: 4}
    monkeypatch.setenv("VLLM_HD_GEMM_MIN_CTAS", "12576x2304:0")
    taken = decode.KernelFactory().gemm(in_proj, min_ctas_per_sm={16: 4})
    assert taken["min_ctas_per_sm"] is None
    monkeypatch.setenv("VLLM_HD_GEMM_MIN_CTAS", "0")
    factory = decode.KernelFactory()
    for weight in (in_proj, other):
        assert factory.gemm(weight, min_ctas_per_sm={16: 4})["min_ctas_per_sm"] is None


def test_the_kernel_factory_names_the_min_ctas_switch_when_a_gemm_cannot_take_it(
    monkeypatch,
):
    prepared = pytest.importorskip(
        "vllm.models.kimi_linear.sm90.specialized_decode.cutedsl.gemm.prepared",
        reason="CuTe DSL is not installed",
    )

    def refuse(weight, *args, min_ctas_per_sm=None, **kwargs):
        if min_ctas_per_sm and 1 in min_ctas_per_sm.values():
            raise ValueError("min_ctas_per_sm=1 would let fewer than 2 CTAs an SM wait")

    monkeypatch.setattr(prepared, "PreparedGemm", refuse)
    monkeypatch.setenv("VLLM_HD_GEMM_MIN_CTAS", "2304x4096:1")
    with pytest.raises(
        ValueError,
        match=r"^VLLM_HD_GEMM_MIN_CTAS='2304x4096:1': the 2304x4096 GEMM cannot take "
        r"them: min_ctas_per_sm=1 would",
    ):
        decode.KernelFactory(clusters=True).gemm(torch.empty(2304, 4096))


def test_a_gemm_min_ctas_shape_no_gemm_has_fails_at_start(monkeypatch):
    monkeypatch.setenv("VLLM_HD_GEMM_MIN_CTAS", "12576x2304:6")
    with pytest.raises(ValueError, match=r"^VLLM_HD_GEMM_MIN_CTAS='12576x2304:6' names "):
        build()


def test_a_gemm_prewait_shape_the_model_has_passes_the_start_check(monkeypatch):
    _, _, probe = build()
    shape = min(probe.gemm_shapes)
    monkeypatch.setenv("VLLM_HD_GEMM_PREWAIT", f"{shape[0]}x{shape[1]}:2")
    _, _, kernels = build()
    assert kernels.gemm_prewait == {shape: 2}


@pytest.mark.parametrize(
    ("environ", "steps"),
    [
        ({}, (None, 6)),
        ({"VLLM_HD_MOE_PREWAIT": ""}, (None, 6)),
        ({"VLLM_HD_MOE_PREWAIT": "4,8"}, (4, 8)),
        ({"VLLM_HD_MOE_PREWAIT": "4,"}, (4, 6)),
        ({"VLLM_HD_MOE_PREWAIT": ",0"}, (None, 0)),
    ],
)
def test_the_moe_prewait_switch(environ, steps):
    assert decode.moe_prewait_from_env(environ) == steps


@pytest.mark.parametrize("value", [",", "4", "4,6,8", "4;6", " 4,6", "04,6", "4,100", "-1,4"])
def test_other_moe_prewait_values_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_MOE_PREWAIT", value)
    with pytest.raises(ValueError, match=f"VLLM_HD_MOE_PREWAIT={value!r}"):
        decode.KernelFactory()


def test_the_kernel_factory_hands_the_moe_prewait_to_the_moe(monkeypatch, moe_prepared):
    monkeypatch.setenv("VLLM_HD_MOE_PREWAIT", ",4")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert (config.gate_up_prewait_steps, config.down_prewait_steps) == (None, 4)
    monkeypatch.delenv("VLLM_HD_MOE_PREWAIT")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert (config.gate_up_prewait_steps, config.down_prewait_steps) == (None, 6)


@pytest.mark.parametrize(
    ("environ", "bounds"),
    [({}, None), ({"VLLM_HD_MOE_EXPERT_REGISTERS": ""}, None),
     ({"VLLM_HD_MOE_EXPERT_REGISTERS": "0"}, None),
     ({"VLLM_HD_MOE_EXPERT_REGISTERS": "128"}, (128, 1, 16)),
     ({"VLLM_HD_MOE_EXPERT_REGISTERS": "64"}, (64, 1, 16)),
     ({"VLLM_HD_MOE_EXPERT_REGISTERS": "255:16"}, (255, 1, 16)),
     ({"VLLM_HD_MOE_EXPERT_REGISTERS": "96:4"}, (96, 1, 4)),
     ({"VLLM_HD_MOE_EXPERT_REGISTERS": "128:16-16"}, (128, 16, 16)),
     ({"VLLM_HD_MOE_EXPERT_REGISTERS": "168:1-4"}, (168, 1, 4)),
     ({"VLLM_HD_MOE_EXPERT_REGISTERS": "128:2-2"}, (128, 2, 2))],
)  # fmt: skip
def test_the_moe_expert_registers_switch(environ, bounds):
    assert decode.moe_expert_registers_from_env(environ) == bounds


@pytest.mark.parametrize(
    "value",
    ["63", "256", "0128", "128 ", "1e2", "-128", "yes", "128:", "128:3", "128:8-2",
     "128:2-32", "128:-8", "128:2-", ":2-8", "00", "128:1-2-4"],
)  # fmt: skip
def test_other_moe_expert_registers_values_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_MOE_EXPERT_REGISTERS", value)
    with pytest.raises(ValueError, match=f"VLLM_HD_MOE_EXPERT_REGISTERS={re.escape(repr(value))}"):
        decode.check_environment()
    with pytest.raises(ValueError, match="VLLM_HD_MOE_EXPERT_REGISTERS"):
        decode.KernelFactory()


def test_the_kernel_factory_hands_the_moe_expert_registers_to_the_moe(monkeypatch, moe_prepared):
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert [config.expert_registers(b) for b in (1, 2, 4, 8, 16)] == [None] * 5
    monkeypatch.setenv("VLLM_HD_MOE_EXPERT_REGISTERS", "128:2-8")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert [config.expert_registers(b) for b in (1, 2, 4, 8, 16)] == [None, 128, 128, 128, None]
    monkeypatch.setenv("VLLM_HD_MOE_EXPERT_REGISTERS", "160")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert [config.expert_registers(b) for b in (1, 2, 4, 8, 16)] == [160] * 5
    monkeypatch.setenv("VLLM_HD_MOE_EXPERT_REGISTERS", "0")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert [config.expert_registers(b) for b in (1, 2, 4, 8, 16)] == [None] * 5


@pytest.mark.parametrize(
    ("value", "buckets"),
    [(None, (2, 2)), ("", (2, 2)), ("0", None), ("1", (1, 1)), ("8", (1, 8)),
     ("2-8", (2, 8)), ("1-2", (1, 2)), ("4-4", (4, 4))],
)  # fmt: skip
def test_the_moe_early_shared_down_switch(value, buckets):
    environ = {} if value is None else {"VLLM_HD_MOE_EARLY_SHARED_DOWN": value}
    assert decode.moe_early_shared_down_from_env(environ) == buckets


@pytest.mark.parametrize("value", ["16", "3", "yes", " 1", "01", "8-2", "0-8", "2-", "-8", "2-16"])
def test_other_moe_early_shared_down_values_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_MOE_EARLY_SHARED_DOWN", value)
    with pytest.raises(ValueError, match=f"VLLM_HD_MOE_EARLY_SHARED_DOWN={value!r}"):
        decode.KernelFactory()


def test_the_kernel_factory_hands_the_early_shared_down_to_the_moe(monkeypatch, moe_prepared):
    monkeypatch.setenv("VLLM_HD_MOE_EARLY_SHARED_DOWN", "1")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert [b for b in (1, 2, 4, 8) if config.early_shared_down(b)] == [1]
    monkeypatch.setenv("VLLM_HD_MOE_EARLY_SHARED_DOWN", "2-8")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert [b for b in (1, 2, 4, 8) if config.early_shared_down(b)] == [2, 4, 8]
    monkeypatch.setenv("VLLM_HD_MOE_EARLY_SHARED_DOWN", "0")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert not any(config.early_shared_down(b) for b in (1, 2, 4, 8))
    # Unset: bucket 2 only, the one the engine A/B gained at.
    monkeypatch.delenv("VLLM_HD_MOE_EARLY_SHARED_DOWN")
    config = decode.KernelFactory(clusters=True).moe(top_k=8)["config"]
    assert [b for b in (1, 2, 4, 8) if config.early_shared_down(b)] == [2]


def test_an_unknown_expert_l2_policy_fails_at_start_naming_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_HD_EXPERT_L2_POLICY", "evict_normal")
    with pytest.raises(ValueError, match="VLLM_HD_EXPERT_L2_POLICY='evict_normal'"):
        decode.KernelFactory()
    monkeypatch.delenv("VLLM_HD_EXPERT_L2_POLICY")
    assert decode.KernelFactory().expert_l2_policy == decode.DEFAULT_EXPERT_L2_POLICY
    explicit = ("evict_last", 8)
    assert decode.KernelFactory(expert_l2_policy=explicit).expert_l2_policy == explicit


@pytest.mark.parametrize(
    "environ, path",
    [
        # On by default, under vLLM's cache root as its own compile cache.
        ({}, "/vllm-cache/hopper_decode/cutedsl"),
        ({"VLLM_HD_KERNEL_CACHE": ""}, "/vllm-cache/hopper_decode/cutedsl"),
        ({"VLLM_HD_KERNEL_CACHE": "0"}, None),
        ({"VLLM_HD_KERNEL_CACHE": "1"}, "/vllm-cache/hopper_decode/cutedsl"),
        ({"VLLM_DISABLE_COMPILE_CACHE": "1"}, None),
        ({"VLLM_HD_KERNEL_CACHE": "/data/kernels"}, "/data/kernels"),
        ({"VLLM_HD_KERNEL_CACHE": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}, None),
        ({"VLLM_HD_KERNEL_CACHE": "/data/kernels", "VLLM_DISABLE_COMPILE_CACHE": "0"},
         "/data/kernels"),
        # An explicit directory is used even with vLLM's compile cache off.
        ({"VLLM_HD_KERNEL_CACHE": "/data/kernels", "VLLM_DISABLE_COMPILE_CACHE": "1"},
         "/data/kernels"),
    ],
)  # fmt: skip
def test_the_kernel_cache_switch(environ, path):
    assert decode.kernel_cache_dir_from_env(environ, cache_root="/vllm-cache") == path


@pytest.mark.parametrize("value", ["yes", "2", "relative/kernels", "~/kernels"])
def test_other_kernel_cache_values_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_KERNEL_CACHE", value)
    with pytest.raises(ValueError, match=f"VLLM_HD_KERNEL_CACHE={value!r}"):
        decode.KernelFactory()


@pytest.fixture
def compile_cache():
    """The kernels' compile cache module, off again after the test."""
    cache = pytest.importorskip(
        "vllm.models.kimi_linear.sm90.specialized_decode.cutedsl.common.compile_cache",
        reason="CuTe DSL is not installed",
    )
    yield cache
    cache.configure(None)


def test_the_kernel_factory_configures_the_kernel_cache(monkeypatch, tmp_path, compile_cache):
    monkeypatch.setenv("VLLM_HD_KERNEL_CACHE", "0")
    factory = decode.KernelFactory()
    assert factory.kernel_cache is None and compile_cache.cache_directory() is None
    assert factory.kernel_cache_note() == ""
    monkeypatch.delenv("VLLM_HD_KERNEL_CACHE")  # the default: under VLLM_CACHE_ROOT
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    default = tmp_path / "vllm-cache" / "hopper_decode" / "cutedsl"
    assert decode.KernelFactory().kernel_cache == str(default)
    assert compile_cache.cache_directory() == default and default.is_dir()
    monkeypatch.setenv("VLLM_HD_KERNEL_CACHE", str(tmp_path / "kernels"))
    factory = decode.KernelFactory()
    assert compile_cache.cache_directory() == tmp_path / "kernels"
    assert (tmp_path / "kernels").is_dir()
    assert factory.kernel_cache_note().startswith(f"; kernel cache {tmp_path / 'kernels'}: ")


def test_an_unusable_default_kernel_cache_only_warns(monkeypatch, tmp_path, compile_cache):
    """The default directory was not asked for: the engine starts without the cache
    (compiling its kernels), saying why; the same directory asked for with "1" fails."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.delenv("VLLM_HD_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(blocker))
    warnings = []
    monkeypatch.setattr(decode.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    factory = decode.KernelFactory()
    assert factory.kernel_cache is None and compile_cache.cache_directory() is None
    assert len(warnings) == 1 and "the default kernel cache cannot be used" in warnings[0]
    monkeypatch.setenv("VLLM_HD_KERNEL_CACHE", "1")
    with pytest.raises(ValueError, match="VLLM_HD_KERNEL_CACHE: kernel cache directory"):
        decode.KernelFactory()


def test_an_unusable_kernel_cache_directory_fails_at_start(monkeypatch, tmp_path, compile_cache):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_HD_KERNEL_CACHE", str(blocker / "kernels"))
    with pytest.raises(ValueError, match="VLLM_HD_KERNEL_CACHE: kernel cache directory"):
        decode.KernelFactory()
    assert compile_cache.cache_directory() is None


@pytest.mark.parametrize("value", [None, "1"])
def test_the_fused_embed_norm_switch_replaces_the_first_two_launches(monkeypatch, value):
    if value is None:  # the default
        monkeypatch.delenv("VLLM_HD_FUSED_EMBED_NORM", raising=False)
    else:
        monkeypatch.setenv("VLLM_HD_FUSED_EMBED_NORM", value)
    _, executor, kernels = build()
    ops = [step.op for step in executor.plan]
    assert ops[:2] == ["kda_state_slots", "embed_norm"]
    assert "embedding" not in ops and "input_norm" not in ops
    assert executor.plan[1].writes == ("residual0", "x0")
    kernels.log.clear()
    for step in executor.plan[1:2]:
        step.launch(decode.StepContext(2, None, torch.zeros(2, dtype=torch.int64)))
        step.launch(decode.StepContext(2, None, torch.tensor([5, 7], dtype=torch.int32)))
    (_, _, (warm_ids, _, _), _), (_, _, (ids, _, _), _) = kernels.log
    assert warm_ids.dtype == torch.int32 and warm_ids.tolist() == [0, 0]
    assert ids.tolist() == [5, 7]
    monkeypatch.setenv("VLLM_HD_FUSED_EMBED_NORM", "0")
    _, executor, _ = build()
    assert [step.op for step in executor.plan][1:3] == ["embedding", "input_norm"]


@pytest.mark.parametrize("value", ["2", "yes", "true", " 1"])
def test_other_fused_embed_norm_values_fail_at_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_HD_FUSED_EMBED_NORM", value)
    with pytest.raises(ValueError, match=f"VLLM_HD_FUSED_EMBED_NORM={value!r}"):
        decode.KernelFactory()

"""decode_backend parsing and the unsupported-deployment reasons (issue 6), on real vLLM 0.26.0
engine configs; plus the patched KimiLinearForCausalLM raising at construction."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from engine_configs import H200, MODEL_CONFIG, SPECIALIZED, stand_in_platform

from vllm.models.kimi_linear.sm90.specialized_decode import runtime
from vllm.platforms.interface import UnspecifiedPlatform

# --- the reference shapes -----------------------------------------------------------------


def test_reference_shapes_are_the_published_48b_config() -> None:
    linear = MODEL_CONFIG["linear_attn_config"]
    for name, expected in runtime.MODEL_SHAPES.items():
        owner, _, key = name.rpartition(".")
        assert (linear if owner else MODEL_CONFIG)[key] == expected, name
    assert MODEL_CONFIG["num_hidden_layers"] == runtime.MODEL_NUM_LAYERS
    assert tuple(linear["full_attn_layers"]) == runtime.MODEL_MLA_LAYERS
    kda = [i for i in range(1, 28) if i not in runtime.MODEL_MLA_LAYERS]
    assert linear["kda_layers"] == kda


# --- supported deployments ----------------------------------------------------------------


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
        # 0.26.0 resolves FULL to a separate decode routine for these UNIFORM_BATCH backends.
        {"compilation_config": {"cudagraph_mode": "FULL"}},
        {"kv_cache_dtype": "bfloat16", "mamba_cache_dtype": "bfloat16"},
        # KDA's recurrent state is fp32 whatever mamba_ssm_cache_dtype says (0.26.0).
        {"mamba_ssm_cache_dtype": "float16"},
    ],
    ids=["default", "full-decode-only", "full", "explicit-bf16", "ssm-dtype-ignored"],
)
def test_supported_deployment(engine_config: Any, engine_args: dict[str, Any]) -> None:
    vllm_config = engine_config(**engine_args)
    assert runtime.unsupported(vllm_config) == []
    config = runtime.specialized_decode_config(vllm_config)
    assert config == runtime.SpecializedDecodeConfig(
        batch_sizes=(1, 2, 4, 8, 16, 32, 64),  # vLLM's default capture sizes skip 3, 5, 6, 7
        max_model_len=4096,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        dtype=torch.bfloat16,
        recurrent_state_dtype=torch.float32,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_model_len = 8192  # type: ignore[misc]


def test_batch_sizes_follow_capture_sizes_and_max_num_seqs(engine_config: Any) -> None:
    sizes = {"cudagraph_capture_sizes": [1, 3, 5, 6, 7, 12, 16, 48, 64]}
    config = runtime.specialized_decode_config(engine_config(compilation_config=sizes))
    assert config is not None and config.batch_sizes == (1, 3, 5, 6, 7, 16, 64)
    # Decode graphs are captured only up to max_num_seqs requests.
    config = runtime.specialized_decode_config(engine_config(max_num_seqs=6))
    assert config is not None and config.batch_sizes == (1, 2, 4)


def test_fewer_layers_of_the_same_pattern_are_supported(engine_config: Any) -> None:
    """GPU tests run a few layers of the 48B pattern (issue 6: small config, same shapes)."""
    for layers in (1, 4, 5, 26):
        changes = {
            "num_hidden_layers": layers,
            "linear_attn_config.full_attn_layers": [
                i for i in runtime.MODEL_MLA_LAYERS if i <= layers
            ],
            "linear_attn_config.kda_layers": [
                i for i in range(1, layers + 1) if i not in runtime.MODEL_MLA_LAYERS
            ],
        }
        assert runtime.unsupported(engine_config(changes)) == [], layers


# --- which backend --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "additional_config", [{}, {"decode_backend": "auto"}], ids=["unset", "auto"]
)
def test_stock_decode_checks_nothing(engine_config: Any, additional_config: dict) -> None:
    vllm_config = engine_config(enforce_eager=True, additional_config=additional_config)
    assert runtime.unsupported(vllm_config)  # it would not be supported ...
    assert runtime.specialized_decode_config(vllm_config) is None  # ... but is not asked for


@pytest.mark.parametrize("value", ["latency-specialized", "LATENCY_SPECIALIZED", "", None, 1])
def test_unknown_decode_backend(engine_config: Any, value: object) -> None:
    vllm_config = engine_config(additional_config={"decode_backend": value})
    with pytest.raises(ValueError) as raised:
        runtime.specialized_decode_config(vllm_config)
    message = str(raised.value)
    assert repr(value) in message
    assert "'auto'" in message and "'latency_specialized'" in message


# --- every reason, alone --------------------------------------------------------------------

NO_ALLREDUCE_FUSION = {"pass_config": {"fuse_allreduce_rms": False}}

# (id, engine args, environment, the reason's expected text). Each deployment differs from the
# supported one in one respect and must produce exactly one reason.
ONE_REASON = [
    # The all-reduce + RMSNorm fusion pass sizes itself with compiled ops at config time;
    # off here because this machine has none (it does not matter to the reason).
    (
        "tp2",
        dict(tensor_parallel_size=2, compilation_config=NO_ALLREDUCE_FUSION),
        {},
        "tensor parallel size 2",
    ),
    ("pp2", dict(pipeline_parallel_size=2), {}, "pipeline parallelism"),
    ("dp2", dict(data_parallel_size=2), {}, "data parallelism"),
    ("ep", dict(enable_expert_parallel=True), {}, "expert parallelism"),
    # DBO needs an all2all backend that supports micro-batching (checked by vLLM).
    ("dbo", dict(enable_dbo=True, all2all_backend="deepep_low_latency"), {}, "dual batch"),
    ("lora", dict(enable_lora=True), {}, "LoRA"),
    (
        "speculative",
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
        {},
        "speculative decoding",
    ),
    ("sleep", dict(enable_sleep_mode=True), {}, "sleep mode"),
    ("eager", dict(enforce_eager=True), {}, "no FULL decode CUDA graphs (enforce_eager)"),
    (
        "piecewise",
        dict(compilation_config={"cudagraph_mode": "PIECEWISE"}),
        {},
        "no FULL decode CUDA graphs (cudagraph_mode PIECEWISE)",
    ),
    (
        "no-graphs",
        dict(compilation_config={"cudagraph_mode": "NONE"}),
        {},
        "no FULL decode CUDA graphs (cudagraph_mode NONE)",
    ),
    (
        "stock-torch-compile",
        dict(compilation_config={"mode": 1, "cudagraph_mode": "FULL_DECODE_ONLY"}),
        {},
        "STOCK_TORCH_COMPILE",
    ),
    ("breakable-graphs", {}, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, "VLLM_USE_BREAKABLE_CUDAGRAPH"),
    # fp16 weights with a bf16 conv state: only the weights differ.
    (
        "fp16-model",
        dict(dtype="float16", mamba_cache_dtype="bfloat16"),
        {},
        "model dtype torch.float16",
    ),
    ("fp8-kv-cache", dict(kv_cache_dtype="fp8"), {}, "KV cache dtype fp8"),
    ("fp32-conv-state", dict(mamba_cache_dtype="float32"), {}, "KDA conv state dtype"),
    ("prefix-caching", dict(enable_prefix_caching=True), {}, "prefix caching"),
    (
        "flashinfer-moe",
        dict(moe_backend="flashinfer_cutlass"),
        {},
        "MoE backend 'flashinfer_cutlass'",
    ),
    (
        "no-prepared-size",
        dict(compilation_config={"cudagraph_capture_sizes": [12, 24, 48]}),
        {},
        "no prepared batch size",
    ),
    # 32 and 64 are prepared sizes the kernels do not take (they run stock): alone
    # they would leave the executor nothing to run, found only after the weights load.
    (
        "only-stock-sizes",
        dict(compilation_config={"cudagraph_capture_sizes": [32, 64]}),
        {},
        "no prepared batch size the kernels take (1, 2, 3, 4, 5, 6, 7, 8, 16)",
    ),
    (
        "routed-experts",
        dict(enable_return_routed_experts=True),
        {},
        "returning the routed experts",
    ),
    ("prompt-embeds", dict(enable_prompt_embeds=True), {}, "prompt embeddings"),
    ("batch-invariant", {}, {"VLLM_BATCH_INVARIANT": "1"}, "VLLM_BATCH_INVARIANT=1"),
]


@pytest.mark.parametrize(
    "engine_args, env, expected", [c[1:] for c in ONE_REASON], ids=[c[0] for c in ONE_REASON]
)
def test_each_reason_alone(
    engine_config: Any,
    monkeypatch: pytest.MonkeyPatch,
    engine_args: dict[str, Any],
    env: dict[str, str],
    expected: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    vllm_config = engine_config(**engine_args)
    reasons = runtime.unsupported(vllm_config)
    assert len(reasons) == 1 and expected in reasons[0], reasons
    with pytest.raises(ValueError, match="does not support this deployment") as raised:
        runtime.specialized_decode_config(vllm_config)
    assert reasons[0] in str(raised.value)


@pytest.mark.parametrize(
    "name, value",
    [
        ("VLLM_HD_EXPERT_L2_POLICY", "evict"),
        ("VLLM_HD_MOE_EXPERT_WARPS", "3"),
        ("VLLM_HD_GEMM_PREWAIT", "12576x2304"),
        ("VLLM_HD_MOE_PREWAIT", "x"),
        ("VLLM_HD_MOE_EARLY_SHARED_DOWN", "16"),
        ("VLLM_HD_FUSED_EMBED_NORM", "2"),
        ("VLLM_HD_KERNEL_CACHE", "relative/dir"),
    ],
)
def test_a_bad_switch_fails_before_the_weights_load(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """The executor's switches are parsed with the config, while the model is built."""
    vllm_config = engine_config()
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        runtime.specialized_decode_config(vllm_config)
    monkeypatch.delenv(name)
    assert runtime.specialized_decode_config(vllm_config) is not None


def test_v2_model_runner(engine_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """VllmConfig reads VLLM_USE_V2_MODEL_RUNNER when asked (building a V2 config needs Triton,
    absent on this machine), so it is set after the config is built."""
    vllm_config = engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert vllm_config.use_v2_model_runner
    assert runtime.unsupported(vllm_config) == ["the V2 model runner"]


def test_kda_recurrent_state_dtype(engine_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.26.0 always gives KDA an fp32 recurrent state; the check reads the same calculator
    KimiLinearForCausalLM uses, so a vLLM that derives another dtype is refused."""
    from vllm.model_executor.layers.mamba import mamba_utils

    vllm_config = engine_config()
    monkeypatch.setattr(
        mamba_utils.MambaStateDtypeCalculator,
        "kda_state_dtype",
        classmethod(lambda cls, model_dtype, cache_dtype: (torch.bfloat16, torch.bfloat16)),
    )
    reasons = runtime.unsupported(vllm_config)
    assert reasons == ["KDA recurrent state dtype torch.bfloat16 (needs fp32)"]


@pytest.mark.parametrize(
    "platform, expected",
    [
        (stand_in_platform(10, 0), "GPU is not SM90 (Hopper): SM100"),
        (stand_in_platform(8, 0), "GPU is not SM90 (Hopper): SM80"),
        (stand_in_platform(9, 1), "GPU is not SM90 (Hopper): SM91"),
        (UnspecifiedPlatform(), "GPU is not SM90 (Hopper): platform "),
    ],
    ids=["sm100", "sm80", "sm91", "no-cuda"],
)
def test_gpu_reason(engine_config: Any, platform: Any, expected: str) -> None:
    vllm_config = engine_config()
    assert runtime.unsupported(vllm_config, H200) == []
    reasons = runtime.unsupported(vllm_config, platform)
    assert len(reasons) == 1 and reasons[0].startswith(expected), reasons


def test_gpu_reason_defaults_to_current_platform(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.platforms

    vllm_config = engine_config()
    monkeypatch.setattr(vllm.platforms, "_current_platform", stand_in_platform(10, 0))
    assert runtime.unsupported(vllm_config) == ["GPU is not SM90 (Hopper): SM100"]
    with pytest.raises(ValueError, match="SM100"):
        runtime.specialized_decode_config(vllm_config)


def _changed(value: object) -> object:
    """Another valid value of the same kind."""
    if value is None:
        return 64
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    return {"silu": "gelu", "sigmoid": "softmax"}[value]


@pytest.mark.parametrize("name", list(runtime.MODEL_SHAPES))
def test_each_shape_reason_names_its_field(engine_config: Any, name: str) -> None:
    expected = runtime.MODEL_SHAPES[name]
    actual = _changed(expected)
    reasons = runtime.unsupported(engine_config({name: actual}))
    assert reasons == [
        f"not the Kimi-Linear-48B-A3B shapes: {name} is {actual!r}, expected {expected!r}"
    ]


@pytest.mark.parametrize(
    "changes",
    [
        {"num_hidden_layers": 28},
        {"linear_attn_config.full_attn_layers": [3, 8, 12, 16, 20, 24, 27]},
        {
            "linear_attn_config.full_attn_layers": [],
            "linear_attn_config.kda_layers": list(range(1, 28)),
        },
        {
            "num_hidden_layers": 4,
            "linear_attn_config.full_attn_layers": [4],
            "linear_attn_config.kda_layers": [1, 2, 3, 4],
        },
    ],
    ids=["too-many-layers", "mla-moved", "kda-only", "layer-in-both"],
)
def test_layer_pattern_reason(engine_config: Any, changes: dict[str, Any]) -> None:
    reasons = runtime.unsupported(engine_config(changes))
    assert len(reasons) == 1 and "layer pattern" in reasons[0], reasons


def test_every_reason_is_listed(engine_config: Any) -> None:
    vllm_config = engine_config(
        {"hidden_size": 4096},
        enforce_eager=True,
        enable_prefix_caching=True,
        enable_lora=True,
        kv_cache_dtype="fp8",
    )
    with pytest.raises(ValueError) as raised:
        runtime.specialized_decode_config(vllm_config, stand_in_platform(10, 0))
    listed = [
        line.removeprefix("  - ")
        for line in str(raised.value).splitlines()
        if line.startswith("  - ")
    ]
    assert listed == runtime.unsupported(vllm_config, stand_in_platform(10, 0))
    assert len(listed) == 6
    for text in ("SM100", "hidden_size", "LoRA", "enforce_eager", "KV cache", "prefix"):
        assert any(text in reason for reason in listed), text


# --- the patched model class ----------------------------------------------------------------


class StockBuildReached(Exception):
    pass


@pytest.fixture
def kimi_linear(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The installed (patched) kimi_linear module, its stock backbone replaced by a marker:
    reaching it means the decode_backend check let the construction through."""
    from vllm.model_executor.models import kimi_linear

    def stock_backbone(**_: Any) -> None:
        raise StockBuildReached

    monkeypatch.setattr(kimi_linear, "KimiLinearModel", stock_backbone)
    return kimi_linear


def test_patch_checks_through_the_runtime_module(kimi_linear: Any) -> None:
    assert kimi_linear.specialized_decode_config is runtime.specialized_decode_config


def test_model_refuses_an_unsupported_deployment(kimi_linear: Any, engine_config: Any) -> None:
    vllm_config = engine_config(enable_prefix_caching=True, enable_lora=True)
    with pytest.raises(ValueError, match="does not support this deployment") as raised:
        kimi_linear.KimiLinearForCausalLM(vllm_config=vllm_config)
    assert "\n  - LoRA" in str(raised.value) and "\n  - prefix caching" in str(raised.value)


def test_model_refuses_an_unknown_backend(kimi_linear: Any, engine_config: Any) -> None:
    vllm_config = engine_config(additional_config={"decode_backend": "fast"})
    with pytest.raises(ValueError, match="'fast' is not a decode backend"):
        kimi_linear.KimiLinearForCausalLM(vllm_config=vllm_config)


def test_model_holds_the_executor_under_the_flag(
    kimi_linear: Any, engine_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Supported: the model gets a SpecializedDecodeModule (built from the weights later)
    before the stock backbone, so forward() can hand it FULL decode-graph captures."""
    built = []
    holder = kimi_linear.SpecializedDecodeModule

    def recording_holder(config: Any) -> Any:
        built.append(config)
        return holder(config)

    monkeypatch.setattr(kimi_linear, "SpecializedDecodeModule", recording_holder)
    vllm_config = engine_config(additional_config=SPECIALIZED)
    with pytest.raises(StockBuildReached):
        kimi_linear.KimiLinearForCausalLM(vllm_config=vllm_config)
    assert len(built) == 1 and built[0].batch_sizes


@pytest.mark.parametrize(
    "additional_config", [{}, {"decode_backend": "auto"}], ids=["unset", "auto"]
)
def test_model_builds_stock_by_default(
    kimi_linear: Any, engine_config: Any, additional_config: dict
) -> None:
    # Even a deployment the specialized decode would refuse: stock is not checked.
    vllm_config = engine_config(enforce_eager=True, additional_config=additional_config)
    with pytest.raises(StockBuildReached):
        kimi_linear.KimiLinearForCausalLM(vllm_config=vllm_config)

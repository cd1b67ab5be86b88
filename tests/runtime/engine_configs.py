"""Real vLLM 0.26.0 engine configs for the decode_backend tests, built on a CPU machine.

Run with the wheel venv (build/venv-wheel/bin/python), which has the patched vLLM: the tests
exercise the shipped module and the patched KimiLinearForCausalLM, not the repo's sources.

vLLM resolves engine configs through `vllm.platforms.current_platform`; on a machine without
a GPU that is a platform without CUDA graphs, so every config would come out eager. The
stand-in below answers the device questions as a node of H200s (CUDA, SM90) does; nothing
else is faked: EngineArgs.create_engine_config runs vLLM's own resolution (defaults,
cudagraph mode and capture sizes, the hybrid-model prefix-caching default, ...). Modules are
imported under this machine's platform first (their import-time kernel-library choices must
work here), then the stand-in replaces it. conftest.py imports this module first.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import vllm.platforms  # noqa: E402
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum  # noqa: E402

# The published config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (minus auto_map).
MODEL_DIR = Path(__file__).parent / "kimi_linear_48b"
MODEL_CONFIG: dict[str, Any] = json.loads((MODEL_DIR / "config.json").read_text())


class StandInCudaPlatform(Platform):
    """vLLM's view of one CUDA GPU of the given capability, without touching a driver."""

    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"
    dist_backend = "nccl"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"
    capability = DeviceCapability(9, 0)

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return cls.capability

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"stand-in SM{cls.capability.major}{cls.capability.minor}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 141 << 30

    @classmethod
    def is_fully_connected(cls, device_ids: list[int]) -> bool:
        return True

    @classmethod
    def device_count(cls) -> int:
        return 8  # a node with room for the TP / PP / DP variants

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True

    def is_cumem_allocator_available(self) -> bool:
        return True  # sleep mode's allocator; the real check loads the CUDA library


def stand_in_platform(major: int, minor: int) -> Platform:
    cls = type(
        f"StandInSM{major}{minor}",
        (StandInCudaPlatform,),
        {"capability": DeviceCapability(major, minor)},
    )
    return cls()


def install_platform(platform: Platform) -> None:
    """Make `platform` vllm's current platform, also where modules bound it at import."""
    previous = vllm.platforms.current_platform
    for module in list(sys.modules.values()):
        if module is not vllm.platforms and getattr(module, "current_platform", None) is previous:
            module.current_platform = platform  # type: ignore[union-attr]
    # vllm.platforms resolves `current_platform` from here on every access.
    vllm.platforms._current_platform = platform


# Import what the tests use while the platform is still this machine's (CPU): their
# import-time choices (which kernel libraries to load) must be the ones that work here.
# Everything asked afterwards, while configs are resolved, is answered as on an H200.
import vllm.engine.arg_utils  # noqa: E402, F401
import vllm.model_executor.models.kimi_linear  # noqa: E402, F401

H200 = stand_in_platform(9, 0)
install_platform(H200)


def write_model_dir(root: Path, **changes: Any) -> Path:
    """A model directory whose config.json is the 48B one with `changes` applied; a key
    `linear_attn_config.x` changes key x of that dict."""
    config = json.loads(json.dumps(MODEL_CONFIG))
    for name, value in changes.items():
        owner, _, key = name.rpartition(".")
        (config[owner] if owner else config)[key] = value
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


SPECIALIZED = {"decode_backend": "latency_specialized"}

# The engine arguments of a supported deployment (`vllm serve <48B> --additional-config
# '{"decode_backend": "latency_specialized"}'` plus the flags a config-only model needs).
BASE_ENGINE_ARGS: dict[str, Any] = dict(
    skip_tokenizer_init=True,
    load_format="dummy",
    max_model_len=4096,
    additional_config=SPECIALIZED,
)

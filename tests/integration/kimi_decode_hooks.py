"""Test instruments inside one vLLM 0.26.0 engine process (imported by engine_session.py only).

- ``SeededNormalLoader`` (load format ``hd_seeded_normal``): vLLM's dummy loader, then every
  parameter re-drawn from N(0, 0.02) by a generator seeded with the parameter's name. It runs
  inside ``BaseModelLoader.load_model`` between ``load_weights`` and
  ``process_weights_after_loading``, so the stock and the specialized engine see the same
  numbers, and the specialized executor, which is built from the loaded weights in
  ``process_weights_after_loading`` (fused copies, one-time repacks), is built from these
  numbers. Re-initialising after engine start (``collective_rpc`` writing into parameters)
  would not reach such copies, nor MLA's ``W_UK_T`` / ``W_UV``, which stock derives from
  ``kv_b_proj`` at that same point.
- ``StepRecorder``: a V1 custom logits processor (``LLM(logits_processors=[...])``, vLLM's
  public hook into the sampler). The sampler hands it the float32 copy of the step's bf16
  logits, one row per scheduled request, before greedy argmax. It records, per request tag and
  output position, the raw logits row (bf16, lossless), the engine's own argmax, and the
  request's KV block ids; and it can force a row onto a given token (teacher forcing: the
  specialized engine follows the stock engine's tokens, so both see the same inputs at every
  step). The tag and the forced tokens travel in ``SamplingParams.extra_args``.
- ``describe_engine`` / ``read_request_states``: run through ``LLM.collective_rpc`` on the
  worker. The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the callables
  need no serialization (no VLLM_ALLOW_INSECURE_SERIALIZATION) and see the live model runner.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from scenarios import SEEDED_LOAD_FORMAT, WEIGHT_SEED, WEIGHT_STD
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

TAG_KEY = "hd_tag"
FORCED_KEY = "hd_forced"


@torch.no_grad()
def reinit_parameters(model: nn.Module, seed: int, std: float) -> int:
    """Draw every floating-point parameter from N(0, std); the generator of each one is
    seeded from ``seed`` and the parameter's name, so the values depend on neither the
    order of parameters nor anything else in the process. Returns the count."""
    count = 0
    for name, param in model.named_parameters():
        if param.device.type == "meta" or not torch.is_floating_point(param):
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed ^ zlib.crc32(name.encode()))
        param.data.normal_(0.0, std, generator=generator)
        count += 1
    return count


@register_model_loader(SEEDED_LOAD_FORMAT)
class SeededNormalLoader(DummyModelLoader):
    """load_format="dummy", then seeded N(0, 0.02) parameters (see the module docstring)."""

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        super().load_weights(model, model_config)
        if reinit_parameters(model, WEIGHT_SEED, WEIGHT_STD) == 0:
            raise RuntimeError("seeded init found no floating-point parameter")


class StepRecorder(LogitsProcessor):
    """Records every tagged row the sampler sees and applies teacher forcing."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.runner: Any = None  # the GPUModelRunner, attached after engine start
        self.reset()

    def reset(self) -> None:
        self.logits: dict[str, dict[int, torch.Tensor]] = {}
        self.argmax: dict[str, dict[int, int]] = {}
        self.block_ids: dict[str, list[list[int]]] = {}
        self.first_step: dict[str, int] = {}
        self.steps: list[list[tuple[str, int]]] = []

    def is_argmax_invariant(self) -> bool:
        return False  # forcing changes the argmax; it must run for greedy requests

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        # Rows are mapped to requests through the runner's persistent batch in apply().
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        if runner is None:  # engine start-up (dummy sampler runs)
            return logits
        req_ids = runner.input_batch.req_ids
        rows = []
        for row, req_id in enumerate(req_ids[: logits.shape[0]]):
            state = runner.requests.get(req_id)
            params = None if state is None else state.sampling_params
            extra = (params.extra_args if params is not None else None) or {}
            if TAG_KEY in extra:
                rows.append((row, state, extra))
        if not rows:
            return logits
        argmax = logits.argmax(dim=-1).tolist()
        step = []
        forced_rows, forced_tokens = [], []
        for row, state, extra in rows:
            tag = extra[TAG_KEY]
            # Tokens sampled before this step (placeholders under async scheduling count
            # too). A chunked prefill has several rows at position 0: the last one, which
            # comes from the whole prompt, is the one that is sampled and kept.
            position = len(state.output_token_ids)
            self.logits.setdefault(tag, {})[position] = logits[row].to(torch.bfloat16)
            self.argmax.setdefault(tag, {})[position] = argmax[row]
            self.block_ids[tag] = [list(ids) for ids in state.block_ids]
            self.first_step.setdefault(tag, len(self.steps))
            step.append((tag, position))
            forced = extra.get(FORCED_KEY)
            if forced is not None and position < len(forced):
                forced_rows.append(row)
                forced_tokens.append(forced[position])
        self.steps.append(step)
        if forced_rows:
            rows_t = torch.tensor(forced_rows, device=logits.device)
            tokens_t = torch.tensor(forced_tokens, device=logits.device)
            logits[rows_t] = float("-inf")
            logits[rows_t, tokens_t] = 0.0
        return logits

    def take(self, tags: list[str], num_tokens: dict[str, int]) -> dict[str, Any]:
        """The records of ``tags`` on the CPU (logits stacked by output position)."""
        logits, argmax = {}, {}
        for tag in tags:
            rows = self.logits.get(tag, {})
            expected = list(range(num_tokens[tag]))
            if sorted(rows) != expected:
                raise RuntimeError(
                    f"{tag}: recorded positions {sorted(rows)[:8]}... ({len(rows)}), "
                    f"expected 0..{num_tokens[tag] - 1}"
                )
            logits[tag] = torch.stack([rows[k] for k in expected]).cpu()
            argmax[tag] = [self.argmax[tag][k] for k in expected]
        record = {
            "logits": logits,
            "argmax": argmax,
            "block_ids": {tag: self.block_ids[tag] for tag in tags},
            "first_step": {tag: self.first_step[tag] for tag in tags},
            "steps": self.steps,
        }
        self.reset()
        return record


def attach_recorder(worker: Any) -> StepRecorder:
    runner = worker.model_runner
    recorders = [p for p in runner.input_batch.logitsprocs.all if isinstance(p, StepRecorder)]
    if len(recorders) != 1:
        raise RuntimeError(f"expected one StepRecorder in the runner, found {recorders}")
    recorders[0].runner = runner
    return recorders[0]


def kv_cache_groups(runner: Any) -> list[dict[str, Any]]:
    groups = []
    for group in runner.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = (
            "mamba"
            if isinstance(spec, MambaSpec)
            else "attention"
            if isinstance(spec, AttentionSpec)
            else type(spec).__name__
        )
        groups.append(
            {
                "kind": kind,
                "layer_names": list(group.layer_names),
                "block_size": getattr(spec, "block_size", None),
            }
        )
    return groups


def describe_engine(worker: Any) -> dict[str, Any]:
    """What the tests need to know about the engine they judge."""
    import vllm

    runner = worker.model_runner
    model = runner.get_model()
    config = runner.vllm_config
    executor = getattr(model, "specialized_decode", None)
    return {
        "vllm_version": vllm.__version__,
        "gpu": torch.cuda.get_device_name(),
        "model_class": type(model).__name__,
        "specialized_decode_config": repr(getattr(model, "specialized_decode_config", None)),
        "specialized_decode": None if executor is None else type(executor).__name__,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or ()),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "kv_cache_groups": kv_cache_groups(runner),
    }


@torch.no_grad()
def read_request_states(
    worker: Any, block_ids: dict[str, list[list[int]]], num_cached: dict[str, int]
) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """After a run: per request tag and layer, the KDA (conv, recurrent) state of its slot
    and the first ``num_cached[tag]`` MLA cache rows. Finished requests' blocks are free but
    untouched until another request takes them, and nothing runs between the run and this
    read."""
    runner = worker.model_runner
    context = runner.vllm_config.compilation_config.static_forward_context
    states: dict[str, dict[str, dict[str, torch.Tensor]]] = {tag: {} for tag in block_ids}
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        for layer_name in group.layer_names:
            cache = context[layer_name].kv_cache
            for tag, ids in block_ids.items():
                if isinstance(spec, MambaSpec):
                    if len(cache) != 2:
                        raise RuntimeError(f"{layer_name}: {len(cache)} KDA state tensors")
                    conv, recurrent = cache
                    slot = ids[gid][0]
                    states[tag][layer_name] = {
                        "slot": torch.tensor(slot),
                        "conv": conv[slot].cpu().clone(),
                        "recurrent": recurrent[slot].cpu().clone(),
                    }
                elif isinstance(spec, AttentionSpec):
                    states[tag][layer_name] = {
                        "mla": _attention_rows(cache, ids[gid], spec.block_size, num_cached[tag])
                    }
    return states


def _attention_rows(
    cache: torch.Tensor, block_ids: list[int], block_size: int, num_tokens: int
) -> torch.Tensor:
    """Rows 0..num_tokens-1 of one request in an MLA cache [kernel blocks, kernel block
    size, 576]: the scheduler's blocks of ``block_size`` tokens are split into kernel blocks
    (v1/worker/block_table.py: kernel id = block id * (block_size // kernel size) + i)."""
    kernel_block = cache.shape[1]
    per_block = block_size // kernel_block
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids)[positions // block_size]
    offset = positions % block_size
    kernel_ids = (blocks * per_block + offset // kernel_block).to(cache.device)
    rows = (offset % kernel_block).to(cache.device)
    return cache[kernel_ids, rows].reshape(num_tokens, -1).cpu().clone()

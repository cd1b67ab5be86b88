"""What the end-to-end tests run: engine settings, requests and traffic (issue 6).

Plain data, no vLLM import: the test module (judging) and engine_session.py (running one
engine in a subprocess) both read it, so both sides agree on every prompt and schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# The first 5 layers of Kimi-Linear-48B-A3B, every other shape the real one: KDA layers
# 1, 2, 3, 5 and the MLA layer 4 (1-based, as linear_attn_config numbers them); layer 1 has
# the dense MLP, layers 2-5 the 256-expert MoE. The runtime accepts any first N <= 27 layers.
MODEL_DIR = HERE / "kimi_linear_5_layers"
NUM_LAYERS = 5
MLA_LAYERS = (4,)
VOCAB_SIZE = 163840

# Registered by kimi_decode_hooks.py in the engine process: the dummy loader, then every
# parameter re-drawn from N(0, WEIGHT_STD) with a generator seeded by WEIGHT_SEED and the
# parameter's name, before process_weights_after_loading (so before the executor is built).
SEEDED_LOAD_FORMAT = "hd_seeded_normal"
WEIGHT_SEED = 20261130
WEIGHT_STD = 0.02

SPECIALIZED = {"decode_backend": "latency_specialized"}

# One deployment for every engine; only ENGINE_KINDS differ. Small on purpose: 5 layers,
# 2048 tokens, 16 sequences, graphs for 1, 2, 4, 8, 16 (3, 5, 6, 7 requests replay a larger
# graph with padded rows). 64 KV blocks: a request takes one block per KV cache group
# (4 KDA groups + 1 MLA group, the MLA block holds ~1900 tokens), so freed blocks and KDA state
# slots are handed out again within one test run; 512 batched tokens make the long prompt of
# the mixed traffic a chunked prefill that shares steps with decodes.
ENGINE_ARGS: dict[str, Any] = dict(
    model=str(MODEL_DIR),
    skip_tokenizer_init=True,
    load_format=SEEDED_LOAD_FORMAT,
    max_model_len=2048,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    gpu_memory_utilization=0.3,
    num_gpu_blocks_override=64,
    # Fixed, so the start skips vLLM's memory profiling, which reads the device's free
    # memory and would count another engine starting beside this one (engine_runs.py runs
    # the stock and the specialized engine at once). Only 64 blocks are allocated.
    kv_cache_memory_bytes=4 << 30,
    enable_prefix_caching=False,
    compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]},
    seed=0,
)

ENGINE_KINDS: dict[str, dict[str, Any]] = {
    # vLLM's own decode: the reference.
    "stock": {},
    # The default backend named explicitly: must be the stock decode, bit for bit.
    "auto": {"additional_config": {"decode_backend": "auto"}},
    "specialized": {"additional_config": SPECIALIZED},
    # A deployment the executor refuses (no CUDA graphs): engine start must raise.
    "unsupported": {"additional_config": SPECIALIZED, "enforce_eager": True},
}


@dataclass(frozen=True)
class Request:
    tag: str
    prompt: list[int]
    max_tokens: int
    arrive_at_step: int = 0
    """Mixed traffic only: the engine step before which the request is added."""


def _prompt(rng: random.Random, length: int) -> list[int]:
    # Token ids below the special tokens (bos is 163584); any id is valid for dummy weights.
    return [rng.randrange(0, 163584) for _ in range(length)]


# --- specialized vs stock, teacher-forced -------------------------------------------------

COMPARE_BATCHES = (1, 4, 8)
DECODE_STEPS = 256
COMPARE_MAX_TOKENS = DECODE_STEPS + 1  # the first token comes from the prefill step


def compare_scenario(batch: int) -> str:
    return f"compare_b{batch}"


def compare_requests(batch: int) -> list[Request]:
    # Prompts of 8-64 tokens: a batch of 8 prefills in one step (<= 512 tokens), so all
    # requests then decode together for exactly DECODE_STEPS steps of `batch` rows.
    rng = random.Random(1000 + batch)
    return [
        Request(f"b{batch}r{i}", _prompt(rng, rng.randint(8, 64)), COMPARE_MAX_TOKENS)
        for i in range(batch)
    ]


# --- auto vs stock, free-running ----------------------------------------------------------

AUTO_SCENARIO = "auto_check"


def auto_requests() -> list[Request]:
    rng = random.Random(2000)
    return [Request(f"auto{i}", _prompt(rng, rng.randint(8, 64)), 64) for i in range(4)]


# --- mixed traffic vs each request alone, free-running ------------------------------------

MIXED_SCENARIO = "mixed"
ALONE_SCENARIO = "alone"

# (prompt length, output tokens, arrival step). Three requests start (3 decode rows: the
# 4-graph with one padded row); single requests and pairs join a running decode batch; a
# 700-token prompt is prefilled in two chunks next to decodes; requests finish at different
# steps and later arrivals take the KV blocks and KDA slots they freed; decode batches pass
# through 1-8 rows, most not a graph size.
_MIXED_PLAN = (
    (24, 48, 0),
    (40, 32, 0),
    (12, 20, 0),
    (31, 40, 6),
    (700, 24, 10),
    (18, 36, 14),
    (27, 16, 14),
    (9, 40, 24),
    (50, 24, 34),
    (14, 30, 34),
    (22, 12, 36),
    (35, 28, 50),
    (16, 20, 52),
    (28, 16, 62),
    (44, 24, 66),
    (11, 18, 70),
)


def mixed_requests() -> list[Request]:
    rng = random.Random(3000)
    return [
        Request(f"m{i:02d}", _prompt(rng, length), max_tokens, step)
        for i, (length, max_tokens, step) in enumerate(_MIXED_PLAN)
    ]


# Which scenarios each engine runs (the specialized one is forced onto the stock tokens in the
# compare scenarios, so the stock engine runs first).
SCENARIOS: dict[str, tuple[str, ...]] = {
    "stock": (
        *(compare_scenario(b) for b in COMPARE_BATCHES),
        AUTO_SCENARIO,
        MIXED_SCENARIO,
        ALONE_SCENARIO,
    ),
    "specialized": (
        *(compare_scenario(b) for b in COMPARE_BATCHES),
        MIXED_SCENARIO,
        ALONE_SCENARIO,
    ),
    "auto": (AUTO_SCENARIO,),
    "unsupported": (),
}

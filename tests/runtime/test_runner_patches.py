"""CPU tests of the series' V1 runner patches, against the patched vLLM in the wheel venv.

- v1-block-table-commit-rows-to-the-GPU-only-when-they: BlockTable.commit_block_table() copies
  the rows only when they changed since its last copy or another row count is committed (the
  runner nulls padded rows past the active ones on the GPU between commits).
- v1-runner-skip-the-metadata-builds-of-layers-the-mod: GPUModelRunner asks the model which
  layers it builds itself; models without the hook build everything.
- v1-runner-take-a-step-s-logits-from-the-model-when-i: for steps whose requests have one
  token each GPUModelRunner asks the model for the logits its graph computed; any other step,
  and models without the hook, get compute_logits.
- v1-runner-copy-a-step-s-positions-and-sequence-lengt: without async speculative decoding
  the step's positions and sequence lengths are the host's values, copied; with it they are
  still derived from the GPU's num_computed_tokens.
- v1-runner-skip-GPU-fills-that-change-nothing-on-a-st: the padded block-table rows and
  slot-mapping tokens are filled only when the step has any; without drafts
  num_accepted_tokens is filled with ones once.
- v1-runner-index-a-one-token-step-s-logits-rows-witho: when every request has one token the
  logits indices are a slice of a constant arange and the sampled hidden states the first
  rows, a view; other steps compute the indices and gather.
- v1-runner-copy-to-the-GPU-only-the-step-inputs-a-rea: the discard mask reaches the GPU only
  with speculative decoding (its drafters read it there), num_computed_tokens only with async
  drafts.

The "GPU" side of a BlockTable is a second CPU tensor here (device "cpu"), so a copy is seen
as the GPU rows becoming the CPU rows.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

ROWS, BLOCKS = 4, 8
SENTINEL = -5


@pytest.fixture
def table() -> Any:
    from vllm.v1.worker.block_table import BlockTable

    table = BlockTable(
        block_size=16,
        max_num_reqs=ROWS,
        max_num_blocks_per_req=BLOCKS,
        max_num_batched_tokens=64,
        pin_memory=False,
        device=torch.device("cpu"),
        kernel_block_size=16,
        cp_kv_cache_interleave_size=1,
    )
    assert table.block_table.gpu.data_ptr() != table.block_table.cpu.data_ptr()
    return table


def poison_gpu(table: Any) -> None:
    table.block_table.gpu.fill_(SENTINEL)


def gpu_rows(table: Any, n: int) -> torch.Tensor:
    return table.block_table.gpu[:n]


def test_an_unchanged_commit_of_the_same_rows_copies_nothing(table: Any) -> None:
    table.add_row([3, 4], 0)
    table.add_row([7], 1)
    table.commit_block_table(2)
    assert torch.equal(gpu_rows(table, 2), table.block_table.cpu[:2])
    poison_gpu(table)
    table.commit_block_table(2)
    assert (gpu_rows(table, 2) == SENTINEL).all()


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.append_row([9], 0),
        lambda t: t.add_row([5, 6], 1),
        lambda t: t.clear_row(1),
        lambda t: t.move_row(1, 0),
        lambda t: t.swap_row(0, 1),
        lambda t: t.clear(),
    ],
    ids=["append", "add", "clear_row", "move", "swap", "clear"],
)
def test_every_row_change_makes_the_next_commit_copy(table: Any, change: Any) -> None:
    table.add_row([3, 4], 0)
    table.add_row([7], 1)
    table.commit_block_table(2)
    change(table)
    poison_gpu(table)
    table.commit_block_table(2)
    assert torch.equal(gpu_rows(table, 2), table.block_table.cpu[:2])


def test_appending_no_block_is_no_change(table: Any) -> None:
    table.add_row([3], 0)
    table.commit_block_table(1)
    table.append_row([], 0)
    poison_gpu(table)
    table.commit_block_table(1)
    assert (gpu_rows(table, 1) == SENTINEL).all()


@pytest.mark.parametrize("rows", [1, 3])
def test_another_row_count_copies(table: Any, rows: int) -> None:
    # The runner nulls rows past the active ones on the GPU for graph padding, and a dummy
    # run commits the padded count: rows a commit did not cover may differ from the CPU.
    for i in range(3):
        table.add_row([10 + i], i)
    table.commit_block_table(2)
    poison_gpu(table)
    table.commit_block_table(rows)
    assert torch.equal(gpu_rows(table, rows), table.block_table.cpu[:rows])


# ----------------------------------------------------------- the metadata-build hook
def runner_with(model: Any) -> Any:
    return SimpleNamespace(get_model=lambda: model)


def test_the_runner_asks_the_model_which_layers_it_builds() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    asked = []

    class Model:
        def attention_layers_built_by_model(self, mode, descriptor):
            asked.append((mode, descriptor))
            return ["layers.0.attn", "layers.1.attn"]

    descriptor = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    built = GPUModelRunner._attention_layers_built_by_model(
        runner_with(Model()), CUDAGraphMode.FULL, descriptor
    )
    assert built == frozenset({"layers.0.attn", "layers.1.attn"})
    assert asked == [(CUDAGraphMode.FULL, descriptor)]


def test_a_model_without_the_hook_gets_every_build() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    built = GPUModelRunner._attention_layers_built_by_model(
        runner_with(object()), CUDAGraphMode.FULL, None
    )
    assert built == frozenset()


# ------------------------------------------------------------- the graph-logits hook
class LogitsModel:
    def __init__(self, logits: Any) -> None:
        self.logits, self.asked = logits, []

    def logits_computed_in_graph(self, mode: Any, descriptor: Any, num_logits: int) -> Any:
        self.asked.append((mode, descriptor, num_logits))
        return self.logits


def test_a_decode_step_takes_the_logits_the_models_graph_computed() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    logits = torch.zeros(3, 11)
    model = LogitsModel(logits)
    descriptor = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    step = SimpleNamespace(total_num_scheduled_tokens=3)
    got = GPUModelRunner._logits_computed_by_model(
        runner_with(model), step, CUDAGraphMode.FULL, descriptor, 3
    )
    assert got is logits
    assert model.asked == [(CUDAGraphMode.FULL, descriptor, 3)]


def test_steps_with_more_tokens_than_requests_compute_their_logits() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model = LogitsModel(torch.zeros(2, 11))
    step = SimpleNamespace(total_num_scheduled_tokens=5)  # a prefill among them
    got = GPUModelRunner._logits_computed_by_model(
        runner_with(model), step, CUDAGraphMode.FULL, None, 2
    )
    assert got is None and model.asked == []


def test_a_model_without_the_logits_hook_computes_them() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    step = SimpleNamespace(total_num_scheduled_tokens=2)
    got = GPUModelRunner._logits_computed_by_model(
        runner_with(object()), step, CUDAGraphMode.FULL, None, 2
    )
    assert got is None


# ------------------------------------------------- positions and sequence lengths
MAX_REQS, MAX_TOKENS = 6, 32


def input_runner(async_spec_decode: bool, computed: list[int], scheduled: list[int]) -> Any:
    """The runner state _prepare_positions_and_seq_lens reads, as _prepare_inputs leaves it
    (its "GPU" tensors on the CPU, poisoned so that an unwritten entry shows)."""
    from vllm.v1.utils import CpuGpuBuffer

    def buffer(n: int) -> Any:
        buf = CpuGpuBuffer(n, dtype=torch.int64, device=torch.device("cpu"), pin_memory=False)
        buf.gpu.fill_(SENTINEL)
        return buf

    num_reqs = len(computed)
    runner = SimpleNamespace(
        use_async_spec_decode=async_spec_decode,
        req_indices=buffer(MAX_TOKENS),
        query_pos=buffer(MAX_TOKENS),
        num_scheduled_tokens=CpuGpuBuffer(
            MAX_REQS, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False
        ),
        positions=torch.full((MAX_TOKENS,), SENTINEL, dtype=torch.int64),
        positions_cpu=torch.zeros(MAX_TOKENS, dtype=torch.int64),
        seq_lens=torch.full((MAX_REQS,), SENTINEL, dtype=torch.int32),
        seq_lens_cpu=torch.zeros(MAX_REQS, dtype=torch.int32),
        optimistic_seq_lens_cpu=torch.zeros(MAX_REQS, dtype=torch.int32),
        num_computed_tokens=torch.zeros(MAX_REQS, dtype=torch.int32),
    )
    runner.num_computed_tokens[:num_reqs] = torch.tensor(computed, dtype=torch.int32)
    runner.optimistic_seq_lens_cpu[:num_reqs] = torch.tensor(
        [c + s for c, s in zip(computed, scheduled)], dtype=torch.int32
    )
    offset = 0
    for n in scheduled:  # what _get_cumsum_and_arange writes
        runner.query_pos.np[offset : offset + n] = range(n)
        offset += n
    return runner


def prepare_positions(runner: Any, computed: list[int], scheduled: list[int]) -> None:
    import numpy as np

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    scheduled_np = np.array(scheduled, dtype=np.int32)
    req_indices = np.repeat(np.arange(len(scheduled)), scheduled_np)
    total = int(scheduled_np.sum())
    positions_np = np.array(computed)[req_indices] + runner.query_pos.np[:total]
    GPUModelRunner._prepare_positions_and_seq_lens(
        runner, len(scheduled), total, scheduled_np, req_indices, positions_np
    )


STEPS = {
    "decode": ([7, 0, 130], [1, 1, 1]),
    "mixed": ([5, 0, 64, 9], [1, 4, 1, 3]),
    "prefill": ([0], [17]),
}


@pytest.mark.parametrize("async_spec_decode", [False, True], ids=["host", "gpu"])
@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
def test_both_paths_write_every_position_and_sequence_length(
    step: str, async_spec_decode: bool
) -> None:
    computed, scheduled = STEPS[step]
    runner = input_runner(async_spec_decode, computed, scheduled)
    prepare_positions(runner, computed, scheduled)
    want_positions = [c + i for c, n in zip(computed, scheduled) for i in range(n)]
    total = len(want_positions)
    assert runner.positions[:total].tolist() == want_positions
    assert (runner.positions[total:] == SENTINEL).all()  # past the step: untouched
    want_lens = [c + n for c, n in zip(computed, scheduled)]
    assert runner.seq_lens.tolist() == want_lens + [0] * (MAX_REQS - len(computed))


def test_with_async_drafts_the_gpus_computed_tokens_decide() -> None:
    # The async-draft kernel corrected the GPU's count (a rejected draft token): positions
    # and lengths follow it, not the host's optimistic values.
    computed, scheduled = [10, 4], [1, 1]
    runner = input_runner(True, computed, scheduled)
    runner.num_computed_tokens[0] = 8
    prepare_positions(runner, computed, scheduled)
    assert runner.positions[:2].tolist() == [8, 4]
    assert runner.seq_lens[:2].tolist() == [9, 5]


def test_without_async_drafts_no_index_is_copied_to_the_gpu() -> None:
    computed, scheduled = [3, 8], [1, 1]
    runner = input_runner(False, computed, scheduled)
    prepare_positions(runner, computed, scheduled)
    assert (runner.req_indices.gpu == SENTINEL).all()
    assert (runner.query_pos.gpu == SENTINEL).all()
    assert runner.req_indices.np[:2].tolist() == [0, 1]  # the host's copy is kept


# ------------------------------------------------------------ fills that change nothing
class FillRecorder(TorchFunctionMode):
    """Records the tensors every Tensor.fill_ call in its scope writes."""

    def __init__(self) -> None:
        super().__init__()
        self.filled: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.fill_:
            self.filled.append(args[0])
        return func(*args, **(kwargs or {}))


GROUPS = 3  # KV-cache groups (Kimi-Linear has four: one MLA, three KDA)


def metadata_runner() -> Any:
    """The runner state _get_slot_mappings and _build_attention_metadata read, for a model
    whose every layer the model builds itself (so no backend builder runs); its "GPU"
    tensors on the CPU, the block tables and slot mappings poisoned."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.utils import CpuGpuBuffer

    def buffer(n: int, dtype: torch.dtype) -> Any:
        return CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False)

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = [
        SimpleNamespace(kv_cache_spec=spec, layer_names=[f"layers.{g}.attn"]) for g in range(GROUPS)
    ]
    tables = []
    for _ in range(GROUPS):
        rows = torch.full((MAX_REQS, BLOCKS), SENTINEL, dtype=torch.int32)
        tables.append(
            SimpleNamespace(
                get_device_tensor=lambda n, rows=rows: rows[:n],
                slot_mapping=SimpleNamespace(
                    gpu=torch.full((MAX_TOKENS,), SENTINEL, dtype=torch.int64)
                ),
                rows=rows,
            )
        )
    runner = SimpleNamespace(
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        input_batch=SimpleNamespace(
            block_table=tables,
            num_computed_tokens_cpu_tensor=torch.zeros(MAX_REQS, dtype=torch.int32),
            num_prompt_tokens_cpu_tensor=torch.zeros(MAX_REQS, dtype=torch.int32),
        ),
        optimistic_seq_lens_cpu=torch.ones(MAX_REQS, dtype=torch.int32),
        routed_experts_initialized=False,
        use_async_spec_decode=False,
        is_mm_prefix_lm=False,
        model_config=SimpleNamespace(rswa_window=None),
        query_start_loc=buffer(MAX_REQS + 1, torch.int32),
        seq_lens=torch.ones(MAX_REQS, dtype=torch.int32),
        positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
        dcp_world_size=1,
        cache_config=SimpleNamespace(kv_sharing_fast_prefill=False),
        speculative_config=None,
        attn_groups=[[SimpleNamespace(layer_names=g.layer_names)] for g in groups],
        _get_encoder_seq_lens=lambda *args, **kwargs: (None, None),
    )
    return runner


def slot_mappings(runner: Any, num_tokens: int, padded: int) -> tuple[Any, list]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    with FillRecorder() as recorder:
        by_gid, _ = GPUModelRunner._get_slot_mappings(runner, padded, padded, num_tokens)
    return by_gid, recorder.filled


def build_metadata(runner: Any, num_reqs: int, padded: int) -> tuple[dict, list]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    mappings, _ = GPUModelRunner._get_slot_mappings(runner, padded, padded, num_reqs)
    layers = frozenset(f"layers.{g}.attn" for g in range(GROUPS))
    with FillRecorder() as recorder:
        metadata, _ = GPUModelRunner._build_attention_metadata(
            runner,
            num_tokens=num_reqs,
            num_reqs=num_reqs,
            max_query_len=1,
            num_tokens_padded=padded,
            num_reqs_padded=padded,
            slot_mappings=mappings,
            model_built_layers=layers,
        )
    return metadata, recorder.filled


def test_a_step_without_padding_fills_no_slot_mapping() -> None:
    runner = metadata_runner()
    by_gid, filled = slot_mappings(runner, num_tokens=4, padded=4)
    assert filled == []
    assert all((by_gid[g] == SENTINEL).all() for g in range(GROUPS))


def test_a_padded_step_marks_its_padded_slots() -> None:
    runner = metadata_runner()
    by_gid, filled = slot_mappings(runner, num_tokens=3, padded=4)
    assert len(filled) == GROUPS
    for g in range(GROUPS):
        assert by_gid[g].tolist() == [SENTINEL] * 3 + [-1]


def test_a_step_without_padding_fills_no_block_table_row() -> None:
    runner = metadata_runner()
    metadata, filled = build_metadata(runner, num_reqs=4, padded=4)
    assert filled == []
    for g in range(GROUPS):
        table = metadata[f"layers.{g}.attn"].block_table_tensor
        assert table.shape[0] == 4 and (table == SENTINEL).all()


def test_a_padded_step_nulls_its_padded_block_table_rows() -> None:
    from vllm.v1.worker.gpu_model_runner import NULL_BLOCK_ID

    runner = metadata_runner()
    metadata, filled = build_metadata(runner, num_reqs=3, padded=4)
    assert len(filled) == GROUPS
    for g in range(GROUPS):
        table = metadata[f"layers.{g}.attn"].block_table_tensor
        assert (table[:3] == SENTINEL).all() and (table[3] == NULL_BLOCK_ID).all()
        assert (runner.input_batch.block_table[g].rows[4:] == SENTINEL).all()


def accepted_runner(num_spec_tokens: int) -> Any:
    from vllm.v1.utils import CpuGpuBuffer

    buffers = CpuGpuBuffer(
        MAX_REQS, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False
    )
    buffers.np.fill(SENTINEL)
    buffers.gpu.fill_(SENTINEL)
    return SimpleNamespace(
        num_spec_tokens=num_spec_tokens,
        num_accepted_tokens=buffers,
        _num_accepted_tokens_all_ones=False,
    )


@pytest.mark.parametrize("num_spec_tokens", [0, 2], ids=["no-drafts", "drafts"])
def test_num_accepted_tokens_is_filled_again_only_with_drafts(num_spec_tokens: int) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = accepted_runner(num_spec_tokens)
    GPUModelRunner._fill_num_accepted_tokens_with_ones(runner)
    assert (runner.num_accepted_tokens.gpu == 1).all()
    assert (runner.num_accepted_tokens.np == 1).all()
    # A drafts step would have written accepted counts here; without drafts nothing does.
    runner.num_accepted_tokens.gpu[0] = 3
    with FillRecorder() as recorder:
        GPUModelRunner._fill_num_accepted_tokens_with_ones(runner)
    if num_spec_tokens:
        assert len(recorder.filled) == 1 and (runner.num_accepted_tokens.gpu == 1).all()
    else:
        assert recorder.filled == [] and runner.num_accepted_tokens.gpu[0] == 3


# ------------------------------------------------------------ sampled hidden states
def indices_runner() -> Any:
    return SimpleNamespace(one_token_logits_indices=torch.arange(MAX_REQS, dtype=torch.int32))


def test_a_one_token_steps_logits_indices_are_a_slice_of_the_constant_arange() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = indices_runner()
    query_start_loc = torch.tensor([0, 1, 2, 3], dtype=torch.int32)  # 3 requests x 1 token
    got = GPUModelRunner._last_token_indices(runner, query_start_loc, 3, 3)
    assert torch.equal(got, query_start_loc[1:] - 1) and got.dtype == torch.int32
    assert got.data_ptr() == runner.one_token_logits_indices.data_ptr()  # no GPU op


def test_a_step_with_more_tokens_than_requests_computes_its_logits_indices() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    query_start_loc = torch.tensor([0, 2, 4, 5], dtype=torch.int32)  # 2, 2 and 1 tokens
    got = GPUModelRunner._last_token_indices(indices_runner(), query_start_loc, 5, 3)
    assert got.tolist() == [1, 3, 4]


def test_a_one_token_step_samples_the_first_rows_as_a_view() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hidden = torch.arange(24, dtype=torch.float32).reshape(6, 4)  # 6 padded token rows
    logits_indices = torch.arange(3)  # what _prepare_inputs computes for 3 x 1 token
    got = GPUModelRunner._sample_hidden_states(hidden, logits_indices, 3, 3)
    assert torch.equal(got, hidden[logits_indices])
    assert got.data_ptr() == hidden.data_ptr()  # a view: no gather ran


def test_a_step_with_more_tokens_than_requests_gathers_its_rows() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hidden = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    logits_indices = torch.tensor([1, 3, 4])  # requests of 2, 2 and 1 tokens
    got = GPUModelRunner._sample_hidden_states(hidden, logits_indices, 5, 3)
    assert got.tolist() == hidden[[1, 3, 4]].tolist()


# ------------------------------------------------------ inputs no GPU reader needs
def copies_runner(speculative: bool, async_spec_decode: bool) -> Any:
    """The state the two copies read, their "GPU" sides poisoned."""
    from vllm.v1.utils import CpuGpuBuffer

    mask = CpuGpuBuffer(MAX_REQS, dtype=torch.bool, device=torch.device("cpu"), pin_memory=False)
    mask.gpu.fill_(False)
    mask.np[:3] = [True, False, True]
    return SimpleNamespace(
        speculative_config=SimpleNamespace() if speculative else None,
        use_async_spec_decode=async_spec_decode,
        discard_request_mask=mask,
        num_computed_tokens=torch.full((MAX_REQS,), SENTINEL, dtype=torch.int32),
        input_batch=SimpleNamespace(
            num_computed_tokens_cpu_tensor=torch.tensor([5, 9, 2, 0, 0, 0], dtype=torch.int32)
        ),
    )


@pytest.mark.parametrize("speculative", [False, True], ids=["no-drafts", "drafts"])
def test_the_discard_mask_reaches_the_gpu_only_for_drafters(speculative: bool) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = copies_runner(speculative, async_spec_decode=False)
    GPUModelRunner._copy_discard_mask_to_gpu(runner, 3)
    want = [True, False, True] if speculative else [False, False, False]
    assert runner.discard_request_mask.gpu[:3].tolist() == want
    assert runner.discard_request_mask.np[:3].tolist() == [True, False, True]  # host's kept


@pytest.mark.parametrize("async_spec_decode", [False, True], ids=["host", "async-drafts"])
def test_computed_tokens_reach_the_gpu_only_for_async_drafts(async_spec_decode: bool) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = copies_runner(True, async_spec_decode)
    GPUModelRunner._copy_num_computed_tokens_to_gpu(runner, 3)
    want = [5, 9, 2] if async_spec_decode else [SENTINEL] * 3
    assert runner.num_computed_tokens[:3].tolist() == want
    assert (runner.num_computed_tokens[3:] == SENTINEL).all()

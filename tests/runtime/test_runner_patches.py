"""CPU tests of the series' V1 runner patches, against the patched vLLM in the wheel venv.

- v1-block-table-commit-rows-to-the-GPU-only-when-they: BlockTable.commit_block_table() copies
  the rows only when they changed since its last copy or another row count is committed (the
  runner nulls padded rows past the active ones on the GPU between commits).
- v1-runner-skip-the-metadata-builds-of-layers-the-mod: GPUModelRunner asks the model which
  layers it builds itself; models without the hook build everything.
- v1-runner-take-a-step-s-logits-from-the-model-when-i: for steps whose requests have one
  token each GPUModelRunner asks the model for the logits its graph computed; any other step,
  and models without the hook, get compute_logits.

The "GPU" side of a BlockTable is a second CPU tensor here (device "cpu"), so a copy is seen
as the GPU rows becoming the CPU rows.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

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

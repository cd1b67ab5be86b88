# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile the MLA cache-row kernel for sm_90a without a GPU (CuTe DSL errors on CPU).

Kimi-Linear's MLA: 512 latent + 64 rope columns, rows of the q | kv_a projection (row
stride 6720), vLLM's cache [blocks, block_size, 576]. Skips without nvidia-cutlass-dsl.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from ptx_dump import compiled_ptx  # noqa: E402

from kernels.mla.kernel import MlaCacheRowKernel  # noqa: E402

LORA, ROPE, PROJ_STRIDE = 512, 64, 6720


def _ptr(dtype, align=16):
    # Any aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)


def _kernel(block_size=16, use_pdl=True):
    width = LORA + ROPE
    return MlaCacheRowKernel(
        LORA, ROPE, 1e-6, PROJ_STRIDE, block_size, block_size * width, width, use_pdl
    )


def _compile(kern):
    bf16 = _ptr(cutlass.BFloat16)
    return cute.compile(
        kern, bf16, bf16, _ptr(cutlass.Int64, 8), bf16, cutlass.Int32(1), cuda.CUstream(0)
    )


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("use_pdl", [True, False])
def test_compiles_for_sm90a(block_size, use_pdl):
    assert _compile(_kernel(block_size, use_pdl)) is not None


def test_norm_weight_before_the_wait_and_the_rows_after_it(tmp_path):
    """The norm weight is read before griddepcontrol.wait; the projection rows and the
    slots only after it (a kernel before this one may write them)."""
    ptx = compiled_ptx(tmp_path, "test_mla_compile", "_compile(t._kernel())")
    wait = ptx.index("griddepcontrol.wait")
    loads = [i for i in range(len(ptx)) if ptx.startswith("ld.global", i)]
    before = [i for i in loads if i < wait]
    after = [i for i in loads if i > wait]
    assert len(before) == 1  # gamma: one 16-byte vector
    assert len(after) >= 3  # latent, k_pe, slot
    assert "st.global.v4" in ptx[wait:]


def test_rejects_shapes_the_loads_cannot_cover():
    with pytest.raises(ValueError, match="multiple of 256"):
        MlaCacheRowKernel(500, 64, 1e-6, 6720, 16, 16 * 564, 564)
    with pytest.raises(ValueError, match="16-byte rows"):
        MlaCacheRowKernel(512, 64, 1e-6, 6721, 16, 16 * 576, 576)


# ---- decode attention (split pass + merge)

HEADS, SCALE, Q_NOPE_STRIDE, Q_PE_HEAD_STRIDE = 32, 192**-0.5, 32 * 512, 192


def _attention(batch=4, block_size=64, use_pdl=True, heads=HEADS):
    from kernels.mla.kernel import MlaDecodeAttentionKernel

    width = LORA + ROPE
    return MlaDecodeAttentionKernel(
        heads, LORA, ROPE, SCALE, batch, Q_NOPE_STRIDE, PROJ_STRIDE, Q_PE_HEAD_STRIDE,
        block_size, block_size * width, width, use_pdl,
    )  # fmt: skip


def _compile_attention(kern):
    bf16, f32 = _ptr(cutlass.BFloat16), _ptr(cutlass.Float32)
    i32 = _ptr(cutlass.Int32, 4)
    stride = cutlass.Int32(2048)  # the block table's row stride: a launch argument
    return cute.compile(kern, bf16, bf16, bf16, i32, stride, i32, f32, f32, cuda.CUstream(0))


def _compile_merge(batch=4, use_pdl=True):
    from kernels.mla.kernel import MlaAttentionMergeKernel

    f32 = _ptr(cutlass.Float32)
    kern = MlaAttentionMergeKernel(HEADS, LORA, batch, Q_NOPE_STRIDE, use_pdl)
    return cute.compile(
        kern, f32, f32, _ptr(cutlass.Int32, 4), _ptr(cutlass.BFloat16), cuda.CUstream(0)
    )


@pytest.mark.parametrize("batch,block_size", [(1, 16), (3, 64), (16, 64)])
@pytest.mark.parametrize("use_pdl", [True, False])
def test_attention_compiles_for_sm90a(batch, block_size, use_pdl):
    assert _compile_attention(_attention(batch, block_size, use_pdl)) is not None
    assert _compile_merge(batch, use_pdl) is not None


def test_attention_reads_older_rows_before_the_wait_and_the_query_after_it(tmp_path):
    """Before griddepcontrol.wait: the sequence length, the block table and the
    cp.async of the first tile's older rows; after it: the query and the newest row
    (the cache-row kernel chained just before writes it). Two CTAs per SM."""
    ptx = compiled_ptx(tmp_path, "test_mla_compile", "_compile_attention(t._attention())")
    # Two waits: an idle split's (it exits after it) and the working path's.
    assert ptx.count("griddepcontrol.wait") == 2
    wait = ptx.rindex("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    before, after = ptx[:wait], ptx[wait:]
    assert before.count("ld.global") >= 2  # seq_len, block table entries
    assert "cp.async" in before
    assert after.count("cp.async.ca.shared.global") > before.count("cp.async.ca.shared.global")
    assert ".minnctapersm 2" in ptx
    # Loop bodies (kept dynamic for the register budget): Q K^T 4 MMAs (two chunk
    # steps of 2), P V 16 (2 column groups x 4 MMAs x 2 head tiles).
    assert ptx.count("mma.sync.aligned.m16n8k16") == 4 + 16


def test_merge_reads_partials_only_after_the_wait(tmp_path):
    ptx = compiled_ptx(tmp_path, "test_mla_compile", "_compile_merge()")
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    assert before.count("ld.global") == 1  # the sequence length
    assert "cp.async" not in before
    # The partial rows: one batch of 64 splits in flight at once (cp.async).
    assert after.count("cp.async.ca.shared.global") == 64


def test_attention_rejects_shapes_it_was_not_built_for():
    from kernels.mla.kernel import MlaAttentionMergeKernel, splits_for

    with pytest.raises(ValueError, match="built for 32 heads"):
        _attention(heads=16)
    with pytest.raises(ValueError, match="outside 1..16"):
        _attention(batch=17)
    with pytest.raises(ValueError, match="outside 1..16"):
        MlaAttentionMergeKernel(HEADS, LORA, 0, Q_NOPE_STRIDE)
    # The split grid: two CTAs per SM of an H200.
    assert [splits_for(b) for b in (1, 4, 8, 16)] == [264, 66, 33, 16]


@pytest.mark.parametrize("splits", [264, 66, 33, 16, 1])
def test_split_ranges_cover_every_tile_once(splits):
    """Contiguous ranges of whole tiles, one per used split, none past the grid; short rows
    one tile a split, long rows at most LONG_TILES a split until the grid is full."""
    from kernels.mla.kernel import LONG_TILES, SHORT_SPLITS, split_range

    for tiles in [*range(0, 700), 1024, 3125, 31250]:
        per_split, used = split_range(tiles, splits)
        ranges = [range(s * per_split, min((s + 1) * per_split, tiles)) for s in range(used)]
        assert [t for r in ranges for t in r] == list(range(tiles))
        assert all(len(r) > 0 for r in ranges) and used <= splits
        if tiles <= min(SHORT_SPLITS, splits):
            assert per_split == 1
        if tiles <= LONG_TILES * splits:
            assert per_split <= LONG_TILES

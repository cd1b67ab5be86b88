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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the wheel's ptxas makes of a kernel's PTX (registers, spills, SASS), for
tests that check how the machine code keeps loads ahead of their MMAs."""

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


def sass_tools() -> tuple[Path, Path] | None:
    """ptxas and nvdisasm of the wheel's CUDA (nvidia-cuda-nvcc), or None."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in map(Path, nvidia.__path__):
        tools = (root / "cu13" / "bin" / "ptxas", root / "cu13" / "bin" / "nvdisasm")
        if all(tool.exists() for tool in tools):
            return tools
    return None


needs_sass_tools = pytest.mark.skipif(
    sass_tools() is None, reason="no ptxas / nvdisasm (nvidia-cuda-nvcc)"
)


@dataclass
class Sass:
    registers: int
    spill_bytes: int
    text: str

    def loads_before_first_mma(self, after: str | None = None) -> int:
        """16-byte global loads between ``after`` (an opcode, None: the start)
        and the next MMA."""
        code = self.text if after is None else self.text[self.text.index(after) :]
        return code[: code.index("HMMA")].count("LDG.E.128")


def compile_sass(tmp_path: Path, ptx: str, name: str) -> Sass:
    """``ptx`` through ``ptxas -arch=sm_90a -v`` and ``nvdisasm -c``."""
    ptxas, nvdisasm = sass_tools()
    source, cubin = tmp_path / f"{name}.ptx", tmp_path / f"{name}.cubin"
    source.write_text(ptx)
    info = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", source, "-o", cubin],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    text = subprocess.run(
        [nvdisasm, "-c", cubin], capture_output=True, text=True, check=True
    ).stdout
    return Sass(
        int(re.search(r"Used (\d+) registers", info)[1]),
        int(re.search(r"(\d+) bytes spill stores", info)[1]),
        text,
    )

#!/usr/bin/env python3
"""Pack CuTe DSL 4.6.0 for the offline H200 host as ONE self-contained part.

`../shared/gpu-bundle/build.py kernels` makes two ~60 MiB parts, so every fresh
GPU machine needs two back-to-back copies before any work.  The device tool
carries at most 64 MiB per call (repository included), so this script repacks
the same unpacked tree without what CuTe DSL never loads for sm_90 JIT use:

* ``nvidia/cu13/bin/nvdisasm`` (the nvidia-cuda-nvdisasm wheel: only used to
  print SASS on request),
* ``dsl_packages/iket`` (in-kernel event tracing; cutlass imports it lazily
  and substitutes a stub when it is absent),

and compresses with ``xz -9e``.  The result (~59 MiB) fits one call beside a
working tree of up to ~5 MiB (checked below; the tree was 5.9 MiB on 2026-12-06):
``sh .gpu-bundle/kernels-slim/install.sh && python3 ...``.

Usage (from the repository root, after build.py kernels has filled its cache):
    python3 ci/gpu/slim_bundle.py
Output: .gpu-bundle/kernels-slim/{bundle.tar.xz,install.sh} (git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPU_BUNDLE_CACHE", Path.home() / ".cache" / "gpu-bundle"))
DROP = [
    "./nvidia",
    "./nvidia_cuda_nvdisasm-13.5.37.dist-info",
    "./nvidia_cutlass_dsl/dsl_packages/iket",
]
# What one device call carries: the working tree (the files git tracks and the
# untracked ones it does not ignore) and the carried paths together.
DEVICE_CALL_MIB = 64

INSTALL_SH = """#!/bin/sh
# Unpack CuTe DSL into /opt/gpu-site and register it as a site directory.
set -e
here=$(cd "$(dirname "$0")" && pwd)
expected="{sha256}"
actual=$(sha256sum "$here/bundle.tar.xz" | cut -d' ' -f1)
if [ "$actual" != "$expected" ]; then
  echo "bundle.tar.xz corrupt: sha256 $actual, expected $expected" >&2; exit 1
fi
mkdir -p /opt/gpu-site
xz -dc -T0 "$here/bundle.tar.xz" | tar xf - -C /opt/gpu-site
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('/opt/gpu-site')" > "$sp/zz-gpu-bundle.pth"
python3 -c "import cutlass, cutlass.cute; print('cutlass', cutlass.__version__)"
"""


def travelling_bytes(repo: Path) -> int:
    """The bytes a device call sends besides its carried paths: the files of
    ``repo`` that git tracks and the untracked ones it does not ignore."""
    names = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others"]
        + ["--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    total = 0
    for name in filter(None, names):
        path = repo / os.fsdecode(name)
        # A tracked file deleted in the working tree does not travel.
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tree", type=Path, default=CACHE / "tree-kernels")
    ap.add_argument("--out", type=Path, default=Path(".gpu-bundle/kernels-slim"))
    args = ap.parse_args()
    marker = args.tree / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass"
    if not marker.is_dir():
        print(
            f"error: {args.tree} has no CuTe DSL tree; run "
            "`python3 ../shared/gpu-bundle/build.py kernels` first",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    blob = args.out / "bundle.tar.xz"
    tar_cmd = ["tar", "cf", "-", "-C", str(args.tree)]
    tar_cmd += [f"--exclude={d}" for d in DROP] + ["."]
    with open(blob, "wb") as fh:
        tar = subprocess.Popen(tar_cmd, stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", "-9e"], stdin=tar.stdout, stdout=fh, check=True)
        if tar.wait() != 0:
            print("error: tar failed", file=sys.stderr)
            return 2
    size_mib = blob.stat().st_size / 2**20
    tree_mib = travelling_bytes(ROOT) / 2**20
    if size_mib + tree_mib > DEVICE_CALL_MIB:
        print(
            f"error: {size_mib:.1f} MiB of bundle and {tree_mib:.1f} MiB of working "
            f"tree do not fit one {DEVICE_CALL_MIB} MiB device call; use the parts "
            "of `make gpu-bundle` (56 MiB each) instead",
            file=sys.stderr,
        )
        # No bundle left behind that no call can carry (nor an earlier install.sh).
        blob.unlink()
        (args.out / "install.sh").unlink(missing_ok=True)
        return 1
    sha = hashlib.sha256(blob.read_bytes()).hexdigest()
    (args.out / "install.sh").write_text(INSTALL_SH.format(sha256=sha))
    print(f"{blob}: {size_mib:.1f} MiB, sha256 {sha}")
    print(f'carry [".gpu-bundle/kernels-slim"]  run: sh {args.out}/install.sh && ...')
    return 0


if __name__ == "__main__":
    sys.exit(main())

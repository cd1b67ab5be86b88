"""scripts/ab_kernels.py stage: the base revision's kernels/ as an importable package."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ab_kernels.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT
    )


def test_stage_exports_the_revisions_kernels_as_kernels_base(tmp_path):
    done = _run("stage", "--base", "HEAD", "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    package = tmp_path / "kernels_base"
    for family in ("gemm", "kda", "moe"):
        assert (package / family / "kernel.py").is_file()
        assert (package / family / "prepared.py").is_file()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert (tmp_path / "REVISION").read_text().strip() == head
    # The copy imports under its new name: the package imports, and no module of it names
    # the tree's `kernels` package (that would time this tree's code as the base).
    done = subprocess.run(
        [sys.executable, "-c", "import kernels_base; print(kernels_base.__file__)"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0 and str(package) in done.stdout, done.stderr
    for module in package.rglob("*.py"):
        for line in module.read_text().splitlines():
            assert not re.match(r"\s*(from|import) kernels\b", line), f"{module}: {line}"


def test_unknown_revision_and_missing_stage_are_refused(tmp_path):
    done = _run("stage", "--base", "no-such-revision", "--dir", str(tmp_path))
    assert done.returncode == 2 and "is not a commit" in done.stderr
    done = _run("moe", "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "empty"))
    assert done.returncode == 2 and "run `stage --base REV` first" in done.stderr

"""scripts/ab_kernels.py stage: the base revision's kernels/ as an importable package."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _ab_kernels():
    spec = importlib.util.spec_from_file_location("ab_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_change_ab_scripts_share_the_argument_checks():
    """The cluster A/Bs' shared parser: --out and --m, token counts in 1..16, named
    subsets; a bad value is a usage error (exit 2) before anything runs."""
    ab = _ab_kernels()
    doc = "A/B of one thing.\n\nMore words."
    parser = ab.ab_parser(doc, "ab_x.json", "1,2")
    args = parser.parse_args(["--out", "d"])
    assert ab.parsed_token_counts(parser, args.m) == [1, 2]
    assert ab.parsed_subset(parser, "a,b", ("a", "b", "c"), "part") == ["a", "b"]
    for bad in (lambda: ab.parsed_token_counts(parser, "0,4"),
                lambda: ab.parsed_token_counts(parser, "17"),
                lambda: ab.parsed_subset(parser, "a,z", ("a", "b"), "part")):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            bad()
        assert stop.value.code == 2


def test_moe_seam_probe_refuses_bad_arguments_before_any_gpu_work(tmp_path):
    """scripts/probe_moe_seams.py: an unknown variant or token count is a usage error
    (exit 2) before torch is imported or a GPU looked for."""
    probe = ROOT / "scripts" / "probe_moe_seams.py"
    for bad, said in ((["--variants", "full,no_gate_up"], "unknown variant"),
                      (["--m", "0"], "--m values must lie in 1..16")):  # fmt: skip
        done = subprocess.run(
            [sys.executable, str(probe), "--out", str(tmp_path), *bad],
            capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 2 and said in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())

"""lint, patch file names and the hd.py entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hdtest import KERNELS_DEST, MODEL_PY, SCRIPTS, Project

from hdtool.gitutil import git
from hdtool.patchfile import parse_diff_paths, patch_filename, subject_slug
from hdtool.pin import HdError
from hdtool.series import FORMAT_PATCH_OPTIONS


def test_lint_accepts_exported_patches(project: Project):
    project.add_patch("One", {"vllm/model.py": MODEL_PY + "EXTRA = 1\n"})
    project.add_patch("Two", {"vllm/new.py": "NEW = 2\n"})
    result = project.hd("lint")
    assert result.rc == 0, result.text
    assert "2 patch files ok" in result.out


def test_lint_reports_every_problem(project: Project):
    good = project.add_patch("Good one", {"vllm/model.py": MODEL_PY + "A = 1\n"})
    project.add_patch(
        "No why", {"vllm/a.py": "A\n"}, body="Upstream-Status: pending\nRemoval-Plan: r.\n"
    )
    project.add_patch(
        "Bad status",
        {"vllm/b.py": "B\n"},
        body="Why: w.\nUpstream-Status: maybe later\nRemoval-Plan: r.\n",
    )
    project.add_patch(
        "Empty plan",
        {"vllm/c.py": "C\n"},
        body="Why: w.\nUpstream-Status: backport abc123\nRemoval-Plan:\n",
    )
    project.add_patch("Not listed", {"vllm/d.py": "D\n"}, list_in_series=False)
    shutil.copy(good, project.patches / "Wrong-name.patch")
    project.write("patches/notes.txt", "stray\n")
    with open(project.patches / "series", "a") as fh:
        fh.write("Wrong-name.patch\nMissing.patch\nGood-one.patch\n# comment\n")

    result = project.hd("lint")
    assert result.rc == 1
    err = result.err
    expected = [
        "patches/No-why.patch: no `Why:` line",
        "patches/Bad-status.patch: `Upstream-Status: maybe later` is not one of",
        "patches/Empty-plan.patch: `Removal-Plan:` is empty",
        "patches/Not-listed.patch: not listed in patches/series",
        "patches/notes.txt: only `series` and *.patch files belong here",
        "patches/series lists Missing.patch, which does not exist",
        "Good-one.patch is listed twice",
        "'# comment' is not a patch file name",
        "patches/Wrong-name.patch: file name does not match its subject; expected Good-one.patch",
    ]
    for line in expected:
        assert line in err, line
    assert "Good-one.patch: no" not in err


def test_lint_refuses_patches_touching_the_overlay(project: Project):
    project.write("vllm_overlay/vllm/toy_overlay.py", "T = 1\n")
    project.add_patch("Touch overlay", {"vllm/toy_overlay.py": "T = 2\n"})
    project.add_patch("Touch kernels", {f"{KERNELS_DEST}/k.py": "K = 1\n"})
    project.add_patch("Touch build info", {"vllm/_hopper_decode_build.py": "X = 1\n"})
    result = project.hd("lint")
    assert result.rc == 1
    assert "Touch-overlay.patch: touches vllm/toy_overlay.py" in result.err
    assert f"Touch-kernels.patch: touches {KERNELS_DEST}/k.py" in result.err
    assert "Touch-build-info.patch: touches vllm/_hopper_decode_build.py" in result.err


def test_lint_refuses_non_patch_content_and_unsafe_paths(project: Project):
    project.write("patches/Not-a-patch.patch", "just text\n")
    patch = project.add_patch("Escape", {"vllm/e.py": "E\n"})
    text = patch.read_text().replace("a/vllm/e.py", "a/../e.py").replace("b/vllm/e.py", "b/../e.py")
    patch.write_text(text)
    with open(project.patches / "series", "a") as fh:
        fh.write("Not-a-patch.patch\n")
    result = project.hd("lint")
    assert result.rc == 1
    assert "Not-a-patch.patch: is not a git format-patch file" in result.err
    assert "Escape.patch: path '../e.py' contains '..'" in result.err


@pytest.mark.parametrize(
    "subject",
    [
        "Simple subject",
        "  [x] Foo: bar..baz / qux \u2014\u00fc (long long long long long long long subject)--",
        "dots... at the end...",
        "a_b.c-d e",
        "\u00dcn\u00efc\u00f6d\u00e9 only \u00c4\u00d6\u00dc words",
        "x" * 80,
        "cut exactly at a separator: " + "abcd " * 10,
        "kimi_linear: route decode to the SM90 CuTe DSL path (bs<=8, TP=1)",
    ],
)
def test_patch_filename_matches_git_format_patch(tmp_path: Path, subject: str):
    repo = tmp_path / "r"
    git("init", "-q", str(repo), cwd=tmp_path)
    (repo / "f").write_text("1\n")
    git("add", "f", cwd=repo)
    git("commit", "-q", "-m", "base", cwd=repo)
    (repo / "f").write_text("2\n")
    git("commit", "-q", "-am", subject, cwd=repo)
    git("format-patch", *FORMAT_PATCH_OPTIONS, "-o", "out", "-1", cwd=repo)
    (produced,) = (repo / "out").iterdir()
    assert patch_filename(subject) == produced.name[len("0001-") :]
    assert subject_slug(subject)


def test_diff_path_parsing_handles_quoting_and_renames():
    diff = (
        'diff --git "a/dir/\\303\\244 x.py" "b/dir/\\303\\244 x.py"\n'
        "index 1..2 100644\n"
        '--- "a/dir/\\303\\244 x.py"\n'
        '+++ "b/dir/\\303\\244 x.py"\n'
        "@@ -1 +1 @@\n"
        "--- a/not/a/header\n"
        "diff --git a/old name.py b/new name.py\n"
        "similarity index 90%\n"
        "rename from old name.py\n"
        "rename to new name.py\n"
        "diff --git a/gone.py b/gone.py\n"
        "deleted file mode 100644\n"
        "diff --git a/same name.bin b/same name.bin\n"
        "new file mode 100644\n"
        "Binary files /dev/null and b/same name.bin differ\n"
    )
    changes = [(c.old_path, c.new_path) for c in parse_diff_paths(diff)]
    assert changes == [
        ("dir/\u00e4 x.py", "dir/\u00e4 x.py"),
        ("old name.py", "new name.py"),
        ("gone.py", None),
        (None, "same name.bin"),
    ]


def test_a_bad_escape_in_a_quoted_diff_path_is_an_error_not_a_traceback(project: Project):
    with pytest.raises(HdError, match="bad escape in the quoted path"):
        parse_diff_paths('diff --git "a/x\\q.py" "b/x\\q.py"\n')
    patch = project.add_patch("Change LINE_30", {"vllm/model.py": "X = 1\n"})
    patch.write_text(patch.read_text().replace(" a/vllm/model.py", ' "a/vllm/m\\qodel.py"', 1))
    result = project.hd("lint")
    assert result.rc == 2 and "bad escape in the quoted path" in result.err
    assert "Traceback" not in result.err


def test_hd_py_entry_point(project: Project):
    project.add_patch("One", {"vllm/model.py": MODEL_PY + "EXTRA = 1\n"})
    hd = str(SCRIPTS / "hd.py")
    for argv in (["--root", str(project.root), "lint"], ["lint", "--root", str(project.root)]):
        proc = subprocess.run([sys.executable, hd, *argv], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "1 patch files ok" in proc.stdout
    proc = subprocess.run([sys.executable, hd, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for command in ("fetch", "import", "apply", "export", "lint"):
        assert command in proc.stdout
    project.write("patches/series", "Nope.patch\n")
    proc = subprocess.run(
        [sys.executable, hd, "--root", str(project.root), "apply"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ")

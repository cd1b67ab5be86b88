"""apply / export on a synthetic upstream: strictness, failure reports, overlay, drift."""

from __future__ import annotations

import re

from hdtest import BUILD_INFO, KERNELS_DEST, MODEL_PY, RELEASE_010, Project

from hdtool.buildinfo import build_info_source
from hdtool.gitutil import am_in_progress, current_branch, dirty_paths, git
from hdtool.pin import fingerprint
from hdtool.series import OVERLAY_SUBJECT

UTILS_PY = RELEASE_010["vllm/utils.py"].decode()


def model_with(**values: int) -> str:
    text = MODEL_PY
    for name, value in values.items():
        number = int(name.split("_")[1])
        text = text.replace(f"{name} = {number}\n", f"{name} = {value}\n")
    return text


def add_overlay_and_kernels(project: Project) -> None:
    project.write("vllm_overlay/vllm/models/toy/__init__.py", "TOY = 1\n")
    project.write("vllm_overlay/vllm/models/toy/run.sh", "#!/bin/sh\n").chmod(0o755)
    project.write("kernels/__init__.py", "from .gemm import gemm\n")
    project.write("kernels/gemm.py", "def gemm(a, b):\n    return a @ b\n")
    project.write("kernels/tests/test_gemm.py", "def test_gemm():\n    pass\n")
    project.write("kernels/__pycache__/gemm.cpython-311.pyc", b"\0\0")


def break_patch_line(project: Project, name: str, old: str, new: str) -> None:
    path = project.patches / name
    text = path.read_text()
    assert text.count(old) == 1, (old, text)
    path.write_text(text.replace(old, new))


def subjects(project: Project, rev: str) -> list[str]:
    return project.git("log", "--format=%s", rev).splitlines()


# --- clean apply -------------------------------------------------------------------------------


def test_clean_apply_builds_series_plus_one_overlay_commit(project: Project):
    add_overlay_and_kernels(project)
    project.add_patch("Toy: tune LINE_10", {"vllm/model.py": model_with(LINE_10=100)})
    helper3 = UTILS_PY + "\n\ndef h3():\n    pass\n"
    project.add_patch("utils: add helper3", {"vllm/utils.py": helper3})

    result = project.hd("apply")
    assert result.rc == 0, result.text
    assert subjects(project, "hd/0.1.0") == [
        OVERLAY_SUBJECT,
        "utils: add helper3",
        "Toy: tune LINE_10",
        "vllm 0.1.0: upstream sdist",
    ]
    assert current_branch(project.repo) == "hd/0.1.0"
    assert project.rev("hd/0.1.0-wip") is None
    assert dirty_paths(project.repo) == []

    tree = set(project.git("ls-tree", "-r", "--name-only", "hd/0.1.0").splitlines())
    added = tree - set(RELEASE_010)
    assert added == {
        "vllm/models/toy/__init__.py",
        "vllm/models/toy/run.sh",
        f"{KERNELS_DEST}/__init__.py",
        f"{KERNELS_DEST}/gemm.py",
        BUILD_INFO,
    }
    mode = project.git("ls-tree", "hd/0.1.0", "vllm/models/toy/run.sh").split()[0]
    assert mode == "100755"
    assert (project.repo / "vllm/model.py").read_text() == model_with(LINE_10=100)

    info_text = (project.repo / BUILD_INFO).read_text()
    assert info_text == build_info_source(project.pin)
    info: dict[str, object] = {}
    exec(compile(info_text, BUILD_INFO, "exec"), info)
    assert info["SERIES"] == ("Toy-tune-LINE_10.patch", "utils-add-helper3.patch")
    assert info["FINGERPRINT"] == fingerprint(project.pin)
    assert (info["PATCHSET_VERSION"], info["LOCAL_LABEL"], info["UPSTREAM_VERSION"]) == (
        "0.0.1",
        "hd.7",
        "0.1.0",
    )
    for line in ("1 applied", "2 applied", "2 patches"):
        assert line in result.out

    # Same inputs, same commits: apply is reproducible.
    tip = project.rev("hd/0.1.0")
    assert project.hd("apply").rc == 0
    assert project.rev("hd/0.1.0") == tip


def test_apply_from_nothing_fetches_and_imports(bare_project: Project):
    result = bare_project.hd("apply")
    assert result.rc == 0, result.text
    assert subjects(bare_project, "hd/0.1.0") == [OVERLAY_SUBJECT, "vllm 0.1.0: upstream sdist"]


# --- failures ----------------------------------------------------------------------------------


def test_conflict_report_names_patch_and_file_and_leaves_branch(project: Project):
    project.add_patch("First change", {"vllm/model.py": model_with(LINE_05=50)})
    assert project.hd("apply").rc == 0
    applied = project.rev("hd/0.1.0")
    project.add_patch("Second change", {"vllm/model.py": model_with(LINE_05=50, LINE_20=200)})
    project.add_patch("Third change", {"vllm/utils.py": UTILS_PY + "X = 3\n"})
    break_patch_line(project, "Second-change.patch", "-LINE_20 = 20\n", "-LINE_20 = 21\n")

    result = project.hd("apply")
    assert result.rc == 2
    out = result.out
    assert re.search(r"1 applied\s+First-change\.patch", out), out
    assert re.search(r"2 FAILED\s+Second-change\.patch", out), out
    assert re.search(r"3 not attempted\s+Third-change\.patch", out), out
    assert "files: vllm/model.py" in out
    assert "git: error: patch failed: vllm/model.py:" in out
    for command in (
        f"git -C {project.repo} am --show-current-patch=diff",
        f"git -C {project.repo} am --continue",
        f"git -C {project.repo} am --abort",
        "scripts/hd.py --root",
        "export",
    ):
        assert command in out, command
    assert "Second-change.patch did not apply" in result.err

    # Nothing looks successful: hd/0.1.0 did not move; the am stopped on the -wip branch.
    assert project.rev("hd/0.1.0") == applied
    assert current_branch(project.repo) == "hd/0.1.0-wip"
    assert am_in_progress(project.repo)
    assert subjects(project, "HEAD")[0] == "First change"

    again = project.hd("apply")
    assert again.rc == 2 and "`git am` is in progress" in again.err
    assert project.hd("export").rc == 2

    git("am", "--abort", cwd=project.repo)
    assert not am_in_progress(project.repo)


def test_failed_apply_resolves_with_the_printed_commands(project: Project):
    project.add_patch("First change", {"vllm/model.py": model_with(LINE_05=50)})
    project.add_patch("Second change", {"vllm/model.py": model_with(LINE_05=50, LINE_20=200)})
    project.add_patch("Third change", {"vllm/utils.py": UTILS_PY + "X = 3\n"})
    break_patch_line(project, "Second-change.patch", "-LINE_20 = 20\n", "-LINE_20 = 21\n")
    assert project.hd("apply").rc == 2

    # The developer makes the intended change by hand and continues the am.
    (project.repo / "vllm/model.py").write_text(model_with(LINE_05=50, LINE_20=200))
    git("add", "vllm/model.py", cwd=project.repo)
    git("am", "--continue", cwd=project.repo)
    assert not am_in_progress(project.repo)

    result = project.hd("export")
    assert result.rc == 0, result.text
    fixed = (project.patches / "Second-change.patch").read_text()
    assert "-LINE_20 = 20\n+LINE_20 = 200\n" in fixed
    assert project.series() == ["First-change.patch", "Second-change.patch", "Third-change.patch"]

    result = project.hd("apply")
    assert result.rc == 0, result.text
    assert project.rev("hd/0.1.0-wip") is None
    assert project.hd("export", "--check").rc == 0
    assert project.hd("lint").rc == 0


def test_fuzz_is_refused(project: Project):
    project.add_patch("Change LINE_20", {"vllm/model.py": model_with(LINE_20=200)})
    # The outermost context line no longer matches the tree: applies only with fuzz.
    break_patch_line(project, "Change-LINE_20.patch", " LINE_17 = 17\n", " LINE_17 = 1700\n")
    patch = str(project.patches / "Change-LINE_20.patch")
    assert git("apply", "--check", patch, cwd=project.repo, check=False).returncode != 0
    assert git("apply", "--check", "-C2", patch, cwd=project.repo, check=False).returncode == 0

    result = project.hd("apply")
    assert result.rc == 2
    assert re.search(r"1 FAILED\s+Change-LINE_20\.patch", result.out), result.out
    assert project.rev("hd/0.1.0") is None


def test_whitespace_lenient_patch_is_refused(project: Project):
    project.add_patch("Change LINE_20", {"vllm/model.py": model_with(LINE_20=200)})
    # Context that differs from the tree only in whitespace.
    break_patch_line(project, "Change-LINE_20.patch", " LINE_19 = 19\n", " LINE_19  =  19\n")
    patch = str(project.patches / "Change-LINE_20.patch")
    assert git("apply", "--check", patch, cwd=project.repo, check=False).returncode != 0
    lenient = git("apply", "--check", "--ignore-whitespace", patch, cwd=project.repo, check=False)
    assert lenient.returncode == 0

    result = project.hd("apply")
    assert result.rc == 2
    assert re.search(r"1 FAILED\s+Change-LINE_20\.patch", result.out), result.out
    assert project.rev("hd/0.1.0") is None


def test_new_whitespace_errors_are_refused(project: Project):
    # Upstream's .gitattributes waives trailing-space checks for *.py; apply must not.
    project.add_patch("Add X with trailing space", {"vllm/utils.py": UTILS_PY + "X = 1   \n"})
    result = project.hd("apply")
    assert result.rc == 2
    assert "trailing whitespace" in result.out
    assert "files: vllm/utils.py" in result.out
    assert project.rev("hd/0.1.0") is None


def test_overlay_collision_is_refused_before_anything_applies(project: Project):
    project.add_patch("Add helper module", {"vllm/helper_mod.py": "X = 1\n"})
    project.write("vllm_overlay/vllm/model.py", "OVERLAY = True\n")
    project.write("vllm_overlay/vllm/helper_mod.py", "OVERLAY = True\n")
    head = project.rev("HEAD")

    result = project.hd("apply")
    assert result.rc == 2
    assert "vllm/model.py already exists upstream" in result.err
    assert "vllm/helper_mod.py already exists upstream" in result.err
    assert "nothing was applied" in result.err
    assert project.rev("hd/0.1.0") is None and project.rev("hd/0.1.0-wip") is None
    assert project.rev("HEAD") == head
    assert dirty_paths(project.repo) == []


def test_dirty_tree_is_refused(project: Project):
    assert project.hd("apply").rc == 0
    applied = project.rev("hd/0.1.0")
    (project.repo / "vllm/model.py").write_text("edited by hand\n")
    result = project.hd("apply")
    assert result.rc == 2
    assert "uncommitted changes" in result.err and "vllm/model.py" in result.err
    assert (project.repo / "vllm/model.py").read_text() == "edited by hand\n"
    assert project.rev("hd/0.1.0") == applied
    assert project.hd("export").rc == 2

    git("checkout", "--", "vllm/model.py", cwd=project.repo)
    (project.repo / "stray.txt").write_text("untracked\n")
    result = project.hd("apply")
    assert result.rc == 2 and "stray.txt" in result.err


# --- export ------------------------------------------------------------------------------------


def test_export_round_trip_is_byte_identical(project: Project):
    project.add_patch(
        "  [toy] Ünïcode subject: a rather long one, with punctuation... and more words--",
        {"vllm/model.py": model_with(LINE_01=10, LINE_40=400)},
        body="Why: exercises encoded headers.\nUpstream-Status: not-needed toy only\n"
        "Removal-Plan: never.\n\nA second paragraph with a line starting\nFrom here.\n",
    )
    project.add_patch(
        "CRLF, delete and add",
        {
            "vllm/crlf.txt": b"first\r\nsecond changed\r\n",
            "vllm/utils.py": None,
            "vllm/brand_new.py": "NEW = 1\n",
        },
    )
    before = project.snapshot_patches()
    assert project.hd("apply").rc == 0

    result = project.hd("export", "--check")
    assert result.rc == 0, result.text
    result = project.hd("export")
    assert result.rc == 0, result.text
    assert "0 written, 3 unchanged, 0 removed" in result.out
    assert project.snapshot_patches() == before
    assert project.hd("lint").rc == 0


def test_drift_is_detected_after_a_one_byte_edit(project: Project):
    patch = project.add_patch("Change LINE_30", {"vllm/model.py": model_with(LINE_30=3)})
    assert project.hd("apply").rc == 0
    assert project.hd("export", "--check").rc == 0

    data = patch.read_bytes()
    edited = data.replace(b"Why: the toy", b"Why: The toy", 1)
    assert len(edited) == len(data) and edited != data
    patch.write_bytes(edited)
    result = project.hd("export", "--check")
    assert result.rc == 1
    assert "patches/Change-LINE_30.patch: differs" in result.out
    assert "-Why: The toy" in result.out and "+Why: the toy" in result.out
    assert patch.read_bytes() == edited, "--check must not write"

    patch.write_bytes(data)
    project.write("patches/Stale.patch", "old\n")
    result = project.hd("export", "--check")
    assert result.rc == 1 and "patches/Stale.patch" in result.out


def _commit_below_overlay(project: Project, edits: dict[str, str], subject: str) -> None:
    """What a developer does to add a change: commit under the hd-overlay commit."""
    repo = project.repo
    git("checkout", "-q", "--detach", "hd/0.1.0~1", cwd=repo)
    for rel, text in edits.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
        git("add", "-f", rel, cwd=repo)
    body = "Why: x.\nUpstream-Status: submitted https://example.org/pr/1\nRemoval-Plan: y.\n"
    git("commit", "-q", "-m", subject, "-m", body, cwd=repo)
    git("cherry-pick", "hd/0.1.0", cwd=repo)
    git("checkout", "-q", "-B", "hd/0.1.0", cwd=repo)


def test_export_writes_new_commits_and_drops_stale_files(project: Project):
    project.add_patch("First change", {"vllm/model.py": model_with(LINE_05=50)})
    assert project.hd("apply").rc == 0
    _commit_below_overlay(
        project, {"vllm/__init__.py": '__version__ = "0.1.0+toy"\n'}, "Mark the toy version"
    )
    project.write("patches/Stale.patch", "old\n")

    result = project.hd("export")
    assert result.rc == 0, result.text
    assert project.series() == ["First-change.patch", "Mark-the-toy-version.patch"]
    assert not (project.patches / "Stale.patch").exists()
    assert "removed patches/Stale.patch" in result.out
    assert project.hd("lint").rc == 0
    assert project.hd("apply").rc == 0
    assert project.hd("export", "--check").rc == 0


def test_export_requires_apply(bare_project: Project):
    result = bare_project.hd("export")
    assert result.rc == 2 and "make apply" in result.err
    result = bare_project.hd("export", "--check")
    assert result.rc == 2 and "make apply" in result.err


def test_export_refuses_commit_above_overlay(project: Project):
    assert project.hd("apply").rc == 0
    (project.repo / "vllm/__init__.py").write_text("X = 1\n")
    git("commit", "-q", "-am", "On top", cwd=project.repo)
    result = project.hd("export")
    assert result.rc == 2
    assert "must be the one" in result.err and "rebase -i" in result.err


def test_export_refuses_commit_touching_overlay_paths(project: Project):
    add_overlay_and_kernels(project)
    assert project.hd("apply").rc == 0
    _commit_below_overlay(project, {f"{KERNELS_DEST}/extra.py": "E = 1\n"}, "Sneak a kernel in")
    result = project.hd("export")
    assert result.rc == 2
    assert f"{KERNELS_DEST}/extra.py" in result.err and "overlay commit owns" in result.err


def test_export_refuses_to_empty_the_series_after_an_aborted_am(project: Project):
    project.add_patch("First change", {"vllm/model.py": model_with(LINE_05=50)})
    break_patch_line(project, "First-change.patch", "-LINE_05 = 5\n", "-LINE_05 = 6\n")
    assert project.hd("apply").rc == 2
    git("am", "--abort", cwd=project.repo)
    before = project.snapshot_patches()
    result = project.hd("export")
    assert result.rc == 2 and "would empty patches/" in result.err
    assert project.snapshot_patches() == before


def test_apply_refuses_to_replace_commits_not_yet_exported(project: Project):
    """A developer commits a fix on hd/0.1.0 and runs `make check` (lint, apply, drift)
    before exporting: apply must not rebuild the branch from patches/ over it."""
    project.add_patch("First change", {"vllm/model.py": model_with(LINE_05=50)})
    assert project.hd("apply").rc == 0
    _commit_below_overlay(project, {"vllm/__init__.py": '__version__ = "x"\n'}, "Unexported fix")
    tip = project.rev("hd/0.1.0")
    result = project.hd("apply")
    assert result.rc == 2
    assert "has moved since the last apply or export" in result.err
    assert "export" in result.err and "reset -q --hard" in result.err
    assert project.rev("hd/0.1.0") == tip
    # Exported, the commits are in patches/: apply goes ahead and keeps them.
    assert project.hd("export").rc == 0
    assert project.hd("apply").rc == 0
    assert "Unexported fix" in subjects(project, "hd/0.1.0")
    assert project.hd("export", "--check").rc == 0


def test_apply_goes_ahead_after_the_commits_were_dropped_as_told(project: Project):
    project.add_patch("First change", {"vllm/model.py": model_with(LINE_05=50)})
    assert project.hd("apply").rc == 0
    recorded = project.rev("hd/0.1.0")
    _commit_below_overlay(project, {"vllm/__init__.py": '__version__ = "x"\n'}, "Throwaway")
    assert project.hd("apply").rc == 2
    git("reset", "-q", "--hard", recorded, cwd=project.repo)
    assert project.hd("apply").rc == 0
    assert "Throwaway" not in subjects(project, "hd/0.1.0")


def test_export_refuses_to_overwrite_series_edits_not_yet_applied(project: Project):
    project.add_patch("First change", {"vllm/model.py": model_with(LINE_05=50)})
    assert project.hd("apply").rc == 0
    # A new patch listed in the series, not applied yet.
    project.add_patch("Second change", {"vllm/model.py": model_with(LINE_05=50, LINE_06=60)})
    before = project.snapshot_patches()
    result = project.hd("export")
    assert result.rc == 2 and "patches/ changed since the last apply or export" in result.err
    assert project.snapshot_patches() == before
    # --check only reads: it still reports the difference.
    assert project.hd("export", "--check").rc == 1
    # Applied, the edit is in the branch, and export writes the same files back.
    assert project.hd("apply").rc == 0
    result = project.hd("export")
    assert result.rc == 0, result.text
    assert project.snapshot_patches() == before


def test_a_failed_apply_of_edited_patches_still_exports_from_its_branch(project: Project):
    """After a good apply, an edited patch fails to apply; resolved on the wip branch as the
    report says, export takes the resolution (the edit is in that branch already)."""
    project.add_patch("First change", {"vllm/model.py": model_with(LINE_05=50)})
    assert project.hd("apply").rc == 0
    break_patch_line(project, "First-change.patch", "-LINE_05 = 5\n", "-LINE_05 = 6\n")
    assert project.hd("apply").rc == 2
    git("am", "--abort", cwd=project.repo)
    git("checkout", "-q", "-B", "hd/0.1.0-wip", "v0.1.0", cwd=project.repo)
    (project.repo / "vllm/model.py").write_text(model_with(LINE_05=50))
    git("commit", "-q", "-am", "First change", "-m", "Why: x.\nUpstream-Status: pending\n"
        "Removal-Plan: y.", cwd=project.repo)  # fmt: skip
    result = project.hd("export")
    assert result.rc == 0, result.text
    assert "-LINE_05 = 5" in (project.patches / "First-change.patch").read_text()

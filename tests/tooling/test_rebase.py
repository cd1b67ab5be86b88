"""rebase / bump-pin on synthetic upstream releases: one release per outcome.

0.1.0 is the pin. The series has two patches: `Toy: tune LINE_10` (vllm/model.py) and
`layers: add gelu` (vllm/layers.py). The overlay imports `from vllm.layers import Attention,
rope`. Each later release provokes one outcome:
  0.2.0 clean      lines inserted above (the hunk moves; full context still matches)
  0.3.0 3-way      a context line of the LINE_10 hunk changed (strict apply fails, merge works)
  0.4.0 conflict   LINE_10 itself changed upstream
  0.5.0 empty      upstream made the very same LINE_10 change
  0.6.0 symbol     `rope` moved from vllm/layers.py to vllm/ops/rope.py
  0.7.0 conflicts  LINE_10 changed and the line the gelu patch appends after changed too
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
from hdtest import (
    MODEL_PY,
    NAME,
    RELEASE_010,
    Index,
    Project,
    isolate_pip,
    make_sdist,
    make_wheel,
    sha256,
    version_toml,
    write_simple_index,
)

from hdtool import cli, rebase
from hdtool.gitutil import am_in_progress, current_branch, git
from hdtool.importcheck import MISSING_MODULE, MISSING_NAME, OK, UNVERIFIABLE, SourceTree
from hdtool.importcheck import resolve as resolve_import
from hdtool.overlay import overlay_plan
from hdtool.patchfile import read_series
from hdtool.pin import HdError, fingerprint
from hdtool.rebase import (
    State,
    _bumped_version_text,
    _counts,
    grouped_notes,
    stage_project,
    upstream_test_requirements,
    upstream_tests_config,
    work_dir,
)

LAYERS_PY = "class Attention:\n    pass\n\n\ndef rope(x):\n    return x\n\n\nEPS = 1e-6\n"


def model_with(**values: int) -> str:
    text = MODEL_PY
    for name, value in values.items():
        number = int(name.split("_")[1])
        text = text.replace(f"{name} = {number}\n", f"{name} = {value}\n")
    return text


BASE = {**RELEASE_010, "vllm/layers.py": LAYERS_PY.encode()}
RELEASES: dict[str, dict[str, bytes]] = {
    "0.1.0": BASE,
    "0.2.0": {
        **BASE,
        "vllm/model.py": ("# moved down\n" * 5 + MODEL_PY).encode(),
        "requirements/test/cuda.txt": b"tblib==3.1.0\ntransformers==9.1.0\n",
    },
    "0.3.0": {**BASE, "vllm/model.py": model_with(LINE_08=8000).encode()},
    "0.4.0": {**BASE, "vllm/model.py": model_with(LINE_10=10_000).encode()},
    "0.5.0": {**BASE, "vllm/model.py": model_with(LINE_10=100).encode()},
    "0.6.0": {
        **BASE,
        "vllm/layers.py": b"class Attention:\n    pass\n\n\nEPS = 1e-6\n",
        "vllm/ops/__init__.py": b"",
        "vllm/ops/rope.py": b"def rope(x):\n    return x\n",
    },
    "0.7.0": {
        **BASE,
        "vllm/model.py": model_with(LINE_10=10_000).encode(),
        "vllm/layers.py": LAYERS_PY.replace("EPS = 1e-6", "EPS = 1e-5").encode(),
    },
}
OVERLAY_FILE = "vllm_overlay/vllm/models/toy/decode.py"
OVERLAY_PY = (
    "from vllm.layers import Attention, rope\n"
    "import vllm.model\n"
    "from . import helpers\n"
    "from .helpers import SCALE\n"
)
PATCH_1 = "Toy-tune-LINE_10.patch"
PATCH_2 = "layers-add-gelu.patch"


@pytest.fixture(scope="module")
def rebase_index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    root = tmp_path_factory.mktemp("rebase-index")
    files_dir = root / "files"
    files_dir.mkdir()
    files = {}
    for version, tree in RELEASES.items():
        tree = {**tree, "PKG-INFO": f"Name: vllm\nVersion: {version}\n".encode()}
        wheel = make_wheel(files_dir, version)
        if version == "0.5.0":  # a release whose wheel moves the paired pins
            with zipfile.ZipFile(wheel) as zf:
                members = {n: zf.read(n) for n in zf.namelist()}
            members["vllm-0.5.0.dist-info/METADATA"] = (
                b"Name: vllm\nVersion: 0.5.0\nRequires-Dist: torch==9.9.0\n"
                b"Requires-Dist: nvidia-cutlass-dsl[cu13]==9.8.0\n"
            )
            with zipfile.ZipFile(wheel, "w") as zf:
                for name, data in members.items():
                    zf.writestr(name, data)
        for path in (make_sdist(files_dir, version, tree), wheel):
            files[path.name] = path
    return write_simple_index(root, files)


@pytest.fixture
def pip_index(monkeypatch: pytest.MonkeyPatch, rebase_index: Index) -> Index:
    isolate_pip(monkeypatch, rebase_index)
    return rebase_index


@pytest.fixture(scope="module")
def rebase_template(tmp_path_factory: pytest.TempPathFactory, rebase_index: Index) -> Path:
    """A project pinned to 0.1.0 with the two-patch series and the overlay, applied."""
    root = tmp_path_factory.mktemp("rebase-template") / "proj"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "series").write_text("")
    (root / "kernels").mkdir()
    (root / "VERSION").write_text(version_toml(rebase_index))
    with pytest.MonkeyPatch.context() as mp:
        isolate_pip(mp, rebase_index)
        assert cli.main(["--root", str(root), "import"]) == 0
        project = Project(root, _NoCapture())
        project.add_patch("Toy: tune LINE_10", {"vllm/model.py": model_with(LINE_10=100)})
        gelu = LAYERS_PY + "\n\ndef gelu(x):\n    return x\n"
        project.add_patch("layers: add gelu", {"vllm/layers.py": gelu})
        project.write(OVERLAY_FILE, OVERLAY_PY)
        project.write("vllm_overlay/vllm/models/toy/helpers.py", "SCALE = 2\n")
        assert cli.main(["--root", str(root), "apply"]) == 0
    shutil.rmtree(root.parent / "proj-scratch")
    shutil.rmtree(root.parent / "proj-fp", ignore_errors=True)
    return root


class _NoCapture:
    def readouterr(self) -> object:
        class Empty:
            out = err = ""

        return Empty()


@pytest.fixture
def project(
    tmp_path: Path, rebase_template: Path, pip_index: Index, capsys: pytest.CaptureFixture[str]
) -> Project:
    root = tmp_path / "proj"
    shutil.copytree(rebase_template, root, symlinks=True)
    return Project(root, capsys)


def report(project: Project, version: str) -> str:
    return (project.root / "reports" / f"rebase-{version}.md").read_text()


def state_of_pin(project: Project) -> tuple[str, dict[str, bytes], str]:
    return (
        (project.root / "VERSION").read_text(),
        project.snapshot_patches(),
        project.git("rev-parse", "hd/0.1.0"),
    )


def assert_pin_untouched(project: Project, before: tuple[str, dict[str, bytes], str]) -> None:
    assert state_of_pin(project) == before, "VERSION, patches/ or hd/0.1.0 changed"


# --- one test per outcome ----------------------------------------------------------------------


def test_clean_rebase_reports_both_patches_clean(project: Project, rebase_index: Index):
    before = state_of_pin(project)
    result = project.hd("rebase", "--to", "0.2.0")
    assert result.rc == 0, result.text
    assert_pin_untouched(project, before)
    assert project.git("log", "--format=%s", "v0.2.0..rebase/0.2.0").splitlines() == [
        "layers: add gelu",
        "Toy: tune LINE_10",
    ]
    text = report(project, "0.2.0")
    assert f"| 1 | `{PATCH_1}` | clean |" in text
    assert f"| 2 | `{PATCH_2}` | clean |" in text
    assert "**0 missing**" in text
    sdist = f"{NAME}-0.2.0.tar.gz"
    assert f"| `{sdist}` | `{sha256(rebase_index.files[sdist])}` |" in text
    assert "git range-diff v0.1.0..hd-rebase/0.2.0/old v0.2.0..rebase/0.2.0" in text
    assert "1:  " in text and "= 1:  " in text  # range-diff: both patches unchanged
    assert "Tests were not run" in text
    assert current_branch(project.repo) == "hd/0.1.0"  # the pinned checkout is back

    again = project.hd("rebase", "--to", "0.2.0", "--continue")  # re-check, rewrite the report
    assert again.rc == 0, again.text
    assert f"| 1 | `{PATCH_1}` | clean |" in report(project, "0.2.0")


def test_context_change_is_merged_three_way(project: Project):
    result = project.hd("rebase", "--to", "0.3.0")
    assert result.rc == 0, result.text
    text = report(project, "0.3.0")
    assert f"| 1 | `{PATCH_1}` | 3-way merge (drift) | +1 -1 | +1 -1 |" in text
    assert f"| 2 | `{PATCH_2}` | clean |" in text
    model = project.git("show", "rebase/0.3.0:vllm/model.py")
    assert "LINE_08 = 8000" in model and "LINE_10 = 100" in model


def test_conflict_stops_with_am_in_progress_and_writes_nothing(project: Project):
    before = state_of_pin(project)
    result = project.hd("rebase", "--to", "0.4.0")
    assert result.rc == 2
    assert_pin_untouched(project, before)
    assert am_in_progress(project.repo)
    assert current_branch(project.repo) == "rebase/0.4.0"
    repo = str(project.repo)
    for expected in (
        f"git -C {repo} add vllm/model.py",
        f"git -C {repo} am --continue",
        f"git -C {repo} am --abort",
        "rebase --to 0.4.0 --continue",
        "bump-pin --to 0.4.0",
    ):
        assert expected in result.out, expected
    assert "conflicts with 0.4.0 (vllm/model.py)" in result.err
    text = report(project, "0.4.0")
    assert "STOPPED ON A CONFLICT" in text
    assert f"| 1 | `{PATCH_1}` | CONFLICT |" in text
    # The patch after the conflict, tried alone in a scratch index: it would apply.
    assert f"| 2 | `{PATCH_2}` | not attempted; alone: applies clean |" in text
    assert "*alone*: what a patch after the conflict would do without it" in text
    assert "- file `vllm/model.py`" in text
    assert "vllm/model.py: patch hunk @@ -7,7 +7,7 @@" in text
    assert "vllm/model.py: conflict markers at lines" in text

    refused = project.hd("bump-pin", "--to", "0.4.0")
    assert refused.rc == 2
    assert "not a complete rebase" in refused.err
    assert_pin_untouched(project, before)
    again = project.hd("rebase", "--to", "0.4.0")
    assert again.rc == 2 and "still in progress" in again.err
    assert am_in_progress(project.repo)

    # Resolve by hand as the printed commands say; --continue applies the rest and re-checks.
    (project.repo / "vllm/model.py").write_text(model_with(LINE_10=100))
    git("add", "vllm/model.py", cwd=project.repo)
    git("am", "--continue", cwd=project.repo)
    assert not am_in_progress(project.repo)
    result = project.hd("rebase", "--to", "0.4.0", "--continue")
    assert result.rc == 0, result.text
    text = report(project, "0.4.0")
    assert f"| 1 | `{PATCH_1}` | resolved by hand |" in text
    assert f"| 2 | `{PATCH_2}` | clean |" in text

    result = project.hd("bump-pin", "--to", "0.4.0")
    assert result.rc == 0, result.text
    assert project.pin.upstream_version == "0.4.0"
    assert project.series() == [PATCH_1, PATCH_2]
    assert "-LINE_10 = 10000" in (project.patches / PATCH_1).read_text()
    result = project.hd("apply")  # the refreshed series applies strictly to the new pin
    assert result.rc == 0, result.text
    assert project.hd("export", "--check").rc == 0


def test_a_patch_after_the_conflict_that_would_conflict_too_is_named(project: Project):
    # A third patch that edits what the second adds: at 0.7.0 it can only conflict too.
    gelu_doc = LAYERS_PY + '\n\ndef gelu(x):\n    """Identity here."""\n    return x\n'
    series = [str(project.patches / name) for name in (PATCH_1, PATCH_2)]
    git("am", "-q", *series, cwd=project._scratch_repo())  # the series so far, under it
    project.add_patch("layers: document gelu", {"vllm/layers.py": gelu_doc})
    assert project.hd("apply").rc == 0
    result = project.hd("rebase", "--to", "0.7.0")
    assert result.rc == 2
    text = report(project, "0.7.0")
    assert f"| 1 | `{PATCH_1}` | CONFLICT |" in text
    assert f"| 2 | `{PATCH_2}` | not attempted; alone: conflicts (`vllm/layers.py`) |" in text
    assert (
        "| 3 | `layers-document-gelu.patch` | not attempted; alone: conflicts "
        "(`vllm/layers.py`; without #2) |"
    ) in text
    # Tried in a scratch index only: the branch holds nothing of it, the work tree neither.
    assert project.git("log", "--format=%s", "v0.7.0..rebase/0.7.0") == ""
    assert "gelu" not in (project.repo / "vllm/layers.py").read_text()


def test_an_aborted_am_does_not_let_bump_pin_drop_the_series(project: Project):
    """`git am --abort` (printed as the way to give up) then --continue leaves every patch
    off rebase/X: bump-pin must not empty the series unless the patches are named."""
    before = state_of_pin(project)
    assert project.hd("rebase", "--to", "0.4.0").rc == 2
    git("am", "--abort", cwd=project.repo)
    result = project.hd("rebase", "--to", "0.4.0", "--continue")
    assert result.rc == 0, result.text
    refused = project.hd("bump-pin", "--to", "0.4.0")
    assert refused.rc == 2
    assert f"lacks 2 patches of the series: {PATCH_1}, {PATCH_2}" in refused.err
    assert f"--drop {PATCH_1} --drop {PATCH_2}" in refused.err
    assert "--restart" in refused.err
    assert_pin_untouched(project, before)
    unknown = project.hd("bump-pin", "--to", "0.4.0", "--drop", "nope.patch")
    assert unknown.rc == 2 and "--drop names patches not in the series: nope.patch" in unknown.err
    assert_pin_untouched(project, before)
    # Named, they go (the way to drop patches upstream absorbed and `git am --skip` left out).
    dropped = project.hd("bump-pin", "--to", "0.4.0", "--drop", PATCH_1, "--drop", PATCH_2)
    assert dropped.rc == 0, dropped.text
    assert project.series() == []
    assert f"dropped {PATCH_1}" in dropped.out


def test_absorbed_patch_is_now_empty_and_dropped_by_bump_pin(project: Project):
    result = project.hd("rebase", "--to", "0.5.0")
    assert result.rc == 0, result.text
    text = report(project, "0.5.0")
    assert f"| 1 | `{PATCH_1}` | now empty (drop candidate) | +1 -1 | - |" in text
    assert f"| 2 | `{PATCH_2}` | clean |" in text
    assert project.git("log", "--format=%s", "v0.5.0..rebase/0.5.0") == "layers: add gelu"

    result = project.hd("bump-pin", "--to", "0.5.0")
    assert result.rc == 0, result.text
    assert f"dropped {PATCH_1}" in result.out
    assert project.series() == [PATCH_2]
    assert not (project.patches / PATCH_1).exists()
    version_text = (project.root / "VERSION").read_text()
    assert 'version = "0.5.0"' in version_text
    assert 'torch = "9.9.0"' in version_text and 'nvidia-cutlass-dsl = "9.8.0"' in version_text
    assert "| torch | 2.11.0 | 9.9.0 **(changed)** |" in report(project, "0.5.0")


def test_symbol_gone_is_reported_and_blocks_bump_pin(project: Project):
    before = state_of_pin(project)
    result = project.hd("rebase", "--to", "0.6.0")
    assert result.rc == 0, result.text  # the series itself carries over
    assert "1 missing" in result.out
    text = report(project, "0.6.0")
    assert "**1 missing**" in text
    assert (
        f"- `{OVERLAY_FILE}:1` `from vllm.layers import rope`: missing name: "
        "vllm.layers does not define rope (resolved at 0.1.0: gone since)"
    ) in text
    assert "  - defined at 0.6.0: `vllm/ops/rope.py:1`" in text
    assert f"| `{OVERLAY_FILE}` | 5 | 1 |" in text  # Attention, vllm.model, the relative ones ok

    refused = project.hd("bump-pin", "--to", "0.6.0")
    assert refused.rc == 2
    assert "imports 1 names that rebase/0.6.0 lacks" in refused.err
    assert_pin_untouched(project, before)
    assert project.hd("bump-pin", "--to", "0.6.0", "--allow-import-errors").rc == 0
    assert project.pin.upstream_version == "0.6.0"


# --- guard rails -------------------------------------------------------------------------------


def test_existing_rebase_branch_needs_restart(project: Project):
    assert project.hd("rebase", "--to", "0.2.0").rc == 0
    again = project.hd("rebase", "--to", "0.2.0")
    assert again.rc == 2
    assert "--continue" in again.err and "--restart" in again.err
    assert project.hd("rebase", "--to", "0.2.0", "--restart").rc == 0


def test_bump_pin_refuses_when_patches_changed_after_the_rebase(project: Project):
    assert project.hd("rebase", "--to", "0.2.0").rc == 0
    (project.patches / PATCH_2).write_text((project.patches / PATCH_2).read_text() + "\n")
    result = project.hd("bump-pin", "--to", "0.2.0")
    assert result.rc == 2
    assert "patches/ changed since the rebase" in result.err
    assert project.pin.upstream_version == "0.1.0"


def test_bump_pin_without_a_rebase_refuses(project: Project):
    result = project.hd("bump-pin", "--to", "0.2.0")
    assert result.rc == 2
    assert "no rebase to 0.2.0 was started" in result.err


def test_bumped_version_text_keeps_comments_and_other_tables():
    text = (
        '# pin\npatchset_version = "1"\n\n[upstream]\nname = "vllm"\n'
        'version = "0.1.0"  \nsdist = "a"\nsdist_sha256 = "b"\nwheel = "c"\n'
        'wheel_sha256 = "d"\n\n[layout]\nversion = "keep"\n'
    )
    release = {"sdist": "s", "sdist_sha256": "1" * 64, "wheel": "w", "wheel_sha256": "2" * 64}
    new = _bumped_version_text(text, release, "0.9.0")
    assert 'version = "0.9.0"' in new and 'sdist = "s"' in new and 'wheel = "w"' in new
    assert new.endswith('[layout]\nversion = "keep"\n')
    assert new.startswith("# pin\n")


# --- the static import resolver ----------------------------------------------------------------


def tree_of(files: dict[str, str]) -> SourceTree:
    return SourceTree(set(files), lambda path: files[path].encode(), "test tree")


def test_resolver_follows_packages_star_imports_and_conditional_definitions():
    tree = tree_of(
        {
            "vllm/__init__.py": "",
            "vllm/a/__init__.py": "from .impl import *\nif X:\n    COND = 1\nelse:\n    pass\n",
            "vllm/a/impl.py": "def public():\n    pass\n",
            "vllm/a/sub.py": "",
            "vllm/lazy.py": "def __getattr__(name):\n    raise AttributeError(name)\n",
            "vllm/ns/leaf.py": "",
        }
    )
    assert resolve_import(tree, "vllm.a", "public")[0] == OK
    assert resolve_import(tree, "vllm.a", "COND")[0] == OK
    assert resolve_import(tree, "vllm.a", "sub") == (OK, "submodule")
    assert resolve_import(tree, "vllm.ns.leaf", None)[0] == OK  # namespace package
    assert resolve_import(tree, "vllm.a", "gone")[0] == MISSING_NAME
    assert resolve_import(tree, "vllm.b.c", "x") == (
        MISSING_MODULE,
        "no module vllm.b in test tree; vllm exists",
    )
    assert resolve_import(tree, "vllm.lazy", "anything")[0] == UNVERIFIABLE


# --- per-version upstream test selection -------------------------------------------------------


def test_upstream_tests_config_merges_a_tags_differences(project: Project):
    project.write(
        "ci/upstream_tests.yaml",
        "extract: [tests]\n"
        "cpu:\n  include: [tests/a, tests/b]\n  min_passed: 200\n"
        "  exclude:\n  - {path: tests/a/x.py, reason: needs a GPU}\n"
        "  - {paths: [tests/a/gone.py, tests/a/z.py], reason: needs the hub}\n"
        "versions:\n  '0.2.0':\n    cpu:\n      min_passed: 150\n"
        "      why: tests/b is gone\n",
    )
    project.write(
        "ci/upstream_tests-0.2.0.yaml",
        "cpu:\n"
        "  remove_include:\n  - {path: tests/b, reason: deleted upstream in 0.2.0}\n"
        "  exclude:\n  - {path: tests/a/y.py, reason: needs the hub since 0.2.0}\n"
        "  remove_exclude:\n  - {path: tests/a/gone.py, reason: deleted upstream in 0.2.0}\n",
    )
    config, notes = upstream_tests_config(project.pin, "0.2.0")
    assert config is not None and "versions" not in config
    assert config["cpu"]["include"] == ["tests/a"]
    assert config["cpu"]["min_passed"] == 150
    assert config["cpu"]["exclude"] == [
        {"path": "tests/a/x.py", "reason": "needs a GPU"},
        {"paths": ["tests/a/z.py"], "reason": "needs the hub"},
        {"path": "tests/a/y.py", "reason": "needs the hub since 0.2.0"},
    ]
    assert "cpu: min_passed = 150 (base 200): tests/b is gone" in notes
    assert "cpu: remove include tests/b: deleted upstream in 0.2.0" in notes
    untouched, none = upstream_tests_config(project.pin, "0.3.0")
    assert untouched is not None and untouched["cpu"]["min_passed"] == 200 and none == []

    project.write("ci/upstream_tests-0.4.0.yaml", "cpu:\n  exclude:\n  - {path: tests/a/z.py}\n")
    with pytest.raises(HdError, match="needs a reason"):
        upstream_tests_config(project.pin, "0.4.0")


def test_stage_project_is_a_root_for_the_new_tag(project: Project):
    """--with-tests builds and tests from this staged root: X's VERSION, the rebased series."""
    assert project.hd("rebase", "--to", "0.3.0").rc == 0
    state = State.load(work_dir(project.pin, "0.3.0") / "state.json")
    stage_pin = stage_project(project.pin, state)
    assert stage_pin.upstream_version == "0.3.0"
    assert stage_pin.sdist == f"{NAME}-0.3.0.tar.gz"
    assert read_series(stage_pin) == [PATCH_1, PATCH_2]
    rebased = (stage_pin.patches_dir / PATCH_1).read_text()
    assert " LINE_08 = 8000\n" in rebased  # the context of the new tree, not 0.1.0's
    assert "vllm/models/toy/decode.py" in overlay_plan(stage_pin)
    assert fingerprint(stage_pin) != fingerprint(project.pin)
    assert project.pin.upstream_version == "0.1.0"  # the project itself is untouched


def test_series_that_does_not_apply_to_the_pin_is_refused(project: Project):
    path = project.patches / PATCH_1
    path.write_text(path.read_text().replace(" LINE_09 = 9\n", " LINE_09 = 99\n"))
    result = project.hd("rebase", "--to", "0.2.0")
    assert result.rc == 2
    assert "does not apply strictly to the pinned v0.1.0" in result.err
    assert current_branch(project.repo) == "hd/0.1.0"  # the previous checkout is back
    assert project.rev("rebase/0.2.0") is None
    assert not am_in_progress(project.repo)


def test_upstream_test_requirements_follow_the_tags_own_lock(project: Project):
    project.write(
        "ci/requirements-upstream-tests.txt",
        "# header\ntblib==3.1.0  # conftest\ntransformers==5.13.1\nextra-only-here==1.0\n",
    )
    assert project.hd("rebase", "--to", "0.2.0").rc == 0
    state = State.load(work_dir(project.pin, "0.2.0") / "state.json")
    text, notes = upstream_test_requirements(project.pin, state)
    assert text is not None
    assert "transformers==9.1.0\n" in text and "tblib==3.1.0  # conftest\n" in text
    assert "extra-only-here==1.0\n" in text  # not in the lock: kept
    assert notes == ["transformers: 5.13.1 -> 9.1.0 (from 0.2.0's test lock)"]

    project.write("ci/requirements-upstream-tests-0.2.0.txt", "tblib==3.0.0\n")
    text, notes = upstream_test_requirements(project.pin, state)
    assert text == "tblib==3.0.0\n"
    assert notes == ["ci/requirements-upstream-tests-0.2.0.txt used as is"]


def test_counts_of_a_partial_upstream_run_keep_the_not_run_tests() -> None:
    line = "upstream-tests cpu: 1261 passed, 72 failed, 31 skipped, 3 errors, 535 deselected, "
    line += "812 not run in 1223 s"
    assert _counts(f"noise\n{line}\nreports: x\n") == {
        "passed": 1261,
        "failed": 72,
        "skipped": 31,
        "errors": 3,
        "deselected": 535,
        "not run": 812,
    }


def test_allow_list_notes_share_one_line_per_reason() -> None:
    notes = [
        "cpu: remove include tests/a.py: gone upstream",
        "cpu: remove include tests/b: budget - too slow",
        "cpu: remove include tests/c.py: budget - too slow",
        "cpu: exclude tests/d.py: needs a CUDA GPU",
        "cpu: account_all = False (base True): new files",
    ]
    assert grouped_notes(notes) == [
        "cpu: remove include tests/a.py: gone upstream",
        "cpu: remove include tests/b, tests/c.py: budget - too slow",
        "cpu: exclude tests/d.py: needs a CUDA GPU",
        "cpu: account_all = False (base True): new files",
    ]


def test_conflict_messages_name_the_files_not_the_sides() -> None:
    # The messages git am -3 prints (git 2.4x), one per kind of conflict.
    lines = [
        "CONFLICT (content): Merge conflict in vllm/model.py",
        "CONFLICT (modify/delete): vllm/old.py deleted in HEAD and modified in toy: tune. "
        "Version toy: tune of vllm/old.py left in tree.",
        "CONFLICT (rename/delete): vllm/a.py renamed to vllm/b.py in HEAD, but deleted in x.",
        "error: patch failed: vllm/layers.py:12",
        "CONFLICT (content): Merge conflict in vllm/model.py",
    ]
    assert rebase.conflict_paths(lines) == [
        "vllm/model.py",
        "vllm/old.py",
        "vllm/a.py",
        "vllm/layers.py",
    ]
    assert rebase.deleted_upstream(lines) == ["vllm/old.py"]

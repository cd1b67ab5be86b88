"""upstream-pr on a synthetic upstream whose sdist carries a ruff and pre-commit configuration."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
from hdtest import (
    BUILD_INFO,
    GOOD_BODY,
    KERNELS_DEST,
    MODEL_PY,
    RELEASE_010,
    Index,
    Project,
    isolate_pip,
    make_imported_project,
    make_sdist,
    make_wheel,
    write_simple_index,
)

from hdtool.gitutil import git, git_out
from hdtool.pin import HdError, fingerprint
from hdtool.upstream_pr import (
    DRAFT_DESCRIPTION,
    FEATURE_SUBJECT,
    PATCH_NAME,
    read_runtime,
    spdx_fixed,
)

LICENSE = "# SPDX-License-Identifier: Apache-2.0\n"
COPYRIGHT = "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
HEADER = LICENSE + COPYRIGHT
RUNTIME = "vllm/models/toy/runtime/__init__.py"  # next to KERNELS_DEST (vllm/models/toy/cutedsl)

# The synthetic release's lint configuration: vLLM's shape, a line length other than ruff's
# default (88) so the test sees which one applies, and local Python hooks written here.
PYPROJECT = b"""\
[tool.ruff]
line-length = 100

[tool.ruff.lint]
select = ["E", "F"]
"""
PRE_COMMIT = b"""\
exclude: 'vllm/third_party/.*'
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.14.0
  hooks:
  - id: ruff-check
    args: [--output-format, github, --fix]
  - id: ruff-format
- repo: https://github.com/crate-ci/typos
  rev: v1.43.5
  hooks:
  - id: typos
- repo: local
  hooks:
  - id: spdx
    name: every python file has the license line
    entry: python tools/pre_commit/spdx.py
    language: python
    types_or: [python]
    exclude: ^vllm/model\\.py$
  - id: no-pickle
    name: no pickle
    entry: python tools/pre_commit/no_pickle.py
    language: python
    types: [python]
  - id: needs-extra
    name: needs a package nobody has
    entry: python tools/pre_commit/no_pickle.py
    language: python
    additional_dependencies: [surely-not-installed-hd-pkg==1.0]
    types: [python]
  - id: only-docs
    name: only for docs
    entry: python tools/pre_commit/no_pickle.py
    language: python
    files: ^docs/
  - id: signoff-commit
    name: sign-off
    entry: bash -c true
    language: system
    stages: [commit-msg]
  - id: suggestion
    name: Suggestion
    entry: bash -c 'echo advice'
    language: system
    pass_filenames: false
"""
SPDX_HOOK = b"""\
import sys

texts = {p: open(p).read() for p in sys.argv[1:]}
missing = [p for p, text in texts.items() if text and "SPDX-License-Identifier" not in text]
for p in missing:
    print(f"{p}: no SPDX license line")
sys.exit(1 if missing else 0)
"""
NO_PICKLE_HOOK = b"""\
import sys

bad = 0
for p in sys.argv[1:]:
    for n, line in enumerate(open(p), 1):
        if line.startswith("import pickle"):
            print(f"{p}:{n}: \\033[91merror:\\033[0m pickle is forbidden")
            bad = 1
sys.exit(bad)
"""
RELEASE = {
    **RELEASE_010,
    "pyproject.toml": PYPROJECT,
    ".pre-commit-config.yaml": PRE_COMMIT,
    "tools/pre_commit/spdx.py": SPDX_HOOK,
    "tools/pre_commit/no_pickle.py": NO_PICKLE_HOOK,
}

RUNTIME_PY = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The toy decode's configuration."""

DECODE_BACKEND_KEY = "decode_backend"
BACKENDS = ("auto", "latency_specialized")
SIZES = (1, 2, 4)
SHAPES = {"hidden": 64, "act": "silu"}


def unsupported(config) -> list[str]:
    """Every reason the toy decode cannot run this deployment.

    More text that the description leaves out."""
    reasons = []
    if config.tp != 1:
        reasons.append(f"tensor parallel size {config.tp} (only 1)")
    checks = [
        (config.pp > 1, "pipeline parallelism"),
        *_dtype_checks(config),
    ]
    reasons += [why for failed, why in checks if failed]
    if config.eager:
        reasons.append("enforce_eager " + "(sizes " + ", ".join(map(str, SIZES)) + ")")
    return reasons


def _dtype_checks(config):
    out = []
    for name in ("kv", "conv"):
        out.append((getattr(config, name) != "bf16", f"{name} dtype is not bf16"))
    return out
'''
EXPECTED_REASONS = [
    ("tensor parallel size {config.tp} (only 1)", "config.tp != 1"),
    ("pipeline parallelism", "config.pp > 1"),
    ("{name} dtype is not bf16", "for name in ('kv', 'conv'); getattr(config, name) != 'bf16'"),
    ("enforce_eager (sizes 1, 2, 4)", "config.eager"),
]


def model_with(**values: int) -> str:
    text = MODEL_PY
    for name, value in values.items():
        number = int(name.split("_")[1])
        text = text.replace(f"{name} = {number}\n", f"{name} = {value}\n")
    return text


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pr_index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    root = tmp_path_factory.mktemp("upstream-pr-index")
    files_dir = root / "files"
    files_dir.mkdir()
    made = (make_sdist(files_dir, "0.1.0", RELEASE), make_wheel(files_dir, "0.1.0"))
    files = {p.name: p for p in made}
    return write_simple_index(root, files)


@pytest.fixture(scope="module")
def pr_template(tmp_path_factory: pytest.TempPathFactory, pr_index: Index) -> Path:
    return make_imported_project(tmp_path_factory.mktemp("upstream-pr-template") / "proj", pr_index)


@pytest.fixture
def project(
    tmp_path: Path,
    pr_template: Path,
    pr_index: Index,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> Project:
    isolate_pip(monkeypatch, pr_index)
    root = tmp_path / "proj"
    shutil.copytree(pr_template, root, symlinks=True)
    return Project(root, capsys)


def build_patch_set(project: Project) -> None:
    """Two hooks on one upstream file, a hook adding a file without SPDX, overlay, kernels."""
    project.add_patch(
        "Toy: tune LINE_10",
        {"vllm/model.py": model_with(LINE_10=100)},
        body="Tune it for the toy.\n\n" + GOOD_BODY,
    )
    project.add_patch(
        "Toy: tune LINE_30 and add a hook module",
        {
            "vllm/model.py": model_with(LINE_10=100, LINE_30=300),
            "vllm/hook.py": "HOOK = 1\n",
        },
    )
    project.write(f"vllm_overlay/{RUNTIME}", RUNTIME_PY)
    project.write("vllm_overlay/vllm/models/toy/__init__.py", "")
    project.write("vllm_overlay/vllm/models/toy/plain.py", "PLAIN = 1\n")
    project.write("vllm_overlay/vllm/models/toy/half.py", LICENSE + '"""Half."""\n')
    project.write("vllm_overlay/vllm/models/toy/tool.py", "#!/usr/bin/env python3\nTOOL = 1\n")
    project.root.joinpath("vllm_overlay/vllm/models/toy/tool.py").chmod(0o755)
    project.write("vllm_overlay/vllm/models/toy/README.md", "# Toy\n")
    project.write("kernels/__init__.py", HEADER + 'from .gemm import gemm\n\n__all__ = ["gemm"]\n')
    project.write("kernels/gemm.py", "def gemm(a, b):\n    return a @ b\n")
    project.write("kernels/tests/test_gemm.py", "def test_gemm():\n    pass\n")


def perf_data(project: Project, **overrides: object) -> dict:
    data: dict = {
        "fingerprint": fingerprint(project.pin),
        "vllm": "0.1.0+hd.7",
        "gpu": "NVIDIA H200",
        "date": "2026-12-01T10:00:00+00:00",
        "command": "python3 scripts/bench_decode.py --out-dir docs/perf",
        "method": "median inter-token latency with exactly N requests in flight",
        "model": "Toy-1B",
        "summary": {
            "step_ms": {
                "1": {"stock": 3.6012, "specialized": 1.7234},
                "2": {"stock": 4.1701, "specialized": 2.0012},
                "16": {"stock": 9.1, "specialized": 6.25},
            },
            "speedup": {"1": 2.08959, "2": 2.08375, "16": 1.456},
            "floor_ms": {"1": 1.5, "2": 1.75, "16": 5.9876},
            "distinct_experts": {"1": 8, "2": 15.5, "16": 98},
            "prefill_throughput_ratio": 0.9912,
            "note": "not a table",
        },
        "correctness": {
            "command": "pytest tests/gpu/test_decode_equivalence.py",
            "result": "12 passed",
            "checks": ["logits cosine >= 0.999 every step"],
        },
    }
    data.update(overrides)
    return data


def write_perf(project: Project, data: dict) -> None:
    project.write("docs/perf/decode.json", json.dumps(data, indent=2))


def ready(project: Project) -> None:
    build_patch_set(project)
    write_perf(project, perf_data(project))


def description(project: Project) -> str:
    return (project.root / "reports" / "upstream-pr.md").read_text()


def section(text: str, title: str) -> list[str]:
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"## {title}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def table(lines: list[str]) -> list[list[str]]:
    """The first markdown table in lines: header, then the rows."""
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start:end]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[:1] + rows[2:]]


def fresh_sdist_tree(project: Project, dest: Path) -> Path:
    """The pinned sdist, unpacked as a contributor would have it."""
    with tarfile.open(project.root / ".cache" / "upstream" / "vllm-0.1.0.tar.gz") as tf:
        tf.extractall(dest, filter="data")
    return dest / "vllm-0.1.0"


def tree_files(repo: Path, rev: str) -> dict[str, bytes]:
    names = git_out("ls-tree", "-r", "--name-only", rev, cwd=repo).splitlines()
    return {n: git("show", f"{rev}:{n}", cwd=repo).stdout for n in names}


# --- the export -------------------------------------------------------------------------------


def test_export_applies_to_a_fresh_sdist_tree(project: Project, tmp_path: Path):
    ready(project)
    result = project.hd("upstream-pr")
    assert result.rc == 0, result.text
    branch = "upstream-pr/0.1.0"
    patch = project.root / "build" / "upstream-pr" / PATCH_NAME

    # git apply --check, then git apply, on the plain unpacked sdist.
    plain = fresh_sdist_tree(project, tmp_path / "plain")
    check = git("apply", "--check", str(patch), cwd=plain, check=False)
    assert check.returncode == 0, check.stderr.decode()
    git("apply", str(patch), cwd=plain)
    expected = tree_files(project.repo, branch)
    for rel, data in expected.items():
        assert (plain / rel).read_bytes() == data, rel

    # git am on a git repository of the same sdist: the same commits, hooks first.
    am_repo = fresh_sdist_tree(project, tmp_path / "am")
    git("init", "-q", cwd=am_repo)
    (am_repo / ".git" / "info" / "attributes").write_text("* -text\n")
    git("add", "-A", "-f", cwd=am_repo)
    git("commit", "-q", "-m", "sdist", cwd=am_repo)
    am = git("am", "--whitespace=error", str(patch), cwd=am_repo, check=False)
    assert am.returncode == 0, am.stderr.decode()
    assert git_out("log", "--format=%s", "-3", cwd=am_repo).splitlines() == [
        FEATURE_SUBJECT,
        "Toy: tune LINE_30 and add a hook module",
        "Toy: tune LINE_10",
    ]
    assert git_out("rev-parse", "HEAD^{tree}", cwd=am_repo) == project.git(
        "rev-parse", f"{branch}^{{tree}}"
    )
    # The hook commits keep their author; this project's fields stay out of the PR.
    assert git_out("log", "-1", "--format=%an <%ae>", "HEAD~2", cwd=am_repo) == (
        "Dev Eloper <dev@example.org>"
    )
    messages = git_out("log", "--format=%B", "-3", cwd=am_repo)
    for field in ("Why", "Upstream-Status", "Removal-Plan", "the toy model needs it"):
        assert field not in messages
    assert "Tune it for the toy." in messages

    assert "- **Toy: tune LINE_10** (`vllm/model.py`, +1/-1). Tune it for the toy." in (
        description(project)
    )

    # Deterministic: the same inputs give the same branch.
    head = project.rev(branch)
    assert project.hd("upstream-pr").rc == 0
    assert project.rev(branch) == head
    assert project.git("log", "-1", "--format=%an", branch) == "vllm-hopper-decode"
    assert project.hd("upstream-pr", "--author", "Ada Lovelace <ada@example.org>").rc == 0
    assert (
        project.git("log", "-1", "--format=%an <%ae>", branch) == "Ada Lovelace <ada@example.org>"
    )
    assert project.git("log", "-1", "--format=%an", f"{branch}~1") == "Dev Eloper"
    bad = project.hd("upstream-pr", "--author", "nobody")
    assert bad.rc == 2 and "expected 'Name <email@example.org>'" in bad.err


def test_touched_files_are_what_series_and_overlay_imply(project: Project):
    ready(project)
    result = project.hd("upstream-pr")
    assert result.rc == 0, result.text
    touched = set(project.git("diff", "--name-only", "v0.1.0", "upstream-pr/0.1.0").splitlines())
    overlay = {
        RUNTIME,
        "vllm/models/toy/__init__.py",
        "vllm/models/toy/plain.py",
        "vllm/models/toy/half.py",
        "vllm/models/toy/tool.py",
        "vllm/models/toy/README.md",
        f"{KERNELS_DEST}/__init__.py",
        f"{KERNELS_DEST}/gemm.py",
    }
    assert touched == {"vllm/model.py", "vllm/hook.py"} | overlay
    # Never the project's tooling: no build info, no relabelled version, no kernel tests.
    assert BUILD_INFO not in touched and "vllm/_version.py" not in touched
    assert not any("tests" in p for p in touched)
    mode = project.git("ls-tree", "upstream-pr/0.1.0", "vllm/models/toy/tool.py").split()[0]
    assert mode == "100755"

    # The description's file table: the same files, with git's own line counts.
    rows = table(section(description(project), "Files touched"))
    numstat = {}
    for line in project.git("diff", "--numstat", "v0.1.0", "upstream-pr/0.1.0").splitlines():
        added, deleted, path = line.split("\t")
        numstat[path] = (added, deleted)
    assert {r[0].strip("`"): (r[2], r[3]) for r in rows[1:]} == numstat
    assert {r[0].strip("`"): r[1] for r in rows[1:]}["vllm/model.py"] == "modified"
    assert "(10: 1 upstream files changed, 9 new;" in description(project)


def test_spdx_header_added_where_missing(project: Project):
    ready(project)
    result = project.hd("upstream-pr")
    assert result.rc == 0, result.text
    files = tree_files(project.repo, "upstream-pr/0.1.0")
    assert files["vllm/hook.py"] == (HEADER + "\nHOOK = 1\n").encode()  # added by a hook
    assert files["vllm/models/toy/plain.py"] == (HEADER + "\nPLAIN = 1\n").encode()
    assert files["vllm/models/toy/half.py"] == (HEADER + '"""Half."""\n').encode()
    assert (
        files["vllm/models/toy/tool.py"]
        == ("#!/usr/bin/env python3\n" + HEADER + "\nTOOL = 1\n").encode()
    )
    assert files[f"{KERNELS_DEST}/gemm.py"].startswith(HEADER.encode() + b"\n\ndef gemm")
    # Already complete, empty (vLLM's rule) or not Python: unchanged.
    assert files[RUNTIME] == RUNTIME_PY.encode()
    assert files["vllm/models/toy/__init__.py"] == b""
    assert files["vllm/models/toy/README.md"] == b"# Toy\n"
    fixed = result.out.split("SPDX header added to 5 new file(s):\n")[1].split("\nupstream-pr:")[0]
    assert sorted(line.strip() for line in fixed.splitlines()) == [
        "vllm/hook.py",
        "vllm/models/toy/cutedsl/gemm.py",
        "vllm/models/toy/half.py",
        "vllm/models/toy/plain.py",
        "vllm/models/toy/tool.py",
    ]
    # The sources are not edited: the fix lives in the export only.
    assert (project.root / "vllm_overlay/vllm/models/toy/plain.py").read_text() == "PLAIN = 1\n"


def test_spdx_fixed_follows_vllms_rule():
    assert spdx_fixed(b"") is None
    assert spdx_fixed((HEADER + "X = 1\n").encode()) is None
    assert spdx_fixed(b'"""Doc."""\n' + HEADER.encode()) is None  # anywhere counts
    assert spdx_fixed(b"X = 1\n") == (HEADER + "\nX = 1\n").encode()
    assert spdx_fixed(b"\nX = 1\n") == (HEADER + "\nX = 1\n").encode()
    assert spdx_fixed(b"def f():\n    pass\n") == (HEADER + "\n\ndef f():\n    pass\n").encode()
    assert spdx_fixed(b"@cache\ndef f(): ...\n").startswith((HEADER + "\n\n@cache").encode())
    assert spdx_fixed(COPYRIGHT.encode() + b"X\n") == (HEADER + "X\n").encode()
    assert spdx_fixed(LICENSE.encode() + b"X\n") == (HEADER + "X\n").encode()
    assert spdx_fixed(b"X = 1\r\n") == (HEADER.replace("\n", "\r\n") + "\r\nX = 1\r\n").encode()
    assert spdx_fixed(b"#!/bin/env python3") == ("#!/bin/env python3\n" + HEADER).encode()


def test_tooling_files_never_go_upstream(project: Project):
    ready(project)
    project.add_patch("Relabel the version", {"vllm/_version.py": '__version__ = "x"\n'})
    write_perf(project, perf_data(project))
    result = project.hd("upstream-pr")
    assert result.rc == 2
    assert "vllm/_version.py, which only this project's tooling writes" in result.err
    assert project.rev("upstream-pr/0.1.0") is None


# --- the description --------------------------------------------------------------------------


def test_description_table_equals_the_json(project: Project):
    ready(project)
    data = perf_data(project)
    result = project.hd("upstream-pr")
    assert result.rc == 0, result.text
    text = description(project)
    assert "DRAFT" not in text
    perf = section(text, "Performance")
    rows = table(perf)
    header, body = rows[0], rows[1:]
    assert header == [
        "N",
        "step (ms), stock",
        "step (ms), specialized",
        "speedup",
        "weight-read floor (ms)",
        "distinct experts",
    ]
    summary = data["summary"]
    assert [int(r[0]) for r in body] == sorted(int(n) for n in summary["speedup"])
    for row in body:
        n = row[0]
        assert float(row[1]) == pytest.approx(summary["step_ms"][n]["stock"], abs=5e-4)
        assert float(row[2]) == pytest.approx(summary["step_ms"][n]["specialized"], abs=5e-4)
        assert row[3].endswith("x")
        assert float(row[3][:-1]) == pytest.approx(summary["speedup"][n], abs=5e-3)
        assert float(row[4]) == pytest.approx(summary["floor_ms"][n], abs=5e-4)
        assert float(row[5]) == summary["distinct_experts"][n]
    joined = "\n".join(perf)
    for key in ("gpu", "vllm", "date", "method", "command", "model", "fingerprint"):
        assert data[key] in joined, key
    assert "specialized / stock: 0.991" in joined

    assert "12 passed" in "\n".join(section(text, "Correctness"))
    assert "1.46x to 2.09x" in "\n".join(section(text, "Test Result"))
    assert """--additional-config '{"decode_backend": "latency_specialized"}'""" in text


def test_description_reads_the_reasons_from_unsupported(project: Project):
    ready(project)
    assert project.hd("upstream-pr").rc == 0
    rows = table(section(description(project), "Supported and rejected"))
    assert [(r[1], r[2].strip("`")) for r in rows[1:]] == EXPECTED_REASONS
    text = description(project)
    assert "Every reason the toy decode cannot run this deployment." in text
    assert "More text" not in text
    assert "- `SIZES = (1, 2, 4)`" in text and "| `act` | `'silu'` |" in text

    # Edit the source, not the description: the description follows.
    runtime = project.root / "vllm_overlay" / RUNTIME
    runtime.write_text(runtime.read_text().replace("pipeline parallelism", "PP of any size"))
    write_perf(project, perf_data(project))
    assert project.hd("upstream-pr").rc == 0
    rows = table(section(description(project), "Supported and rejected"))
    assert rows[2][1] == "PP of any size"


def test_unreadable_reason_is_a_clear_error(project: Project):
    path = project.write(
        f"vllm_overlay/{RUNTIME}",
        RUNTIME_PY.replace(
            '        reasons.append(f"tensor parallel size {config.tp} (only 1)")',
            "        reasons.append(config.describe())",
        ),
    )
    with pytest.raises(HdError, match=r"__init__.py:17: `config.describe\(\)` is not a string"):
        read_runtime(project.pin, {RUNTIME: path})
    path.write_text("def unsupported(config):\n    return []\n# latency_specialized\n")
    with pytest.raises(HdError, match="never mentions 'decode_backend'"):
        read_runtime(project.pin, {RUNTIME: path})
    path.write_text("decode_backend = latency_specialized = 1\n")
    with pytest.raises(HdError, match=r"defines no unsupported\(\)"):
        read_runtime(project.pin, {RUNTIME: path})
    with pytest.raises(HdError, match="the overlay has no vllm/models/toy/runtime/__init__.py"):
        read_runtime(project.pin, {})


# --- the perf report gate ---------------------------------------------------------------------


def test_missing_perf_report_fails_and_writes_nothing(project: Project):
    build_patch_set(project)
    result = project.hd("upstream-pr")
    assert result.rc == 2
    assert "docs/perf/decode.json does not exist" in result.err
    assert "make bench" in result.err
    assert fingerprint(project.pin) in result.err
    assert project.rev("upstream-pr/0.1.0") is None
    assert not (project.root / "reports").exists()
    assert not (project.root / "build" / "upstream-pr").exists()


def test_stale_perf_report_fails(project: Project):
    ready(project)
    project.write("kernels/gemm.py", HEADER + "def gemm(a, b):\n    return b @ a\n")
    result = project.hd("upstream-pr")
    assert result.rc == 2
    assert "older than the kernels it describes" in result.err
    assert "Re-run the decode benchmark" in result.err
    assert fingerprint(project.pin)[:16] in result.err
    assert project.rev("upstream-pr/0.1.0") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fingerprint": None}, 'records no "fingerprint"'),
        (
            {"vllm": "0.1.0+hd.6"},
            "was measured with vllm 0.1.0+hd.6, but the pin builds 0.1.0+hd.7",
        ),
        ({"gpu": ""}, '"gpu" must be a non-empty string'),
        (
            {"switches": {"VLLM_HD_EXPERT_L2_POLICY": "evict_first"}},
            "measured with experiment switches set",
        ),
        ({"summary": {"speedup": {}}}, "prefill_throughput_ratio must be a number"),
    ],
)
def test_malformed_perf_report_fails(project: Project, change: dict, message: str):
    build_patch_set(project)
    data = perf_data(project)
    data.update(change)
    write_perf(project, {k: v for k, v in data.items() if v is not None})
    result = project.hd("upstream-pr")
    assert result.rc == 2
    assert message in result.err


def test_bad_table_keys_fail(project: Project):
    build_patch_set(project)
    data = perf_data(project)
    data["summary"]["speedup"]["one"] = 2.0
    write_perf(project, data)
    result = project.hd("upstream-pr")
    assert result.rc == 2
    assert "summary.speedup has key 'one'" in result.err


def test_draft_says_loudly_what_is_missing_and_stays_out_of_reports(project: Project):
    build_patch_set(project)
    result = project.hd("upstream-pr", "--draft")
    assert result.rc == 0, result.text
    assert not (project.root / "reports").exists()
    draft = (project.root / "build" / "upstream-pr" / DRAFT_DESCRIPTION).read_text()
    assert draft.startswith("> [!CAUTION]\n> **DRAFT — NOT FOR SUBMISSION.**")
    assert "docs/perf/decode.json does not exist" in draft
    assert "**NUMBERS MISSING**" in draft
    assert "| N |" not in draft
    assert "DRAFT description (NOT for submission)" in result.out
    assert project.rev("upstream-pr/0.1.0") is not None


# --- vLLM's lint ------------------------------------------------------------------------------


def test_lint_uses_the_pinned_configuration(project: Project):
    ready(project)
    # 95 columns pass (the pinned line-length is 100, ruff's default 88); 105 do not.
    project.write(
        "vllm_overlay/vllm/models/toy/long.py",
        HEADER
        + "import pickle\n\n"
        + f'OK = pickle.dumps("{"a" * 70}")\n'
        + f'TOO_LONG = pickle.dumps("{"b" * 74}")\n',
    )
    project.write("vllm_overlay/vllm/models/toy/ugly.py", HEADER + "x=1\n")
    write_perf(project, perf_data(project))
    result = project.hd("upstream-pr")
    assert result.rc == 0, result.text
    lint = (project.root / "build" / "upstream-pr" / "lint.md").read_text()
    rows = {r[0]: r[1:] for r in table(lint.split("\n"))[1:]}
    # pyproject.toml's line-length applies.
    assert rows["ruff-check"][1] == "1 finding(s)"
    assert "vllm/models/toy/long.py:6:101: E501" in lint and "long.py:5:" not in lint
    assert rows["ruff-format"][1] == "2 finding(s)"  # ugly.py, and long.py's long line
    assert "Would reformat: vllm/models/toy/ugly.py" in lint and "+x = 1" in lint
    assert "Would reformat: vllm/models/toy/long.py" in lint
    assert rows["no-pickle"][1] == "1 finding(s)"
    assert "vllm/models/toy/long.py:3: error: pickle is forbidden" in lint  # colours stripped
    assert rows["spdx"][1] == "passed"  # after the export added the missing headers
    assert rows["needs-extra"][1] == "not run: needs surely-not-installed-hd-pkg==1.0"
    assert rows["typos"][1] == "not run: needs https://github.com/crate-ci/typos v1.43.5"
    # Python files only (ruff) vs every file (typos); hooks for other files or stages: absent.
    assert rows["ruff-check"][0] == "11" and rows["typos"][0] == "12"
    assert not {"only-docs", "signoff-commit", "suggestion"} & set(rows)
    assert "vLLM lint: 4 finding(s)" in result.out
    assert "on the touched files: 4 finding(s)" in description(project)


def test_lint_finds_nothing_in_clean_files(project: Project):
    ready(project)
    assert project.hd("upstream-pr").rc == 0
    lint = (project.root / "build" / "upstream-pr" / "lint.md").read_text()
    rows = {r[0]: r[1:] for r in table(lint.split("\n"))[1:]}
    for hook in ("ruff-check", "ruff-format", "spdx", "no-pickle"):
        assert rows[hook][1] == "passed", (hook, lint)


def spread_data(project: Project, **overrides: object) -> dict:
    data = perf_data(project, command="python3 scripts/bench_decode.py --routing spread")
    data["summary"]["step_ms"]["2"] = {"stock": 4.5891, "specialized": 2.8422}
    data["summary"]["speedup"]["2"] = 1.61457
    data["summary"]["distinct_experts"]["2"] = 15.7491
    data.pop("correctness")
    data.update(overrides)
    return data


def test_spread_routing_table_equals_its_json(project: Project):
    ready(project)
    data = spread_data(project)
    project.write("docs/perf/decode_spread_routing.json", json.dumps(data, indent=2))
    result = project.hd("upstream-pr")
    assert result.rc == 0, result.text
    perf = section(description(project), "Performance")
    start = perf.index("### With routing that follows the token")
    spread = perf[start:]
    assert data["command"] in "\n".join(spread)
    rows = table(spread)
    assert rows[0][-1] == "distinct experts"
    by_n = {r[0]: r for r in rows[1:]}
    assert sorted(by_n) == ["1", "16", "2"]
    assert float(by_n["2"][2]) == pytest.approx(2.8422, abs=5e-4)
    assert by_n["2"][3] == "1.61x"
    assert by_n["2"][5] == "15.7"
    # The dummy-routing table stays the section's first.
    assert float(table(perf)[2][2]) == pytest.approx(2.0012, abs=5e-4)


def test_stale_spread_routing_report_is_left_out(project: Project):
    ready(project)
    stale = spread_data(project, fingerprint="0" * 64)
    project.write("docs/perf/decode_spread_routing.json", json.dumps(stale, indent=2))
    result = project.hd("upstream-pr")
    assert result.rc == 0, result.text
    assert "decode_spread_routing.json left out" in result.text
    perf = section(description(project), "Performance")
    spread = "\n".join(perf[perf.index("### With routing that follows the token") :])
    assert "Not shown (docs/perf/decode_spread_routing.json is older than the kernels" in spread
    assert "2.842" not in spread and "|" not in spread


def test_missing_spread_routing_report_is_said(project: Project):
    ready(project)
    result = project.hd("upstream-pr")
    assert result.rc == 0, result.text
    perf = "\n".join(section(description(project), "Performance"))
    assert "Not shown (no `docs/perf/decode_spread_routing.json`)" in perf

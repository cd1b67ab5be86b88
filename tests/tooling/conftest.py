"""Fixtures of the patch-set tooling tests (helpers live in hdtest.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hdtest import (
    RELEASE_010,
    RELEASE_020,
    Index,
    Project,
    isolate_pip,
    make_imported_project,
    make_sdist,
    make_wheel,
    version_toml,
    write_simple_index,
)


@pytest.fixture(scope="session")
def package_index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    """A PEP 503 file:// index with the synthetic releases 0.1.0 and 0.2.0."""
    root = tmp_path_factory.mktemp("index")
    files_dir = root / "files"
    files_dir.mkdir()
    files = {}
    for version, tree in (("0.1.0", RELEASE_010), ("0.2.0", RELEASE_020)):
        for path in (make_sdist(files_dir, version, tree), make_wheel(files_dir, version)):
            files[path.name] = path
    return write_simple_index(root, files)


@pytest.fixture
def pip_sees_only_the_test_index(monkeypatch: pytest.MonkeyPatch, package_index: Index) -> None:
    isolate_pip(monkeypatch, package_index)


@pytest.fixture(scope="session")
def imported_template(
    tmp_path_factory: pytest.TempPathFactory, package_index: Index
) -> Iterator[Path]:
    """A project with 0.1.0 fetched and imported, copied by each test (import runs once)."""
    yield make_imported_project(tmp_path_factory.mktemp("template") / "proj", package_index)


@pytest.fixture
def project(
    tmp_path: Path,
    imported_template: Path,
    capsys: pytest.CaptureFixture[str],
    pip_sees_only_the_test_index: None,
) -> Project:
    """A project with the synthetic 0.1.0 imported into build/upstream."""
    root = tmp_path / "proj"
    shutil.copytree(imported_template, root, symlinks=True)
    return Project(root, capsys)


@pytest.fixture
def bare_project(
    tmp_path: Path,
    package_index: Index,
    capsys: pytest.CaptureFixture[str],
    pip_sees_only_the_test_index: None,
) -> Project:
    """A project that has fetched and imported nothing yet."""
    root = tmp_path / "bare"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "series").write_text("")
    (root / "vllm_overlay").mkdir()
    (root / "kernels").mkdir()
    (root / "VERSION").write_text(version_toml(package_index))
    return Project(root, capsys)

"""Fixtures of the patch-set tooling tests (helpers live in hdtest.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hdtest import (
    NAME,
    RELEASE_010,
    RELEASE_020,
    Index,
    Project,
    make_sdist,
    make_wheel,
    sha256,
    version_toml,
)

from hdtool import cli


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
    page = root / "simple" / NAME
    page.mkdir(parents=True)
    links = "".join(
        f'<a href="../../files/{name}#sha256={sha256(path)}">{name}</a>\n'
        for name, path in sorted(files.items())
    )
    (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    return Index((root / "simple").as_uri(), files)


def _isolate_pip(mp: pytest.MonkeyPatch, index: Index) -> None:
    """pip reads no config file and no other index: fetch must work from the local index."""
    for var in list(os.environ):
        if var.startswith("PIP_"):
            mp.delenv(var)
    mp.setenv("PIP_CONFIG_FILE", os.devnull)
    mp.setenv("PIP_INDEX_URL", index.url)


@pytest.fixture
def pip_sees_only_the_test_index(monkeypatch: pytest.MonkeyPatch, package_index: Index) -> None:
    _isolate_pip(monkeypatch, package_index)


@pytest.fixture(scope="session")
def imported_template(
    tmp_path_factory: pytest.TempPathFactory, package_index: Index
) -> Iterator[Path]:
    """A project with 0.1.0 fetched and imported, copied by each test (import runs once)."""
    root = tmp_path_factory.mktemp("template") / "proj"
    root.mkdir()
    (root / "VERSION").write_text(version_toml(package_index))
    (root / "patches").mkdir()
    (root / "patches" / "series").write_text("")
    (root / "vllm_overlay").mkdir()
    (root / "kernels").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        _isolate_pip(mp, package_index)
        assert cli.main(["--root", str(root), "import"]) == 0
    yield root


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

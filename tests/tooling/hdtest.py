"""Helpers of the tooling tests: synthetic upstream releases, a local package index and
throw-away projects. Nothing here touches the network or the real pin."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from hdtool import cli  # noqa: E402
from hdtool.gitutil import git, git_out  # noqa: E402
from hdtool.pin import Pin  # noqa: E402
from hdtool.series import FORMAT_PATCH_OPTIONS  # noqa: E402

NAME = "vllm"
WHEEL_TAGS = "cp38-abi3-manylinux_2_28_x86_64"
KERNELS_DEST = "vllm/models/toy/cutedsl"
BUILD_INFO = "vllm/_hopper_decode_build.py"
RELEASE_MTIME = 1_700_000_000

MODEL_PY = "".join(f"LINE_{i:02d} = {i}\n" for i in range(1, 41))

# Files of the synthetic upstream release 0.1.0. The .gitignore/.gitattributes are hostile on
# purpose: import must still take every file byte for byte, and apply must stay strict.
RELEASE_010: dict[str, bytes] = {
    "PKG-INFO": b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.1.0\n",
    "setup.py": b"from setuptools import setup\n\nsetup()\n",
    ".gitignore": b"*.egg-info/\nignored_by_upstream.txt\n",
    ".gitattributes": b"* text=auto eol=crlf\n*.py whitespace=-trailing-space\n",
    "ignored_by_upstream.txt": b"upstream ignores me, the import must not\n",
    "vllm.egg-info/PKG-INFO": b"Name: vllm\n",
    "vllm/__init__.py": b'__version__ = "0.1.0"\n',
    "vllm/model.py": MODEL_PY.encode(),
    "vllm/utils.py": b"def helper(x):\n    return x + 1\n\n\ndef other(y):\n    return y * 2\n",
    "vllm/models/__init__.py": b"",
    "vllm/crlf.txt": b"first\r\nsecond\r\n",
    "tools/run.sh": b"#!/bin/sh\necho run\n",
}
EXECUTABLE = {"tools/run.sh"}

RELEASE_020: dict[str, bytes] = {
    **{k: v for k, v in RELEASE_010.items() if k != "vllm/utils.py"},
    "PKG-INFO": b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.2.0\n",
    "vllm/__init__.py": b'__version__ = "0.2.0"\n',
    "vllm/new_in_020.py": b"NEW = True\n",
}

GOOD_BODY = (
    "Why: the toy model needs it.\n"
    "Upstream-Status: pending\n"
    "Removal-Plan: drop when upstream has it.\n"
)


def make_sdist(dest: Path, version: str, files: dict[str, bytes]) -> Path:
    path = dest / f"{NAME}-{version}.tar.gz"
    top = f"{NAME}-{version}"
    with tarfile.open(path, "w:gz") as tf:
        dirs = sorted({str(Path(p).parent) for p in files if "/" in p})
        for d in [top] + [f"{top}/{d}" for d in dirs]:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, RELEASE_MTIME
            tf.addfile(info)
        for rel, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            info.mode = 0o755 if rel in EXECUTABLE else 0o644
            info.mtime = RELEASE_MTIME + len(rel)
            tf.addfile(info, io.BytesIO(data))
    return path


def make_wheel(dest: Path, version: str) -> Path:
    path = dest / f"{NAME}-{version}-{WHEEL_TAGS}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/__init__.py", f'__version__ = "{version}"\n')
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
        zf.writestr(f"vllm-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\n")
        zf.writestr(f"vllm-{version}.dist-info/RECORD", "")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Index:
    url: str
    files: dict[str, Path]  # file name -> path


def write_simple_index(root: Path, files: dict[str, Path]) -> Index:
    """A PEP 503 file:// index under root/simple listing files (which live in root/files)."""
    page = root / "simple" / NAME
    page.mkdir(parents=True)
    links = "".join(
        f'<a href="../../files/{name}#sha256={sha256(path)}">{name}</a>\n'
        for name, path in sorted(files.items())
    )
    (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    return Index((root / "simple").as_uri(), files)


def isolate_pip(mp: pytest.MonkeyPatch, index: Index) -> None:
    """pip reads no config file and no other index: fetch must work from the local index."""
    for var in list(os.environ):
        if var.startswith("PIP_"):
            mp.delenv(var)
    mp.setenv("PIP_CONFIG_FILE", os.devnull)
    mp.setenv("PIP_INDEX_URL", index.url)


def make_imported_project(root: Path, index: Index) -> Path:
    """An empty patch-set project pinned to 0.1.0 of ``index``, fetched and imported."""
    root.mkdir(parents=True)
    (root / "VERSION").write_text(version_toml(index))
    (root / "patches").mkdir()
    (root / "patches" / "series").write_text("")
    (root / "vllm_overlay").mkdir()
    (root / "kernels").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        isolate_pip(mp, index)
        assert cli.main(["--root", str(root), "import"]) == 0
    return root


def version_toml(index: Index, **overrides: str) -> str:
    sdist, wheel = f"{NAME}-0.1.0.tar.gz", f"{NAME}-0.1.0-{WHEEL_TAGS}.whl"
    values = {
        "sdist_sha256": sha256(index.files[sdist]),
        "wheel_sha256": sha256(index.files[wheel]),
        **overrides,
    }
    return f"""\
patchset_version = "0.0.1"
local_label = "hd.7"

[upstream]
name = "{NAME}"
version = "0.1.0"
sdist = "{sdist}"
sdist_sha256 = "{values["sdist_sha256"]}"
wheel = "{wheel}"
wheel_sha256 = "{values["wheel_sha256"]}"

[pairs_with]
torch = "2.11.0"
nvidia-cutlass-dsl = "4.6.0"

[layout]
kernels_dest = "{KERNELS_DEST}"
build_info_module = "{BUILD_INFO}"
"""


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


class Project:
    """A throw-away patch-set project: VERSION, patches/, vllm_overlay/, kernels/."""

    def __init__(self, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.root = root
        self._capsys = capsys
        self._scratch: Path | None = None

    @property
    def pin(self) -> Pin:
        return Pin.load(self.root)

    @property
    def repo(self) -> Path:
        return self.pin.upstream_repo

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    def hd(self, *args: str) -> Result:
        """Run `hd.py --root <project> args...` in this process; capture its output."""
        self._capsys.readouterr()
        rc = cli.main(["--root", str(self.root), *args])
        captured = self._capsys.readouterr()
        return Result(rc, captured.out, captured.err)

    def git(self, *args: str, cwd: Path | None = None) -> str:
        return git_out(*args, cwd=cwd or self.repo)

    def rev(self, rev: str) -> str | None:
        proc = git("rev-parse", "--verify", "--quiet", rev, cwd=self.repo, check=False)
        return proc.stdout.decode().strip() or None

    def write(self, rel: str, data: str | bytes) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            data = data.encode()
        path.write_bytes(data)
        return path

    def series(self) -> list[str]:
        return (self.patches / "series").read_text().splitlines()

    def snapshot_patches(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.patches.iterdir())}

    # --- making patches the way a developer would: commits, then format-patch ------------

    def _scratch_repo(self) -> Path:
        """A clone of build/upstream on which the series so far is committed."""
        if self._scratch is None:
            scratch = self.root.parent / f"{self.root.name}-scratch"
            git("clone", "-q", "--no-checkout", str(self.repo), str(scratch), cwd=self.root)
            attributes = self.repo / ".git" / "info" / "attributes"
            shutil.copy(attributes, scratch / ".git" / "info" / "attributes")
            git("checkout", "-q", "-b", "work", self.pin.upstream_tag, cwd=scratch)
            self._scratch = scratch
        return self._scratch

    def add_patch(
        self,
        subject: str,
        edits: dict[str, str | bytes | None],
        body: str = GOOD_BODY,
        *,
        list_in_series: bool = True,
    ) -> Path:
        """Commit `edits` (path -> new content, None deletes) on top of the series so far and
        write it as the next patch with the canonical format-patch options."""
        scratch = self._scratch_repo()
        for rel, content in edits.items():
            path = scratch / rel
            if content is None:
                git("rm", "-q", rel, cwd=scratch)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode() if isinstance(content, str) else content)
            git("add", "-f", rel, cwd=scratch)
        git(
            "commit",
            "-q",
            "-m",
            subject,
            "-m",
            body,
            cwd=scratch,
            env={
                "GIT_AUTHOR_NAME": "Dev Eloper",
                "GIT_AUTHOR_EMAIL": "dev@example.org",
                "GIT_AUTHOR_DATE": "2026-01-02T03:04:05+00:00",
            },
        )
        out = self.root.parent / f"{self.root.name}-fp"
        shutil.rmtree(out, ignore_errors=True)
        git("format-patch", *FORMAT_PATCH_OPTIONS, "-o", str(out), "-1", "HEAD", cwd=scratch)
        (produced,) = out.iterdir()
        name = produced.name[len("0001-") :]
        target = self.patches / name
        shutil.move(produced, target)
        if list_in_series:
            with open(self.patches / "series", "a") as fh:
                fh.write(name + "\n")
        return target

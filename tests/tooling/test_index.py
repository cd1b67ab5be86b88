"""index: the PEP 503 page for a built (synthetic) wheel, served on loopback and used by pip."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.tooling.wheel_helpers import OUT_NAME, Project, build_info_text, make_project

from hdtool.index import write_index
from hdtool.pin import HdError
from hdtool.wheel import build_wheel


@pytest.fixture
def dist(tmp_path: Path) -> Path:
    project: Project = make_project(tmp_path / "proj")
    pin = project.pin
    build_wheel(pin, project.upstream_wheel, build_info_text(pin))
    return pin.dist_dir


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def served(dist: Path) -> Iterator[str]:
    """dist/ on a free loopback port; yields the index URL."""
    handler = functools.partial(_QuietHandler, directory=str(dist))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_index_pages(dist: Path) -> None:
    write_index(dist)
    root = (dist / "simple" / "index.html").read_text()
    assert re.findall(r'<a href="([^"]+)">vllm</a>', root) == ["vllm/"]
    page = (dist / "simple" / "vllm" / "index.html").read_text()
    sha = hashlib.sha256((dist / OUT_NAME).read_bytes()).hexdigest()
    quoted = OUT_NAME.replace("+", "%2B")
    anchors = re.findall(r"<a ([^>]*)>([^<]*)</a>", page)
    assert len(anchors) == 1
    attrs, text = anchors[0]
    assert text == OUT_NAME
    assert f'href="../../{quoted}#sha256={sha}"' in attrs
    assert 'data-requires-python="&lt;3.15,&gt;=3.10"' in attrs
    metadata = (dist / f"{OUT_NAME}.metadata").read_bytes()
    assert b"\nVersion: 0.26.0+hd.1\n" in metadata
    assert f'data-core-metadata="sha256={hashlib.sha256(metadata).hexdigest()}"' in attrs


def test_index_is_deterministic(dist: Path) -> None:
    write_index(dist)
    first = {p: p.read_bytes() for p in sorted((dist / "simple").rglob("*")) if p.is_file()}
    write_index(dist)
    second = {p: p.read_bytes() for p in sorted((dist / "simple").rglob("*")) if p.is_file()}
    assert first == second
    assert [p.name for p in dist.iterdir() if p.name.startswith(".")] == []


def test_index_without_wheels_fails(tmp_path: Path) -> None:
    with pytest.raises(HdError, match="no wheels to index"):
        write_index(tmp_path)


def test_pip_installs_from_the_served_index(dist: Path, served: str, tmp_path: Path) -> None:
    write_index(dist)
    target = tmp_path / "target"
    # Only our index: no pip config (this machine's has extra indexes and find-links).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--no-input",
            "--index-url",
            served,
            "--target",
            str(target),
            "vllm==0.26.0+hd.1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    version_py = (target / "vllm" / "_version.py").read_text()
    assert "__version__ = version = '0.26.0+hd.1'" in version_py
    assert (target / "vllm-0.26.0+hd.1.dist-info" / "RECORD").is_file()
    assert (target / "vllm" / "models" / "kimi_linear" / "sm90" / "__init__.py").is_file()

"""index: a PEP 503 simple repository over the wheels in dist/.

Layout (serve dist/ itself, e.g. `python3 -m http.server -d dist`, and point pip at /simple):

    dist/simple/index.html          one anchor per project
    dist/simple/<project>/index.html  one anchor per wheel: ../../<wheel>#sha256=<hex>
    dist/<wheel>.metadata           the wheel's METADATA (PEP 658), so pip resolves without
                                    downloading the ~300 MB wheel first

Hrefs are relative and percent-quoted (the `+` of a local version becomes %2B). The output
depends only on the wheels' bytes: same wheels, same files.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import html
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from hdtool.pin import HdError, Pin, sha256_file

_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def normalize(name: str) -> str:
    """PEP 503 project name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class IndexedWheel:
    filename: str
    project: str
    sha256: str
    requires_python: str | None
    metadata_sha256: str


def _read_metadata(path: Path) -> bytes:
    try:
        with zipfile.ZipFile(path) as archive:
            found = [
                n
                for n in archive.namelist()
                if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
            ]
            if len(found) != 1:
                raise HdError(f"{path}: expected one .dist-info/METADATA, found {found}")
            return archive.read(found[0])
    except (OSError, zipfile.BadZipFile) as e:
        raise HdError(f"{path}: not a readable wheel ({e})") from e


def _page(title: str, anchors: list[str]) -> str:
    body = "".join(f"    {a}<br>\n" for a in anchors)
    return (
        "<!DOCTYPE html>\n<html>\n  <head>\n"
        '    <meta name="pypi:repository-version" content="1.0">\n'
        f"    <title>{html.escape(title)}</title>\n  </head>\n  <body>\n"
        f"    <h1>{html.escape(title)}</h1>\n{body}  </body>\n</html>\n"
    )


def collect_wheels(dist: Path) -> list[IndexedWheel]:
    wheels = []
    for path in sorted(dist.glob("*.whl")):
        if path.name.startswith("."):
            continue  # a build's partial file
        match = _WHEEL_NAME.match(path.name)
        if not match:
            raise HdError(f"{path}: not a wheel file name (PEP 427)")
        metadata = _read_metadata(path)
        headers = email.parser.BytesHeaderParser().parsebytes(metadata)
        if normalize(headers["Name"] or "") != normalize(match["name"]):
            raise HdError(
                f"{path}: METADATA names {headers['Name']!r}, the file name {match['name']!r}"
            )
        wheels.append(
            IndexedWheel(
                filename=path.name,
                project=normalize(match["name"]),
                sha256=sha256_file(path),
                requires_python=headers["Requires-Python"],
                metadata_sha256=hashlib.sha256(metadata).hexdigest(),
            )
        )
    return wheels


def write_index(dist: Path) -> list[IndexedWheel]:
    """(Re)write dist/simple and the .metadata files for every wheel in dist/."""
    wheels = collect_wheels(dist)
    if not wheels:
        raise HdError(f"{dist}: no wheels to index; build one with `make build-wheel`")
    staging = Path(tempfile.mkdtemp(prefix=".simple-", dir=dist))
    staging.chmod(0o755)  # mkdtemp makes it 0700; a server may run as another user
    try:
        projects = sorted({w.project for w in wheels})
        root_links = [f'<a href="{quote(p)}/">{html.escape(p)}</a>' for p in projects]
        (staging / "index.html").write_text(_page("Simple index", root_links))
        for project in projects:
            anchors = []
            for wheel in (w for w in wheels if w.project == project):
                href = f"../../{quote(wheel.filename)}#sha256={wheel.sha256}"
                attrs = f'href="{html.escape(href)}"'
                if wheel.requires_python:
                    attrs += f' data-requires-python="{html.escape(wheel.requires_python)}"'
                meta = f"sha256={wheel.metadata_sha256}"
                attrs += f' data-core-metadata="{meta}" data-dist-info-metadata="{meta}"'
                anchors.append(f"<a {attrs}>{html.escape(wheel.filename)}</a>")
            (staging / project).mkdir()
            (staging / project / "index.html").write_text(_page(f"Links for {project}", anchors))
        for wheel in wheels:
            (dist / f"{wheel.filename}.metadata").write_bytes(_read_metadata(dist / wheel.filename))
        for stale in dist.glob("*.whl.metadata"):
            if not (dist / stale.name.removesuffix(".metadata")).is_file():
                stale.unlink()
        shutil.rmtree(dist / "simple", ignore_errors=True)
        staging.rename(dist / "simple")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return wheels


def cmd_index(args: argparse.Namespace, pin: Pin) -> int:
    wheels = write_index(pin.dist_dir)
    for wheel in wheels:
        print(f"indexed {wheel.filename} sha256={wheel.sha256}")
    print(
        f"wrote {(pin.dist_dir / 'simple').relative_to(pin.root)}/; serve it with "
        f"`python3 -m http.server -d {pin.dist_dir.relative_to(pin.root)} PORT` and use "
        "`pip install --index-url http://127.0.0.1:PORT/simple ...`"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    index = sub.add_parser("index", help="write a PEP 503 simple index of dist/ in dist/simple/")
    index.set_defaults(func=cmd_index)

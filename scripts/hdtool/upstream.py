"""`import`: the local git repository of upstream releases (build/upstream).

Branch `upstream` holds one commit per imported sdist (the whole unpacked tree, byte for byte:
no .gitignore, .gitattributes or eol rules of the tree apply) and tag v<version> marks each.
Later releases are committed on top, so `git am -3` has the pre-image blobs of older patches.

The tree goes straight from the verified tarball into `git fast-import` (nothing is unpacked
on disk), which takes a few seconds for vLLM's ~6k files. Commits are deterministic: fixed
identity, the date of the newest file in the sdist, a message naming the sdist and its sha256.
"""

from __future__ import annotations

import argparse
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import IO

from hdtool.fetch import ensure_upstream_sdist, fetch_release
from hdtool.gitutil import (
    IDENTITY_EMAIL,
    IDENTITY_NAME,
    current_branch,
    git,
    git_env,
    git_out,
    rev_exists,
)
from hdtool.pin import HdError, Pin, sha256_file

UPSTREAM_BRANCH = "upstream"

# Attributes for the whole repository, above anything the upstream tree's own .gitattributes
# says: no eol conversion, filters or ident expansion (blobs are exactly the sdist's bytes),
# and git's default whitespace/diff/merge rules (a tree cannot loosen `--whitespace=error`).
_INFO_ATTRIBUTES = """\
# Written by scripts/hd.py import; see scripts/hdtool/upstream.py.
* -text !eol -filter -ident !working-tree-encoding !whitespace !diff !merge
"""

_REPO_CONFIG = {
    "core.autocrlf": "false",
    "core.safecrlf": "false",
    "core.fileMode": "true",
    "core.quotePath": "false",
    "gc.auto": "0",
}
# No user.name/user.email here: commits a developer makes in build/upstream must carry their
# own identity (it becomes the patch's author); the tooling passes its own per command.

# HEAD of a fresh repository points here; the branch is never created.
_INITIAL_HEAD = "refs/heads/hd/none"


def ensure_repo(pin: Pin) -> Path:
    """Create build/upstream if needed (idempotent: also re-asserts config and attributes)."""
    repo = pin.upstream_repo
    fresh = not (repo / ".git").is_dir()
    if fresh:
        repo.mkdir(parents=True, exist_ok=True)
        if any(repo.iterdir()):
            raise HdError(
                f"{repo} exists, is not a git repository and is not empty; remove it "
                "(`make clean` or rm -rf) and run import again"
            )
        git("init", "-q", str(repo), cwd=repo.parent)
        git("symbolic-ref", "HEAD", _INITIAL_HEAD, cwd=repo)
    for key, value in _REPO_CONFIG.items():
        git("config", key, value, cwd=repo)
    info = repo / ".git" / "info"
    info.mkdir(exist_ok=True)
    (info / "attributes").write_text(_INFO_ATTRIBUTES)
    return repo


def _quote_path(path: str) -> str:
    """fast-import's C-style quoting, needed only for paths with '"' first or a newline."""
    if not path.startswith('"') and "\n" not in path:
        return path
    escaped = path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _member_path(member: tarfile.TarInfo, top: str | None) -> tuple[str, str]:
    """(top-level directory, path inside it) of an sdist member, refusing unsafe names."""
    name = member.name
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or name.startswith("/") or ".." in parts:
        raise HdError(f"sdist member {member.name!r} has an unsafe path")
    if any(p.lower() == ".git" for p in parts):
        raise HdError(f"sdist member {member.name!r} is inside a .git directory")
    if top is not None and parts[0] != top:
        raise HdError(f"sdist member {member.name!r} is outside the top directory {top}/")
    return parts[0], "/".join(parts[1:])


def _write_import_stream(
    out: IO[bytes], name: str, sdist: Path, version: str, sha256: str, parent: str | None
) -> int:
    """Write the fast-import commands for one sdist: its files as blobs, then one commit on
    `upstream` (on top of parent) and tag v<version>. Returns the number of files."""
    entries: dict[str, tuple[str, int]] = {}  # path -> (mode, mark)
    newest = 0
    top: str | None = None
    mark = 0
    with tarfile.open(sdist, "r:*") as tf:
        for member in tf:
            if member.isdir():
                continue
            top, path = _member_path(member, top)
            if not path:
                raise HdError(f"sdist member {member.name!r} is not inside a directory")
            if member.issym():
                mode, data = "120000", member.linkname.encode()
            elif member.isfile() or member.islnk():
                fh = tf.extractfile(member)
                if fh is None:
                    raise HdError(f"sdist member {member.name!r} cannot be read")
                data = fh.read()
                mode = "100755" if member.mode & 0o111 else "100644"
            else:
                raise HdError(f"sdist member {member.name!r} is not a file or symlink")
            mark += 1
            out.write(b"blob\nmark :%d\ndata %d\n" % (mark, len(data)))
            out.write(data)
            out.write(b"\n")
            entries[path] = (mode, mark)
            newest = max(newest, int(member.mtime))
    if not entries:
        raise HdError(f"{sdist.name} holds no files")
    when = f"{newest} +0000"
    message = (
        f"{name} {version}: upstream sdist\n\nImported unchanged from {sdist.name}\n"
        f"sha256 {sha256}\n"
    ).encode()
    commit_mark = mark + 1
    out.write(
        f"commit refs/heads/{UPSTREAM_BRANCH}\nmark :{commit_mark}\n"
        f"author {IDENTITY_NAME} <{IDENTITY_EMAIL}> {when}\n"
        f"committer {IDENTITY_NAME} <{IDENTITY_EMAIL}> {when}\n".encode()
    )
    out.write(b"data %d\n" % len(message) + message)
    if parent:
        out.write(f"from {parent}\n".encode())
    out.write(b"deleteall\n")
    for path in sorted(entries):
        mode, blob = entries[path]
        out.write(f"M {mode} :{blob} {_quote_path(path)}\n".encode())
    out.write(f"\nreset refs/tags/v{version}\nfrom :{commit_mark}\n\ndone\n".encode())
    return len(entries)


def _fast_import_sdist(
    repo: Path, name: str, sdist: Path, version: str, sha256: str
) -> tuple[str, int]:
    """Import the sdist's tree with git fast-import; (commit id, number of files).

    fast-import updates the refs only when the stream ends with `done`, so a failure half
    way leaves no branch or tag behind."""
    parent = None
    if rev_exists(repo, UPSTREAM_BRANCH):
        parent = git_out("rev-parse", UPSTREAM_BRANCH, cwd=repo)
    # stderr goes to a file, not a pipe, so fast-import can never block on it. --depth=0:
    # fast-import would only try deltas against the previous blob in the stream (an
    # unrelated file here); skipping that is ~40% faster for the same pack size.
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            ["git", "fast-import", "--quiet", "--done", "--depth=0"],
            cwd=repo,
            stdin=subprocess.PIPE,
            stderr=errors,
            env=git_env(),
        )
        assert proc.stdin is not None
        try:
            count = _write_import_stream(proc.stdin, name, sdist, version, sha256, parent)
            proc.stdin.close()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.wait() != 0:
            errors.seek(0)
            raise HdError(f"git fast-import failed:\n{errors.read().decode(errors='replace')}")
    return git_out("rev-parse", f"v{version}^{{commit}}", cwd=repo), count


def import_sdist(pin: Pin, version: str, sdist: Path, sha256: str) -> tuple[str, bool]:
    """Import one verified sdist as v<version>; (commit, whether anything was imported)."""
    repo = ensure_repo(pin)
    tag = f"v{version}"
    if rev_exists(repo, tag):
        return git_out("rev-parse", f"{tag}^{{commit}}", cwd=repo), False
    actual = sha256_file(sdist)
    if actual != sha256:
        raise HdError(f"{sdist} changed since it was verified (sha256 {actual}); fetch again")
    if current_branch(repo) == UPSTREAM_BRANCH:
        # fast-import moves the branch under a checked-out work tree; step off it first.
        git("checkout", "-q", "--detach", cwd=repo)
    was_unborn = not rev_exists(repo, "HEAD")
    commit, count = _fast_import_sdist(repo, pin.upstream_name, sdist, version, sha256)
    if was_unborn:
        # Give the fresh repository a work tree to look at; apply switches branches anyway.
        git("checkout", "-q", "--detach", tag, cwd=repo)
    print(f"import: {sdist.name}: {count} files")
    return commit, True


def tag_import_commit(repo: Path, tag: str, sdist_name: str, sha256: str) -> str:
    """The commit of ``tag``, checked to be the import of the sdist of this sha256 (its
    message names it): a tag moved by hand, or a build/upstream copied from elsewhere,
    must not stand in for a verified release."""
    commit = git_out("rev-parse", f"{tag}^{{commit}}", cwd=repo)
    message = git_out("log", "-1", "--format=%B", commit, cwd=repo)
    if f"sha256 {sha256}" not in message:
        raise HdError(
            f"{tag} in {repo} is not the import of {sdist_name} (sha256 {sha256}); its "
            f"commit says:\n{message}\nNothing was changed. Remove the tag "
            f"(git -C {repo} tag -d {tag}) and run again: the verified sdist is imported anew."
        )
    return commit


def imported_commit(pin: Pin, version: str) -> str:
    """The commit of v<version> in build/upstream; for the pinned version, checked to be
    the import of the pinned sdist."""
    if version == pin.upstream_version:
        return tag_import_commit(pin.upstream_repo, f"v{version}", pin.sdist, pin.sdist_sha256)
    return git_out("rev-parse", f"v{version}^{{commit}}", cwd=pin.upstream_repo)


def ensure_imported(pin: Pin, version: str | None = None) -> str:
    """Make sure v<version> (default: the pin) is in build/upstream; returns its commit."""
    version = version or pin.upstream_version
    repo = pin.upstream_repo
    if (repo / ".git").is_dir() and rev_exists(repo, f"v{version}"):
        return imported_commit(pin, version)
    commit, _ = import_sdist(pin, version, *_verified_sdist(pin, version))
    return commit


def _verified_sdist(pin: Pin, version: str) -> tuple[Path, str]:
    """(path, sha256) of version's sdist in the cache, fetched and verified if needed."""
    if version == pin.upstream_version:
        return ensure_upstream_sdist(pin), pin.sdist_sha256
    release = fetch_release(pin, version)
    return release.sdist, release.sdist_sha256


def _cmd_import(args: argparse.Namespace, pin: Pin) -> int:
    started = time.monotonic()
    version = args.version or pin.upstream_version
    repo = pin.upstream_repo
    if (repo / ".git").is_dir() and rev_exists(repo, f"v{version}"):
        commit, imported = imported_commit(pin, version), False
    else:
        commit, imported = import_sdist(pin, version, *_verified_sdist(pin, version))
    if imported:
        print(
            f"import: {pin.upstream_name} {version} -> {repo} branch {UPSTREAM_BRANCH}, "
            f"tag v{version} ({commit[:12]}) in {time.monotonic() - started:.1f} s"
        )
    else:
        print(f"import: v{version} is already in {repo} ({commit[:12]}); nothing to do")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        help="commit the pinned upstream sdist into build/upstream (branch upstream, tag)",
        description="Keep build/upstream, a git repository with branch `upstream` holding one "
        "commit per imported upstream sdist and a tag v<version> for each. Fetches the sdist "
        "first if needed. Importing a version that is already there does nothing.",
    )
    p.add_argument("--version", help="import another upstream release (e.g. for a rebase)")
    p.set_defaults(func=_cmd_import)

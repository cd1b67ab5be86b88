"""Running git for the tooling: a clean, reproducible environment and one error type.

Every git call here ignores the user's system and global config (so an `am.threeWay`,
`apply.ignoreWhitespace`, `diff.noprefix` or `format.*` setting cannot change what apply and
export do), speaks English (we read its messages), and uses the project's fixed identity.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from hdtool.pin import HdError

IDENTITY_NAME = "vllm-hopper-decode"
IDENTITY_EMAIL = "hd-tooling@invalid"

# Config passed on every call; wins over anything the repository's own config says.
_FIXED_CONFIG = (
    "core.autocrlf=false",
    "core.safecrlf=false",
    "core.quotePath=false",
    "am.threeWay=false",
    "am.keepcr=true",
    "apply.ignoreWhitespace=no",
    "apply.whitespace=error",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.algorithm=myers",
    "commit.gpgSign=false",
    "tag.gpgSign=false",
    "gc.auto=0",
    "advice.detachedHead=false",
)


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for git: inherited minus every GIT_* variable, plus fixed settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        GIT_EDITOR="true",
        GIT_PAGER="cat",
        LC_ALL="C",
        LANGUAGE="C",
        GIT_AUTHOR_NAME=IDENTITY_NAME,
        GIT_AUTHOR_EMAIL=IDENTITY_EMAIL,
        GIT_COMMITTER_NAME=IDENTITY_NAME,
        GIT_COMMITTER_EMAIL=IDENTITY_EMAIL,
    )
    if extra:
        env.update(extra)
    return env


def git(
    *args: str,
    cwd: Path,
    input: bytes | None = None,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run `git args...` in cwd; raise HdError with git's stderr when check and it fails."""
    cmd = ["git"]
    for item in _FIXED_CONFIG:
        cmd += ["-c", item]
    cmd += list(args)
    try:
        # No input: stdin is /dev/null, so git can never wait on the terminal.
        stdin = subprocess.DEVNULL if input is None else None
        proc = subprocess.run(
            cmd, cwd=cwd, input=input, stdin=stdin, capture_output=True, env=git_env(env)
        )
    except FileNotFoundError as e:
        raise HdError("git is not installed (needed by the patch-set tooling)") from e
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).decode(errors="replace").strip()
        raise HdError(f"git {' '.join(args[:3])} failed in {cwd}:\n{msg}")
    return proc


def git_out(*args: str, cwd: Path, input: bytes | None = None) -> str:
    """Run git and return its stdout as text (stripped of the final newline)."""
    return git(*args, cwd=cwd, input=input).stdout.decode().rstrip("\n")


def rev_exists(repo: Path, rev: str) -> bool:
    proc = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", cwd=repo, check=False)
    return proc.returncode == 0


def git_dir(repo: Path) -> Path:
    return repo / ".git"


def am_in_progress(repo: Path) -> bool:
    return (git_dir(repo) / "rebase-apply" / "applying").exists()


def other_operation_in_progress(repo: Path) -> str | None:
    """Name of a rebase/merge/cherry-pick/revert in progress in repo, if any."""
    gd = git_dir(repo)
    if (gd / "rebase-apply").is_dir() and not (gd / "rebase-apply" / "applying").exists():
        return "rebase"
    if (gd / "rebase-merge").is_dir():
        return "rebase"
    for name, what in (
        ("MERGE_HEAD", "merge"),
        ("CHERRY_PICK_HEAD", "cherry-pick"),
        ("REVERT_HEAD", "revert"),
    ):
        if (gd / name).exists():
            return what
    return None


def dirty_paths(repo: Path) -> list[str]:
    """Modified, staged or untracked (not ignored) paths in repo's work tree."""
    out = git("status", "--porcelain=v1", "-z", "--untracked-files=all", cwd=repo).stdout
    entries = out.decode(errors="replace").split("\0")
    paths: list[str] = []
    skip_next = False
    for entry in entries:
        if skip_next:  # the source path of a rename/copy entry
            skip_next = False
            continue
        if not entry:
            continue
        status, path = entry[:2], entry[3:]
        if status[0] in "RC":
            skip_next = True
        paths.append(f"{status} {path}")
    return paths


def current_branch(repo: Path) -> str | None:
    proc = git("symbolic-ref", "--quiet", "--short", "HEAD", cwd=repo, check=False)
    return proc.stdout.decode().strip() if proc.returncode == 0 else None

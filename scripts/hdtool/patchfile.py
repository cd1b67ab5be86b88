"""The patch series on disk: patches/series, the format-patch files, their names and paths.

Shared by apply/export/lint (series.py) and the wheel build. Parsing goes through git's own
mailsplit/mailinfo so that what we check is exactly what `git am` will see.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hdtool.gitutil import git
from hdtool.pin import HdError, Pin

SERIES_FILE = "series"
PATCH_SUFFIX = ".patch"
# git format-patch's --filename-max-length (its default); export passes it explicitly.
FILENAME_MAX_LENGTH = 64
# The mbox separator `git format-patch --zero-commit` writes.
ZERO_FROM_LINE = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001"
_MBOX_FROM = re.compile(r"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$", re.MULTILINE)
_TITLE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._")
_VALID_NAME = re.compile(r"^[A-Za-z0-9._-]+\.patch$")


# --- series ---------------------------------------------------------------------------------


def parse_series_text(text: str) -> tuple[list[str], list[str]]:
    """(names in order, problems) for the contents of patches/series.

    The file holds one patch file name per line and nothing else; export writes it that way,
    so anything else would also show up as drift.
    """
    problems: list[str] = []
    names: list[str] = []
    if text and not text.endswith("\n"):
        problems.append("series: the last line has no newline")
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not _VALID_NAME.match(line):
            problems.append(
                f"series:{lineno}: {line!r} is not a patch file name "
                "(one `<subject-slug>.patch` per line, no blanks or comments)"
            )
            continue
        if line in seen:
            problems.append(f"series:{lineno}: {line} is listed twice")
            continue
        seen.add(line)
        names.append(line)
    return names, problems


def read_series(pin: Pin) -> list[str]:
    """Patch file names from patches/series, in order; HdError if the file is malformed."""
    path = pin.patches_dir / SERIES_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise HdError(f"{path} does not exist (an empty file means: no patches)") from e
    names, problems = parse_series_text(text)
    if problems:
        raise HdError(f"{path} is malformed:\n  " + "\n  ".join(problems))
    return names


def series_paths(pin: Pin) -> list[Path]:
    """The patch files of the series, in order; HdError naming any that are missing."""
    names = read_series(pin)
    paths = [pin.patches_dir / name for name in names]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise HdError("patches/series lists files that do not exist: " + ", ".join(missing))
    return paths


# --- names ----------------------------------------------------------------------------------


def subject_slug(subject: str) -> str:
    """git's sanitized subject (format-patch file names, `%f`).

    Runs of characters outside [A-Za-z0-9._] become one '-', leading ones are dropped, '..'
    collapses to '.', and trailing '.'/'-' are trimmed (git's format_sanitized_subject).
    """
    out: list[str] = []
    state = 2  # 2: nothing written yet, 1: separator pending, 0: inside a word
    text = subject.replace("\n", " ")
    i = 0
    while i < len(text):
        ch = text[i]
        if ch in _TITLE_CHARS:
            if state == 1:
                out.append("-")
            state = 0
            out.append(ch)
            if ch == ".":
                while i + 1 < len(text) and text[i + 1] == ".":
                    i += 1
        else:
            state |= 1
        i += 1
    return "".join(out).rstrip(".-")


def patch_filename(subject: str) -> str:
    """The file name export gives a commit with this subject.

    git format-patch names it NNNN-<slug>.patch cut to FILENAME_MAX_LENGTH; we drop the
    NNNN- (order lives in series) but keep git's cut so the two agree.
    """
    numbered = ("0001-" + subject_slug(subject))[: FILENAME_MAX_LENGTH - len(PATCH_SUFFIX) - 1]
    return numbered[len("0001-") :] + PATCH_SUFFIX


# --- one patch file -------------------------------------------------------------------------


@dataclass(frozen=True)
class PatchFile:
    path: Path
    messages: int  # mbox messages in the file (a series file must hold exactly one)
    first_line: str
    author: str
    email: str
    subject: str
    date: str
    message: str  # the commit message body (after the subject), as git am will record it
    diff: str  # the patch part (what git apply sees)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def file_changes(self) -> list[FileChange]:
        return parse_diff_paths(self.diff)

    @property
    def paths(self) -> list[str]:
        """Every path the patch names (old and new sides), in order, without duplicates."""
        seen: dict[str, None] = {}
        for change in self.file_changes:
            for p in (change.old_path, change.new_path):
                if p is not None:
                    seen.setdefault(p, None)
        return list(seen)


def parse_patch(path: Path) -> PatchFile:
    """Split and parse a format-patch file with git mailsplit + mailinfo (as git am does)."""
    data = path.read_bytes()
    text = data.decode("utf-8", errors="replace")
    first_line = text.split("\n", 1)[0]
    if not data.startswith(b"From "):
        # Not an mbox at all; mailsplit would only say "corrupt mailbox".
        return PatchFile(path, 0, first_line, "", "", "", "", "", "")
    with tempfile.TemporaryDirectory(prefix="hd-patch-") as tmp:
        tmpdir = Path(tmp)
        split = tmpdir / "split"
        split.mkdir()
        proc = git("mailsplit", "--keep-cr", f"-o{split}", str(path), cwd=tmpdir, check=False)
        if proc.returncode != 0:
            raise HdError(f"{path.name}: git mailsplit cannot read it: {proc.stderr.decode()}")
        parts = sorted(split.iterdir())
        messages = len(parts)
        if not parts:
            return PatchFile(path, 0, first_line, "", "", "", "", "", "")
        msg_file, patch_file = tmpdir / "msg", tmpdir / "patch"
        info = git(
            "mailinfo",
            "-k",
            str(msg_file),
            str(patch_file),
            cwd=tmpdir,
            input=parts[0].read_bytes(),
            check=False,
        )
        if info.returncode != 0:
            raise HdError(f"{path.name}: git mailinfo cannot read it: {info.stderr.decode()}")
        fields: dict[str, str] = {}
        for line in info.stdout.decode("utf-8", errors="replace").splitlines():
            key, _, value = line.partition(": ")
            fields[key] = value
        message = msg_file.read_text(encoding="utf-8", errors="replace")
        diff = patch_file.read_text(encoding="utf-8", errors="replace")
    return PatchFile(
        path=path,
        messages=messages,
        first_line=first_line,
        author=fields.get("Author", ""),
        email=fields.get("Email", ""),
        subject=fields.get("Subject", ""),
        date=fields.get("Date", ""),
        message=message,
        diff=diff,
    )


# --- paths inside a diff --------------------------------------------------------------------


@dataclass(frozen=True)
class FileChange:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    diff_line: int  # 1-based line of its `diff --git` header within the patch text


_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def unquote_c_path(text: str) -> str:
    """Undo git's C-style quoting of a path ("a/\\303\\244.py" -> a/ä.py)."""
    if not (len(text) >= 2 and text.startswith('"') and text.endswith('"')):
        return text
    body = text[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode()
            i += 1
            continue
        nxt = body[i + 1 : i + 2]
        if nxt in _C_ESCAPES:
            out.append(_C_ESCAPES[nxt])
            i += 2
        elif re.match(r"[0-7]{3}", body[i + 1 : i + 4]):
            out.append(int(body[i + 1 : i + 4], 8))
            i += 4
        else:
            raise HdError(
                f"bad escape in the quoted path {text!r} of a patch's diff header; "
                "regenerate the patch with git format-patch"
            )
    return out.decode("utf-8", errors="surrogateescape")


def _strip_prefix(path: str, prefix: str) -> str | None:
    if path == "/dev/null":
        return None
    path = unquote_c_path(path.rstrip("\t"))
    return path[len(prefix) :] if path.startswith(prefix) else path


_QUOTED = r'"(?:[^"\\]|\\.)*"'


def _split_diff_git(rest: str) -> tuple[str, str]:
    """Both paths of a `diff --git <a> <b>` header (either side may be C-quoted)."""
    for pattern in (
        rf"({_QUOTED}) ({_QUOTED})",
        rf"({_QUOTED}) (\S.*)",
        rf"(.*\S) ({_QUOTED})",
    ):
        m = re.fullmatch(pattern, rest)
        if m:
            return unquote_c_path(m[1]), unquote_c_path(m[2])
    # Unquoted: git only leaves a header ambiguous (spaces in names) when both sides are the
    # same name; renames and copies carry their own header lines, which win below.
    half = (len(rest) - 1) // 2
    return rest[:half], rest[half + 1 :]


def parse_diff_paths(diff: str) -> list[FileChange]:
    """One FileChange per `diff --git` section, from its extended header lines."""
    changes: list[FileChange] = []
    lines = diff.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("diff --git "):
            i += 1
            continue
        header_line = i + 1
        a, b = _split_diff_git(line[len("diff --git ") :])
        old: str | None = a[2:] if a.startswith("a/") else a
        new: str | None = b[2:] if b.startswith("b/") else b
        i += 1
        while i < len(lines) and not lines[i].startswith(("diff --git ", "@@ ")):
            head = lines[i]
            if head.startswith("new file mode"):
                old = None
            elif head.startswith("deleted file mode"):
                new = None
            elif head.startswith(("rename from ", "copy from ")):
                old = unquote_c_path(head.split(" ", 2)[2])
            elif head.startswith(("rename to ", "copy to ")):
                new = unquote_c_path(head.split(" ", 2)[2])
            elif head.startswith("--- "):
                old = _strip_prefix(head[4:], "a/")
            elif head.startswith("+++ "):
                new = _strip_prefix(head[4:], "b/")
            elif head.startswith(("GIT binary patch", "Binary files ")):
                break
            i += 1
        changes.append(FileChange(old, new, header_line))
    return changes


def path_problem(path: str) -> str | None:
    """Why a path named in a patch is unacceptable (absolute, escaping, into .git), or None."""
    if path.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", path):
        return "is absolute"
    parts = path.split("/")
    if ".." in parts:
        return "contains '..'"
    if any(part.lower() == ".git" for part in parts):
        return "is inside .git"
    if "" in parts or "." in parts:
        return "is not a normalized relative path"
    return None

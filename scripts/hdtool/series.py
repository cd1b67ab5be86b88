"""`apply`, `export` and `lint` of the patch series (patches/series) against build/upstream.

apply:  branch hd/<version>-wip from tag v<version>, `git am` every patch strictly (full
        context, no 3-way, --whitespace=error), then ONE commit adding vllm_overlay/, kernels/
        and the build-info module, and only then move hd/<version> there. A failed patch
        leaves the am session on the -wip branch (hd/<version> untouched) with a report.
export: the inverse: `git format-patch` each commit between the tag and the branch (minus the
        overlay commit) into patches/, rewriting series; --check compares instead of writing.
lint:   the series file and the directory agree; each patch is one format-patch message
        named after its subject, carrying Why / Upstream-Status / Removal-Plan, and touching
        no path the overlay commit owns.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hdtool.buildinfo import build_info_source
from hdtool.gitutil import (
    am_in_progress,
    current_branch,
    dirty_paths,
    git,
    git_dir,
    git_out,
    other_operation_in_progress,
    rev_exists,
)
from hdtool.overlay import collisions, is_reserved, overlay_plan, reserved_paths
from hdtool.patchfile import (
    FILENAME_MAX_LENGTH,
    PATCH_SUFFIX,
    SERIES_FILE,
    ZERO_FROM_LINE,
    PatchFile,
    parse_diff_paths,
    parse_patch,
    parse_series_text,
    patch_filename,
    path_problem,
    read_series,
    series_paths,
)
from hdtool.pin import HdError, Pin
from hdtool.upstream import ensure_imported

OVERLAY_SUBJECT = "hd-overlay: vllm_overlay + kernels + build info"
# What the last apply or export left, per applied branch (in the upstream repo's git dir):
# the branch's tip and a digest of the series it matched. apply refuses to rebuild a
# branch that moved since (commits not exported yet), export to overwrite a series that
# changed since (edits not applied yet).
SYNC_RECORD = "hd-synced.json"

# `git am` exactly as the series is meant to apply: every context line must match (git's
# default; no -C), no 3-way fallback, no whitespace leniency and new whitespace errors fail.
AM_OPTIONS = (
    "--keep",  # the subject is the patch's Subject (format-patch --keep-subject)
    "--keep-cr",  # bytes as in the patch file, CRs included
    "--no-3way",
    "--whitespace=error",
    "--no-scissors",
    "--committer-date-is-author-date",  # reproducible commit ids for the same series
)

# `git format-patch` options for byte-stable patch files (the project's canonical format).
FORMAT_PATCH_OPTIONS = (
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-stat",
    "--keep-subject",
    "--no-numbered",
    "--no-thread",
    "--no-cover-letter",
    "--no-base",
    "--no-notes",
    "--encode-email-headers",
    "--find-renames",
    "--no-ext-diff",
    "--src-prefix=a/",
    "--dst-prefix=b/",
    "--diff-algorithm=myers",
    f"--filename-max-length={FILENAME_MAX_LENGTH}",
)

_UPSTREAM_STATUS = re.compile(r"^(pending|submitted https?://\S+|not-needed \S.*|backport \S.*)$")


# --- shared helpers -------------------------------------------------------------------------


def wip_branch(pin: Pin) -> str:
    return f"{pin.applied_branch}-wip"


def _rel(path: Path) -> str:
    """path as users should type it: relative when below the current directory."""
    path = Path(os.path.abspath(path))
    try:
        return path.relative_to(Path.cwd()).as_posix() or "."
    except ValueError:
        return str(path)


def hd_command(pin: Pin, command: str) -> str:
    """How to run an hd.py command for this project from the current directory."""
    script = pin.root / "scripts" / "hd.py"
    this_script = Path(__file__).resolve().parent.parent / "hd.py"
    if script.resolve() == this_script:
        return f"python3 {_rel(script)} {command}"
    return f"python3 {_rel(this_script)} --root {_rel(pin.root)} {command}"


def _require_clean_repo(pin: Pin, action: str) -> Path:
    repo = pin.upstream_repo
    if am_in_progress(repo):
        raise HdError(
            f"a `git am` is in progress in {_rel(repo)} (a patch of an earlier apply failed).\n"
            f"Finish it:  git -C {_rel(repo)} am --continue (after fixing the patch), "
            f"then {hd_command(pin, 'export')}\n"
            f"or drop it: git -C {_rel(repo)} am --abort\n"
            f"then run {action} again."
        )
    other = other_operation_in_progress(repo)
    if other:
        raise HdError(
            f"a git {other} is in progress in {_rel(repo)}; finish or abort it "
            f"(git -C {_rel(repo)} {other} --continue / --abort), then run {action} again"
        )
    dirty = dirty_paths(repo)
    if dirty:
        shown = "\n  ".join(dirty[:20]) + ("\n  ..." if len(dirty) > 20 else "")
        raise HdError(
            f"{_rel(repo)} has uncommitted changes ({action} refuses to touch them):\n  {shown}\n"
            "If they belong in the series, commit them below the hd-overlay commit and run "
            f"{hd_command(pin, 'export')}; to throw them away: "
            f"git -C {_rel(repo)} reset --hard && git -C {_rel(repo)} clean -fd"
        )
    return repo


def _tree_files(repo: Path, rev: str) -> set[str]:
    out = git("ls-tree", "-r", "-z", "--name-only", rev, cwd=repo).stdout.decode(
        "utf-8", errors="surrogateescape"
    )
    return {p for p in out.split("\0") if p}


# --- apply ----------------------------------------------------------------------------------


@dataclass
class PatchOutcome:
    name: str
    status: str  # "applied", "FAILED", "not attempted"
    files: list[str]
    errors: list[str]


_FILE_ERRORS = (
    re.compile(r"^error: patch failed: (.+):\d+$"),
    re.compile(
        r"^error: (.+): (patch does not apply|already exists in (working directory|index)"
        r"|does not exist in index|No such file or directory|does not match index"
        r"|wrong type|has type \S+, expected \S+)$"
    ),
)
_WHITESPACE_ERROR = re.compile(r"^\.git/rebase-apply/patch:(\d+): ")
_NOISE = re.compile(
    r"^(Applying: |hint: |Patch failed at |When you have resolved|If you prefer to skip"
    r"|To restore the original|Use 'git am --show-current-patch)"
)


def _file_at_line(patch_text: str, lineno: int) -> str | None:
    """The file whose diff section contains line `lineno` of a patch."""
    sections = [c for c in parse_diff_paths(patch_text) if c.diff_line <= lineno]
    if not sections:
        return None
    last = sections[-1]
    return last.new_path or last.old_path


def _failure_details(repo: Path, output: str, patch: PatchFile) -> tuple[list[str], list[str]]:
    """(files, git's error lines) of a failed `git am`."""
    errors: list[str] = []
    files: list[str] = []
    current_patch = repo / ".git" / "rebase-apply" / "patch"
    patch_text = current_patch.read_text(errors="replace") if current_patch.exists() else ""
    for line in output.splitlines():
        if not line.strip() or _NOISE.match(line):
            continue
        errors.append(line)
        for pattern in _FILE_ERRORS:
            m = pattern.match(line)
            if m and m[1] not in files:
                files.append(m[1])
        m = _WHITESPACE_ERROR.match(line)
        if m:
            path = _file_at_line(patch_text, int(m[1]))
            if path and path not in files:
                files.append(path)
    if not files:
        files = patch.paths
    return files, errors


def _report_failure(pin: Pin, outcomes: list[PatchOutcome], failed: PatchOutcome) -> str:
    repo = _rel(pin.upstream_repo)
    export, apply = hd_command(pin, "export"), hd_command(pin, "apply")
    width = max(len(export), len(apply), len(f"git -C {repo} am --continue"))
    lines = ["", "apply FAILED:"]
    lines += _outcome_lines(outcomes)
    lines += [
        "",
        f"{pin.applied_branch} was not changed. {repo} is on branch {wip_branch(pin)} with "
        f"`git am` stopped at {failed.name}; the patches before it are committed there, "
        "nothing of the failed one is in the tree.",
        "",
        "To fix the series by hand (from this directory):",
        f"  {f'git -C {repo} am --show-current-patch=diff':<{width}}  # what did not apply",
        f"  # edit the files named above in {repo}/ to make that change, then",
        f"  #   git -C {repo} add <files>",
        "  # or let git merge it using the pre-image blobs and resolve the conflict markers:",
        f"  #   git -C {repo} apply --3way .git/rebase-apply/patch",
        f"  {f'git -C {repo} am --continue':<{width}}  # commits it, applies the rest",
        f"  {export:<{width}}  # writes the fixed patches to patches/",
        f"  {apply:<{width}}  # re-applies the series strictly",
        "To give up instead:",
        f"  git -C {repo} am --abort",
    ]
    return "\n".join(lines)


def _outcome_lines(outcomes: list[PatchOutcome]) -> list[str]:
    lines = []
    width = len(str(len(outcomes)))
    for i, outcome in enumerate(outcomes, 1):
        lines.append(f"  {i:>{width}} {outcome.status:<13} {outcome.name}")
        if outcome.status == "FAILED":
            pad = " " * (width + 17)
            lines.append(f"{pad}files: {', '.join(outcome.files) or '(none named)'}")
            for err in outcome.errors:
                lines.append(f"{pad}git: {err}")
    return lines


def _copy_file(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    executable = src.stat().st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    dest.chmod(0o755 if executable else 0o644)


def _commit_overlay(pin: Pin, repo: Path, plan: dict[str, Path]) -> str:
    """Write overlay + kernels + build info into the work tree and commit them as one."""
    for target, src in plan.items():
        _copy_file(src, repo / target)
    info_path = repo / pin.build_info_module
    info_path.parent.mkdir(parents=True, exist_ok=True)
    info_path.write_text(build_info_source(pin), encoding="utf-8")
    paths = sorted([*plan, pin.build_info_module])
    git(
        "add",
        "-f",
        "--pathspec-from-file=-",
        "--pathspec-file-nul",
        cwd=repo,
        input="\0".join(paths).encode(),
    )
    # The commit's date is the previous commit's, so the same inputs give the same commit id.
    date = git_out("log", "-1", "--format=%cI", "HEAD", cwd=repo)
    n_kernels = sum(1 for t in plan if t.startswith(pin.kernels_dest.strip("/") + "/"))
    body = (
        f"vllm_overlay/: {len(plan) - n_kernels} files; kernels/ -> {pin.kernels_dest}: "
        f"{n_kernels} files; {pin.build_info_module} generated.\n"
        "Added by scripts/hd.py apply; export leaves this commit out."
    )
    git(
        "commit",
        "-q",
        "--no-verify",
        "-m",
        OVERLAY_SUBJECT,
        "-m",
        body,
        cwd=repo,
        env={"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date},
    )
    return git_out("rev-parse", "HEAD", cwd=repo)


def series_digest(pin: Pin) -> str:
    """sha256 over patches/series and the patch files it lists (unlisted files are not
    part of the series: export removes them)."""

    def read(name: str) -> bytes:
        path = pin.patches_dir / name
        return path.read_bytes() if path.is_file() else b""

    series = read(SERIES_FILE)
    names, _ = parse_series_text(series.decode("utf-8", errors="replace"))
    digest = hashlib.sha256()
    for name in (SERIES_FILE, *names):
        data = series if name == SERIES_FILE else read(name)
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def _sync_records(repo: Path) -> dict[str, dict[str, str]]:
    try:
        records = json.loads((git_dir(repo) / SYNC_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _record_sync(pin: Pin, repo: Path, tip: str | None) -> None:
    """Remember the applied branch's tip (None: keep the recorded one) and the series."""
    records = _sync_records(repo)
    entry = records.get(pin.applied_branch, {})
    if tip is not None:
        entry["tip"] = tip
    entry["series_sha256"] = series_digest(pin)
    records[pin.applied_branch] = entry
    path = git_dir(repo) / SYNC_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _refuse_unexported_commits(pin: Pin, repo: Path) -> None:
    """apply rebuilds the applied branch from patches/: refuse while it holds commits the
    last apply or export did not leave there (they would only survive in the reflog)."""
    branch = pin.applied_branch
    recorded = _sync_records(repo).get(branch, {}).get("tip")
    if not recorded or not rev_exists(repo, branch):
        return
    tip = git_out("rev-parse", branch, cwd=repo)
    if tip == recorded:
        return
    r = _rel(repo)
    raise HdError(
        f"{branch} in {r} has moved since the last apply or export (now {tip[:12]}, "
        f"then {recorded[:12]}): its commits are not in patches/, and apply would replace "
        f"the branch. Nothing was changed.\n"
        f"Keep them: {hd_command(pin, 'export')} (writes them to patches/), then apply.\n"
        f"Drop them: git -C {r} branch rescue {tip[:12]} (to keep a copy), then "
        f"git -C {r} checkout -q {branch} && git -C {r} reset -q --hard {recorded[:12]}, "
        "then apply."
    )


def apply_series(pin: Pin) -> int:
    started = time.monotonic()
    names = read_series(pin)
    paths = series_paths(pin)
    patches = [parse_patch(p) for p in paths]
    for patch in patches:
        if patch.messages != 1 or not patch.diff.strip():
            raise HdError(
                f"{patch.name} is not one format-patch message with a diff "
                f"({patch.messages} messages); run {hd_command(pin, 'lint')}"
            )
    tag = pin.upstream_tag
    ensure_imported(pin)
    repo = _require_clean_repo(pin, "apply")
    _refuse_unexported_commits(pin, repo)

    plan = overlay_plan(pin)
    touched = {p for patch in patches for p in patch.paths}
    clashes = collisions(pin, _tree_files(repo, tag) | touched)
    if clashes:
        raise HdError(
            "the overlay would overwrite upstream or patched files; nothing was applied:\n  "
            + "\n  ".join(clashes)
            + "\nRename the overlay file, or change the upstream file through a patch instead."
        )

    wip = wip_branch(pin)
    previous_wip = git_out("rev-parse", wip, cwd=repo) if rev_exists(repo, wip) else None
    tag_commit = git_out("rev-parse", f"{tag}^{{commit}}", cwd=repo)
    git("checkout", "-q", "-B", wip, tag, cwd=repo)
    if previous_wip and previous_wip != tag_commit:
        print(
            f"apply: note: replaced {wip} (was {previous_wip[:12]}; "
            f"`git -C {_rel(repo)} branch rescue {previous_wip[:12]}` brings it back)"
        )

    outcomes = [PatchOutcome(name, "not attempted", [], []) for name in names]
    if paths:
        proc = git("am", *AM_OPTIONS, *[str(p) for p in paths], cwd=repo, check=False)
        if proc.returncode != 0:
            output = (proc.stdout + proc.stderr).decode(errors="replace")
            if not am_in_progress(repo):
                raise HdError(f"git am failed before applying anything:\n{output}")
            failed_index = int((repo / ".git" / "rebase-apply" / "next").read_text()) - 1
            for outcome in outcomes[:failed_index]:
                outcome.status = "applied"
            failed = outcomes[failed_index]
            failed.status = "FAILED"
            failed.files, failed.errors = _failure_details(repo, output, patches[failed_index])
            print(_report_failure(pin, outcomes, failed))
            raise HdError(
                f"{failed.name} did not apply (patch {failed_index + 1} of {len(names)}); "
                f"{pin.applied_branch} is unchanged, see the report above"
            )
    for outcome in outcomes:
        outcome.status = "applied"

    overlay_commit = _commit_overlay(pin, repo, plan)
    git("checkout", "-q", "-B", pin.applied_branch, cwd=repo)
    git("branch", "-q", "-D", wip, cwd=repo)
    _record_sync(pin, repo, overlay_commit)

    n_kernels = sum(1 for t in plan if t.startswith(pin.kernels_dest.strip("/") + "/"))
    print(f"apply: {tag} + {len(names)} patches -> {pin.applied_branch} in {_rel(repo)}")
    for line in _outcome_lines(outcomes):
        print(line)
    print(
        f"apply: overlay commit {overlay_commit[:12]}: {len(plan) - n_kernels} overlay files, "
        f"{n_kernels} kernel files -> {pin.kernels_dest}, {pin.build_info_module}"
    )
    print(f"apply: done in {time.monotonic() - started:.1f} s")
    return 0


# --- export ---------------------------------------------------------------------------------


def _export_source(pin: Pin) -> tuple[Path, str, list[str]]:
    """(repo, branch, patch commits oldest first) to export, after checking the history."""
    repo = pin.upstream_repo
    tag = pin.upstream_tag
    how = f"run `make apply` ({hd_command(pin, 'apply')}) first"
    if not (repo / ".git").is_dir() or not rev_exists(repo, tag):
        raise HdError(f"{_rel(repo)} has no {tag}: nothing to export; {how}")
    _require_clean_repo(pin, "export")
    wip = wip_branch(pin)
    branch = wip if current_branch(repo) == wip else pin.applied_branch
    if not rev_exists(repo, branch):
        raise HdError(f"{_rel(repo)} has no branch {branch}: nothing to export; {how}")
    if git("merge-base", "--is-ancestor", tag, branch, cwd=repo, check=False).returncode:
        raise HdError(f"{branch} is not based on {tag}; re-create it with {how[4:]}")
    merges = git_out("rev-list", "--merges", f"{tag}..{branch}", cwd=repo)
    if merges:
        raise HdError(
            f"{branch} has merge commits; the series must be linear: {merges.split()[0][:12]}"
        )
    log = git_out("log", "--reverse", "--format=%H%x09%s", f"{tag}..{branch}", cwd=repo)
    commits = [line.split("\t", 1) for line in log.splitlines() if line]
    overlay_positions = [i for i, (_, subject) in enumerate(commits) if subject == OVERLAY_SUBJECT]
    if branch == pin.applied_branch and overlay_positions != [len(commits) - 1]:
        raise HdError(
            f"the top commit of {branch} must be the one `{OVERLAY_SUBJECT}` commit "
            f"(found it at {[p + 1 for p in overlay_positions]} of {len(commits)}).\n"
            "Commit changes below it, e.g. commit on top, then "
            f"`git -C {_rel(repo)} rebase -i {tag}` and move the hd-overlay line last."
        )
    if branch == wip and overlay_positions not in ([], [len(commits) - 1]):
        raise HdError(f"{wip} has an hd-overlay commit that is not on top; move it last")
    patch_commits = [sha for i, (sha, _) in enumerate(commits) if i not in overlay_positions]
    if branch == wip and not patch_commits and read_series(pin):
        raise HdError(
            f"{wip} (the branch of an interrupted apply) holds no patches, so exporting it "
            "would empty patches/ (was the `git am` aborted?). Run "
            f"{hd_command(pin, 'apply')} again, or switch back: "
            f"git -C {_rel(repo)} checkout {pin.applied_branch}"
        )

    exact, prefixes = reserved_paths(pin)
    for sha, subject in commits:
        if sha not in patch_commits:
            continue
        out = git(
            "diff-tree",
            "--no-commit-id",
            "-r",
            "-z",
            "--name-only",
            "--no-renames",
            sha,
            cwd=repo,
        ).stdout.decode("utf-8", errors="surrogateescape")
        touched = [p for p in out.split("\0") if p]
        if not touched:
            raise HdError(f"commit {sha[:12]} ({subject}) changes nothing; drop it")
        owned = [p for p in touched if is_reserved(p, exact, prefixes)]
        if owned:
            raise HdError(
                f"commit {sha[:12]} ({subject}) touches files the overlay commit owns:\n  "
                + "\n  ".join(owned)
                + "\nChange them in vllm_overlay/ or kernels/ instead, and drop them from "
                "the commit."
            )
    return repo, branch, patch_commits


def _format_patches(pin: Pin, repo: Path, commits: list[str], outdir: Path) -> list[str]:
    """Write one canonical patch file per commit into outdir; returns names in order."""
    if not commits:
        return []
    raw = outdir / ".raw"
    raw.mkdir()
    tag = pin.upstream_tag
    git("format-patch", *FORMAT_PATCH_OPTIONS, "-o", str(raw), f"{tag}..{commits[-1]}", cwd=repo)
    produced = sorted(raw.iterdir())
    if len(produced) != len(commits):
        raise HdError(f"git format-patch wrote {len(produced)} files for {len(commits)} commits")
    names: list[str] = []
    for path in produced:
        name = re.sub(r"^\d{4}-", "", path.name)
        if name in names:
            raise HdError(f"two commits get the file name {name}; give them distinct subjects")
        if name == PATCH_SUFFIX:
            raise HdError(f"{path.name}: a commit subject has no letters or digits")
        names.append(name)
        path.rename(outdir / name)
    raw.rmdir()
    return names


def _series_text(names: list[str]) -> str:
    return "".join(f"{name}\n" for name in names)


def _patch_dir_files(pin: Pin) -> dict[str, bytes]:
    files = {SERIES_FILE: b""}
    if pin.patches_dir.is_dir():
        for path in sorted(pin.patches_dir.iterdir()):
            if path.is_file() and (path.name == SERIES_FILE or path.suffix == PATCH_SUFFIX):
                files[path.name] = path.read_bytes()
    return files


def _drift_report(current: dict[str, bytes], expected: dict[str, bytes]) -> list[str]:
    lines: list[str] = []
    for name in sorted(set(current) | set(expected)):
        a, b = current.get(name), expected.get(name)
        if a == b:
            continue
        if a is None:
            lines.append(f"patches/{name}: missing (export would write it)")
            continue
        if b is None:
            lines.append(f"patches/{name}: not produced by export (stale or not in series)")
            continue
        diff = list(
            difflib.unified_diff(
                a.decode(errors="replace").splitlines(keepends=True),
                b.decode(errors="replace").splitlines(keepends=True),
                f"patches/{name}",
                f"exported/{name}",
                n=1,
            )
        )
        lines.append(f"patches/{name}: differs from the export ({len(a)} vs {len(b)} bytes)")
        if not diff:  # same text lines, different bytes (e.g. line endings)
            diff = ["  (the difference is in line endings or encoding only)\n"]
        shown = diff[:40]
        lines += ["    " + d.rstrip("\n") for d in shown]
        if len(diff) > len(shown):
            lines.append(f"    ... {len(diff) - len(shown)} more diff lines")
    return lines


def export_series(pin: Pin, check: bool) -> int:
    started = time.monotonic()
    repo, branch, commits = _export_source(pin)
    with tempfile.TemporaryDirectory(prefix="hd-export-") as tmp:
        outdir = Path(tmp)
        names = _format_patches(pin, repo, commits, outdir)
        exported = {name: (outdir / name).read_bytes() for name in names}
    exported[SERIES_FILE] = _series_text(names).encode()
    current = _patch_dir_files(pin)
    if check:
        drift = _drift_report(current, exported)
        if drift:
            print(f"export --check: patches/ differs from {branch} in {_rel(repo)}:")
            for line in drift:
                print(f"  {line}")
            print(
                f"Either patches/ was edited after the last apply ({hd_command(pin, 'apply')}),"
                f" or commits in {_rel(repo)} were not exported ({hd_command(pin, 'export')})."
            )
            return 1
        print(
            f"export --check: patches/ matches {branch} byte for byte "
            f"({len(names)} patches, {time.monotonic() - started:.1f} s)"
        )
        return 0

    # The branch of an interrupted apply was built from patches/ as they are: only the
    # applied branch can be older than an edit of them.
    recorded = _sync_records(repo).get(pin.applied_branch, {}).get("series_sha256")
    if branch == pin.applied_branch and recorded and recorded != series_digest(pin):
        raise HdError(
            "patches/ changed since the last apply or export (series or listed patch files "
            f"edited, added or removed), and export would overwrite it from {branch}. "
            "Nothing was written.\n"
            f"Take the edits in: {hd_command(pin, 'apply')} (rebuilds {pin.applied_branch} "
            "from patches/), then export.\n"
            "Or undo them in patches/ (e.g. `git checkout -- patches/` in this project) and "
            "export again."
        )
    pin.patches_dir.mkdir(exist_ok=True)
    written, unchanged = [], []
    for name, data in exported.items():
        if current.get(name) == data:
            unchanged.append(name)
            continue
        (pin.patches_dir / name).write_bytes(data)
        written.append(name)
    removed = [name for name in current if name != SERIES_FILE and name not in exported]
    for name in removed:
        (pin.patches_dir / name).unlink()
    tip = git_out("rev-parse", branch, cwd=repo) if branch == pin.applied_branch else None
    _record_sync(pin, repo, tip)
    print(f"export: {len(names)} patches from {branch} in {_rel(repo)}")
    for name in written:
        print(f"  wrote   patches/{name}")
    for name in removed:
        print(f"  removed patches/{name}")
    print(
        f"export: {len(written)} written, {len(unchanged)} unchanged, {len(removed)} removed "
        f"in {time.monotonic() - started:.1f} s"
    )
    return 0


# --- lint -----------------------------------------------------------------------------------


def _message_problems(patch: PatchFile) -> list[str]:
    problems = []
    fields: dict[str, list[str]] = {"Why": [], "Upstream-Status": [], "Removal-Plan": []}
    for line in patch.message.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in fields:
            fields[key].append(value.strip())
    for key, values in fields.items():
        if not values:
            problems.append(f"no `{key}:` line in the commit message")
        elif len(values) > 1:
            problems.append(f"`{key}:` appears {len(values)} times")
        elif not values[0]:
            problems.append(f"`{key}:` is empty")
    for value in fields["Upstream-Status"][:1]:
        if value and not _UPSTREAM_STATUS.match(value):
            problems.append(
                f"`Upstream-Status: {value}` is not one of: pending | submitted <url> | "
                "not-needed <reason> | backport <ref>"
            )
    return problems


def lint_problems(pin: Pin) -> tuple[list[str], int]:
    """(problems, number of patch files checked)."""
    problems: list[str] = []
    series_file = pin.patches_dir / SERIES_FILE
    if not series_file.is_file():
        return [f"{_rel(series_file)} does not exist (an empty file means: no patches)"], 0
    names, series_problems = parse_series_text(series_file.read_text(encoding="utf-8"))
    problems += [f"patches/{p}" for p in series_problems]
    on_disk = sorted(p.name for p in pin.patches_dir.iterdir() if p.name != SERIES_FILE)
    for name in on_disk:
        if not name.endswith(PATCH_SUFFIX):
            problems.append(f"patches/{name}: only `series` and *.patch files belong here")
        elif name not in names:
            problems.append(f"patches/{name}: not listed in patches/series")
    for name in names:
        if not (pin.patches_dir / name).is_file():
            problems.append(f"patches/series lists {name}, which does not exist")

    exact, prefixes = reserved_paths(pin)
    checked = [n for n in names if (pin.patches_dir / n).is_file()]
    checked += [n for n in on_disk if n.endswith(PATCH_SUFFIX) and n not in names]
    for name in checked:
        where = f"patches/{name}"
        try:
            patch = parse_patch(pin.patches_dir / name)
        except HdError as e:
            problems.append(str(e))
            continue
        if patch.messages == 0:
            problems.append(f"{where}: is not a git format-patch file (no mbox `From ` line)")
            continue
        if patch.messages != 1:
            problems.append(f"{where}: holds {patch.messages} mbox messages, expected 1")
        if patch.first_line != ZERO_FROM_LINE:
            problems.append(
                f"{where}: does not start with `{ZERO_FROM_LINE}` (format-patch --zero-commit)"
            )
        if not patch.author or not patch.email:
            problems.append(f"{where}: no `From:` author")
        if not patch.subject:
            problems.append(f"{where}: no `Subject:`")
            continue
        if patch.subject.startswith("[PATCH"):
            problems.append(f"{where}: subject starts with [PATCH (export uses --keep-subject)")
        expected_name = patch_filename(patch.subject)
        if name != expected_name:
            problems.append(
                f"{where}: file name does not match its subject; expected {expected_name}"
            )
        problems += [f"{where}: {p}" for p in _message_problems(patch)]
        changes = patch.file_changes
        if not changes:
            problems.append(f"{where}: has no `diff --git` section")
        for path in patch.paths:
            why = path_problem(path)
            if why:
                problems.append(f"{where}: path {path!r} {why}")
            elif is_reserved(path, exact, prefixes):
                problems.append(
                    f"{where}: touches {path}, which the overlay commit provides "
                    "(vllm_overlay/, kernels/ or the build-info module)"
                )
    return problems, len(checked)


def lint(pin: Pin) -> int:
    problems, count = lint_problems(pin)
    if problems:
        print(f"lint: {len(problems)} problem(s):", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"lint: patches/series and {count} patch files ok")
    return 0


# --- CLI ------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "apply",
        help="build hd/<version> in build/upstream: tag + series (git am, strict) + overlay",
        description="Branch from the upstream tag, `git am` patches/series strictly (no fuzz, "
        "no 3-way, --whitespace=error), then add vllm_overlay/, kernels/ and the build-info "
        "module as one commit. Refuses a dirty build/upstream; on a failed patch prints a "
        "per-patch report and how to continue, leaving hd/<version> unchanged.",
    )
    p.set_defaults(func=lambda args, pin: apply_series(pin))

    p = sub.add_parser(
        "export",
        help="write the commits of hd/<version> back to patches/ (format-patch)",
        description="git format-patch every commit between the upstream tag and hd/<version> "
        "(or hd/<version>-wip while on it), except the hd-overlay commit, into patches/ and "
        "rewrite patches/series.",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a fresh export would differ from patches/ by any byte",
    )
    p.set_defaults(func=lambda args, pin: export_series(pin, args.check))

    p = sub.add_parser(
        "lint",
        help="check patches/series and every patch's format, name and header fields",
        description="Check that patches/series and patches/*.patch agree, every patch is one "
        "format-patch message named after its subject with Why:, Upstream-Status: and "
        "Removal-Plan: lines, and no patch touches what the overlay commit provides.",
    )
    p.set_defaults(func=lambda args, pin: lint(pin))

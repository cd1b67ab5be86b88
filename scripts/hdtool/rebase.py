"""`rebase --to X` and `bump-pin --to X`: carry the patch set to a new upstream release.

rebase --to X
    1. fetch X's sdist and wheel (sha256 from the index, checked before they are kept);
    2. import the sdist as the next commit on `upstream` (tag vX);
    3. apply the current series strictly onto the pinned tag (ref hd-rebase/X/old: the old
       series as commits, for the range-diff), then onto vX on branch rebase/X, one patch at
       a time: strict `git am` when `git apply --check` passes (clean), else `git am -3`
       (3-way merge: drift), which either commits, finds nothing left to change (upstream
       absorbed the patch: drop candidate) or stops with conflict markers;
    4. import-check every overlay and kernels module against the new tree (importcheck.py),
       check the overlay does not collide with it, and `git range-diff` old vs new series;
    5. write reports/rebase-X.md (hand-written notes from reports/notes/rebase-X.md are
       appended) and build/rebase/X/state.json, which bump-pin and --continue read.
    On a conflict it stops with `git am` in progress on rebase/X and prints the commands to
    resolve, continue and export. patches/, VERSION and hd/<pinned> are never touched.
    --with-tests: build the wheel for X (from a staged project root, build/rebase/X/stage,
    holding X's VERSION, the rebased series, the overlay and kernels), make its venv, run
    our tests and upstream's CPU allow-list against it; the report gives the counts.

bump-pin --to X
    Moves VERSION's [upstream] table to X (version, file names, sha256s) and exports
    rebase/X into patches/, only if rebase/X is the complete, conflict-free result that
    rebase (or rebase --continue) checked, and patches/ has not changed since.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from hdtool.fetch import Release, fetch_release
from hdtool.gitutil import am_in_progress, current_branch, dirty_paths, git, git_out, rev_exists
from hdtool.importcheck import CheckResult, check_overlay, definitions
from hdtool.overlay import collisions, is_reserved, overlay_plan, reserved_paths
from hdtool.patchfile import PatchFile, parse_diff_paths, parse_patch, read_series, series_paths
from hdtool.pin import HdError, Pin, fingerprint, sha256_file, tracked_files
from hdtool.series import (
    AM_OPTIONS,
    _format_patches,
    _patch_dir_files,
    _require_clean_repo,
    _series_text,
    _tree_files,
    hd_command,
)
from hdtool.series import _rel as rel
from hdtool.upstream import ensure_imported, import_sdist, tag_import_commit

# Patch outcomes, as the report names them.
CLEAN = "clean"
THREE_WAY = "3-way merge (drift)"
EMPTY = "now empty (drop candidate)"
CONFLICT = "CONFLICT"
NOT_TRIED = "not attempted"
RESOLVED = "resolved by hand"
ABSENT = "absent (absorbed or skipped)"
# What a patch after a conflict would do alone (`PatchResult.alone`), tried in a scratch
# index onto the patches before the conflict (and the later ones that applied there).
ALONE_CLEAN = "applies clean"
ALONE_THREE_WAY = "merges 3-way"
ALONE_CONFLICT = "conflicts"

# `git am` for the rebase: as strict as apply, except that a patch whose context no longer
# matches may be merged with the pre-image blobs (--3way); the conflict is left for a human.
AM3_OPTIONS = tuple("--3way" if o == "--no-3way" else o for o in AM_OPTIONS)
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*([a-z0-9.+-]*)$")
STATE_FILE = "state.json"
# Where the model the patch set specializes, and the runner hooks a port would use, are
# defined in the old and the new tree (a move shows up here even when no import breaks).
WATCHED_SYMBOLS = (
    "KimiLinearForCausalLM",
    "init_model_state",
    "resolve_model_state_cls",
    "get_model_state_cls",
)
NOTES_DIR = "reports/notes"


def rebase_branch(version: str) -> str:
    return f"rebase/{version}"


def old_series_ref(version: str) -> str:
    """The old series applied to the pinned tag (rev-parse finds refs/<this> by this name)."""
    return f"hd-rebase/{version}/old"


def work_dir(pin: Pin, version: str) -> Path:
    return pin.root / "build" / "rebase" / version


def report_path(pin: Pin, version: str) -> Path:
    return pin.root / "reports" / f"rebase-{version}.md"


# --- what a run found ------------------------------------------------------------------------


@dataclass
class PatchResult:
    name: str
    subject: str
    status: str = NOT_TRIED
    old_commit: str = ""
    new_commit: str = ""
    old_stat: str = ""  # "+a -d" of the old commit
    new_stat: str = ""
    files: list[str] = field(default_factory=list)  # conflicted files
    hunks: list[str] = field(default_factory=list)  # conflict details, one line each
    git_errors: list[str] = field(default_factory=list)
    # For a patch not attempted after a conflict: what it would do on its own (ALONE_*,
    # with the conflicted files); never committed anywhere.
    alone: str = ""


@dataclass
class TestRun:
    name: str
    command: str
    rc: int
    counts: dict[str, int]
    seconds: float
    note: str = ""


@dataclass
class State:
    version: str
    from_version: str
    started: str
    release: dict[str, str]  # sdist, sdist_sha256, wheel, wheel_sha256
    upstream_commit: str
    old_ref_commit: str
    series: list[str]
    series_sha256: dict[str, str]  # patches/ file -> sha256 at the time of the rebase
    patches: list[PatchResult]
    outcome: str = "conflict"  # "complete" or "conflict"
    head: str = ""  # rebase/X at the time of the check
    import_problems: int = 0
    collisions: list[str] = field(default_factory=list)
    tests: list[TestRun] = field(default_factory=list)
    tests_note: str = "not run (rebase without --with-tests)"
    previous_checkout: str = ""  # what build/upstream had checked out before the rebase
    pairs: dict[str, list[str]] = field(default_factory=dict)  # torch etc. -> [old, new]
    tests_config_notes: list[str] = field(default_factory=list)  # per-version test changes
    requirements_notes: list[str] = field(default_factory=list)  # per-version test pins
    tests_when: str = ""  # when the tests ran, and on which patch-set fingerprint
    tests_fingerprint: str = ""
    watched: dict[str, list[list[str]]] = field(default_factory=dict)  # name -> [old, new]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> State:
        try:
            data = json.loads(path.read_text())
            data["patches"] = [PatchResult(**p) for p in data["patches"]]
            data["tests"] = [TestRun(**t) for t in data.get("tests", [])]
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise HdError(f"{path}: cannot read the rebase state ({e!r})") from e


# --- helpers ---------------------------------------------------------------------------------


def _check_version(pin: Pin, version: str) -> None:
    if not _VERSION.match(version):
        raise HdError(f"{version!r} is not a release version (e.g. 0.30.0)")
    if version == pin.upstream_version:
        raise HdError(f"{version} is the pinned version already; nothing to rebase onto")


def _series_files(pin: Pin) -> dict[str, str]:
    return {
        name: sha256_file(pin.patches_dir / name) if (pin.patches_dir / name).is_file() else ""
        for name in ["series", *read_series(pin)]
    }


def _stat(repo: Path, commit: str) -> str:
    out = git_out("show", "--numstat", "--format=", commit, cwd=repo)
    added = deleted = 0
    for line in out.splitlines():
        a, d, _ = line.split("\t", 2)
        added += int(a) if a.isdigit() else 0
        deleted += int(d) if d.isdigit() else 0
    return f"+{added} -{deleted}"


def _head(repo: Path) -> str:
    return git_out("rev-parse", "HEAD", cwd=repo)


def _verified_import(pin: Pin, release: Release) -> str:
    """vX in build/upstream, imported from exactly the verified sdist; its commit."""
    repo = pin.upstream_repo
    tag = f"v{release.version}"
    if rev_exists(repo, tag):
        return tag_import_commit(repo, tag, release.sdist.name, release.sdist_sha256)
    commit, _ = import_sdist(pin, release.version, release.sdist, release.sdist_sha256)
    return commit


def _apply_old_series(pin: Pin, version: str, paths: list[Path]) -> str:
    """Commit the series strictly onto the pinned tag; point hd-rebase/X/old at the result."""
    repo = pin.upstream_repo
    git("checkout", "-q", "--detach", pin.upstream_tag, cwd=repo)
    if paths:
        proc = git("am", *AM_OPTIONS, *[str(p) for p in paths], cwd=repo, check=False)
        if proc.returncode != 0:
            if am_in_progress(repo):
                git("am", "--abort", cwd=repo)
            raise HdError(
                f"the series does not apply strictly to the pinned {pin.upstream_tag}; fix "
                f"that first ({hd_command(pin, 'apply')} reports why). git said:\n"
                + (proc.stdout + proc.stderr).decode(errors="replace")
            )
    head = _head(repo)
    git("update-ref", f"refs/{old_series_ref(version)}", head, cwd=repo)
    return head


def _strict_applies(repo: Path, patch: Path) -> bool:
    """Would `git am` apply the patch to HEAD without 3-way (full context, no fuzz)?"""
    proc = git(
        "apply", "--check", "--whitespace=error", str(patch.resolve()), cwd=repo, check=False
    )
    return proc.returncode == 0


# git am -3's conflict messages, and where each names the file:
#   CONFLICT (content): Merge conflict in <path>
#   CONFLICT (modify/delete): <path> deleted in <side> and modified in <side>. ...
#   CONFLICT (rename/delete): <path> renamed to <path2> in <side>, but deleted in <side>.
#   error: patch failed: <path>:<line>
_CONFLICT_PATH = re.compile(
    r"^(?:CONFLICT \(content\): Merge conflict in (?P<content>\S+)"
    r"|CONFLICT \([^)]*/delete\): (?P<deleted>\S+) (?:deleted in|renamed to)"
    r"|error: patch failed: (?P<failed>[^:\s]+))"
)
_DELETED_UPSTREAM = re.compile(r"^CONFLICT \((?:modify|rename)/delete\): (\S+) deleted in")


def conflict_paths(lines: list[str]) -> list[str]:
    """The files git's conflict / failure messages name, in order, once each."""
    paths: list[str] = []
    for line in lines:
        m = _CONFLICT_PATH.match(line)
        path = m and (m["content"] or m["deleted"] or m["failed"])
        if path and path not in paths:
            paths.append(path)
    return paths


def deleted_upstream(lines: list[str]) -> list[str]:
    """Files the patch modifies that the new release deleted (or moved away)."""
    return [m[1] for m in map(_DELETED_UPSTREAM.match, lines) if m]


def _conflict_details(
    repo: Path, patch: PatchFile, output: str
) -> tuple[list[str], list[str], list[str]]:
    """(files, hunk lines, git's error lines) of a `git am -3` that stopped."""
    unmerged = git_out("diff", "--name-only", "--diff-filter=U", cwd=repo).splitlines()
    errors = [
        line
        for line in output.splitlines()
        if line.strip()
        and not line.startswith(("Applying: ", "hint: ", "Using index info", "Falling back"))
        and not line.startswith(("When you have resolved", "If you prefer to skip"))
        and not line.startswith(("To restore the original", "Use 'git am --show-current"))
    ]
    files = list(unmerged)
    for path in conflict_paths(errors):
        if path not in files:
            files.append(path)
    if not files:
        files = patch.paths
    hunks: list[str] = []
    sections = parse_diff_paths(patch.diff)
    lines = patch.diff.split("\n")
    for i, section in enumerate(sections):
        path = section.new_path or section.old_path
        if path not in files:
            continue
        end = sections[i + 1].diff_line - 1 if i + 1 < len(sections) else len(lines)
        for text in lines[section.diff_line - 1 : end]:
            if text.startswith("@@ "):
                hunks.append(f"{path}: patch hunk {text}")
    for path in files:
        file = repo / path
        if not file.is_file():
            hunks.append(f"{path}: not in the work tree (deleted or renamed upstream?)")
            continue
        start = None
        for number, text in enumerate(file.read_bytes().split(b"\n"), 1):
            if text.startswith(b"<<<<<<< "):
                start = number
            elif text.startswith(b">>>>>>> ") and start is not None:
                hunks.append(f"{path}: conflict markers at lines {start}-{number}")
                start = None
    return files, hunks, errors


def _classify_new(pin: Pin, state: State, paths: list[Path], patches: list[PatchFile]) -> bool:
    """Apply the series onto vX on rebase/X, one patch at a time. True when all applied."""
    repo = pin.upstream_repo
    branch = rebase_branch(state.version)
    git("checkout", "-q", "-B", branch, f"v{state.version}", cwd=repo)
    for index, (path, patch, result) in enumerate(zip(paths, patches, state.patches, strict=True)):
        before = _head(repo)
        if _strict_applies(repo, path):
            git("am", *AM_OPTIONS, str(path), cwd=repo)
            result.status = CLEAN
        else:
            proc = git("am", *AM3_OPTIONS, str(path), cwd=repo, check=False)
            if proc.returncode != 0:
                # Redo it with the remaining patches in one session, so that after the
                # conflict is resolved `git am --continue` applies the rest too.
                git("am", "--abort", cwd=repo)
                rest = [str(p) for p in paths[index:]]
                proc = git("am", *AM3_OPTIONS, *rest, cwd=repo, check=False)
                output = (proc.stdout + proc.stderr).decode(errors="replace")
                if proc.returncode == 0 or not am_in_progress(repo):
                    raise HdError(f"git am -3 behaved differently on a second run:\n{output}")
                result.status = CONFLICT
                result.files, result.hunks, result.git_errors = _conflict_details(
                    repo, patch, output
                )
                for later, alone in zip(
                    state.patches[index + 1 :],
                    _try_alone(repo, before, paths[index + 1 :], first_number=index + 2),
                    strict=True,
                ):
                    later.alone = alone
                return False
            result.status = THREE_WAY if _head(repo) != before else EMPTY
        if _head(repo) != before:
            result.new_commit = _head(repo)
            result.new_stat = _stat(repo, result.new_commit)
    return True


def _try_alone(repo: Path, base: str, paths: list[Path], *, first_number: int) -> list[str]:
    """What each of ``paths`` (series numbers from ``first_number``) would do without the
    conflicting patch before them: applied in order in a scratch index (no work tree, no
    commit) onto ``base``'s tree, each onto what the earlier ones that applied left,
    strictly first, then 3-way. So the report says which later patches need a hand too,
    before anyone resolves the first conflict. A merge conflict names the patches of this
    run left out before it: it may only need theirs."""
    outcomes: list[str] = []
    left_out: list[int] = []
    tree = git_out("rev-parse", f"{base}^{{tree}}", cwd=repo)
    with tempfile.TemporaryDirectory(prefix="hd-alone-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        for number, path in enumerate(paths, first_number):
            patch = str(path.resolve())
            git("read-tree", tree, cwd=repo, env=env)
            strict = git(
                "apply", "--cached", "--whitespace=error", patch, cwd=repo, env=env, check=False
            )
            if strict.returncode == 0:
                outcome = ALONE_CLEAN
            else:
                git("read-tree", tree, cwd=repo, env=env)
                merged = git("apply", "--cached", "--3way", patch, cwd=repo, env=env, check=False)
                if merged.returncode != 0:
                    listed = git("ls-files", "--unmerged", cwd=repo, env=env).stdout.decode()
                    files = sorted({line.split("\t", 1)[1] for line in listed.splitlines()})
                    errors = [
                        line.removeprefix("error: ")
                        for line in merged.stderr.decode(errors="replace").splitlines()
                        if line.startswith("error: ")
                    ]
                    why = ", ".join(f"`{f}`" for f in files) or (errors[0] if errors else "")
                    if files and left_out:  # a missing file is not the left-out ones' doing
                        why += "; without " + ", ".join(f"#{n}" for n in left_out)
                    outcomes.append(f"{ALONE_CONFLICT} ({why})" if why else ALONE_CONFLICT)
                    left_out.append(number)
                    continue
                outcome = ALONE_THREE_WAY
            tree = git("write-tree", cwd=repo, env=env).stdout.decode().strip()
            outcomes.append(outcome)
    return outcomes


def _reclassify(pin: Pin, state: State, patches: list[PatchFile]) -> None:
    """After a conflict was resolved by hand: match rebase/X's commits to the series."""
    repo = pin.upstream_repo
    branch = rebase_branch(state.version)
    log = git_out("log", "--reverse", "--format=%H%x09%s", f"v{state.version}..{branch}", cwd=repo)
    commits = [line.split("\t", 1) for line in log.splitlines() if line]
    by_subject: dict[str, list[str]] = {}
    for sha, subject in commits:
        by_subject.setdefault(subject, []).append(sha)
    known = {p.subject for p in patches}
    extra = [subject for _, subject in commits if subject not in known]
    if extra:
        raise HdError(
            f"{branch} has commits that are not in the series: {', '.join(extra)}; "
            "a rebase only carries the existing series (add new patches after bump-pin)"
        )
    stopped = False
    for patch, result in zip(patches, state.patches, strict=True):
        found = by_subject.get(patch.subject, [])
        if len(found) > 1:
            raise HdError(f"{branch} has {len(found)} commits with subject {patch.subject!r}")
        if result.status == CONFLICT:
            stopped = True
        if result.status in (CLEAN, THREE_WAY, EMPTY) and not stopped:
            continue  # classified by the automated run, before the conflict
        if not found:
            result.status = ABSENT
            result.new_commit = result.new_stat = ""
            continue
        sha = found[0]
        if result.status == CONFLICT:
            result.status = RESOLVED
        else:
            parent = git_out("rev-parse", f"{sha}^", cwd=repo)
            result.status = CLEAN if _applies_to(repo, parent, patch.path) else THREE_WAY
        result.new_commit = sha
        result.new_stat = _stat(repo, sha)


def _applies_to(repo: Path, rev: str, patch: Path) -> bool:
    """Would the patch apply strictly to rev's tree? (a scratch index, no work tree)"""
    with tempfile.TemporaryDirectory(prefix="hd-index-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", rev, cwd=repo, env=env)
        proc = git(
            "apply",
            "--check",
            "--cached",
            "--whitespace=error",
            str(patch.resolve()),
            cwd=repo,
            env=env,
            check=False,
        )
    return proc.returncode == 0


def _range_diff(repo: Path, state: State, new_tip: str) -> str:
    old = f"v{state.from_version}..{old_series_ref(state.version)}"
    new = f"v{state.version}..{new_tip}"
    if not state.series:
        return ""
    proc = git("range-diff", "--no-color", old, new, cwd=repo, check=False)
    text = (proc.stdout + proc.stderr).decode(errors="replace").rstrip()
    return text


# --- the report ------------------------------------------------------------------------------


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _conflict_commands(pin: Pin, state: State, result: PatchResult) -> list[str]:
    repo = rel(pin.upstream_repo)
    files = " ".join(result.files) or "<files>"
    cont = hd_command(pin, f"rebase --to {state.version} --continue")
    bump = hd_command(pin, f"bump-pin --to {state.version}")
    gone = deleted_upstream(result.git_errors)
    edited = " ".join(f for f in result.files if f not in gone)
    lines = [
        f"git -C {repo} status                 # conflicted files (both modified)",
        f"git -C {repo} diff                   # the conflict markers",
        f"git -C {repo} am --show-current-patch=diff   # the patch being applied",
    ]
    if edited or not gone:
        lines += [
            f"# edit {edited or files} in {repo}/ (remove the markers), then:",
            f"git -C {repo} add {edited or files}",
        ]
    for path in gone:
        lines += [
            f"# {path} was deleted or moved upstream: port the patch's change to where the",
            "# code lives now (the report's port notes say where), stage that file, and:",
            f"git -C {repo} rm -q {path}",
        ]
    lines += [
        f"git -C {repo} am --continue          # commits it, then applies the remaining patches",
        "# repeat for any later conflict, then re-check and rewrite the report:",
        cont,
        "# when it reports a complete rebase, export it into patches/ and move VERSION:",
        bump,
        "# if upstream made the patch unnecessary, drop it instead of resolving:",
        f"git -C {repo} am --skip",
        "# to give up (patches/, VERSION and the pinned branch were never touched):",
        f"git -C {repo} am --abort",
    ]
    return lines


_PATH_NOTE = re.compile(r"^(\w+): (remove include|exclude|drop exclusion) (\S+): (.*)$", re.S)


def grouped_notes(notes: list[str]) -> list[str]:
    """The allow-list notes with one line per (subset, change, reason): a reason shared by
    many paths (e.g. a budget) is written once, after all its paths."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for note in notes:
        m = _PATH_NOTE.match(note)
        key = (m[1], m[2], m[4]) if m else (note,)
        groups.setdefault(key, []).append(m[3] if m else "")
    out = []
    for key, paths in groups.items():
        if len(key) == 1:
            out.append(key[0])
        else:
            subset, change, reason = key
            out.append(f"{subset}: {change} {', '.join(paths)}: {reason}")
    return out


def render_report(
    pin: Pin,
    state: State,
    check: CheckResult | None,
    old_check: CheckResult | None,
    range_diff: str,
    notes: str | None,
) -> str:
    v, old = state.version, state.from_version
    branch = rebase_branch(v)
    counts: dict[str, int] = {}
    for p in state.patches:
        counts[p.status] = counts.get(p.status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in counts.items()) or "the series is empty"
    problems = check.problems if check else []
    out = [
        f"# Rebase of the patch series: vLLM {old} -> {v}",
        "",
        f"Written by `{hd_command(pin, f'rebase --to {v}')}` (scripts/hdtool/rebase.py) "
        f"on {state.started}.",
        "",
        "## Outcome",
        "",
        f"- Rebase: **{'complete' if state.outcome == 'complete' else 'STOPPED ON A CONFLICT'}**"
        f" - {len(state.patches)} patches: {summary}.",
        f"- Branch `{branch}` in build/upstream"
        + (f" at `{state.head[:12]}`" if state.outcome == "complete" else " (`git am` in progress)")
        + f"; `hd/{old}`, `patches/` and `VERSION` untouched.",
    ]
    if check is not None:
        out.append(
            f"- Overlay/kernels import check: {len(check.files)} modules, "
            f"{len(check.results)} vllm/relative imports, **{len(problems)} missing**, "
            f"{len(check.unverifiable)} unverifiable."
        )
    out.append(
        "- Overlay collisions with the new tree: "
        + (f"**{len(state.collisions)}**" if state.collisions else "none")
        + "."
    )
    out.append(f"- Tests against a {v} wheel: {state.tests_note}.")
    out += [
        "",
        "## Upstream files (sha256 from the package index, verified on download)",
        "",
        "| file | sha256 |",
        "|---|---|",
        f"| `{state.release['sdist']}` | `{state.release['sdist_sha256']}` |",
        f"| `{state.release['wheel']}` | `{state.release['wheel_sha256']}` |",
        "",
        f"Imported as tag `v{v}` (commit `{state.upstream_commit[:12]}`) on branch `upstream` "
        "of build/upstream.",
        "",
        "Pins the new wheel states (Requires-Dist) for VERSION's [pairs_with]; bump-pin "
        "moves them:",
        "",
        f"| distribution | pinned ({old}) | {v} wheel |",
        "|---|---|---|",
        *[
            f"| {name} | {before} | {after or '(no == pin)'}"
            + (" **(changed)**" if after and after != before else "")
            + " |"
            for name, (before, after) in state.pairs.items()
        ],
        "",
        "## Patches",
        "",
    ]
    if not state.patches:
        out.append(f"`patches/series` is empty at {old}: there is nothing to carry over.")
    else:
        out += ["| # | patch | outcome | old diff | new diff |", "|---|---|---|---|---|"]
        for i, p in enumerate(state.patches, 1):
            status = p.status
            if p.status == NOT_TRIED and p.alone:
                status += f"; alone: {_md_escape(p.alone)}"
            out.append(f"| {i} | `{p.name}` | {status} | {p.old_stat} | {p.new_stat or '-'} |")
        if any(p.status == NOT_TRIED and p.alone for p in state.patches):
            out += [
                "",
                "*alone*: what a patch after the conflict would do without it, tried in a "
                "scratch index (no commit) onto the patches before the conflict and the later "
                'ones that applied there: strictly, else by 3-way merge; "without #N": '
                "patches of that run that conflicted before it (it may need only theirs). "
                "`git am --continue` after the resolution applies them for real.",
            ]
        for p in state.patches:
            if p.status != CONFLICT:
                continue
            out += ["", f"### Conflict: `{p.name}`", ""]
            out += [f"- file `{f}`" for f in p.files]
            out += [f"- {_md_escape(h)}" for h in p.hunks]
            out += [f"- git: `{e}`" for e in p.git_errors]
            out += ["", "To resolve (from the project root):", "", "```sh"]
            out += _conflict_commands(pin, state, p)
            out.append("```")
        if any(p.status == EMPTY for p in state.patches):
            out += [
                "",
                "A patch that is *now empty* changed nothing on top of the new tree: upstream "
                "already contains it. It is not on the branch; bump-pin drops it from the "
                "series (check its Removal-Plan).",
            ]
    out += ["", "## Overlay and kernels: import check against the new tree", ""]
    if check is None:
        out.append("Not run.")
    else:
        out.append(
            f"Tree: {check.label}. Every `import vllm...`, `from vllm... import ...` and "
            "relative import of each module was resolved statically (module file or package "
            "exists; each imported name bound at the module's top level or a submodule)."
        )
        out.append("")
        if not check.files:
            out.append("The overlay and kernels hold no Python modules.")
        else:
            out += ["| module | imports checked | missing |", "|---|---|---|"]
            for dest, origin in check.files.items():
                mine = [r for r in check.results if r.file == dest]
                bad = [r for r in mine if r in problems]
                out.append(f"| `{origin}` | {len(mine)} | {len(bad) or '-'} |")
        if problems:
            old_status = {}
            if old_check is not None:
                old_status = {(r.file, r.line, r.symbol): r.status for r in old_check.results}
            out += ["", "Missing:", ""]
            for r in problems:
                was = old_status.get((r.file, r.line, r.symbol))
                since = (
                    f" (resolved at {old}: gone since)"
                    if was == "ok"
                    else (f" (missing at {old} too)" if was else "")
                )
                out.append(
                    f"- `{r.origin}:{r.line}` `{r.statement}`: {r.status}: {r.detail}{since}"
                )
                if r.defined_elsewhere:
                    shown = ", ".join(f"`{d}`" for d in r.defined_elsewhere[:8])
                    label = "defined at" if r.name else "same-named modules"
                    out.append(f"  - {label} {v}: {shown}")
        for r in check.unverifiable:
            out.append(f"- unverifiable: `{r.origin}:{r.line}` `{r.statement}`: {r.detail}")
    if state.collisions:
        out += ["", "## Overlay collisions", ""]
        out += [f"- {c}" for c in state.collisions]
    if state.watched:
        out += [
            "",
            "## Where the model and the runner hooks are defined",
            "",
            f"`git grep` for definitions (class/def, methods included) under vllm/ at v{old} "
            f"and v{v}; a move here breaks patches and overlay code that hook into it even "
            "when no import in the overlay names it yet.",
            "",
            f"| symbol | v{old} | v{v} |",
            "|---|---|---|",
        ]
        for name, (before, after) in state.watched.items():
            cells = []
            for hits in (before, after):
                shown = [f"`{d}`" for d in hits[:6]]
                if len(hits) > 6:
                    shown.append(f"... {len(hits) - 6} more")
                cells.append("<br>".join(shown) or "(none)")
            old_files = {h.split(":")[0] for h in before}
            new_files = {h.split(":")[0] for h in after}
            if not old_files and not new_files:
                change = " (in neither)"
            elif not old_files:
                change = " **(new)**"
            elif old_files and not new_files:
                change = " **(gone)**"
            elif not old_files & new_files:
                change = " **(moved)**"
            elif new_files - old_files:
                change = f" (also in {len(new_files - old_files)} more files)"
            else:
                change = ""
            out.append(f"| `{name}`{change} | {cells[0]} | {cells[1]} |")
    out += ["", f"## `git range-diff` of the series ({old} -> {v})", ""]
    if not state.series:
        out.append("The series is empty: nothing to compare.")
    else:
        out += [
            f"`git range-diff v{old}..{old_series_ref(v)} v{v}..{branch}` in build/upstream"
            + (" (up to the conflict)" if state.outcome != "complete" else "")
            + ":",
            "",
            "```",
            range_diff or "(no output)",
            "```",
        ]
    out += ["", f"## Tests against the {v} wheel", ""]
    if state.tests:
        if state.tests_when:
            out += [
                f"Ran {state.tests_when} on the staged {v} project (build/rebase/{v}/stage, "
                f"patch-set fingerprint `{state.tests_fingerprint[:16]}`).",
                "",
            ]
        out += ["| suite | result | counts | time |", "|---|---|---|---|"]
        for t in state.tests:
            order = (
                "passed",
                "failed",
                "error",
                "errors",
                "skipped",
                "xfailed",
                "xpassed",
                "deselected",
                "not run",
            )
            keys = sorted(t.counts, key=lambda k: order.index(k) if k in order else len(order))
            shown = ", ".join(f"{t.counts[k]} {k}" for k in keys) or "(no counts)"
            if not t.command:
                result = "not run"
            elif t.rc == PYTEST_NO_TESTS:
                result = "nothing ran (pytest exit 5)"
            else:
                result = "ok" if t.rc == 0 else f"FAILED (exit {t.rc})"
            out.append(f"| {t.name} | {result} | {shown} | {t.seconds:.0f} s |")
        out.append("")
        for t in state.tests:
            parts = [f"`{t.command}`"] if t.command else []
            parts += [t.note] if t.note else []
            out.append(f"- {t.name}: " + " - ".join(parts))
    else:
        out.append(f"Tests were {state.tests_note}; no counts are claimed.")
    if state.requirements_notes:
        out += ["", f"Upstream test requirements for {v}:", ""]
        out += [f"- {_md_escape(note)}" for note in state.requirements_notes]
    if state.tests_config_notes:
        out += ["", f"Upstream allow-list differences for {v} (merged over the default):", ""]
        out += [f"- {_md_escape(note)}" for note in grouped_notes(state.tests_config_notes)]
    if notes:
        out += [
            "",
            f"## Port notes (hand-written: {NOTES_DIR}/rebase-{v}.md)",
            "",
            notes.strip(),
        ]
    return "\n".join(out) + "\n"


# --- the checks after the patches ------------------------------------------------------------


def _check_tree(pin: Pin, state: State, tip: str) -> tuple[CheckResult, CheckResult, list[str]]:
    repo = pin.upstream_repo
    label = (
        f"`{rebase_branch(state.version)}` (v{state.version} + rebased series)"
        if state.outcome == "complete"
        else f"v{state.version} + the patches before the conflict"
    )
    check = check_overlay(pin, repo, tip, label + " + overlay + kernels")
    old_check = check_overlay(pin, repo, old_series_ref(state.version), f"v{state.from_version}")
    touched = set()
    for p in state.patches:
        if p.new_commit:
            out = git_out(
                "diff-tree", "--no-commit-id", "-r", "--name-only", p.new_commit, cwd=repo
            )
            touched.update(out.splitlines())
    clashes = collisions(pin, _tree_files(repo, f"v{state.version}") | touched)
    return check, old_check, clashes


def _finish(pin: Pin, state: State, tip: str) -> CheckResult:
    repo = pin.upstream_repo
    check, old_check, clashes = _check_tree(pin, state, tip)
    state.import_problems = len(check.problems)
    state.collisions = clashes
    state.watched = {
        name: [
            definitions(repo, f"v{state.from_version}", name, methods=True),
            definitions(repo, f"v{state.version}", name, methods=True),
        ]
        for name in WATCHED_SYMBOLS
    }
    if state.outcome == "complete":
        state.head = git_out("rev-parse", tip, cwd=repo)
    state.save(work_dir(pin, state.version) / STATE_FILE)
    _write_report(pin, state, check, old_check, _range_diff(repo, state, tip))
    return check


def _write_report(
    pin: Pin, state: State, check: CheckResult, old_check: CheckResult, range_diff: str
) -> Path:
    notes_file = pin.root / NOTES_DIR / f"rebase-{state.version}.md"
    notes = notes_file.read_text() if notes_file.is_file() else None
    path = report_path(pin, state.version)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(pin, state, check, old_check, range_diff, notes))
    return path


def _print_summary(pin: Pin, state: State, check: CheckResult) -> None:
    width = len(str(len(state.patches)))
    print(f"rebase: {pin.upstream_version} -> {state.version}: {len(state.patches)} patches")
    for i, p in enumerate(state.patches, 1):
        print(f"  {i:>{width}} {p.status:<28} {p.name}")
        for f in p.files if p.status == CONFLICT else []:
            print(f"  {'':>{width}} {'':<28} conflict in {f}")
    print(
        f"rebase: import check: {len(check.results)} imports in {len(check.files)} modules, "
        f"{len(check.problems)} missing"
    )
    for r in check.problems:
        print(f"  {r.origin}:{r.line}: {r.statement}: {r.detail}")
    for c in state.collisions:
        print(f"  overlay collision: {c}")
    print(f"rebase: report written to {rel(report_path(pin, state.version))}")


# --- rebase ----------------------------------------------------------------------------------


def _series_with_patches(pin: Pin) -> tuple[list[Path], list[PatchFile]]:
    paths = series_paths(pin)
    patches = [parse_patch(p) for p in paths]
    for patch in patches:
        if patch.messages != 1 or not patch.diff.strip():
            raise HdError(f"{patch.name} is not one format-patch message with a diff; lint it")
    return paths, patches


def rebase(pin: Pin, version: str, *, restart: bool, with_tests: bool, python: str) -> int:
    started = time.monotonic()
    _check_version(pin, version)
    paths, patches = _series_with_patches(pin)
    ensure_imported(pin)
    branch = rebase_branch(version)
    repo = pin.upstream_repo
    if am_in_progress(repo) and current_branch(repo) == branch:
        raise HdError(
            f"the rebase to {version} stopped on a conflict and `git am` is still in progress "
            f"in {rel(repo)}. Resolve it (git -C {rel(repo)} status), `git -C {rel(repo)} add` "
            f"the files, `git -C {rel(repo)} am --continue`, then "
            f"{hd_command(pin, f'rebase --to {version} --continue')}; or give up with "
            f"`git -C {rel(repo)} am --abort` and start over with --restart"
        )
    _require_clean_repo(pin, "rebase")
    if rev_exists(repo, branch):
        previous = git_out("rev-parse", branch, cwd=repo)
        if not restart:
            raise HdError(
                f"{rel(repo)} already has {branch} (at {previous[:12]}) from an earlier rebase.\n"
                f"Re-check it (after resolving a conflict): "
                f"{hd_command(pin, f'rebase --to {version} --continue')}\n"
                f"Start over (replaces the branch): "
                f"{hd_command(pin, f'rebase --to {version} --restart')}"
            )
        print(
            f"rebase: replacing {branch} (was {previous[:12]}; "
            f"`git -C {rel(repo)} branch rescue {previous[:12]}` brings it back)"
        )

    previous_checkout = current_branch(repo) or _head(repo)
    try:
        release = fetch_release(pin, version)
    except HdError as e:
        raise HdError(
            f"{e}\n(`pip index versions {pin.upstream_name}` lists the published releases; "
            "nothing was changed)"
        ) from e
    print(f"rebase: {release.sdist.name} sha256 {release.sdist_sha256} (index, verified)")
    print(f"rebase: {release.wheel.name} sha256 {release.wheel_sha256} (index, verified)")
    upstream_commit = _verified_import(pin, release)
    try:
        old_tip = _apply_old_series(pin, version, paths)
    except HdError:
        _restore_checkout(repo, previous_checkout)
        raise
    old_commits = git_out("rev-list", "--reverse", f"{pin.upstream_tag}..{old_tip}", cwd=repo)
    state = State(
        version=version,
        from_version=pin.upstream_version,
        started=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        release={
            "sdist": release.sdist.name,
            "sdist_sha256": release.sdist_sha256,
            "wheel": release.wheel.name,
            "wheel_sha256": release.wheel_sha256,
        },
        upstream_commit=upstream_commit,
        old_ref_commit=old_tip,
        series=[p.name for p in paths],
        series_sha256=_series_files(pin),
        patches=[PatchResult(p.name, p.subject) for p in patches],
        previous_checkout=previous_checkout,
    )
    new_pins = wheel_pins(release.wheel)
    old_pins = {"torch": pin.torch, "nvidia-cutlass-dsl": pin.cutlass_dsl}
    state.pairs = {n: [old_pins[n], new_pins.get(n, "")] for n in PAIRED_DISTRIBUTIONS}
    for result, sha in zip(state.patches, old_commits.split(), strict=True):
        result.old_commit = sha
        result.old_stat = _stat(repo, sha)
    complete = _classify_new(pin, state, paths, patches)
    state.outcome = "complete" if complete else "conflict"
    check = _finish(pin, state, "HEAD")
    _print_summary(pin, state, check)
    if not complete:
        conflict = next(p for p in state.patches if p.status == CONFLICT)
        print("")
        print(
            f"rebase STOPPED at {conflict.name}: {rel(repo)} is on {branch} with `git am -3` "
            f"in progress; patches/ and VERSION are unchanged. To resolve:"
        )
        for line in _conflict_commands(pin, state, conflict):
            print(f"  {line}")
        raise HdError(
            f"{conflict.name} conflicts with {version} "
            f"({', '.join(conflict.files)}); see the commands above"
        )
    _switch_back(pin, state)
    if with_tests:
        run_tests(pin, state, python)
        _finish(pin, state, branch)
    print(
        f"rebase: {branch} complete in {time.monotonic() - started:.1f} s; next: "
        f"{hd_command(pin, f'bump-pin --to {version}')}"
    )
    return 1 if _failed(state) else 0


def rebase_continue(pin: Pin, version: str, *, with_tests: bool, python: str) -> int:
    repo = pin.upstream_repo
    state = State.load(_state_file(pin, version))
    branch = rebase_branch(version)
    if am_in_progress(repo):
        unmerged = git_out("diff", "--name-only", "--diff-filter=U", cwd=repo)
        raise HdError(
            f"`git am` is still in progress in {rel(repo)} (unresolved: "
            f"{', '.join(unmerged.split()) or 'none; run am --continue'}).\n"
            f"Resolve, `git -C {rel(repo)} add <files>`, `git -C {rel(repo)} am --continue`, "
            "then run this again."
        )
    if not rev_exists(repo, branch):
        raise HdError(
            f"{rel(repo)} has no {branch}; start over: "
            + hd_command(pin, f"rebase --to {version} --restart")
        )
    if state.outcome != "complete" and current_branch(repo) != branch:
        raise HdError(f"{rel(repo)} is not on {branch}; git -C {rel(repo)} checkout {branch}")
    dirty = dirty_paths(repo)
    if dirty:
        raise HdError(f"{rel(repo)} has uncommitted changes: {', '.join(dirty[:10])}")
    if state.series_sha256 != _series_files(pin):
        raise HdError(
            "patches/ changed since the rebase started; start over: "
            + hd_command(pin, f"rebase --to {version} --restart")
        )
    _, patches = _series_with_patches(pin)
    _reclassify(pin, state, patches)
    _check_no_markers(repo, f"v{version}", branch)
    same_result = state.outcome == "complete" and state.head == git_out(
        "rev-parse", branch, cwd=repo
    )
    state.outcome = "complete"
    if not same_result or with_tests:  # test results only stay with the branch they ran on
        state.tests, state.tests_note = [], "not run (rebase without --with-tests)"
        state.tests_when = state.tests_fingerprint = ""
    check = _finish(pin, state, branch)
    _print_summary(pin, state, check)
    _switch_back(pin, state)
    if with_tests:
        run_tests(pin, state, python)
        _finish(pin, state, branch)
    print(f"rebase: {branch} complete; next: {hd_command(pin, f'bump-pin --to {version}')}")
    return 1 if _failed(state) else 0


def _failed(state: State) -> list[TestRun]:
    return [t for t in state.tests if t.rc not in (0, PYTEST_NO_TESTS)]


def _restore_checkout(repo: Path, target: str) -> None:
    """Check out a branch name or a commit (detached) again."""
    if rev_exists(repo, f"refs/heads/{target}"):
        git("checkout", "-q", target, cwd=repo)
    elif rev_exists(repo, target):
        git("checkout", "-q", "--detach", target, cwd=repo)


def _switch_back(pin: Pin, state: State) -> None:
    """After a complete rebase, give build/upstream back its previous checkout: other
    commands (apply, tests reading the tree) expect the pinned work tree there."""
    repo = pin.upstream_repo
    target = state.previous_checkout
    if target.startswith("rebase/"):  # an earlier rebase's branch: prefer the pinned one
        target = pin.applied_branch
    if not target or not rev_exists(repo, target):
        return
    _restore_checkout(repo, target)
    print(
        f"rebase: {rel(repo)} is back on {target}; "
        f"the result is branch {rebase_branch(state.version)}"
    )


def _check_no_markers(repo: Path, base: str, branch: str) -> None:
    proc = git("diff", "--check", base, branch, cwd=repo, check=False)
    markers = [
        line
        for line in proc.stdout.decode(errors="replace").splitlines()
        if "leftover conflict marker" in line
    ]
    if markers:
        raise HdError(f"{branch} still has conflict markers:\n  " + "\n  ".join(markers[:20]))


def _state_file(pin: Pin, version: str) -> Path:
    path = work_dir(pin, version) / STATE_FILE
    if not path.is_file():
        raise HdError(
            f"no rebase to {version} was started here ({rel(path)} is missing); run "
            + hd_command(pin, f"rebase --to {version}")
        )
    return path


# --- tests against the new tag ---------------------------------------------------------------

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|not run)\b")


def _counts(output: str) -> dict[str, int]:
    """The last pytest-style summary in output, e.g. {'passed': 210, 'skipped': 3}."""
    for line in reversed(output.splitlines()):
        found = _COUNT.findall(line)
        if found:
            return {kind: int(n) for n, kind in found}
    return {}


def _set_table_values(text: str, table_name: str, values: dict[str, str]) -> str:
    """TOML text with `key = "value"` lines of one [table] replaced (comments kept)."""
    head, sep, rest = text.partition(f"\n[{table_name}]\n")
    if not sep:
        raise HdError(f"VERSION has no [{table_name}] table")
    table, nxt, tail = rest.partition("\n[")
    for key, value in values.items():
        table, n = re.subn(
            rf'^{re.escape(key)}\s*=\s*"[^"\n]*"',
            lambda _m, k=key, v=value: f'{k} = "{v}"',
            table,
            count=1,
            flags=re.M,
        )
        if n != 1:
            raise HdError(f'VERSION: [{table_name}] has no `{key} = "..."` line')
    return head + sep + table + nxt + tail


def _bumped_version_text(
    text: str, release: dict[str, str], version: str, pairs: dict[str, list[str]] | None = None
) -> str:
    """VERSION's text moved to `version`: the [upstream] table, and the [pairs_with] pins the
    new wheel states (pairs: name -> [old, new])."""
    text = _set_table_values(
        text,
        "upstream",
        {
            "version": version,
            "sdist": release["sdist"],
            "sdist_sha256": release["sdist_sha256"],
            "wheel": release["wheel"],
            "wheel_sha256": release["wheel_sha256"],
        },
    )
    changed = {name: new for name, (_, new) in (pairs or {}).items() if new}
    return _set_table_values(text, "pairs_with", changed) if changed else text


# The [pairs_with] pins of VERSION, as the upstream wheel's Requires-Dist states them.
PAIRED_DISTRIBUTIONS = ("torch", "nvidia-cutlass-dsl")


def wheel_pins(wheel: Path) -> dict[str, str]:
    """`name==version` Requires-Dist pins of PAIRED_DISTRIBUTIONS in a wheel's METADATA."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            metadata = archive.read(names[0]).decode() if len(names) == 1 else ""
    except (OSError, zipfile.BadZipFile) as e:
        raise HdError(f"{wheel}: not a readable wheel ({e})") from e
    pins = {}
    for line in metadata.partition("\n\n")[0].splitlines():
        m = re.match(
            r"^Requires-Dist:\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*==\s*([^\s;,]+)\s*$", line
        )
        if m:
            name = re.sub(r"[-_.]+", "-", m[1]).lower()
            if name in PAIRED_DISTRIBUTIONS:
                pins[name] = m[3]
    return pins


# --- per-version upstream test requirements -------------------------------------------------

UPSTREAM_TEST_REQUIREMENTS = "ci/requirements-upstream-tests.txt"
# The lock upstream's own CUDA CI tests with, inside the sdist; the default requirements file
# takes its pins from the pinned release's copy of it.
UPSTREAM_TEST_LOCK = "requirements/test/cuda.txt"
_PIN_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)(\[[^\]]*\])?==([^\s;#]+)")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def upstream_test_requirements(pin: Pin, state: State) -> tuple[str | None, list[str]]:
    """ci/requirements-upstream-tests.txt for release X, and what changed.

    ci/requirements-upstream-tests-<X>.txt, when present, is used as is. Otherwise every
    `name==version` pin of the default file moves to the version that X's own test lock
    (requirements/test/cuda.txt in X's sdist) names, so the pins fit X's dependencies (e.g.
    transformers); names the lock lacks keep their pin.
    """
    per_tag = pin.root / f"ci/requirements-upstream-tests-{state.version}.txt"
    if per_tag.is_file():
        return per_tag.read_text(), [f"{per_tag.relative_to(pin.root).as_posix()} used as is"]
    default = pin.root / UPSTREAM_TEST_REQUIREMENTS
    if not default.is_file():
        return None, []
    sdist = pin.cache_dir / state.release["sdist"]
    if sha256_file(sdist) != state.release["sdist_sha256"]:
        raise HdError(f"{sdist} changed since it was verified; fetch it again")
    member = f"{pin.upstream_name}-{state.version}/{UPSTREAM_TEST_LOCK}"
    lock: dict[str, str] = {}
    try:
        with tarfile.open(sdist, "r:*") as archive:
            fh = archive.extractfile(member)
            text = fh.read().decode() if fh else ""
    except KeyError:
        text = ""
    for line in text.splitlines():
        m = _PIN_LINE.match(line.strip())
        if m:
            lock[_normalized(m[1])] = m[3]
    notes = [] if text else [f"{member} not in the sdist: default pins kept"]
    out = [
        f"# {UPSTREAM_TEST_REQUIREMENTS} for {state.version}: the default file with its pins "
        f"moved to {state.version}'s {UPSTREAM_TEST_LOCK} (written by hd.py rebase)."
    ]
    for line in default.read_text().splitlines():
        m = _PIN_LINE.match(line.strip())
        if m and lock.get(_normalized(m[1])) not in (None, m[3]):
            new = lock[_normalized(m[1])]
            notes.append(f"{m[1]}: {m[3]} -> {new} (from {state.version}'s test lock)")
            line = line.replace(f"=={m[3]}", f"=={new}", 1)
        out.append(line)
    return "\n".join(out) + "\n", notes


# --- per-version upstream test selection ----------------------------------------------------


def _without_exclusions(exclude: list, removals: list, where: str) -> list:
    """The exclusion entries minus the paths in removals ({path, reason} each)."""
    for removal in removals:
        path, reason = removal.get("path"), str(removal.get("reason", "")).strip()
        if not path or not reason:
            raise HdError(f"{where}.remove_exclude: every entry needs a path and a reason")
        found = False
        kept = []
        for entry in exclude:
            if entry.get("path") == path:
                found = True
                continue
            if path in (entry.get("paths") or []):
                found = True
                entry = {**entry, "paths": [p for p in entry["paths"] if p != path]}
                if not entry["paths"]:
                    continue
            kept.append(entry)
        if not found:
            raise HdError(f"{where}.remove_exclude: {path} is not excluded in the base file")
        exclude = kept
    return exclude


UPSTREAM_TESTS_CONFIG = "ci/upstream_tests.yaml"


def upstream_tests_config(pin: Pin, version: str) -> tuple[dict | None, list[str]]:
    """ci/upstream_tests.yaml with X's differences merged in, and what they were.

    The differences for a tag live in ci/upstream_tests-<X>.yaml or in a
    `versions: {"<X>": ...}` section of ci/upstream_tests.yaml (both may exist; the file
    is applied last). Per subset (cpu, gpu): `exclude` entries (path, reason, k) are added,
    `include` entries added, `remove_include` entries ({path, reason}) taken out of the
    include list (e.g. a test file upstream deleted), `remove_exclude` entries ({path,
    reason}) taken out of the exclusions (their file is gone), and other keys (min_passed,
    account_all, ...) replace the base value, explained by the section's `why:`.
    """
    import yaml

    base_path = pin.root / UPSTREAM_TESTS_CONFIG
    if not base_path.is_file():
        return None, []
    base = yaml.safe_load(base_path.read_text()) or {}
    if not isinstance(base, dict):
        raise HdError(f"{base_path}: expected a mapping at the top level")
    sections = []
    versions = base.pop("versions", None) or {}
    if not isinstance(versions, dict):
        raise HdError(f"{base_path}: versions: expected a mapping of version -> changes")
    if version in versions:
        sections.append((f"{UPSTREAM_TESTS_CONFIG} versions.{version}", versions[version]))
    per_tag = pin.root / f"ci/upstream_tests-{version}.yaml"
    if per_tag.is_file():
        sections.append(
            (per_tag.relative_to(pin.root).as_posix(), yaml.safe_load(per_tag.read_text()))
        )
    notes: list[str] = []
    for where, section in sections:
        if not isinstance(section, dict):
            raise HdError(f"{where}: expected a mapping of subset -> changes")
        for subset, changes in section.items():
            if subset not in base or not isinstance(base[subset], dict):
                raise HdError(f"{where}: {subset!r} is not a subset of {UPSTREAM_TESTS_CONFIG}")
            if not isinstance(changes, dict):
                raise HdError(f"{where}: {subset}: expected a mapping")
            target = base[subset]
            for key, value in changes.items():
                if key == "exclude":
                    for entry in value or []:
                        if not isinstance(entry, dict) or not str(entry.get("reason", "")).strip():
                            raise HdError(f"{where}: {subset}.exclude: every entry needs a reason")
                        k = f" (-k {entry['k']})" if entry.get("k") else ""
                        notes.append(f"{subset}: exclude {entry.get('path')}{k}: {entry['reason']}")
                    target["exclude"] = list(target.get("exclude") or []) + list(value or [])
                elif key == "include":
                    target["include"] = list(target.get("include") or []) + list(value or [])
                    notes += [f"{subset}: include {path}" for path in value or []]
                elif key == "remove_exclude":
                    target["exclude"] = _without_exclusions(
                        list(target.get("exclude") or []), value or [], f"{where}: {subset}"
                    )
                    notes += [
                        f"{subset}: drop exclusion {e['path']}: {e['reason']}" for e in value or []
                    ]
                elif key == "why":
                    continue
                elif key == "remove_include":
                    includes = list(target.get("include") or [])
                    for entry in value or []:
                        path, reason = entry.get("path"), str(entry.get("reason", "")).strip()
                        if path not in includes or not reason:
                            raise HdError(
                                f"{where}: {subset}.remove_include: {path!r} must be in the "
                                "base include list and carry a reason"
                            )
                        includes.remove(path)
                        notes.append(f"{subset}: remove include {path}: {reason}")
                    target["include"] = includes
                else:
                    why = changes.get("why")
                    if not why:
                        raise HdError(
                            f"{where}: {subset}.{key}: changing it needs a `why:` in that section"
                        )
                    notes.append(f"{subset}: {key} = {value!r} (base {target.get(key)!r}): {why}")
                    target[key] = value
    return base, notes


def _export_commits(repo: Path, base: str, branch: str) -> list[str]:
    return git_out("rev-list", "--reverse", f"{base}..{branch}", cwd=repo).split()


def stage_project(pin: Pin, state: State) -> Pin:
    """build/rebase/X/stage: a project root for X (VERSION, rebased patches, overlay, kernels,
    ci/) that the wheel, venv and test tooling can use as is."""
    stage = work_dir(pin, state.version) / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    for sub in ("patches", "vllm_overlay", "kernels", "ci", ".git", "tests"):
        shutil.rmtree(stage / sub, ignore_errors=True)
    (stage / "VERSION").write_text(
        _bumped_version_text(
            (pin.root / "VERSION").read_text(), state.release, state.version, state.pairs
        )
    )
    for sub in ("vllm_overlay", "kernels", "ci"):
        for src in tracked_files(pin.root, sub):
            dest = stage / src.relative_to(pin.root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
    config, state.tests_config_notes = upstream_tests_config(pin, state.version)
    if config is not None:
        import yaml

        (stage / UPSTREAM_TESTS_CONFIG).write_text(
            f"# {UPSTREAM_TESTS_CONFIG} with the differences for {state.version} merged in "
            "(hd.py rebase)\n" + yaml.safe_dump(config, sort_keys=False, width=100)
        )
    for extra in (stage / "ci").glob("upstream_tests-*.yaml"):
        extra.unlink()
    requirements, state.requirements_notes = upstream_test_requirements(pin, state)
    for extra in (stage / "ci").glob("requirements-upstream-tests-*.txt"):
        extra.unlink()
    if requirements is not None:
        (stage / UPSTREAM_TEST_REQUIREMENTS).write_text(requirements)
    cache = stage / ".cache"
    cache.mkdir(exist_ok=True)
    if not (cache / "upstream").exists():
        (cache / "upstream").symlink_to(pin.cache_dir.resolve())
    stage_pin = Pin.load(stage)
    (stage / "patches").mkdir()
    repo = pin.upstream_repo
    commits = _export_commits(repo, f"v{state.version}", rebase_branch(state.version))
    names = _format_patches(stage_pin, repo, commits, stage / "patches")
    (stage / "patches" / "series").write_text(_series_text(names))
    # Its own repository, so that tracked_files() sees the staged files (build/ is ignored).
    git("init", "-q", str(stage), cwd=stage)
    return stage_pin


# pytest's exit status when it collected nothing to run (e.g. every test skipped at import).
PYTEST_NO_TESTS = 5


def _shown(cmd: list[str]) -> str:
    """A command as the report shows it: paths relative to the project, python3 for us."""
    root = str(Path(__file__).resolve().parents[2]) + "/"
    words = ["python3" if word == sys.executable else word.replace(root, "") for word in cmd]
    return " ".join(shlex.quote(word) if "\n" not in word else "'<script>'" for word in words)


def _run_suite(name: str, cmd: list[str], env: dict[str, str] | None, cwd: Path) -> TestRun:
    shown = _shown(cmd)
    print(f"rebase: tests: {name}: {shown}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False
    )
    output = proc.stdout.decode(errors="replace")
    sys.stdout.write(output[-3000:])
    return TestRun(name, shown, proc.returncode, _counts(output), time.monotonic() - start)


# Imports each module named on the command line; prints a pytest-style count line.
_IMPORT_PROBE = """
import importlib, sys, traceback
failed = 0
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        failed += 1
        print(f"FAILED import {name}:")
        traceback.print_exc()
print(f"{len(sys.argv) - 1 - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
"""


def run_tests(pin: Pin, state: State, python: str) -> None:
    """Build X's wheel from the staged root, make its venv, run our and upstream's tests."""
    from hdtool.buildinfo import build_info_source
    from hdtool.wheel import build_wheel

    stage_pin = stage_project(pin, state)
    wheel_path = pin.cache_dir / state.release["wheel"]
    if sha256_file(wheel_path) != state.release["wheel_sha256"]:
        raise HdError(f"{wheel_path} changed since it was verified; fetch it again")
    start = time.monotonic()
    built = build_wheel(stage_pin, wheel_path, build_info_source(stage_pin))
    print(f"rebase: built {rel(built.path)} in {time.monotonic() - start:.0f} s")
    venv = work_dir(pin, state.version) / "venv"
    hd = [sys.executable, str(Path(__file__).resolve().parents[1] / "hd.py")]
    runs: list[TestRun] = []
    made = _run_suite(
        "venv",
        [
            *hd,
            "--root",
            str(stage_pin.root),
            "venv",
            "--if-stale",
            "--path",
            str(venv),
            "--wheel",
            str(built.path),
            "--python",
            python,
        ],
        None,
        pin.root,
    )
    if made.rc != 0:
        state.tests = [made]
        state.tests_note = "not run: making the venv failed"
        return
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    runs.append(
        _run_suite(
            "ours: tooling (CPU; synthetic trees, the same at every tag)",
            [sys.executable, "-m", "pytest", "tests/tooling", "-q", "-p", "no:cacheprovider"],
            env,
            pin.root,
        )
    )
    real_env = {
        **env,
        "HD_REQUIRE_REAL_PIN": "1",
        "HD_VENV": str(venv),
        "HD_ROOT": str(stage_pin.root),
    }
    runs.append(
        _run_suite(
            "ours: real pin (wheel venv)",
            [
                sys.executable,
                "-m",
                "pytest",
                "tests/test_real_pin.py",
                "-q",
                "-p",
                "no:cacheprovider",
            ],
            real_env,
            pin.root,
        )
    )
    runs.append(
        _run_suite(
            "ours: kernels (GPU tests skip without an SM90 GPU)",
            [
                str(venv / "bin" / "python"),
                "-m",
                "pytest",
                "tests/kernels",
                "-q",
                "-rs",
                "-p",
                "no:cacheprovider",
            ],
            env,
            pin.root,
        )
    )
    modules = sorted(
        dest[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        for dest in overlay_plan(stage_pin)
        if dest.endswith(".py")
    )
    runs.append(
        _run_suite(
            "ours: import every overlay/kernels module from the installed wheel (CPU)",
            [str(venv / "bin" / "python"), "-c", _IMPORT_PROBE, *modules],
            env,
            work_dir(pin, state.version),
        )
    )
    upstream_name = "upstream allow-list (CPU)"
    if not (stage_pin.root / UPSTREAM_TESTS_CONFIG).is_file():
        upstream = TestRun(
            upstream_name, "", 0, {}, 0.0, f"not run: this checkout has no {UPSTREAM_TESTS_CONFIG}"
        )
    else:
        upstream = _run_suite(
            upstream_name,
            [
                *hd,
                "--root",
                str(stage_pin.root),
                "upstream-tests",
                "--python",
                str(venv / "bin" / "python"),
                "--subset",
                "cpu",
            ],
            env,
            pin.root,
        )
        if upstream.rc == 2 and not upstream.counts:
            upstream.note = (
                "the upstream-tests command failed before running tests (see its output)"
            )
        elif upstream.counts.get("not run"):
            upstream.note = (
                f"PARTIAL: pytest stopped early (the subset's session_timeout), "
                f"{upstream.counts['not run']} selected tests did not run"
            )
    runs.append(upstream)
    state.tests = runs
    state.tests_when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    state.tests_fingerprint = fingerprint(stage_pin)
    ran = [t for t in runs if t.command]
    failed = [t.name for t in _failed(state)]
    empty = [t.name for t in ran if t.rc == PYTEST_NO_TESTS]
    skipped = [t.name for t in runs if not t.command]
    passed = len(ran) - len(failed) - len(empty)
    state.tests_note = (
        f"run with --with-tests: {passed} of {len(ran)} suites passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
        + (f"; ran nothing (all skipped): {', '.join(empty)}" if empty else "")
        + (f"; not run: {', '.join(skipped)}" if skipped else "")
        + " (counts below)"
    )


# --- bump-pin --------------------------------------------------------------------------------


def bump_pin(
    pin: Pin, version: str, *, allow_import_errors: bool, drop: tuple[str, ...] = ()
) -> int:
    _check_version(pin, version)
    repo = pin.upstream_repo
    state = State.load(_state_file(pin, version))
    branch = rebase_branch(version)
    redo = hd_command(pin, f"rebase --to {version} --continue")
    if state.from_version != pin.upstream_version:
        raise HdError(
            f"the rebase to {version} started from {state.from_version}, the pin is "
            f"{pin.upstream_version}; start over: "
            + hd_command(pin, f"rebase --to {version} --restart")
        )
    if am_in_progress(repo) or state.outcome != "complete":
        raise HdError(
            f"{branch} is not a complete rebase: `git am` stopped on a conflict"
            + (" and is still in progress" if am_in_progress(repo) else "")
            + f". Resolve it (see reports/rebase-{version}.md), then {redo}; "
            "nothing was changed"
        )
    bad = [p.name for p in state.patches if p.status in (CONFLICT, NOT_TRIED)]
    if bad:
        raise HdError(f"patches not carried over: {', '.join(bad)}; nothing was changed")
    # A patch missing from the branch after a hand-resolved stop was skipped, or the
    # whole `git am` was aborted: dropping it must be asked for by name.
    absent = [p.name for p in state.patches if p.status == ABSENT]
    unknown = sorted(set(drop) - {p.name for p in state.patches})
    if unknown:
        raise HdError(f"--drop names patches not in the series: {', '.join(unknown)}")
    unconfirmed = [name for name in absent if name not in drop]
    if unconfirmed:
        raise HdError(
            f"{branch} lacks {len(unconfirmed)} patches of the series: "
            f"{', '.join(unconfirmed)} (skipped with `git am --skip`, or the `git am` was "
            "aborted before --continue). Nothing was changed.\n"
            f"If upstream absorbed them, drop them by name: "
            + hd_command(
                pin, f"bump-pin --to {version} " + " ".join(f"--drop {n}" for n in unconfirmed)
            )
            + "\nElse start over and resolve them: "
            + hd_command(pin, f"rebase --to {version} --restart")
        )
    _require_clean_repo(pin, "bump-pin")
    if not rev_exists(repo, branch) or git_out("rev-parse", branch, cwd=repo) != state.head:
        raise HdError(
            f"{branch} changed since the rebase checked it (or is gone); re-check it: {redo}"
        )
    if state.series_sha256 != _series_files(pin):
        raise HdError(
            "patches/ changed since the rebase; redo it: "
            + hd_command(pin, f"rebase --to {version} --restart")
        )
    _check_no_markers(repo, f"v{version}", branch)
    for key in ("sdist", "wheel"):
        path = pin.cache_dir / state.release[key]
        if not path.is_file() or sha256_file(path) != state.release[f"{key}_sha256"]:
            raise HdError(f"{path} is missing or changed since the rebase verified it")
    _refuse_dirty_project(pin)

    check = check_overlay(pin, repo, branch, f"{branch} + overlay + kernels")
    clashes = collisions(pin, _tree_files(repo, branch))
    if clashes:
        raise HdError("the overlay collides with the new tree:\n  " + "\n  ".join(clashes))
    if check.problems and not allow_import_errors:
        lines = [f"{r.origin}:{r.line}: {r.statement}: {r.detail}" for r in check.problems]
        raise HdError(
            f"the overlay imports {len(check.problems)} names that {branch} lacks:\n  "
            + "\n  ".join(lines)
            + "\nPort the overlay first, or pass --allow-import-errors to move the pin now "
            "and port right after (make test will fail until then). Nothing was changed."
        )

    new_text = _bumped_version_text(
        (pin.root / "VERSION").read_text(), state.release, version, state.pairs
    )
    new_pin = dataclasses.replace(pin, upstream_version=version)
    commits = _export_commits(repo, f"v{version}", branch)
    exact, prefixes = reserved_paths(pin)
    for sha in commits:
        touched = git_out("diff-tree", "--no-commit-id", "-r", "--name-only", sha, cwd=repo)
        owned = [p for p in touched.splitlines() if is_reserved(p, exact, prefixes)]
        if owned:
            raise HdError(f"commit {sha[:12]} touches overlay-owned files: {', '.join(owned)}")
    with tempfile.TemporaryDirectory(prefix="hd-bump-") as tmp:
        names = _format_patches(new_pin, repo, commits, Path(tmp))
        exported = {name: (Path(tmp) / name).read_bytes() for name in names}
    exported["series"] = _series_text(names).encode()
    current = _patch_dir_files(pin)
    for name, data in exported.items():
        if current.get(name) != data:
            (pin.patches_dir / name).write_bytes(data)
    removed = [n for n in current if n != "series" and n not in exported]
    for name in removed:
        (pin.patches_dir / name).unlink()
    tmp_version = pin.root / "VERSION.partial"
    tmp_version.write_text(new_text)
    tmp_version.replace(pin.root / "VERSION")
    dropped = [p.name for p in state.patches if p.status in (EMPTY, ABSENT)]
    print(
        f"bump-pin: VERSION now pins {pin.upstream_name} {version} "
        f"({state.release['sdist_sha256'][:16]}..., {state.release['wheel_sha256'][:16]}...)"
    )
    print(f"bump-pin: patches/: {len(names)} patches exported from {branch}")
    for name in dropped:
        print(f"  dropped {name} (upstream absorbed it)")
    if check.problems:
        print(f"bump-pin: WARNING: {len(check.problems)} overlay imports are missing in {version}")
    print(
        "next: make apply && make check && make build-wheel && make test, then commit "
        "VERSION, patches/ and reports/"
    )
    return 0


def _refuse_dirty_project(pin: Pin) -> None:
    """VERSION and patches/ must have no uncommitted changes (when the project is in git)."""
    # The project's own git, not a GIT_DIR / GIT_WORK_TREE the caller has set.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", *args], cwd=pin.root, capture_output=True, text=True, check=False, env=env
        )

    inside = run("rev-parse", "--show-toplevel")
    if inside.returncode != 0 and "not a git repository" in inside.stderr:
        return  # not in git at all (e.g. a test project): nothing to protect
    if inside.returncode == 0 and Path(inside.stdout.strip()).resolve() != pin.root.resolve():
        return  # inside another repository, not a checkout of its own
    proc = run("status", "--porcelain", "--", "VERSION", "patches")
    if inside.returncode != 0 or proc.returncode != 0:
        raise HdError(
            f"git cannot read the project checkout {pin.root} "
            f"({(inside.stderr or proc.stderr).strip()}), so it cannot tell whether VERSION "
            "and patches/ are committed; fix that and run again. Nothing was changed."
        )
    if proc.stdout.strip():
        raise HdError(
            "VERSION or patches/ have uncommitted changes; commit or stash them first:\n"
            + proc.stdout.rstrip()
        )


# --- CLI -------------------------------------------------------------------------------------


def _cmd_rebase(args: argparse.Namespace, pin: Pin) -> int:
    if args.cont:
        if args.restart:
            raise HdError("--continue and --restart exclude each other")
        return rebase_continue(pin, args.to, with_tests=args.with_tests, python=args.python)
    return rebase(
        pin, args.to, restart=args.restart, with_tests=args.with_tests, python=args.python
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rebase",
        help="rebase the series onto a new upstream release (branch rebase/X) and report",
        description="Fetch and verify release X, import it (tag vX), `git am -3` the series "
        "onto it on branch rebase/X in build/upstream, classify each patch (clean, 3-way, "
        "conflict, now empty), import-check the overlay and kernels against the new tree, "
        "range-diff old vs new, and write reports/rebase-X.md. Never touches patches/, "
        "VERSION or hd/<pinned>; bump-pin does that.",
    )
    p.add_argument("--to", required=True, metavar="X", help="the upstream version, e.g. 0.30.0")
    p.add_argument(
        "--continue",
        dest="cont",
        action="store_true",
        help="after resolving a conflict (git am --continue): re-check rebase/X, rewrite the "
        "report",
    )
    p.add_argument(
        "--restart", action="store_true", help="replace an existing rebase/X and start over"
    )
    p.add_argument(
        "--with-tests",
        action="store_true",
        help="on success, build X's wheel, make its venv (several GB) and run the CPU tests",
    )
    p.add_argument(
        "--python", default=sys.executable, help="interpreter for the test venv (default: this)"
    )
    p.set_defaults(func=_cmd_rebase)

    p = sub.add_parser(
        "bump-pin",
        help="move VERSION to X and export rebase/X into patches/ (after a complete rebase)",
        description="Update VERSION's [upstream] table (version, file names, sha256s) to X and "
        "refresh patches/ from rebase/X. Refuses unless rebase/X is the complete, "
        "conflict-free rebase that `rebase --to X` checked and patches/ is unchanged since.",
    )
    p.add_argument("--to", required=True, metavar="X", help="the upstream version, e.g. 0.30.0")
    p.add_argument(
        "--allow-import-errors",
        action="store_true",
        help="move the pin even though overlay imports are missing in X (a port in progress)",
    )
    p.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="PATCH",
        help="drop this patch of the series, missing from rebase/X after a hand-resolved "
        "stop (skipped as absorbed upstream); repeat per patch",
    )
    p.set_defaults(
        func=lambda args, pin: bump_pin(
            pin, args.to, allow_import_errors=args.allow_import_errors, drop=tuple(args.drop)
        )
    )

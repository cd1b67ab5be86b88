"""build-wheel and verify-wheel: the pinned upstream wheel + series + overlay + kernels -> dist/.

Why patch the upstream wheel rather than build the sdist: the wheel carries vLLM's compiled CUDA
extensions (building them needs a CUDA toolchain and hours), and its vllm/ Python files equal the
sdist's, so the series, written against the source tree, applies to it as is.

Only the files the patch set touches are extracted and rewritten; every other member is copied
as its raw compressed bytes (see wheelfile.py for the measurements behind that choice).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import email.parser
import os
import re
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from hdtool.buildinfo import build_info_source
from hdtool.gitutil import git
from hdtool.index import write_index
from hdtool.overlay import collisions, overlay_plan
from hdtool.patchfile import FileChange, parse_patch, series_paths
from hdtool.pin import HdError, Pin, fingerprint
from hdtool.series import hd_command
from hdtool.wheelfile import (
    EXECUTABLE_FILE,
    REGULAR_FILE,
    DeterministicZipWriter,
    RecordRow,
    format_record,
    hash_to_record,
    member_digest,
    open_wheel,
    parse_record,
    record_hash,
)

# Only the changed/added files are compressed here (a few hundred KB), so the level hardly moves
# the build time; 6 is zlib's default and what the upstream wheel itself uses.
COMPRESSLEVEL = 6
PATCH_SCOPE = "vllm/"
VERSION_MODULE = "vllm/_version.py"
_LOCAL_LABEL = re.compile(r"^[a-z0-9]+(?:\.[a-z0-9]+)*$")


# --- names -----------------------------------------------------------------------------------


def _escaped(name: str) -> str:
    """A distribution name as wheel file and .dist-info names spell it."""
    return re.sub(r"[-_.]+", "_", name).lower()


def output_wheel_name(pin: Pin) -> str:
    """vllm-0.26.0-cp38-abi3-....whl -> vllm-0.26.0+hd.1-cp38-abi3-....whl"""
    prefix = f"{_escaped(pin.upstream_name)}-{pin.upstream_version}-"
    if not (pin.wheel.startswith(prefix) and pin.wheel.endswith(".whl")):
        raise HdError(f"VERSION: upstream wheel {pin.wheel!r} does not start with {prefix!r}")
    if not _LOCAL_LABEL.match(pin.local_label):
        raise HdError(
            f"VERSION: local_label {pin.local_label!r} is not a PEP 440 local label "
            "(lowercase letters and digits, dot-separated, e.g. hd.1)"
        )
    return f"{_escaped(pin.upstream_name)}-{pin.local_version}-{pin.wheel[len(prefix) :]}"


def dist_info_dir(pin: Pin, version: str) -> str:
    return f"{_escaped(pin.upstream_name)}-{version}.dist-info"


def data_dir(pin: Pin, version: str) -> str:
    return f"{_escaped(pin.upstream_name)}-{version}.data"


def version_tuple(upstream_tuple: tuple, local_label: str) -> tuple:
    """The relabelled __version_tuple__, shaped like setuptools-scm writes local versions:
    release fields, then the whole local label as one string, e.g. (0, 26, 0, 'hd.1').
    vllm.version._prev_minor_version_was reads fields 0 and 1 (ints, unchanged) and
    vllm.collect_env reads the last field as a git label only when it starts with 'g'."""
    return (*upstream_tuple, local_label)


# --- the series ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesPatch:
    path: Path
    changes: tuple[FileChange, ...]  # only the vllm/ part

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def paths(self) -> set[str]:
        return {p for c in self.changes for p in (c.old_path, c.new_path) if p is not None}


def load_series(pin: Pin) -> list[SeriesPatch]:
    """The series with each patch's vllm/ file changes; refuses changes the build cannot carry."""
    result = []
    for path in series_paths(pin):
        changes = []
        for change in parse_patch(path).file_changes:
            paths = [p for p in (change.old_path, change.new_path) if p is not None]
            inside = {p.startswith(PATCH_SCOPE) for p in paths}
            if inside == {True, False}:
                raise HdError(
                    f"{path.name}: moves a file across {PATCH_SCOPE} "
                    f"({change.old_path} -> {change.new_path}); the wheel only "
                    f"carries {PATCH_SCOPE}"
                )
            if True not in inside:
                continue
            for generated in (VERSION_MODULE, pin.build_info_module):
                if generated in paths:
                    raise HdError(
                        f"{path.name}: changes {generated}, which the wheel build "
                        "generates; drop that part of the patch"
                    )
            changes.append(change)
        result.append(SeriesPatch(path, tuple(changes)))
    return result


# --- git apply on a scratch tree -------------------------------------------------------------


def git_apply(tree: Path, patch: Path, *, reverse: bool = False) -> tuple[bool, str]:
    """git apply `patch`'s vllm/ part in `tree`; (succeeded, git's messages).

    Strict: the full context must match (no -C), whitespace errors are errors. Reversing only
    checks presence, so whitespace on lines the patch removes does not matter there. The
    ceiling keeps git off the enclosing checkout (build/ lies inside it): inside a repository,
    git apply would take paths relative to its top and silently skip ours."""
    args = ["apply", f"--include={PATCH_SCOPE}*", "--whitespace=error"]
    if reverse:
        args[-1:] = ["--reverse", "--whitespace=nowarn"]
    proc = git(
        *args,
        str(patch.resolve()),
        cwd=tree,
        check=False,
        env={"GIT_CEILING_DIRECTORIES": str(tree.parent)},
    )
    return proc.returncode == 0, proc.stderr.decode(errors="replace").strip()


def _extract(archive: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(archive.read(info))
    dest.chmod((info.external_attr >> 16) & 0o777 or 0o644)


@dataclass
class PatchedFiles:
    content: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # path -> (data, mode)
    deleted: set[str] = field(default_factory=set)


def apply_series(
    pin: Pin, series: list[SeriesPatch], archive: zipfile.ZipFile, tree: Path, upstream_label: str
) -> PatchedFiles:
    """git-apply each patch's vllm/ part to the touched files of `archive`, in series order."""
    members = {info.filename: info for info in archive.infolist()}
    tree.mkdir(parents=True)
    materialized: set[str] = set()
    width = len(str(len(series)))
    done: list[str] = []
    for index, patch in enumerate(series):
        number = f"  {index + 1:>{width}}"
        if not patch.changes:
            done.append(f"{number} ok        {patch.name} (no {PATCH_SCOPE} part)")
            continue
        for path in sorted(patch.paths - materialized):
            materialized.add(path)
            if path in members:
                _extract(archive, members[path], tree / path)
        applied, messages = git_apply(tree, patch.path)
        if not applied:
            pad = " " * (width + 13)
            lines = [
                f"the series does not apply to {upstream_label} "
                f"(git apply --whitespace=error, {PATCH_SCOPE} part only):",
                *done,
                f"{number} FAILED    {patch.name}",
                f"{pad}files: {', '.join(sorted(patch.paths))}",
            ]
            lines += [f"{pad}git: {msg}" for msg in messages.splitlines()]
            lines += [
                f"  {i:>{width}} not tried {p.name}"
                for i, p in enumerate(series[index + 1 :], index + 2)
            ]
            lines += [
                f"No wheel was written ({pin.dist_dir.name}/{output_wheel_name(pin)} is "
                "gone). To fix the patch:",
                f"  {hd_command(pin, 'apply')}   # stops at the failing patch and says "
                "how to resolve it",
                f"  {hd_command(pin, 'export')}  # writes the fixed patches back",
                f"  {hd_command(pin, 'build-wheel')}",
            ]
            raise HdError("\n".join(lines))
        done.append(f"{number} ok        {patch.name}")
    patched = PatchedFiles()
    for path in sorted(materialized):
        file = tree / path
        if file.is_file():
            mode = EXECUTABLE_FILE if file.stat().st_mode & 0o111 else REGULAR_FILE
            patched.content[path] = (file.read_bytes(), mode)
        elif path in members:
            patched.deleted.add(path)
    return patched


# --- overlay, kernels, generated module ------------------------------------------------------


@dataclass(frozen=True)
class AddedFile:
    data: bytes
    mode: int
    origin: str  # what the user edits to change it


def _file_mode(path: Path) -> int:
    return EXECUTABLE_FILE if path.stat().st_mode & 0o111 else REGULAR_FILE


def added_files(pin: Pin, build_info_text: str) -> dict[str, AddedFile]:
    """Wheel path -> content of every file the patch set adds (overlay, kernels, build info)."""
    added = {}
    for dest, src in overlay_plan(pin).items():
        origin = src.relative_to(pin.root).as_posix()
        if not dest.startswith(PATCH_SCOPE):
            raise HdError(
                f"{origin}: lands on {dest}, outside {PATCH_SCOPE}; the wheel only "
                f"carries the {PATCH_SCOPE} package"
            )
        added[dest] = AddedFile(src.read_bytes(), _file_mode(src), origin)
    added[pin.build_info_module] = AddedFile(
        build_info_text.encode(), REGULAR_FILE, "the generated build-info module"
    )
    return added


# --- relabelling -----------------------------------------------------------------------------


def relabel_metadata(text: str, old: str, new: str, origin: str) -> str:
    header, sep, body = text.partition("\n\n")
    lines = header.split("\n")
    found = [i for i, line in enumerate(lines) if line.startswith("Version:")]
    if len(found) != 1 or lines[found[0]].partition(":")[2].strip() != old:
        raise HdError(f"{origin}: expected one `Version: {old}` header line")
    lines[found[0]] = f"Version: {new}"
    return "\n".join(lines) + sep + body


_VERSION_ASSIGN = re.compile(r"^(__version__ = version = )(.+)$", re.M)
_TUPLE_ASSIGN = re.compile(r"^(__version_tuple__ = version_tuple = )(.+)$", re.M)


def read_version_module(text: str, origin: str) -> tuple[str, tuple]:
    """(__version__, __version_tuple__) of a setuptools-scm _version.py, read without running it."""
    values = {}
    for name, pattern in (("__version__", _VERSION_ASSIGN), ("__version_tuple__", _TUPLE_ASSIGN)):
        found = pattern.findall(text)
        if len(found) != 1:
            raise HdError(f"{origin}: expected one `{pattern.pattern[2:-6]}` line")
        try:
            values[name] = ast.literal_eval(found[0][1])
        except (ValueError, SyntaxError) as e:
            raise HdError(f"{origin}: {name} is not a literal ({e})") from e
    version, vtuple = values["__version__"], values["__version_tuple__"]
    if not isinstance(version, str) or not isinstance(vtuple, tuple):
        raise HdError(f"{origin}: __version__ must be a str and __version_tuple__ a tuple")
    return version, vtuple


def relabel_version_module(text: str, pin: Pin, origin: str) -> str:
    version, vtuple = read_version_module(text, origin)
    if version != pin.upstream_version:
        raise HdError(
            f"{origin}: __version__ is {version!r}, the pin says {pin.upstream_version!r}"
        )
    new_tuple = version_tuple(vtuple, pin.local_label)
    text = _VERSION_ASSIGN.sub(lambda m: m.group(1) + repr(pin.local_version), text)
    return _TUPLE_ASSIGN.sub(lambda m: m.group(1) + repr(new_tuple), text)


# --- the upstream wheel ----------------------------------------------------------------------


@dataclass
class Upstream:
    archive: zipfile.ZipFile
    members: dict[str, zipfile.ZipInfo]
    dist_info: str
    record: dict[str, RecordRow]

    @classmethod
    def open(cls, pin: Pin, path: Path) -> Upstream:
        archive = open_wheel(path)
        members = {info.filename: info for info in archive.infolist()}
        dist_info = dist_info_dir(pin, pin.upstream_version)
        found = sorted({n.split("/")[0] for n in members if n.split("/")[0].endswith(".dist-info")})
        if found != [dist_info]:
            raise HdError(f"{path}: expected exactly one {dist_info}/, found {found}")
        for needed in ("METADATA", "RECORD", "WHEEL"):
            if f"{dist_info}/{needed}" not in members:
                raise HdError(f"{path}: no {dist_info}/{needed}")
        if VERSION_MODULE not in members:
            raise HdError(f"{path}: no {VERSION_MODULE}")
        rows = parse_record(archive.read(f"{dist_info}/RECORD").decode(), f"{path}:RECORD")
        return cls(archive, members, dist_info, {row.path: row for row in rows})

    def read(self, name: str) -> bytes:
        return self.archive.read(self.members[name])

    def relabelled(self, pin: Pin) -> dict[str, bytes]:
        """The two rewritten text files, under their new wheel paths."""
        metadata = relabel_metadata(
            self.read(f"{self.dist_info}/METADATA").decode(),
            pin.upstream_version,
            pin.local_version,
            "METADATA",
        )
        version = relabel_version_module(self.read(VERSION_MODULE).decode(), pin, VERSION_MODULE)
        return {
            f"{dist_info_dir(pin, pin.local_version)}/METADATA": metadata.encode(),
            VERSION_MODULE: version.encode(),
        }

    def renamed(self, pin: Pin, name: str) -> str:
        """An upstream member's path in the relabelled wheel (.dist-info/.data renamed)."""
        top, sep, rest = name.partition("/")
        for make in (dist_info_dir, data_dir):
            if top == make(pin, pin.upstream_version):
                return make(pin, pin.local_version) + sep + rest
        return name


def _member_order(dist_info: str):
    record = f"{dist_info}/RECORD"
    # Wheel convention: .dist-info last so streaming installers meet it at the end, RECORD last.
    return lambda name: (name.startswith(dist_info + "/"), name == record, name)


# --- build -----------------------------------------------------------------------------------


@dataclass
class BuildResult:
    path: Path
    members: int
    changed: int
    seconds: dict[str, float]
    report: VerifyReport


def build_wheel(
    pin: Pin, upstream_wheel: Path, build_info_text: str, *, compresslevel: int = COMPRESSLEVEL
) -> BuildResult:
    """Write dist/<relabelled wheel>, verified; on any failure no wheel of that name is left."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    out_name = output_wheel_name(pin)
    out_path = pin.dist_dir / out_name
    # A failed build must not leave the previous wheel in place looking current.
    out_path.unlink(missing_ok=True)
    series = load_series(pin)
    added = added_files(pin, build_info_text)
    scratch_root = pin.root / "build"
    scratch_root.mkdir(parents=True, exist_ok=True)
    pin.dist_dir.mkdir(parents=True, exist_ok=True)
    partial = pin.dist_dir / f".{out_name}.partial-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="wheel-", dir=scratch_root) as scratch:
        try:
            up = Upstream.open(pin, upstream_wheel)
            with up.archive:
                patched = apply_series(
                    pin, series, up.archive, Path(scratch) / "tree", upstream_wheel.name
                )
                timings["apply"] = time.perf_counter() - start
                new_files = _new_contents(pin, up, patched, added)
                members = _write(pin, up, patched, new_files, partial, compresslevel)
            timings["write"] = time.perf_counter() - start - timings["apply"]
            mark = time.perf_counter()
            report = verify_wheel(pin, partial, upstream_wheel, expected_name=out_name)
            timings["verify"] = time.perf_counter() - mark
            os.replace(partial, out_path)
        finally:
            partial.unlink(missing_ok=True)
    timings["total"] = time.perf_counter() - start
    return BuildResult(out_path, members, len(new_files) + len(patched.deleted), timings, report)


def _new_contents(
    pin: Pin, up: Upstream, patched: PatchedFiles, added: dict[str, AddedFile]
) -> dict[str, tuple[bytes, int]]:
    """Wheel path -> (data, mode) of every member not copied from upstream as is."""
    existing = (set(up.members) - patched.deleted) | set(patched.content)
    problems = collisions(pin, existing)
    if problems:
        raise HdError(
            "files the patch set adds collide with the patched upstream wheel "
            "(change existing files with a patch; add new ones in vllm_overlay/ or "
            "kernels/):\n  " + "\n  ".join(problems)
        )
    new: dict[str, tuple[bytes, int]] = dict(patched.content)
    version_mode = (up.members[VERSION_MODULE].external_attr >> 16) or REGULAR_FILE
    for path, data in up.relabelled(pin).items():
        new[path] = (data, version_mode if path == VERSION_MODULE else REGULAR_FILE)
    for dest, item in added.items():
        new[dest] = (item.data, item.mode)
    return new


def _write(
    pin: Pin,
    up: Upstream,
    patched: PatchedFiles,
    new_files: dict[str, tuple[bytes, int]],
    out: Path,
    compresslevel: int,
) -> int:
    dist_info = dist_info_dir(pin, pin.local_version)
    record_name = f"{dist_info}/RECORD"
    plan: dict[str, zipfile.ZipInfo | tuple[bytes, int]] = {}
    for name, info in up.members.items():
        if name in patched.deleted or name == f"{up.dist_info}/RECORD":
            continue
        if name.startswith(f"{up.dist_info}/RECORD."):  # RECORD.jws/.p7s: signs the old RECORD
            continue
        plan[up.renamed(pin, name)] = info
    plan.update(new_files)
    rows = []
    for name in sorted(plan):
        entry = plan[name]
        if isinstance(entry, tuple):
            rows.append(RecordRow(name, record_hash(entry[0]), str(len(entry[0]))))
            continue
        known = up.record.get(entry.filename)
        if known and known.hash.startswith("sha256=") and known.size == str(entry.file_size):
            # The upstream wheel is sha256-pinned, so its RECORD is too; verify re-hashes all.
            rows.append(RecordRow(name, known.hash, known.size))
        else:
            digest, size = member_digest(up.archive, entry)
            rows.append(RecordRow(name, hash_to_record(digest), str(size)))
    rows.append(RecordRow(record_name, "", ""))
    plan[record_name] = (format_record(rows), REGULAR_FILE)
    with open(up.archive.filename, "rb") as source, open(out, "wb") as fh:
        writer = DeterministicZipWriter(fh)
        for name in sorted(plan, key=_member_order(dist_info)):
            entry = plan[name]
            if isinstance(entry, tuple):
                writer.add_bytes(name, entry[0], mode=entry[1], compresslevel=compresslevel)
            else:
                writer.copy_raw(name, source, entry)
        writer.close()
        fh.flush()
        os.fsync(fh.fileno())
    return len(plan)


# --- verify ----------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    members: int
    overlay: int
    kernels: int
    patches: int  # patches in the series
    patches_in_scope: int  # of those, patches with a vllm/ part (all checked present)
    fingerprint: str


def read_build_info(text: str, origin: str) -> dict[str, object]:
    """The literal top-level assignments of the build-info module, read without running it."""
    try:
        tree = ast.parse(text, origin)
    except SyntaxError as e:
        raise HdError(f"{origin}: not valid Python ({e})") from e
    values: dict[str, object] = {}
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else ([node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        )
        for target in targets:
            if isinstance(target, ast.Name):
                with contextlib.suppress(ValueError):
                    values[target.id] = ast.literal_eval(node.value)
    return values


def verify_wheel(
    pin: Pin, wheel: Path, upstream_wheel: Path, *, expected_name: str | None = None
) -> VerifyReport:
    """Check a built wheel against the pin and this checkout; HdError names the first problem."""
    name = expected_name or wheel.name
    if name != output_wheel_name(pin):
        raise HdError(f"{wheel}: named {name}, the pin builds {output_wheel_name(pin)}")
    archive = open_wheel(wheel)
    up = Upstream.open(pin, upstream_wheel)
    with archive, up.archive:
        members = {info.filename: info for info in archive.infolist()}
        digests = _check_record(pin, wheel, archive, members)
        _check_relabel(pin, wheel, archive, up)
        found_fingerprint = _check_build_info(pin, wheel, archive)
        series = load_series(pin)
        added = added_files(pin, "")
        del added[pin.build_info_module]
        for dest, item in sorted(added.items()):
            if dest not in digests:
                raise HdError(f"{wheel}: {item.origin} is missing (expected at {dest})")
            if digests[dest] != record_hash(item.data):
                raise HdError(f"{wheel}: {dest} differs from {item.origin}")
        touched = _check_patches(pin, series, archive, up, wheel)
        _check_members(pin, wheel, digests, up, touched, set(added))
        _check_python_compiles(wheel, archive, touched | set(added))
    overlay_count = sum(1 for item in added.values() if item.origin.startswith("vllm_overlay/"))
    return VerifyReport(
        len(members),
        overlay_count,
        len(added) - overlay_count,
        len(series),
        sum(1 for p in series if p.changes),
        found_fingerprint,
    )


def _check_record(
    pin: Pin, wheel: Path, archive: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo]
) -> dict[str, str]:
    """RECORD lists exactly the members, with their sha256 and size; returns path -> hash."""
    dist_info = dist_info_dir(pin, pin.local_version)
    record_name = f"{dist_info}/RECORD"
    tops = sorted({n.split("/")[0] for n in members if n.split("/")[0].endswith(".dist-info")})
    if tops != [dist_info]:
        raise HdError(f"{wheel}: expected exactly one {dist_info}/, found {tops}")
    if record_name not in members:
        raise HdError(f"{wheel}: no {record_name}")
    rows = parse_record(archive.read(record_name).decode(), f"{wheel}:{record_name}")
    listed = [row.path for row in rows]
    if len(listed) != len(set(listed)):
        raise HdError(f"{wheel}: RECORD lists a path twice")
    if set(listed) != set(members):
        extra, missing = sorted(set(listed) - set(members)), sorted(set(members) - set(listed))
        raise HdError(
            f"{wheel}: RECORD and the archive disagree; only in RECORD: {extra[:5]}, "
            f"not in RECORD: {missing[:5]}"
        )
    digests: dict[str, str] = {}
    for row in rows:
        if row.path == record_name:
            if row.hash or row.size:
                raise HdError(f"{wheel}: RECORD's own row must have empty hash and size")
            continue
        digest, size = member_digest(archive, members[row.path])
        digests[row.path] = hash_to_record(digest)
        if row.hash != digests[row.path] or row.size != str(size):
            raise HdError(
                f"{wheel}: {row.path}: RECORD says {row.hash},{row.size}; "
                f"the member is {digests[row.path]},{size}"
            )
    return digests


def _check_relabel(pin: Pin, wheel: Path, archive: zipfile.ZipFile, up: Upstream) -> None:
    dist_info = dist_info_dir(pin, pin.local_version)
    metadata = email.parser.HeaderParser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
    if metadata["Name"] != pin.upstream_name or metadata["Version"] != pin.local_version:
        raise HdError(
            f"{wheel}: METADATA says {metadata['Name']} {metadata['Version']}, "
            f"expected {pin.upstream_name} {pin.local_version}"
        )
    version, vtuple = read_version_module(archive.read(VERSION_MODULE).decode(), VERSION_MODULE)
    _, up_tuple = read_version_module(up.read(VERSION_MODULE).decode(), "upstream")
    expected_tuple = version_tuple(up_tuple, pin.local_label)
    if (version, vtuple) != (pin.local_version, expected_tuple):
        raise HdError(
            f"{wheel}: {VERSION_MODULE} says {version!r} {vtuple!r}, expected "
            f"{pin.local_version!r} {expected_tuple!r}"
        )
    for path, data in up.relabelled(pin).items():
        if archive.read(path) != data:
            raise HdError(f"{wheel}: {path} differs from the relabelled upstream file")


def stale_install(pin: Pin, package_dir: Path) -> str | None:
    """Why the vllm package installed at ``package_dir`` is not a build of this checkout
    (no build-info module: stock vLLM; another FINGERPRINT: built from other patches,
    overlay or kernels), or None when it is."""
    info = package_dir.parent / pin.build_info_module
    if not info.is_file():
        return f"the vllm at {package_dir} carries no patch set (no {pin.build_info_module})"
    found = read_build_info(info.read_text(), str(info)).get("FINGERPRINT")
    expected = fingerprint(pin)
    if found != expected:
        return (
            f"the vllm at {package_dir} was built from another tree (FINGERPRINT "
            f"{str(found)[:16]}..., this checkout {expected[:16]}...)"
        )
    return None


def _check_build_info(pin: Pin, wheel: Path, archive: zipfile.ZipFile) -> str:
    if pin.build_info_module not in archive.NameToInfo:
        raise HdError(f"{wheel}: no {pin.build_info_module}")
    values = read_build_info(archive.read(pin.build_info_module).decode(), pin.build_info_module)
    found, expected = values.get("FINGERPRINT"), fingerprint(pin)
    if found != expected:
        raise HdError(
            f"{wheel}: built from a different patch set (FINGERPRINT {found!r}, this "
            f"checkout is {expected!r}); rebuild with `make build-wheel`"
        )
    return expected


def _check_patches(
    pin: Pin, series: list[SeriesPatch], archive: zipfile.ZipFile, up: Upstream, wheel: Path
) -> set[str]:
    """Reverting the series (last patch first) on the wheel's files must give upstream's."""
    touched = set().union(*(p.paths for p in series))
    if not touched:
        return touched
    scratch_root = pin.root / "build"
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="verify-", dir=scratch_root) as scratch:
        tree = Path(scratch) / "tree"
        tree.mkdir()
        for path in sorted(touched):
            if path in archive.NameToInfo:
                _extract(archive, archive.NameToInfo[path], tree / path)
        for patch in reversed(series):
            if not patch.changes:
                continue
            reverted, messages = git_apply(tree, patch.path, reverse=True)
            if not reverted:
                raise HdError(
                    f"{wheel}: the {PATCH_SCOPE} hunks of {patch.name} are not all in "
                    f"the wheel (git apply --reverse):\n{messages}"
                )
        for path in sorted(touched):
            file = tree / path
            now = file.read_bytes() if file.is_file() else None
            before = up.read(path) if path in up.members else None
            if now != before:
                raise HdError(
                    f"{wheel}: {path} still differs from upstream after reverting the "
                    "series: the wheel has changes no patch explains"
                )
    return touched


def _check_members(
    pin: Pin, wheel: Path, digests: dict[str, str], up: Upstream, touched: set[str], added: set[str]
) -> None:
    """The wheel holds exactly upstream's files (renamed .dist-info) plus and minus what the
    patch set owns, and every file the patch set does not own is upstream's, byte for byte."""
    dist_info = dist_info_dir(pin, pin.local_version)
    generated = {pin.build_info_module, f"{dist_info}/RECORD"}
    present = set(digests) | {f"{dist_info}/RECORD"}
    expected = {
        up.renamed(pin, n)
        for n in up.members
        if n not in touched and not n.startswith(f"{up.dist_info}/RECORD")
    }
    # Which touched files exist is settled by _check_patches (reverting gives upstream's).
    expected |= added | generated | (touched & present)
    if expected != present:
        extra, lost = sorted(present - expected), sorted(expected - present)
        raise HdError(f"{wheel}: unexpected members {extra[:5]}; missing members {lost[:5]}")
    owned = touched | added | generated | {VERSION_MODULE, f"{dist_info}/METADATA"}
    by_new_name = {up.renamed(pin, n): n for n in up.members}
    for name in sorted(present - owned):
        source = by_new_name[name]
        row = up.record.get(source)
        upstream_hash = row.hash if row and row.hash else record_hash(up.read(source))
        if digests[name] != upstream_hash:
            raise HdError(f"{wheel}: {name} differs from upstream but no patch changes it")


def _check_python_compiles(wheel: Path, archive: zipfile.ZipFile, paths: set[str]) -> None:
    for path in sorted(paths):
        if path.endswith(".py") and path in archive.NameToInfo:
            try:
                compile(archive.read(path), path, "exec", dont_inherit=True)
            except SyntaxError as e:
                raise HdError(f"{wheel}: {path} does not compile: {e}") from e


# --- commands --------------------------------------------------------------------------------


def _upstream_wheel(pin: Pin) -> Path:
    from hdtool.fetch import ensure_upstream_files

    return Path(ensure_upstream_files(pin)[1])


def _print_report(path: Path, report: VerifyReport) -> None:
    if report.patches:
        patches = (
            f"{report.patches_in_scope} of {report.patches} patches have {PATCH_SCOPE} hunks, "
            "all present"
        )
    else:
        patches = "the series is empty"
    print(
        f"verified {path.name}: {report.members} members, RECORD hashes and sizes match; "
        f"{report.overlay} overlay and {report.kernels} kernels files byte-identical; "
        f"{patches}; FINGERPRINT {report.fingerprint[:16]}..."
    )


def cmd_build_wheel(args: argparse.Namespace, pin: Pin) -> int:
    upstream = _upstream_wheel(pin)
    result = build_wheel(pin, upstream, build_info_source(pin), compresslevel=args.compresslevel)
    size_mb = result.path.stat().st_size / 1e6
    t = result.seconds
    print(
        f"wrote {result.path.relative_to(pin.root)} ({size_mb:.1f} MB, {result.members} members, "
        f"{result.changed} added/changed/removed) in {t['total']:.1f} s "
        f"(apply {t['apply']:.1f} s, write {t['write']:.1f} s, verify {t['verify']:.1f} s)"
    )
    _print_report(result.path, result.report)
    if (pin.dist_dir / "simple").is_dir():
        # An index listing the previous wheel's sha256 would make pip refuse the new one.
        write_index(pin.dist_dir)
        print(f"refreshed {pin.dist_dir.name}/simple/ for the new wheel")
    return 0


def cmd_verify_wheel(args: argparse.Namespace, pin: Pin) -> int:
    wheel = args.wheel or pin.dist_dir / output_wheel_name(pin)
    if not wheel.is_file():
        raise HdError(f"{wheel}: no such wheel; build it with `make build-wheel`")
    start = time.perf_counter()
    report = verify_wheel(pin, wheel, _upstream_wheel(pin))
    _print_report(wheel, report)
    print(f"verify took {time.perf_counter() - start:.1f} s")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    build = sub.add_parser(
        "build-wheel",
        help="patch the pinned upstream wheel into dist/<name>-<version>+<label>",
        description="Apply the series' vllm/ part, the overlay and the kernels to the pinned "
        "upstream wheel, relabel it, write it to dist/ and verify it.",
    )
    build.add_argument(
        "--compresslevel",
        type=int,
        default=COMPRESSLEVEL,
        choices=range(0, 10),
        metavar="0-9",
        help="zlib level for changed/added members (default %(default)s)",
    )
    build.set_defaults(func=cmd_build_wheel)
    verify = sub.add_parser(
        "verify-wheel", help="check a built wheel against the pin and this checkout"
    )
    verify.add_argument("wheel", nargs="?", type=Path, help="default: dist/ wheel named by the pin")
    verify.set_defaults(func=cmd_verify_wheel)

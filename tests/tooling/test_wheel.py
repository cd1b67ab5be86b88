"""build-wheel / verify-wheel on a synthetic upstream wheel: relabel, RECORD, patches, overlay."""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import re
import zipfile
from pathlib import Path

import pytest
from tests.tooling.wheel_helpers import (
    BUILD_INFO,
    ENGINE_PY,
    KERNELS_DEST,
    OUT_NAME,
    Project,
    build_info_text,
    engine_py,
    make_project,
    upstream_wheel_members,
)

from hdtool.pin import HdError, fingerprint
from hdtool.wheel import build_wheel, read_version_module, stale_install, verify_wheel
from hdtool.wheelfile import record_hash

DIST_INFO = "vllm-0.26.0+hd.1.dist-info"
UPSTREAM_DIST_INFO = "vllm-0.26.0.dist-info"


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return make_project(tmp_path / "proj")


def build(project: Project, **kwargs) -> Path:
    pin = project.pin
    return build_wheel(pin, project.upstream_wheel, build_info_text(pin), **kwargs).path


def read_members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def rewrite_wheel(path: Path, change) -> None:
    """Rewrite the archive with `change(members)` applied (a tampering tool for the tests)."""
    members = read_members(path)
    change(members)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def fix_record(members: dict[str, bytes]) -> None:
    """Recompute RECORD so that only the content check under test can fail."""
    rows = [
        f"{n},{record_hash(d)},{len(d)}\n" for n, d in members.items() if n != f"{DIST_INFO}/RECORD"
    ]
    members[f"{DIST_INFO}/RECORD"] = ("".join(rows) + f"{DIST_INFO}/RECORD,,\n").encode()


def test_relabel_round_trip(project: Project) -> None:
    project.add_patch(
        "Tune engine args", {"vllm/engine/args.py": engine_py(line_10="line_10 = 'ten'")}
    )
    wheel = build(project)
    assert wheel == project.root / "dist" / OUT_NAME
    built = read_members(wheel)
    upstream = {n: d for n, (d, _) in upstream_wheel_members().items()}

    # Relabelled: dist-info directory, METADATA's Version header (only), _version.py.
    assert not any(n.startswith(UPSTREAM_DIST_INFO) for n in built)
    metadata = built[f"{DIST_INFO}/METADATA"].decode()
    assert metadata == upstream[f"{UPSTREAM_DIST_INFO}/METADATA"].decode().replace(
        "\nVersion: 0.26.0\n", "\nVersion: 0.26.0+hd.1\n", 1
    )
    assert "Version: this line is in the description" in metadata
    version, vtuple = read_version_module(built["vllm/_version.py"].decode(), "built")
    assert (version, vtuple) == ("0.26.0+hd.1", (0, 26, 0, "hd.1"))
    assert "__commit_id__ = commit_id = 'gffd46bfab'" in built["vllm/_version.py"].decode()

    # Everything else from upstream comes back byte for byte (dist-info files renamed).
    relabelled = {f"{UPSTREAM_DIST_INFO}/METADATA", "vllm/_version.py", "vllm/engine/args.py"}
    for name, data in upstream.items():
        if name not in relabelled:
            assert built[name.replace(UPSTREAM_DIST_INFO, DIST_INFO)] == data, name
    assert built["vllm/engine/args.py"] == engine_py(line_10="line_10 = 'ten'").encode()

    # Added: overlay, kernels (without tests/ and caches), build info with the fingerprint.
    pin = project.pin
    assert (
        built["vllm/models/kimi_linear/sm90/specialized_decode/__init__.py"]
        == (
            project.root
            / "vllm_overlay/vllm/models/kimi_linear/sm90/specialized_decode/__init__.py"
        ).read_bytes()
    )
    assert f"{KERNELS_DEST}/ops/rmsnorm.py" in built
    assert f"{KERNELS_DEST}/__init__.py" in built
    assert not any(
        "/tests/" in n or "__pycache__" in n for n in built if n.startswith(KERNELS_DEST)
    )
    info = ast.literal_eval(built[BUILD_INFO].decode().split("FINGERPRINT = ")[1].split("\n")[0])
    assert info == fingerprint(pin)
    expected = set(upstream) - {f"{UPSTREAM_DIST_INFO}/RECORD"}
    expected = {n.replace(UPSTREAM_DIST_INFO, DIST_INFO) for n in expected}
    expected |= {
        f"{DIST_INFO}/RECORD",
        BUILD_INFO,
        f"{KERNELS_DEST}/__init__.py",
        f"{KERNELS_DEST}/ops/rmsnorm.py",
    }
    expected |= {
        f"vllm/{p.relative_to(project.root / 'vllm_overlay/vllm').as_posix()}"
        for p in (project.root / "vllm_overlay").rglob("*.py")
    }
    assert set(built) == expected


def test_layout_and_determinism(project: Project) -> None:
    wheel = build(project)
    first = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with zipfile.ZipFile(wheel) as archive:
        infos = archive.infolist()
    names = [i.filename for i in infos]
    dist_info_at = names.index(next(n for n in names if n.startswith(DIST_INFO)))
    assert all(n.startswith(DIST_INFO) for n in names[dist_info_at:]), "dist-info comes last"
    assert names[-1] == f"{DIST_INFO}/RECORD"
    assert names[:dist_info_at] == sorted(names[:dist_info_at])
    assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
    modes = {i.filename: i.external_attr >> 16 for i in infos}
    assert modes["vllm/_C.abi3.so"] == 0o100755
    assert modes[BUILD_INFO] == 0o100644
    assert build(project) == wheel
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == first


def test_record_lists_every_member_with_hash_and_size(project: Project) -> None:
    wheel = build(project)
    members = read_members(wheel)
    rows = list(csv.reader(io.StringIO(members[f"{DIST_INFO}/RECORD"].decode())))
    assert {r[0] for r in rows} == set(members)
    for path, digest, size in rows:
        if path == f"{DIST_INFO}/RECORD":
            assert (digest, size) == ("", "")
        else:
            assert (digest, size) == (record_hash(members[path]), str(len(members[path])))
    report = verify_wheel(project.pin, wheel, project.upstream_wheel)
    assert (report.overlay, report.kernels) == (3, 2)


def test_verify_catches_a_changed_member(project: Project) -> None:
    wheel = build(project)

    def flip(members: dict[str, bytes]) -> None:
        data = bytearray(members["vllm/_C.abi3.so"])
        data[100] ^= 1
        members["vllm/_C.abi3.so"] = bytes(data)

    rewrite_wheel(wheel, flip)
    with pytest.raises(HdError, match=r"vllm/_C.abi3.so: RECORD says sha256="):
        verify_wheel(project.pin, wheel, project.upstream_wheel)


def test_verify_catches_a_changed_record(project: Project) -> None:
    wheel = build(project)

    def edit(members: dict[str, bytes]) -> None:
        record = members[f"{DIST_INFO}/RECORD"].decode()
        row = next(line for line in record.splitlines() if line.startswith("vllm/engine/old.py,"))
        members[f"{DIST_INFO}/RECORD"] = record.replace(row, row[:-1] + "9").encode()

    rewrite_wheel(wheel, edit)
    with pytest.raises(HdError, match=r"vllm/engine/old.py: RECORD says"):
        verify_wheel(project.pin, wheel, project.upstream_wheel)


def test_verify_catches_corrupt_bytes(project: Project) -> None:
    wheel = build(project)
    data = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo("vllm/_C.abi3.so")
    data[info.header_offset + 30 + len(info.filename) + 10] ^= 0xFF  # inside the deflate stream
    wheel.write_bytes(bytes(data))
    with pytest.raises(HdError, match=r"vllm/_C.abi3.so"):
        verify_wheel(project.pin, wheel, project.upstream_wheel)


def test_verify_catches_a_missing_hunk(project: Project) -> None:
    project.add_patch(
        "Tune engine args", {"vllm/engine/args.py": engine_py(line_10="line_10 = 'ten'")}
    )
    wheel = build(project)

    def revert(members: dict[str, bytes]) -> None:
        members["vllm/engine/args.py"] = ENGINE_PY.encode()
        fix_record(members)

    rewrite_wheel(wheel, revert)
    with pytest.raises(HdError, match=r"hunks of Tune-engine-args.patch are not all in the wheel"):
        verify_wheel(project.pin, wheel, project.upstream_wheel)


def test_verify_catches_an_unexplained_change(project: Project) -> None:
    wheel = build(project)

    def edit(members: dict[str, bytes]) -> None:
        members["vllm/engine/old.py"] = b"OLD = 2\n"
        fix_record(members)

    rewrite_wheel(wheel, edit)
    with pytest.raises(HdError, match=r"vllm/engine/old.py differs from upstream"):
        verify_wheel(project.pin, wheel, project.upstream_wheel)


def test_verify_catches_a_stale_fingerprint(project: Project) -> None:
    wheel = build(project)
    project.write("kernels/ops/rmsnorm.py", "EPS = 1e-5\n")
    with pytest.raises(HdError, match=r"built from a different patch set"):
        verify_wheel(project.pin, wheel, project.upstream_wheel)


def test_an_install_of_another_tree_is_named_stale(project: Project, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(build(project)) as archive:
        archive.extractall(site)
    assert stale_install(project.pin, site / "vllm") is None
    project.write("kernels/ops/rmsnorm.py", "EPS = 1e-5\n")  # edited since the build
    assert "built from another tree" in stale_install(project.pin, site / "vllm")
    (site / project.pin.build_info_module).unlink()  # stock vLLM
    assert "carries no patch set" in stale_install(project.pin, site / "vllm")


def test_patches_create_delete_and_skip_non_vllm_parts(project: Project) -> None:
    project.add_patch("Docs only", {"docs/guide.md": "# Guide\n\nMore text.\n"})
    project.add_patch(
        "Add a module and drop another",
        {
            "vllm/engine/new_part.py": "NEW = 1\n",
            "vllm/engine/old.py": None,
            "docs/guide.md": "# Guide\n\nEven more.\n",
        },
    )
    project.add_patch("Edit the new module", {"vllm/engine/new_part.py": "NEW = 2\n"})
    wheel = build(project)
    built = read_members(wheel)
    assert built["vllm/engine/new_part.py"] == b"NEW = 2\n"
    assert "vllm/engine/old.py" not in built
    assert not any(n.startswith("docs/") for n in built)
    assert verify_wheel(project.pin, wheel, project.upstream_wheel).patches_in_scope == 2


def test_patch_renaming_a_file(project: Project) -> None:
    edited = engine_py(line_7="line_7 = 'seven'")
    patch = project.add_patch(
        "Rename args",
        {"vllm/engine/arguments.py": edited},
        renames={"vllm/engine/args.py": "vllm/engine/arguments.py"},
    )
    assert "rename from vllm/engine/args.py" in patch.read_text()
    wheel = build(project)
    built = read_members(wheel)
    assert "vllm/engine/args.py" not in built
    assert built["vllm/engine/arguments.py"] == edited.encode()
    assert verify_wheel(project.pin, wheel, project.upstream_wheel).patches_in_scope == 1


def test_overlay_collision_refused(project: Project) -> None:
    project.write("vllm_overlay/vllm/engine/args.py", "# replaces upstream\n")
    with pytest.raises(HdError, match=r"vllm/engine/args.py already exists upstream"):
        build(project)
    assert not (project.root / "dist" / OUT_NAME).exists()


def test_overlay_collision_with_a_patch_created_file_refused(project: Project) -> None:
    project.add_patch("Add a module", {"vllm/engine/added.py": "A = 1\n"})
    project.write("vllm_overlay/vllm/engine/added.py", "A = 2\n")
    with pytest.raises(HdError, match=r"vllm/engine/added.py already exists upstream"):
        build(project)


@pytest.mark.parametrize("breakage", ["context", "whitespace"])
def test_patch_that_does_not_apply_leaves_no_wheel(project: Project, breakage: str) -> None:
    build(project)  # a previous good wheel must not survive a failed build
    assert (project.root / "dist" / OUT_NAME).exists()
    project.add_patch("First fix", {"vllm/engine/args.py": engine_py(line_3="line_3 = 'three'")})
    second = project.add_patch(
        "Second fix",
        {
            "vllm/engine/args.py": engine_py(
                line_3="line_3 = 'three'", line_15="line_15 = 'fifteen'"
            )
        },
    )
    project.add_patch("Third fix", {"vllm/engine/__init__.py": "X = 1\n"})
    text = second.read_text()
    if breakage == "context":  # upstream moved on under the patch
        text = text.replace("\n line_14 = 14\n", "\n line_14 = 'fourteen'\n")
    else:  # only whitespace differs: git apply --ignore-whitespace would take it
        text = text.replace("\n line_14 = 14\n", "\n line_14 =  14\n")
    second.write_text(text)
    with pytest.raises(HdError) as failure:
        build(project)
    message = str(failure.value)
    assert "1 ok        First-fix.patch" in message
    assert "2 FAILED    Second-fix.patch" in message
    assert "files: vllm/engine/args.py" in message
    assert "git: error: patch failed: vllm/engine/args.py" in message
    assert "3 not tried Third-fix.patch" in message
    assert re.search(r"hd\.py (--root \S+ )?apply", message)
    assert not (project.root / "dist" / OUT_NAME).exists()
    assert list((project.root / "dist").iterdir()) == []
    assert list((project.root / "build").iterdir()) == []


def test_patch_adding_trailing_whitespace_refused(project: Project) -> None:
    project.add_patch("Sloppy", {"vllm/engine/args.py": engine_py(line_5="line_5 = 5 ")})
    with pytest.raises(HdError, match=r"trailing whitespace"):
        build(project)


def test_patch_touching_version_module_refused(project: Project) -> None:
    project.add_patch("Bump version", {"vllm/_version.py": "__version__ = 'x'\n"})
    with pytest.raises(HdError, match=r"changes vllm/_version.py, which the wheel build generates"):
        build(project)


def test_git_apply_stays_out_of_the_enclosing_repository(project: Project) -> None:
    """build/ lies inside the checkout's git work tree; git apply must patch our scratch tree,
    not silently skip paths relative to the enclosing repository."""
    project.add_patch(
        "Tune engine args", {"vllm/engine/args.py": engine_py(line_1="line_1 = 'one'")}
    )
    built = read_members(build(project))
    assert built["vllm/engine/args.py"].startswith(b"line_1 = 'one'\n")
    assert not (project.root / "vllm").exists()

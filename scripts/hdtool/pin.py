"""The project's pin (VERSION), its fixed paths, and the patch-set fingerprint."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path


class HdError(RuntimeError):
    """A failure the user must act on; the CLI prints it without a traceback."""


@dataclass(frozen=True)
class Pin:
    root: Path
    patchset_version: str
    local_label: str
    upstream_name: str
    upstream_version: str
    sdist: str
    sdist_sha256: str
    wheel: str
    wheel_sha256: str
    torch: str
    cutlass_dsl: str
    kernels_dest: str
    build_info_module: str

    @classmethod
    def load(cls, root: Path) -> Pin:
        path = root / "VERSION"
        try:
            data = tomllib.loads(path.read_text())
            up, pairs, layout = data["upstream"], data["pairs_with"], data["layout"]
            return cls(
                root=root,
                patchset_version=data["patchset_version"],
                local_label=data["local_label"],
                upstream_name=up["name"],
                upstream_version=up["version"],
                sdist=up["sdist"],
                sdist_sha256=up["sdist_sha256"],
                wheel=up["wheel"],
                wheel_sha256=up["wheel_sha256"],
                torch=pairs["torch"],
                cutlass_dsl=pairs["nvidia-cutlass-dsl"],
                kernels_dest=layout["kernels_dest"],
                build_info_module=layout["build_info_module"],
            )
        except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
            raise HdError(f"{path}: cannot read the pin ({e!r})") from e

    # --- derived names -------------------------------------------------------
    @property
    def local_version(self) -> str:
        """The patched distribution's version, e.g. 0.26.0+hd.1."""
        return f"{self.upstream_version}+{self.local_label}"

    @property
    def upstream_tag(self) -> str:
        return f"v{self.upstream_version}"

    @property
    def applied_branch(self) -> str:
        return f"hd/{self.upstream_version}"

    # --- fixed paths (all git-ignored) ---------------------------------------
    @property
    def cache_dir(self) -> Path:
        return self.root / ".cache" / "upstream"

    @property
    def upstream_repo(self) -> Path:
        return self.root / "build" / "upstream"

    @property
    def dist_dir(self) -> Path:
        return self.root / "dist"

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "vllm_overlay"

    @property
    def kernels_dir(self) -> Path:
        return self.root / "kernels"


def tracked_files(root: Path, sub: str) -> list[Path]:
    """Files under root/sub that belong to the patch set (git-tracked or not ignored).

    Byte-identical inputs give the same list whether or not they are committed yet;
    caches (__pycache__, *.pyc) never count.
    """
    base = root / sub
    if not base.exists():
        return []
    # The checkout's own git: a GIT_DIR or GIT_WORK_TREE of the caller's would list
    # another repository's files.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        proc = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", sub],
            cwd=root,
            capture_output=True,
            env=env,
        )
    except FileNotFoundError:
        proc = None  # no git at all: every file counts
    if proc is not None and proc.returncode == 0:
        rels = [p for p in proc.stdout.decode().split("\0") if p]
        files = [root / p for p in rels if (root / p).is_file()]
    elif proc is None or b"not a git repository" in proc.stderr:
        files = [p for p in base.rglob("*") if p.is_file()]
    else:
        # A checkout git cannot read (e.g. "dubious ownership"): listing every file would
        # put ignored ones into the wheel and the fingerprint.
        raise HdError(
            f"git cannot list the files of {root} ({proc.stderr.decode(errors='replace').strip()});"
            " fix that (e.g. `git config --global --add safe.directory "
            f"{root}`) and run again"
        )
    files = [p for p in files if "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return sorted(set(files))


def fingerprint(pin: Pin) -> str:
    """sha256 over the series, the patches, the overlay and the kernels (paths and bytes)."""
    h = hashlib.sha256()
    for sub in ("patches", "vllm_overlay", "kernels"):
        for path in tracked_files(pin.root, sub):
            rel = path.relative_to(pin.root).as_posix()
            data = path.read_bytes()
            h.update(f"{rel}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

"""venv: a fresh virtual environment holding the built wheel, its dependencies and test tools.

The wheel is installed with its dependencies from the configured index (PyPI: torch 2.11.0 and
the CUDA libraries it pulls, several GB), together with pytest from ci/requirements-dev.txt and,
when present, ci/requirements-upstream-tests.txt, in one resolver run. A stamp written last
records what went in (a venv without it is incomplete). With `--if-stale`:
- stamp matches (same wheel bytes, requirement files, Python): the venv is kept;
- only the wheel's bytes changed, not its dependency metadata (the usual case after editing
  kernels or the overlay): just vllm is reinstalled, `--no-deps` (~15 s instead of minutes);
- anything else: the venv is made afresh.

The torch family (torch, torchvision, torchaudio) is installed exactly as the wheel pins it:
each `name==X` pin is also passed as `name===X`, which only the index's own build of X
satisfies. A machine's local build of the same version (e.g. a find-links store holding
torch X+cpu) also satisfies `torch==X`, sorts above it and would be chosen, while torchvision
still comes from the index, built for the index's torch: its compiled ops then fail to load
and `import vllm` breaks in the middle of the upstream tests. After every install (and before
an up-to-date venv is kept) the installed versions are compared with the pins.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from hdtool.pin import HdError, Pin, sha256_file
from hdtool.wheel import output_wheel_name

DEFAULT_PATH = "build/venv-wheel"
STAMP = ".hd-wheel-stamp.json"
DEV_REQUIREMENTS = "ci/requirements-dev.txt"
UPSTREAM_TEST_REQUIREMENTS = "ci/requirements-upstream-tests.txt"
# Taken from DEV_REQUIREMENTS so the wheel venv runs the same pytest as the dev venv.
TEST_TOOLS = ("pytest", "pytest-timeout")


def _requirement_name(line: str) -> str:
    return re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0].lower().replace("_", "-")


def test_tool_pins(pin: Pin) -> list[str]:
    path = pin.root / DEV_REQUIREMENTS
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except OSError as e:
        raise HdError(f"{path}: cannot read the test tool pins ({e})") from e
    pins = [line for line in lines if line and _requirement_name(line) in TEST_TOOLS]
    found = {_requirement_name(line) for line in pins}
    if found != set(TEST_TOOLS):
        raise HdError(f"{path}: needs pinned lines for {', '.join(TEST_TOOLS)}")
    return pins


def _metadata_header(wheel: Path) -> str:
    """The header (fields, no description) of the wheel's .dist-info/METADATA."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            found = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            metadata = archive.read(found[0]).decode() if len(found) == 1 else ""
    except (OSError, zipfile.BadZipFile) as e:
        raise HdError(f"{wheel}: not a readable wheel ({e})") from e
    return metadata.partition("\n\n")[0]


# Built against each other: installed as one set, from the index, at the wheel's pins.
TORCH_FAMILY = ("torch", "torchvision", "torchaudio")
_EXACT_PIN = re.compile(
    r"^Requires-Dist:\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*==\s*([^\s;,]+)\s*(;\s*(.*))?$"
)


def torch_family_pins(wheel: Path) -> dict[str, str]:
    """{name: version} of the wheel's unconditional `==` pins on the torch family."""
    pins = {}
    for line in _metadata_header(wheel).splitlines():
        m = _EXACT_PIN.match(line.strip())
        if not m or (m[5] and "extra" in m[5]):
            continue
        name = re.sub(r"[-_.]+", "-", m[1]).lower()
        if name in TORCH_FAMILY:
            pins[name] = m[3]
    return pins


def torch_family_requirements(wheel: Path) -> list[str]:
    """`name===version` lines: exactly the index's build of each pinned version (no local
    label such as +cpu, which `==` would also accept)."""
    return [f"{name}==={version}" for name, version in sorted(torch_family_pins(wheel).items())]


def installed_versions(venv: Path, names: list[str] | tuple[str, ...]) -> dict[str, str]:
    """{name: installed version, or "" when absent} in the venv."""
    script = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        out[name] = ''\n"
        "print(json.dumps(out))\n"
    )
    try:
        proc = subprocess.run(
            [str(venv / "bin" / "python"), "-c", script, *names],
            capture_output=True,
            text=True,
            check=False,
        )
        return json.loads(proc.stdout)
    except (OSError, ValueError):  # no usable interpreter: nothing counts as installed
        return dict.fromkeys(names, "")


def torch_family_mismatches(venv: Path, wheel: Path) -> list[str]:
    """One line per torch-family package whose installed version is not the wheel's pin."""
    pins = torch_family_pins(wheel)
    if not pins:
        return []
    found = installed_versions(venv, sorted(pins))
    return [
        f"{name} {found.get(name) or '(not installed)'} installed, the wheel pins {version}"
        for name, version in sorted(pins.items())
        if found.get(name) != version
    ]


def dependency_digest(wheel: Path) -> str:
    """sha256 over the wheel's Requires-Dist / Requires-Python / Provides-Extra lines."""
    header = _metadata_header(wheel)
    wanted = ("Requires-Dist:", "Requires-Python:", "Provides-Extra:")
    lines = [line for line in header.splitlines() if line.startswith(wanted)]
    if not lines:
        raise HdError(f"{wheel}: no dependency metadata in its METADATA")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def wanted_stamp(pin: Pin, wheel: Path, python: str) -> dict:
    requirements = {}
    for rel in (DEV_REQUIREMENTS, UPSTREAM_TEST_REQUIREMENTS):
        path = pin.root / rel
        if path.is_file():
            requirements[rel] = sha256_file(path)
    try:
        version = subprocess.run(
            [python, "-c", "import sys; print(sys.version.split()[0])"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError as err:
        raise HdError(f"cannot run the interpreter {python!r} ({err}); check --python") from err
    return {
        "wheel": wheel.name,
        "wheel_sha256": sha256_file(wheel),
        "dependencies_sha256": dependency_digest(wheel),
        "requirements": requirements,
        "python": version,
    }


def read_stamp(venv: Path) -> dict | None:
    try:
        return json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _remove_venv(pin: Pin, venv: Path) -> None:
    """Remove an earlier venv at ``venv``: only a directory that is one (``pyvenv.cfg``
    or this tool's stamp; or empty) and holds none of the project, its build/ or
    build/upstream."""
    if not venv.exists():
        return
    resolved = venv.resolve()
    kept = (pin.root, pin.root / "build", pin.upstream_repo)
    holds = [k for k in kept if k.resolve().is_relative_to(resolved)]
    is_venv = (
        (venv / "pyvenv.cfg").is_file()
        or (venv / STAMP).is_file()
        or (venv.is_dir() and not any(venv.iterdir()))
    )
    if holds or not is_venv:
        what = f"holds {holds[0]}" if holds else "is not a virtual environment"
        raise HdError(
            f"{venv} exists and {what}; nothing was removed. Choose another --path, or "
            "remove it yourself"
        )
    shutil.rmtree(venv)


def _size_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with_path = Path(root) / name
            if not with_path.is_symlink():
                total += with_path.stat().st_size
    return total


def _run(cmd: list[str], what: str, cleanup: str = "the venv was removed") -> None:
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, check=False).returncode != 0:
        raise HdError(f"{what} failed (command above); {cleanup}")


# pip retries opening a connection, not a download cut off midway: on 2026-12-04 a CI
# machine's `make venv` failed after 66 s in the middle of a 95 MB wheel, pip's exception cut
# from the log (on the development machine the same message was a full disk: urllib3's
# "Connection broken: OSError(28, 'No space left on device')"). So a failed install is run
# again, and every failure reports the free disk where pip writes.
PIP_INSTALL_ATTEMPTS = 3
PIP_RETRY_PAUSE_S = 10.0
# The installed wheel venv (the development machine, 2026-12-05, during `bash .ci/run` on a
# fresh clone); pip's downloads come on top where the wheels are not local (the disk peaked
# 11.4 GB above the start there).
VENV_INSTALLED_GB = 8.25
# What a fresh venv needs free before its install starts. On 2026-12-05 a CI machine's
# install ran out of disk three times over (2.1 GB free after the third); below this it
# cannot succeed, so it is refused before pip starts, and a failed attempt is not retried
# when the disk cannot hold the rest.
DEFAULT_MIN_FREE_GB = 9.0


def _existing(path: Path) -> Path:
    """`path`, or its first parent that exists (where it would be written)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _free_disk(paths: tuple[Path, ...]) -> str:
    """'N.N GB free at PATH' for each path (its first existing parent)."""
    shown = []
    for path in map(_existing, paths):
        try:
            free = shutil.disk_usage(path).free
        except OSError:
            continue
        shown.append(f"{free / 1e9:.1f} GB free at {path}")
    return "; ".join(shown)


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def _disk_advice(min_free_gb: float) -> str:
    return (
        "Free disk there (old clones or venvs, ~/.cache/pip), or choose a --path on a larger "
        f"disk (and TMPDIR for pip's downloads); --min-free-gb {min_free_gb:g} is this check's "
        "threshold, 0 turns it off"
    )


def check_free_disk(venv: Path, min_free_gb: float) -> None:
    """Refuse to start an install that the disk at `venv` cannot hold."""
    if min_free_gb <= 0:
        return
    free = _free_bytes(venv)
    if free < min_free_gb * 1e9:
        raise HdError(
            f"{venv}: {free / 1e9:.1f} GB free on its disk, a fresh venv needs at least "
            f"{min_free_gb:g} GB ({VENV_INSTALLED_GB:g} GB installed, more while pip downloads); "
            f"nothing was installed. {_disk_advice(min_free_gb)}"
        )


def _run_pip(
    cmd: list[str],
    what: str,
    cleanup: str = "the venv was removed",
    disk: tuple[Path, ...] = (),
    needs_gb: float = 0.0,
) -> None:
    """`_run` for a pip install, tried up to PIP_INSTALL_ATTEMPTS times; each failure names
    the free disk at `disk` and at pip's temporary directory. With `needs_gb` (what the
    finished `disk[0]` holds), a failure after which the free disk plus what `disk[0]`
    already holds is less than that is a full disk: not tried again."""
    for attempt in range(1, PIP_INSTALL_ATTEMPTS + 1):
        print("+ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd, check=False).returncode == 0:
            return
        space = _free_disk((*disk, Path(tempfile.gettempdir())))
        if needs_gb > 0 and disk:
            room = _free_bytes(disk[0]) + _size_bytes(disk[0])
            if room < needs_gb * 1e9:
                raise HdError(
                    f"{what} failed: the disk is full ({space}; with what is installed so far "
                    f"{room / 1e9:.1f} GB, {needs_gb:g} GB needed); not tried again; {cleanup}. "
                    f"{_disk_advice(needs_gb)}"
                )
        if attempt == PIP_INSTALL_ATTEMPTS:
            raise HdError(f"{what} failed {attempt} times (command above; {space}); {cleanup}")
        print(
            f"{what} failed (attempt {attempt} of {PIP_INSTALL_ATTEMPTS}; {space}); trying "
            f"again in {PIP_RETRY_PAUSE_S:.0f} s",
            flush=True,
        )
        time.sleep(PIP_RETRY_PAUSE_S)


def create_venv(
    pin: Pin, venv: Path, wheel: Path, python: str, min_free_gb: float = DEFAULT_MIN_FREE_GB
) -> dict:
    """Make `venv` from nothing; returns the stamp written last (it marks a complete venv)."""
    stamp = wanted_stamp(pin, wheel, python)
    _remove_venv(pin, venv)
    check_free_disk(venv, min_free_gb)
    venv.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        _run([python, "-m", "venv", str(venv)], "creating the venv")
        requirements = [str(wheel), *torch_family_requirements(wheel), *test_tool_pins(pin)]
        upstream_reqs = pin.root / UPSTREAM_TEST_REQUIREMENTS
        if upstream_reqs.is_file():
            requirements += ["-r", str(upstream_reqs)]
        # No second copy of the downloaded wheels in pip's cache: the venv alone is ~8 GB.
        _run_pip(
            _pip_install(venv, "--no-cache-dir", *requirements),
            "installing the wheel and its dependencies",
            disk=(venv,),
            needs_gb=min_free_gb,
        )
        _check_installed(pin, venv, wheel, stamp)
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    stamp["install_seconds"] = round(time.perf_counter() - start, 1)
    _write_stamp(venv, stamp)
    return stamp


def refresh_wheel(pin: Pin, venv: Path, wheel: Path, python: str) -> dict:
    """Reinstall only vllm from `wheel` into a complete venv whose dependencies still fit."""
    stamp = wanted_stamp(pin, wheel, python)
    (venv / STAMP).unlink()  # until the refresh succeeds the venv is incomplete
    start = time.perf_counter()
    _run_pip(
        _pip_install(venv, "--no-deps", "--force-reinstall", str(wheel)),
        "reinstalling the wheel",
        cleanup="the venv has no stamp now; the next `venv --if-stale` makes it afresh",
        disk=(venv,),
    )
    _check_installed(pin, venv, wheel, stamp)
    stamp["install_seconds"] = round(time.perf_counter() - start, 1)
    _write_stamp(venv, stamp)
    return stamp


def _pip_install(venv: Path, *args: str) -> list[str]:
    """The venv's `pip install` command line, quiet about progress and never prompting."""
    return [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        *args,
    ]


def _check_installed(pin: Pin, venv: Path, wheel: Path, stamp: dict) -> None:
    installed = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('vllm'))",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if installed != pin.local_version:
        raise HdError(f"{venv}: vllm {installed!r} installed, expected {pin.local_version}")
    wrong = torch_family_mismatches(venv, wheel)
    if wrong:
        raise HdError(
            f"{venv}: " + "; ".join(wrong) + ". torch, torchvision and torchaudio must be the "
            "index's builds of the pinned versions (a local build such as +cpu does not fit "
            "the index's torchvision); check pip's find-links / extra-index settings"
        )
    if sha256_file(wheel) != stamp["wheel_sha256"]:
        raise HdError(f"{wheel} changed during the install (a build ran meanwhile); run again")


def _write_stamp(venv: Path, stamp: dict) -> None:
    partial = venv / f"{STAMP}.partial"
    partial.write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    partial.replace(venv / STAMP)


_ENVIRONMENT_KEYS = ("requirements", "python", "dependencies_sha256")


def _same(stamp: dict | None, wanted: dict, keys: tuple[str, ...]) -> bool:
    return stamp is not None and all(stamp.get(k) == wanted[k] for k in keys)


def cmd_venv(args: argparse.Namespace, pin: Pin) -> int:
    venv = args.path if args.path.is_absolute() else pin.root / args.path
    shown = venv.relative_to(pin.root) if venv.is_relative_to(pin.root) else venv
    wheel = args.wheel or pin.dist_dir / output_wheel_name(pin)
    if not wheel.is_file():
        raise HdError(f"{wheel}: no such wheel; build it with `make build-wheel`")
    stamp = read_stamp(venv) if (venv / "bin" / "python").exists() else None
    wanted = wanted_stamp(pin, wheel, args.python)
    wrong = torch_family_mismatches(venv, wheel) if stamp is not None else []
    if wrong:  # e.g. made before the torch family was pinned exactly: not worth keeping
        print(f"{shown}: made afresh: " + "; ".join(wrong))
    elif args.if_stale and _same(stamp, wanted, ("wheel", "wheel_sha256", *_ENVIRONMENT_KEYS)):
        print(f"{shown}: up to date with {wheel.name}")
        return 0
    elif args.if_stale and _same(stamp, wanted, _ENVIRONMENT_KEYS):
        stamp = refresh_wheel(pin, venv, wheel, args.python)
        print(
            f"{shown}: vllm reinstalled from {wheel.name} (dependencies unchanged) in "
            f"{stamp['install_seconds']:.0f} s"
        )
        return 0
    stamp = create_venv(pin, venv, wheel, args.python, args.min_free_gb)
    print(
        f"{shown}: vllm {pin.local_version} with dependencies installed in "
        f"{stamp['install_seconds']:.0f} s; {_size_bytes(venv) / 1e9:.2f} GB"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    venv = sub.add_parser(
        "venv", help="fresh venv with the built wheel, its dependencies and the test tools"
    )
    venv.add_argument(
        "--path",
        type=Path,
        default=Path(DEFAULT_PATH),
        help="venv directory, relative to the checkout (default %(default)s)",
    )
    venv.add_argument("--wheel", type=Path, help="default: the dist/ wheel named by the pin")
    venv.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter to base the venv on (default: this one)",
    )
    venv.add_argument(
        "--if-stale",
        action="store_true",
        help="keep the venv when its stamp matches the wheel and requirements",
    )
    venv.add_argument(
        "--min-free-gb",
        type=float,
        default=DEFAULT_MIN_FREE_GB,
        help="disk a fresh venv needs free before pip starts (default %(default)s; 0: no check)",
    )
    venv.set_defaults(func=cmd_venv)

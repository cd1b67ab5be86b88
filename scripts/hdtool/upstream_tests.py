"""`upstream-tests`: run upstream vLLM's own tests against the installed (patched) wheel.

The selection lives in ci/upstream_tests.yaml: per subset (cpu, gpu) an allow-list of test
files, directories or test ids from the pinned sdist's tests/, and exclusions that each carry a
reason. Steps:

1. verify the cached sdist (pin.cache_dir / pin.sdist) against the pinned sha256, then unpack
   only its tests/ (and the other non-package directories the yaml names, never vllm/) into
   build/upstream-tests/; that directory has no vllm/, so `import vllm` can only find the
   venv's installed wheel (the plugin checks this and aborts otherwise);
2. write pytest.ini there (upstream's markers, read from the sdist's pyproject.toml), the
   selection as JSON and the plugin (upstream_plugin.py) that applies test-id / `-k`
   exclusions and writes the JSON report;
3. run `<python> -m pytest` there, offline (HF_HUB_OFFLINE=1, ...), with a per-test timeout;
4. print the counts and write build/upstream-tests-<subset>.junit.xml and .json.

Exit status: 0 when nothing failed or errored and at least `min_passed` tests passed; 1
otherwise. Problems with the pin, the sdist or the yaml raise HdError (exit 2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from hdtool.pin import HdError, Pin, sha256_file

CONFIG = "ci/upstream_tests.yaml"
DEFAULT_PYTHON = "build/venv-wheel/bin/python"
RUN_DIR = "build/upstream-tests"
PLUGIN_MODULE = "_hd_upstream_plugin"
SDIST_STAMP = ".hd-sdist-sha256"  # which sdist the run directory was unpacked from
SUBSETS = ("cpu", "gpu")
# Never unpacked: the tests must import vllm from the installed wheel.
FORBIDDEN_EXTRACT = ("vllm",)

# Always set: no test may reach the Hugging Face hub (CI has no access, and a run must not
# depend on what a developer's cache happens to hold).
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONDONTWRITEBYTECODE": "1",
}


@dataclass
class Exclusion:
    path: str
    reason: str
    k: str | None = None

    @property
    def ignores_path(self) -> bool:
        """A whole file or directory: not even collected (`--ignore`)."""
        return self.k is None and "::" not in self.path


@dataclass
class Subset:
    name: str
    include: list[str]
    exclude: list[Exclusion]
    min_passed: int
    timeout: int
    session_timeout: int | None
    require_gpu: bool
    account_all: bool
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Config:
    path: Path
    extract: list[str]
    subsets: dict[str, Subset]


# --- configuration -------------------------------------------------------------------------


def _load_yaml(path: Path, python: str | None) -> object:
    text = path.read_text()
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise HdError(f"{path}: not valid YAML ({e})") from e
    # The dev venv has PyYAML; a bare python3 may not. The wheel venv has it (a vLLM dependency).
    if python is None or not Path(python).exists():
        raise HdError(f"{path}: PyYAML is not installed here; run through the dev venv (.venv)")
    proc = subprocess.run(
        [python, "-c", "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise HdError(f"{path}: cannot parse it with {python}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def _str_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise HdError(f"{where}: expected a list of non-empty strings")
    return [v.strip() for v in value]


def _test_path(value: str, where: str) -> str:
    file_part = value.split("::", 1)[0]
    pure = PurePosixPath(file_part)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts or pure.parts[0] != "tests":
        raise HdError(f"{where}: {value!r} must be a path inside tests/ (relative, no '..')")
    return value.rstrip("/") if "::" not in value else value


def _parse_subset(name: str, raw: object, where: str) -> Subset:
    if not isinstance(raw, dict):
        raise HdError(f"{where}: expected a mapping")
    known = {
        "include",
        "exclude",
        "min_passed",
        "timeout",
        "session_timeout",
        "require_gpu",
        "account_all",
        "env",
        "description",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise HdError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")
    include = [
        _test_path(v, f"{where}.include") for v in _str_list(raw.get("include"), f"{where}.include")
    ]
    if not include:
        raise HdError(f"{where}.include: empty")
    exclude = []
    for i, entry in enumerate(raw.get("exclude") or []):
        at = f"{where}.exclude[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"path", "paths", "reason", "k"}:
            raise HdError(f"{at}: expected a mapping with path (or paths), reason and optionally k")
        if ("path" in entry) == ("paths" in entry):
            raise HdError(f"{at}: give either path or paths")
        paths = [entry["path"]] if "path" in entry else entry["paths"]
        paths = _str_list(paths, f"{at}.paths")
        reason, k = entry.get("reason"), entry.get("k")
        if not isinstance(reason, str) or not reason.strip():
            raise HdError(f"{at} ({paths[0]}): every exclusion needs a reason")
        if k is not None and (not isinstance(k, str) or not k.strip()):
            raise HdError(f"{at} ({paths[0]}): k must be a non-empty -k expression")
        for path in paths:
            exclude.append(Exclusion(_test_path(path, at), " ".join(reason.split()), k))
    ints = {}
    for key, default in (("min_passed", 0), ("timeout", 300), ("session_timeout", None)):
        value = raw.get(key, default)
        if value is not None and (not isinstance(value, int) or value < 0):
            raise HdError(f"{where}.{key}: expected a non-negative integer")
        ints[key] = value
    env = raw.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        raise HdError(f"{where}.env: expected a mapping of names to strings")
    flags = {}
    for key in ("require_gpu", "account_all"):
        flags[key] = raw.get(key, False)
        if not isinstance(flags[key], bool):
            raise HdError(f"{where}.{key}: expected true or false")
    return Subset(
        name=name,
        include=include,
        exclude=exclude,
        min_passed=ints["min_passed"],
        timeout=ints["timeout"],
        session_timeout=ints["session_timeout"],
        require_gpu=flags["require_gpu"],
        account_all=flags["account_all"],
        env={k: "" if v is None else str(v) for k, v in env.items()},
    )


def load_config(path: Path, python: str | None = None) -> Config:
    if not path.is_file():
        raise HdError(f"{path}: missing (the allow-list of upstream tests)")
    raw = _load_yaml(path, python)
    if not isinstance(raw, dict):
        raise HdError(f"{path}: expected a mapping at the top level")
    # `versions` holds per-upstream-version differences; the rebase command merges them.
    unknown = sorted(set(raw) - {"extract", "versions", *SUBSETS})
    if unknown:
        raise HdError(f"{path}: unknown top-level keys {unknown}")
    extract = _str_list(raw.get("extract", ["tests"]), f"{path}: extract")
    for top in extract:
        if "/" in top or top in (".", "..") or top in FORBIDDEN_EXTRACT:
            raise HdError(
                f"{path}: extract: {top!r} is not allowed (top-level sdist directories only, "
                "never the vllm/ package: the tests must import the installed wheel)"
            )
    if "tests" not in extract:
        raise HdError(f"{path}: extract must include tests")
    subsets = {}
    for name in SUBSETS:
        if name in raw:
            subsets[name] = _parse_subset(name, raw[name], f"{path}: {name}")
    if not subsets:
        raise HdError(f"{path}: no subset ({', '.join(SUBSETS)}) defined")
    return Config(path=path, extract=extract, subsets=subsets)


# --- the sdist's tests ---------------------------------------------------------------------


def extract_tests(pin: Pin, extract: list[str], dest: Path) -> None:
    """Verify the cached sdist, then unpack the named top-level directories into dest (fresh)."""
    sdist = pin.cache_dir / pin.sdist
    if not sdist.is_file():
        raise HdError(
            f"{sdist}: the pinned sdist is not cached; run `python3 scripts/hd.py fetch` "
            "(or `make fetch`) first"
        )
    actual = sha256_file(sdist)
    if actual != pin.sdist_sha256:
        raise HdError(
            f"{sdist}: sha256 {actual} does not match the pin ({pin.sdist_sha256}); delete it "
            "and run `python3 scripts/hd.py fetch` again. Nothing was unpacked."
        )
    prefix = f"{pin.upstream_name}-{pin.upstream_version}/"
    if dest.exists():
        shutil.rmtree(dest)
    staging = dest.with_name(dest.name + ".part")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    wanted = tuple(f"{prefix}{top}/" for top in extract)
    found: set[str] = set()
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            members = []
            for member in archive:
                if not member.name.startswith(wanted):
                    continue
                if not (member.isfile() or member.isdir()):
                    continue  # no links or devices from an archive
                found.add(member.name[len(prefix) :].split("/", 1)[0])
                member.name = member.name[len(prefix) :]
                members.append(member)
            archive.extractall(staging, members=members, filter="data")
        pyproject = _sdist_member(sdist, f"{prefix}pyproject.toml")
    except (OSError, tarfile.TarError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise HdError(f"{sdist}: cannot unpack ({e})") from e
    missing = sorted(set(extract) - found)
    if missing:
        shutil.rmtree(staging, ignore_errors=True)
        raise HdError(f"{sdist}: has no {', '.join(m + '/' for m in missing)}")
    (staging / "pytest.ini").write_text(_pytest_ini(pyproject))
    (staging / SDIST_STAMP).write_text(pin.sdist_sha256 + "\n")
    staging.rename(dest)


def check_extracted(pin: Pin, dest: Path) -> None:
    """For --extracted: dest must hold tests unpacked from the pinned sdist (its stamp)."""
    stamp = dest / SDIST_STAMP
    if not stamp.is_file():
        raise HdError(
            f"{dest}: no tests unpacked by `upstream-tests` here ({SDIST_STAMP} missing); run "
            "it once without --extracted on a machine with the sdist, then copy the folder"
        )
    found = stamp.read_text().strip()
    if found != pin.sdist_sha256:
        raise HdError(
            f"{dest}: unpacked from sdist sha256 {found}, not the pinned {pin.sdist_sha256}; "
            "unpack again without --extracted"
        )


def _sdist_member(sdist: Path, name: str) -> bytes:
    with tarfile.open(sdist, "r:gz") as archive:
        handle = archive.extractfile(name)
        if handle is None:
            raise HdError(f"{sdist}: {name} is not a file")
        return handle.read()


def _pytest_ini(pyproject: bytes) -> str:
    """pytest.ini with upstream's markers (from the sdist's [tool.pytest.ini_options])."""
    try:
        options = tomllib.loads(pyproject.decode())["tool"]["pytest"]["ini_options"]
    except (KeyError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise HdError(f"the sdist's pyproject.toml has no readable pytest options ({e})") from e
    lines = [
        "# Written by `hd.py upstream-tests`: upstream's pytest options, from the sdist's",
        "# pyproject.toml (the run directory holds tests/ only, no vllm/ and no pyproject).",
        "[pytest]",
    ]
    for key, value in options.items():
        if isinstance(value, list):
            lines.append(f"{key} =")
            lines.extend(f"    {item}" for item in value)
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def _check_paths(subset: Subset, run_dir: Path, config: Path) -> None:
    """Every listed path exists in the unpacked tests; with account_all, every upstream test
    file is either run (under an include) or excluded with a reason."""
    bad = []
    for value in subset.include + [e.path for e in subset.exclude]:
        if not (run_dir / value.split("::", 1)[0]).exists():
            bad.append(value)
    if bad:
        raise HdError(
            f"{config}: {subset.name}: not in the pinned sdist's tests: {', '.join(bad)} "
            "(renamed or removed upstream? update the allow-list)"
        )
    if not subset.account_all:
        return
    covered = [i for i in subset.include if "::" not in i]
    covered += [e.path for e in subset.exclude if e.ignores_path]
    unaccounted = []
    for path in sorted((run_dir / "tests").rglob("*.py")):
        if not (path.name.startswith("test_") or path.name.endswith("_test.py")):
            continue
        rel = path.relative_to(run_dir).as_posix()
        if not any(rel == c or rel.startswith(c + "/") for c in covered):
            unaccounted.append(rel)
    if unaccounted:
        shown = "\n  ".join(unaccounted[:40])
        more = f"\n  ... and {len(unaccounted) - 40} more" if len(unaccounted) > 40 else ""
        raise HdError(
            f"{config}: {subset.name}: {len(unaccounted)} upstream test files are neither "
            f"included nor excluded with a reason:\n  {shown}{more}\n"
            "add each (or its directory) to include, or to exclude with a reason"
        )


def restrict_to(subset: Subset, only: list[str]) -> Subset:
    """The subset cut down to the parts of its allow-list at or under the ``only`` paths (a
    file inside an included directory narrows it to that file), to run a long selection in
    pieces. A path the allow-list does not cover is refused; exclusions still apply."""

    def under(path: str, top: str) -> bool:
        path = path.split("::", 1)[0]
        return path == top or path.startswith(top.rstrip("/") + "/")

    kept: list[str] = []
    for top in only:
        matched = [i for i in subset.include if under(i, top)]
        if not matched and any(under(top, i) and "::" not in i for i in subset.include):
            matched = [top]
        if not matched:
            raise HdError(
                f"--only {top}: not in the {subset.name} allow-list; choose a path it includes "
                f"(`--list` shows them): {', '.join(subset.include)}"
            )
        kept += [m for m in matched if m not in kept]
    # Exclusions outside the part would be reported as matching nothing; the whole list's
    # min_passed does not apply to a part (one passed test of it is the floor).
    exclude = [e for e in subset.exclude if any(under(e.path, k) or under(k, e.path) for k in kept)]
    return replace(
        subset,
        include=kept,
        exclude=exclude,
        min_passed=min(subset.min_passed, 1),
        account_all=False,
    )


# Longest part label kept verbatim; the report names add ~40 characters to it and a file
# name may have at most 255 bytes.
MAX_PART_NAME = 120


def part_name(only: list[str]) -> str:
    """A file-name-safe label of a partial run (its reports must not replace the whole's).

    The joined file stems, or for a long selection the first stems, the count and a hash
    of the whole selection (the H200 run of 12 files named a report past 255 bytes)."""
    labels = [PurePosixPath(o.split("::", 1)[0]).stem or "tests" for o in only]
    name = "+".join(labels)
    if len(name) <= MAX_PART_NAME:
        return name
    digest = hashlib.sha256("\n".join(only).encode()).hexdigest()[:12]
    head = ""
    for label in labels:
        if len(head) + len(label) + 1 > MAX_PART_NAME - 40:
            break
        head += label + "+"
    return f"{head}{len(labels)}-paths-{digest}"


# --- running -------------------------------------------------------------------------------


def pytest_command(
    python: str, subset: Subset, junit: Path, extra: list[str], basetemp: Path
) -> list[str]:
    cmd = [
        python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        PLUGIN_MODULE,
        "-c",
        "pytest.ini",
        "--rootdir",
        ".",
        "-q",
        "-rfE",
        "--continue-on-collection-errors",
        f"--timeout={subset.timeout}",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit2",
        f"--basetemp={basetemp}",
    ]
    if subset.session_timeout:
        cmd.append(f"--session-timeout={subset.session_timeout}")
    for exclusion in subset.exclude:
        if exclusion.ignores_path:
            cmd.append(f"--ignore={exclusion.path}")
    return [*cmd, *extra, *subset.include]


def run_env(run_dir: Path, subset: Subset, selection: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OFFLINE_ENV)
    env.update(
        {
            # Empty caches of our own: results must not depend on a developer's HF cache.
            "HF_HOME": str(run_dir / ".hf-home"),
            "VLLM_CACHE_ROOT": str(run_dir / ".vllm-cache"),
            # upstream's helper package (tests/vllm_test_utils), normally pip-installed in CI.
            "PYTHONPATH": str(run_dir / "tests" / "vllm_test_utils"),
            "HD_UPSTREAM_SELECTION": str(selection),
        }
    )
    env.update(subset.env)
    return env


def _summary_line(counts: dict[str, int]) -> str:
    parts = [
        f"{counts.get('passed', 0)} passed",
        f"{counts.get('failed', 0)} failed",
        f"{counts.get('skipped', 0)} skipped",
        f"{counts.get('error', 0)} errors",
    ]
    for key in ("xfailed", "xpassed", "deselected"):
        if counts.get(key):
            parts.append(f"{counts[key]} {key}")
    if counts.get("not_run"):
        parts.append(f"{counts['not_run']} not run")
    return ", ".join(parts)


def _shown(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def run(args: argparse.Namespace, pin: Pin) -> int:
    root = pin.root
    # Absolute (pytest runs in the run directory), but not resolved: a venv's python is a
    # symlink to the base interpreter, and resolving it would leave the venv.
    python = args.python or str(root / DEFAULT_PYTHON)
    if os.sep not in python:  # a bare name ("python3" on the GPU host): look it up on PATH
        python = shutil.which(python) or python
    python = os.path.abspath(python)
    config = load_config(Path(args.config).resolve() if args.config else root / CONFIG, python)
    if args.subset not in config.subsets:
        raise HdError(f"{config.path}: has no {args.subset!r} subset")
    subset = config.subsets[args.subset]
    if not Path(python).exists():
        raise HdError(f"{python}: no such interpreter; make the wheel venv first (`make venv`)")

    run_dir = root / RUN_DIR
    if args.extracted:
        check_extracted(pin, run_dir)
    else:
        extract_tests(pin, config.extract, run_dir)
    if (run_dir / "vllm").exists():  # extract refuses it; a belt for the braces
        raise HdError(f"{run_dir}/vllm exists: the tests would import the sdist, not the wheel")
    _check_paths(subset, run_dir, config.path)
    if args.only:
        subset = restrict_to(subset, args.only)
    shutil.copy2(Path(__file__).with_name("upstream_plugin.py"), run_dir / f"{PLUGIN_MODULE}.py")

    reports = root / "build"
    stem = f"upstream-tests-{subset.name}"
    if args.only:
        stem += f".{part_name(args.only)}"
    junit = reports / f"{stem}.junit.xml"
    summary = reports / f"{stem}.json"
    raw_report = run_dir / "report.json"
    # An earlier run's counts must not stand in for a run that ends before writing its own.
    for stale in (junit, summary, raw_report):
        stale.unlink(missing_ok=True)
    selection = run_dir / "selection.json"
    selection.write_text(
        json.dumps(
            {
                "subset": subset.name,
                "require_gpu": subset.require_gpu,
                "report": str(raw_report),
                "deselect": [
                    {"path": e.path, "k": e.k, "reason": e.reason}
                    for e in subset.exclude
                    if not e.ignores_path
                ],
            },
            indent=1,
        )
        + "\n"
    )
    extra = list(args.pytest_arg or [])
    if args.timeout is not None:
        subset.timeout = args.timeout
    if args.session_timeout is not None:
        subset.session_timeout = args.session_timeout
    # Short, outside the checkout: tests bind AF_UNIX sockets under tmp_path, whose path may
    # not exceed 107 bytes (a deep checkout, e.g. a rebase's staged project, would).
    basetemp = Path(tempfile.mkdtemp(prefix=f"hd-upstream-{subset.name}-"))
    cmd = pytest_command(python, subset, junit.resolve(), extra, basetemp)
    env = run_env(run_dir.resolve(), subset, selection.resolve())
    shown_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(subset.env.items()))
    print(f"upstream-tests: {subset.name} subset from {_shown(config.path, root)}", flush=True)
    ignores = sum(1 for part in cmd if part.startswith("--ignore="))
    shown_cmd = [part for part in cmd if not part.startswith("--ignore=")]
    print(
        f"upstream-tests: in {_shown(run_dir, root)}: {shown_env} {shlex.join(shown_cmd)}"
        f" (plus {ignores} --ignore options: the yaml's file and directory exclusions)"
    )
    if args.list:
        cmd = [*cmd, "--collect-only", "-q"]
    sys.stdout.flush()
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=run_dir, env=env, check=False)
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)
    wall = time.monotonic() - start
    if args.list:
        return proc.returncode

    if not raw_report.is_file():
        print(
            f"upstream-tests: pytest exited {proc.returncode} before writing its report "
            f"(see the output above)",
            file=sys.stderr,
        )
        return 1
    report = json.loads(raw_report.read_text())
    report.update(
        {
            "wall_s": round(wall, 1),
            "min_passed": subset.min_passed,
            "config": _shown(config.path, root),
            "sdist": pin.sdist,
            "sdist_sha256": pin.sdist_sha256,
            "pytest_returncode": proc.returncode,
            "junit": _shown(junit, root),
            "ignored": [
                {"path": e.path, "reason": e.reason} for e in subset.exclude if e.ignores_path
            ],
        }
    )
    summary.write_text(json.dumps(report, indent=1) + "\n")
    counts = dict(report["counts"])
    if report.get("not_run"):
        counts["not_run"] = report["not_run"]
    for unused in report.get("unused_exclusions", []):
        k = f" -k {unused['k']!r}" if unused.get("k") else ""
        print(f"upstream-tests: warning: exclusion {unused['path']}{k} matched no test")
    for problem in report.get("problems", [])[:50]:
        print(f"upstream-tests: {problem['when']}: {problem['nodeid']}: {problem['message']}")

    verdict = []
    if not report.get("vllm"):
        verdict.append("pytest stopped before running any test (see its message above)")
    if report.get("not_run"):
        verdict.append(
            f"{report['not_run']} of {report.get('selected', '?')} selected tests did not run "
            f"({report.get('stopped') or 'pytest stopped early'}): the counts are partial"
        )
    if counts.get("failed") or counts.get("error"):
        verdict.append("failures or errors")
    if counts.get("passed", 0) < subset.min_passed:
        verdict.append(f"fewer than min_passed={subset.min_passed} passed")
    if proc.returncode not in (0, 1) and not verdict:
        verdict.append(f"pytest exited {proc.returncode}")
    vllm = report.get("vllm", {})
    print()
    print(
        f"upstream-tests {subset.name}: vllm {vllm.get('version', '?')} from "
        f"{vllm.get('location', '?')}"
    )
    print(f"upstream-tests {subset.name}: {_summary_line(counts)} in {wall:.0f} s")
    print(f"upstream-tests {subset.name}: reports: {_shown(junit, root)}, {_shown(summary, root)}")
    if verdict:
        print(f"upstream-tests {subset.name}: FAILED ({'; '.join(verdict)})")
        return 1
    print(f"upstream-tests {subset.name}: OK (min_passed={subset.min_passed})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "upstream-tests",
        help="run upstream vLLM's own tests (ci/upstream_tests.yaml) against the installed wheel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        help=f"interpreter of the venv holding the wheel (default: {DEFAULT_PYTHON})",
    )
    p.add_argument("--subset", choices=SUBSETS, default="cpu", help="which list to run")
    p.add_argument("--config", metavar="YAML", help=f"the allow-list (default: {CONFIG})")
    p.add_argument("--timeout", type=int, metavar="S", help="per-test timeout (default: yaml)")
    p.add_argument(
        "--session-timeout",
        type=int,
        metavar="S",
        help="end the pytest session after S seconds and report what ran (default: yaml), "
        "e.g. to end inside a GPU host's call limit",
    )
    p.add_argument(
        "--list", action="store_true", help="only collect: show what the selection holds"
    )
    p.add_argument(
        "--extracted",
        action="store_true",
        help=f"use the tests already unpacked in {RUN_DIR} (copied to a machine without the "
        "pinned sdist, e.g. the GPU host) instead of unpacking them again",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="PATH",
        help="run only this part of the allow-list (a listed path, or a file under a listed "
        "directory; repeatable), e.g. to fit a GPU host's call limit; reports get the part's "
        "name",
    )
    p.add_argument(
        "--pytest-arg",
        action="append",
        metavar="ARG",
        help="extra pytest argument (repeatable), e.g. --pytest-arg=-x",
    )
    p.set_defaults(func=run)

"""pytest plugin for `hd.py upstream-tests`; copied next to upstream's tests/ and loaded with
`-p _hd_upstream_plugin` inside the wheel venv (it imports only pytest and the stdlib here).

It reads the selection that upstream_tests.py wrote (path in HD_UPSTREAM_SELECTION) and:
- refuses to run unless `vllm` is imported from an installed distribution: the point of the run
  is the installed (patched) wheel, never a source tree that happens to be importable;
- for the GPU subset, refuses to run without a CUDA device (every test would skip);
- deselects the exclusions that name test ids or a `-k` expression (whole files and
  directories are `--ignore`d by the runner), recording each one's reason;
- writes a JSON report: counts per outcome, per file, deselections per reason, failures, and
  how many selected tests never ran (a session timeout or -x stopped the run early: then the
  counts cover only part of the selection, and the report says why it stopped).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections import Counter, defaultdict
from pathlib import Path

import pytest

_SELECTION_ENV = "HD_UPSTREAM_SELECTION"
_OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")


def _load_selection() -> dict:
    path = os.environ.get(_SELECTION_ENV)
    if not path:
        raise pytest.UsageError(f"{_SELECTION_ENV} is not set; run through `hd.py upstream-tests`")
    return json.loads(Path(path).read_text())


def _installed_vllm(rootdir: Path) -> dict:
    """Where vllm comes from; exits the session unless it is an installed distribution's
    copy (a venv's site-packages, or a `pip install --target` folder on the path, as on the
    GPU host), never a source tree."""
    from importlib import metadata

    import vllm

    location = Path(vllm.__file__).resolve().parent
    try:
        installed = Path(metadata.distribution("vllm").locate_file("vllm")).resolve()
    except metadata.PackageNotFoundError:
        installed = None
    if installed != location or location.is_relative_to(rootdir.resolve()):
        site_dirs = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
        pytest.exit(
            f"vllm is imported from {location}, which is not an installed vllm distribution "
            f"(installed: {installed}; this interpreter's site-packages: "
            f"{', '.join(map(str, sorted(site_dirs)))}): the upstream tests must run against "
            "the installed wheel",
            returncode=3,
        )
    info = {
        "version": getattr(vllm, "__version__", "?"),
        "location": str(location),
        "python": sys.executable,
    }
    try:
        from vllm import _hopper_decode_build as build  # the patched wheel's build facts
    except ImportError:
        info["fingerprint"] = None
    else:
        info["fingerprint"] = getattr(build, "FINGERPRINT", None)
    return info


class UpstreamSelection:
    def __init__(self, config: pytest.Config, selection: dict) -> None:
        self.config = config
        self.selection = selection
        self.rules = selection["deselect"]
        self.deselected: dict[int, list[str]] = defaultdict(list)
        self.vllm: dict = {}
        self.outcomes: Counter[str] = Counter()
        self.per_file: dict[str, Counter[str]] = defaultdict(Counter)
        self.problems: list[dict] = []
        self.selected = 0
        self.ran: set[str] = set()

    # --- session start ---------------------------------------------------------------------
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.vllm = _installed_vllm(Path(str(self.config.rootpath)))
        if self.selection["require_gpu"]:
            import torch

            if not torch.cuda.is_available():
                pytest.exit(
                    f"the {self.selection['subset']} subset needs a CUDA GPU and torch sees none",
                    returncode=3,
                )
        fingerprint = self.vllm.get("fingerprint")
        print(
            f"\nupstream-tests: vllm {self.vllm['version']} from {self.vllm['location']}"
            + (f" (patch-set fingerprint {fingerprint[:16]})" if fingerprint else ""),
            flush=True,
        )

    # --- selection -------------------------------------------------------------------------
    def _matches(self, rule: dict, item: pytest.Item) -> bool:
        prefix = rule["path"]
        nodeid = item.nodeid
        if "::" in prefix:
            if not (nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "["))):
                return False
        elif not (nodeid.startswith(prefix + "::") or nodeid.startswith(prefix.rstrip("/") + "/")):
            return False
        expression = rule.get("k")
        if not expression:
            return True
        from _pytest.mark import KeywordMatcher
        from _pytest.mark.expression import Expression

        compiled = rule.get("_compiled")
        if compiled is None:
            try:
                compiled = rule["_compiled"] = Expression.compile(expression)
            except Exception as e:  # pytest's ParseError; its module path moved across versions
                raise pytest.UsageError(
                    f"exclusion {prefix}: bad -k expression {expression!r}: {e}"
                ) from e
        return bool(compiled.evaluate(KeywordMatcher.from_item(item)))

    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        keep, drop = [], []
        for item in items:
            hit = next((i for i, rule in enumerate(self.rules) if self._matches(rule, item)), None)
            if hit is None:
                keep.append(item)
            else:
                self.deselected[hit].append(item.nodeid)
                drop.append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        self.selected = len(items)

    # --- outcomes --------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        outcome = None
        if report.when == "call":
            if hasattr(report, "wasxfail"):
                outcome = "xpassed" if report.passed else "xfailed"
            else:
                outcome = report.outcome
        elif report.failed:  # setup or teardown failed
            outcome = "error"
        elif report.skipped:  # skipped in setup (skip marks, skip fixtures)
            outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        if outcome is None:
            return
        self.ran.add(report.nodeid)
        self.outcomes[outcome] += 1
        self.per_file[report.nodeid.split("::", 1)[0]][outcome] += 1
        if outcome in ("failed", "error"):
            message = str(report.longrepr).strip().splitlines()
            self.problems.append(
                {
                    "nodeid": report.nodeid,
                    "when": report.when,
                    "message": message[-1][:300] if message else "",
                }
            )

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:  # a whole module skipped at import (pytest.skip(allow_module_level))
            self.outcomes["skipped"] += 1
            self.per_file[report.nodeid.split("::", 1)[0]]["skipped"] += 1
        if report.failed:
            self.outcomes["error"] += 1
            self.per_file[report.nodeid.split("::", 1)[0]]["error"] += 1
            message = str(report.longrepr).strip().splitlines()
            self.problems.append(
                {
                    "nodeid": report.nodeid,
                    "when": "collect",
                    "message": message[-1][:300] if message else "",
                }
            )

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        unused = [
            {"path": rule["path"], "k": rule.get("k"), "reason": rule["reason"]}
            for i, rule in enumerate(self.rules)
            if i not in self.deselected
        ]
        stopped = session.shouldfail or session.shouldstop
        report = {
            "subset": self.selection["subset"],
            "pytest_exitstatus": int(exitstatus),
            "selected": self.selected,
            "not_run": max(self.selected - len(self.ran), 0),
            "stopped": str(stopped) if stopped else "",
            "vllm": self.vllm,
            "counts": {key: self.outcomes.get(key, 0) for key in _OUTCOMES}
            | {"deselected": sum(len(v) for v in self.deselected.values())},
            "per_file": {name: dict(counter) for name, counter in sorted(self.per_file.items())},
            "deselected": [
                {
                    "path": self.rules[i]["path"],
                    "k": self.rules[i].get("k"),
                    "reason": self.rules[i]["reason"],
                    "count": len(ids),
                }
                for i, ids in sorted(self.deselected.items())
            ],
            "unused_exclusions": unused,
            "problems": self.problems,
        }
        Path(self.selection["report"]).write_text(json.dumps(report, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(UpstreamSelection(config, _load_selection()), "hd_upstream")

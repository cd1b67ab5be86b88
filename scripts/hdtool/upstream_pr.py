"""`upstream-pr`: the patch set as one pull request against the upstream release.

From the same inputs `apply` uses (the pinned tag, patches/series, vllm_overlay/, kernels/) it
builds, in build/upstream and without touching any work tree:

  branch upstream-pr/<version>  on the tag: one commit per patch of the series (the hooks into
                                upstream files, author and date kept, this project's
                                Upstream-Status / Removal-Plan lines dropped), then ONE feature
                                commit adding vllm_overlay/ and kernels/ (at VERSION's
                                kernels_dest) at their in-tree paths. Nothing of this project's
                                tooling goes in: no build-info module, no relabelled _version.py.
                                Every new .py file carries vLLM's SPDX header (added where
                                missing; the run says which).
  build/upstream-pr/<PATCH_NAME> the branch as one mbox (`git am` applies it to the sdist tree);
                                checked by applying it to the tag and comparing the trees.
  build/upstream-pr/lint.md     vLLM's own pre-commit configuration from the pinned tree, run
                                on the touched files: ruff (its pyproject.toml settings, the
                                ruff version its .pre-commit-config.yaml pins) and its local
                                Python hooks; every hook that applies but cannot run here is
                                listed with the reason.
  reports/upstream-pr.md        the PR description (shape of vLLM PR #61867): purpose, what it
                                adds, how to enable it, supported and rejected configurations
                                read from the runtime's unsupported(), the decode-step table
                                read from docs/perf/decode.json, correctness evidence, test
                                plan, upstream files touched with line counts, lint summary.

docs/perf/decode.json (written by the benchmark, issue 6) must exist and describe this patch
set: its top-level "fingerprint" must equal pin.fingerprint() now (the FINGERPRINT of the
build-info module of the wheel the benchmark ran), and "vllm" the patched version. Otherwise
the command fails and says what to re-run. `--draft` builds everything anyway but writes the
description, headed by a loud list of what is missing, to build/upstream-pr/ instead of
reports/, so a draft can never be mistaken for the description to post.

decode.json keys read here: "fingerprint", "vllm", "gpu", "date", "command" (required);
"summary" with "step_ms", "speedup", "floor_ms" (objects keyed by N as a decimal string; the
values of step_ms may be numbers or objects of numbers, e.g. {"stock": .., "specialized": ..})
and "prefill_throughput_ratio" (required); any other object of summary keyed by N becomes one
more table column; optional "model", "method" (text) and "correctness" (an object: "command",
"result", "gpu", "date" strings and "checks", a list of strings); "switches" (the VLLM_HD_*
experiment switches the benchmark ran with) must be empty or absent.

docs/perf/decode_spread_routing.json (the same benchmark with `--routing spread`) is optional
and read by the same rules: when its fingerprint is current its table follows decode.json's;
otherwise the description says why it is not shown.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hdtool.gitutil import current_branch, dirty_paths, git, git_out
from hdtool.overlay import collisions, overlay_plan
from hdtool.patchfile import PatchFile, parse_patch, series_paths
from hdtool.pin import HdError, Pin, fingerprint
from hdtool.series import FORMAT_PATCH_OPTIONS, _rel, hd_command, lint_problems
from hdtool.upstream import ensure_imported
from hdtool.wheel import VERSION_MODULE

PR_BRANCH_PREFIX = "upstream-pr"
PATCH_NAME = "vllm-kimi-linear-sm90-decode.patch"
PERF_REPORT = "docs/perf/decode.json"
# The same benchmark with every MoE router re-drawn so that tokens route apart (optional).
SPREAD_REPORT = "docs/perf/decode_spread_routing.json"
DESCRIPTION = "reports/upstream-pr.md"
DRAFT_DESCRIPTION = "upstream-pr-DRAFT.md"
LINT_REPORT = "lint.md"
MAX_DIFF_LINES = 400

FEATURE_SUBJECT = "kimi_linear: latency-specialized decode on SM90 (CuTe DSL kernels)"
# No leading [tag]: `git am` would strip it from the subject (mailinfo drops bracketed prefixes).
PR_TITLE = "[Perf][Kimi-Linear] Latency-specialized decode for Kimi-Linear on Hopper (SM90)"
DECODE_BACKEND_KEY = "decode_backend"
DECODE_BACKEND_VALUE = "latency_specialized"
ENABLE_JSON = json.dumps({DECODE_BACKEND_KEY: DECODE_BACKEND_VALUE})
# The runtime package sits next to the kernels' destination, with unsupported() in __init__.
RUNTIME_PACKAGE = "runtime"
RUNTIME_FUNCTION = "unsupported"

SPDX_LICENSE = "# SPDX-License-Identifier: Apache-2.0"
SPDX_COPYRIGHT = "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project"
# Commit-message fields of this project's patches (series lint): its own bookkeeping, which
# refers to its issues and plans; upstream reads the message above them.
PROJECT_FIELDS = ("Why", "Upstream-Status", "Removal-Plan")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_N_KEY = re.compile(r"^[1-9][0-9]*$")


def out_dir(pin: Pin) -> Path:
    return pin.root / "build" / "upstream-pr"


def pr_branch(pin: Pin) -> str:
    return f"{PR_BRANCH_PREFIX}/{pin.upstream_version}"


# --- SPDX headers -----------------------------------------------------------------------------


def spdx_fixed(data: bytes) -> bytes | None:
    """data with vLLM's two SPDX lines added where missing; None when nothing is missing.

    vLLM's rule (tools/pre_commit/check_spdx_header.py): both lines anywhere in the file, an
    empty file needs none; a missing pair goes first (after a shebang) followed by a blank
    line (two before a def or class, as ruff format wants), a lone missing line next to the
    one present.
    """
    if not data:
        return None
    text = data.decode("utf-8")
    lines = text.splitlines(keepends=True)
    stripped = [line.strip() for line in lines]
    has_license, has_copyright = SPDX_LICENSE in stripped, SPDX_COPYRIGHT in stripped
    if has_license and has_copyright:
        return None
    newline = "\r\n" if lines[0].endswith("\r\n") else "\n"
    if has_license:
        at = stripped.index(SPDX_LICENSE) + 1
        lines.insert(at, SPDX_COPYRIGHT + newline)
    elif has_copyright:
        lines.insert(stripped.index(SPDX_COPYRIGHT), SPDX_LICENSE + newline)
    else:
        at = 1 if lines[0].startswith("#!") else 0
        if at == 1 and not lines[0].endswith("\n"):
            lines[0] += newline
        header = [SPDX_LICENSE + newline, SPDX_COPYRIGHT + newline]
        if at < len(lines) and lines[at].strip():
            header.append(newline)
            # ruff format keeps two blank lines between comments and a top-level def/class.
            if lines[at].startswith(("def ", "async def ", "class ", "@")):
                header.append(newline)
        lines[at:at] = header
    return "".join(lines).encode("utf-8")


# --- the perf report (docs/perf/decode.json) --------------------------------------------------


@dataclass
class PerfReport:
    path: Path
    data: dict
    columns: list[str]  # table columns after N, e.g. step_ms.stock, speedup, floor_ms
    rows: list[tuple[int, dict[str, float | None]]]  # (N, column -> value)


def _number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _n_keyed(summary: dict, key: str, where: str) -> dict[int, object]:
    table = summary.get(key)
    if not isinstance(table, dict) or not table:
        raise HdError(f"{where}: summary.{key} must be a non-empty object keyed by N")
    out: dict[int, object] = {}
    for n, value in table.items():
        if not (isinstance(n, str) and _N_KEY.match(n)):
            raise HdError(f"{where}: summary.{key} has key {n!r}; keys are N as strings: '1', ..")
        out[int(n)] = value
    return out


def load_perf(pin: Pin, current_fingerprint: str, report: str = PERF_REPORT) -> PerfReport:
    """A decode report (docs/perf/decode.json by default), checked to exist, be well-formed
    and describe this patch set."""
    path = pin.root / report
    make_bench = "`make bench`"
    if report == SPREAD_REPORT:
        make_bench = "`make bench BENCH_ARGS='--routing spread --n 1,2,4,8,16'`"
    bench = f"the decode benchmark on the H200 ({make_bench}, issue 6) against a wheel built "
    bench += "from this tree (`make build-wheel`)"
    if not path.is_file():
        raise HdError(
            f"{report} does not exist: the PR description needs the measured decode-step "
            f"table. Run {bench}; it writes {report} with "
            f'"fingerprint": "{current_fingerprint}". Then run `make upstream-pr` again '
            "(`--draft` writes a draft without numbers to build/upstream-pr/)."
        )
    where = report
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HdError(f"{where} is not valid JSON ({e}); re-run {bench}") from e
    if not isinstance(data, dict):
        raise HdError(f"{where}: the top level must be an object")
    recorded = data.get("fingerprint")
    if not isinstance(recorded, str) or not recorded:
        raise HdError(
            f'{where} records no "fingerprint", so nothing says which kernels it measured. The '
            f"benchmark must store the FINGERPRINT of the wheel's {pin.build_info_module} "
            f'at the top level. Re-run {bench} (current fingerprint: "{current_fingerprint}").'
        )
    if recorded != current_fingerprint:
        raise HdError(
            f"{where} is older than the kernels it describes: it was measured with patch-set "
            f"fingerprint {recorded[:16]}..., but patches/, vllm_overlay/ and kernels/ now give "
            f"{current_fingerprint[:16]}.... Re-run {bench}, commit the new {report}, "
            "then run `make upstream-pr` again."
        )
    if data.get("switches"):
        raise HdError(
            f"{where} was measured with experiment switches set ({data['switches']}), so it "
            f"is not the default build's number; re-run {bench} without them"
        )
    for key in ("vllm", "gpu", "date", "command"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise HdError(f'{where}: "{key}" must be a non-empty string (issue 6\'s format)')
    if data["vllm"] != pin.local_version:
        raise HdError(
            f"{where} was measured with vllm {data['vllm']}, but the pin builds "
            f"{pin.local_version}; re-run {bench}"
        )
    summary = data.get("summary")
    if not isinstance(summary, dict):
        raise HdError(f'{where}: no "summary" object (issue 6\'s format)')
    ratio = summary.get("prefill_throughput_ratio")
    if not _number(ratio):
        raise HdError(f"{where}: summary.prefill_throughput_ratio must be a number")

    required = ("step_ms", "speedup", "floor_ms")
    extra = [
        key
        for key, value in summary.items()
        if key not in required
        and isinstance(value, dict)
        and value
        and all(isinstance(k, str) and _N_KEY.match(k) for k in value)
    ]
    columns: list[str] = []
    cells: dict[int, dict[str, float | None]] = {}
    for key in (*required, *extra):
        for n, value in _n_keyed(summary, key, where).items():
            row = cells.setdefault(n, {})
            if isinstance(value, dict) and key == "step_ms":
                for sub, number in value.items():
                    if not _number(number):
                        raise HdError(f"{where}: summary.{key}['{n}'].{sub} is not a number")
                    column = f"{key}.{sub}"
                    if column not in columns:
                        columns.append(column)
                    row[column] = float(number)
            elif _number(value):
                if key not in columns:
                    columns.append(key)
                row[key] = float(value)
            else:
                raise HdError(f"{where}: summary.{key}['{n}'] is not a number")
    rows = [(n, {c: cells[n].get(c) for c in columns}) for n in sorted(cells)]
    correctness = data.get("correctness")
    if correctness is not None and not isinstance(correctness, dict):
        raise HdError(f'{where}: "correctness" must be an object')
    return PerfReport(path, data, columns, rows)


def format_cell(column: str, value: float | None) -> str:
    """How the description shows one value of the perf table (tests parse it back)."""
    if value is None:
        return "n/a"
    if column.startswith("speedup"):
        return f"{value:.2f}x"
    if column.split(".")[0].endswith("_ms"):
        return f"{value:.3f}"
    if column == "distinct_experts":  # a mean over layer-steps
        return f"{value:.1f}"
    return f"{value:g}"


def _column_title(column: str) -> str:
    key, _, sub = column.partition(".")
    titles = {"step_ms": "step (ms)", "floor_ms": "weight-read floor (ms)", "speedup": "speedup"}
    title = titles.get(key, key.replace("_", " "))
    return f"{title}, {sub}" if sub else title


def perf_table(perf: PerfReport) -> list[str]:
    head = ["N", *(_column_title(c) for c in perf.columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n, row in perf.rows:
        cells = [str(n), *(format_cell(c, row[c]) for c in perf.columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# --- the runtime's unsupported() ----------------------------------------------------------------


@dataclass(frozen=True)
class Reason:
    message: str  # the reason's text; {expr} marks a value filled in at run time
    condition: str  # the code that leads to it ("" when unconditional)
    line: int


@dataclass
class RuntimeFacts:
    path: str  # tree-relative path of the runtime's __init__.py
    doc: str  # first paragraph of unsupported()'s docstring
    reasons: list[Reason]
    constants: list[tuple[str, object]]  # module-level UPPER_CASE constants and values


_UNKNOWN = object()
# Calls whose result is known when their argument is: how constants are usually spelled.
_STATIC_CALLS = {
    "tuple": tuple,
    "list": list,
    "set": set,
    "frozenset": frozenset,
    "sorted": sorted,
    "dict": dict,
    "MappingProxyType": dict,
    "str": str,
    "repr": repr,
}
_CONVERSIONS = {ord("r"): repr, ord("s"): str, ord("a"): ascii}


class _Module:
    """A parsed module: its functions and the values of its module-level constants."""

    def __init__(self, module: ast.Module) -> None:
        self.functions = {
            node.name: node
            for node in module.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        self.constants: dict[str, object] = {}
        for node in module.body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id.isupper():
                    value = self.static(node.value)
                    if value is not _UNKNOWN:
                        self.constants[target.id] = value

    def static(self, node: ast.expr) -> object:
        """The value of an expression made of literals and module constants, or _UNKNOWN."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.constants.get(node.id, _UNKNOWN)
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = [self.static(e) for e in node.elts]
            if _UNKNOWN in items:
                return _UNKNOWN
            kind = {ast.Tuple: tuple, ast.List: list, ast.Set: frozenset}[type(node)]
            return kind(items)
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                return _UNKNOWN
            keys = [self.static(k) for k in node.keys if k is not None]
            values = [self.static(v) for v in node.values]
            return _UNKNOWN if _UNKNOWN in keys + values else dict(zip(keys, values))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = self.static(node.operand)
            return -value if _number(value) else _UNKNOWN
        if isinstance(node, ast.Call) and not node.keywords:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "map" and len(node.args) == 2 and ast.unparse(node.args[0]) in _STATIC_CALLS:
                values = self.static(node.args[1])
                if values is _UNKNOWN:
                    return _UNKNOWN
                try:
                    return [_STATIC_CALLS[ast.unparse(node.args[0])](v) for v in values]
                except (TypeError, ValueError):
                    return _UNKNOWN
            args = [self.static(a) for a in node.args]
            if _UNKNOWN in args:
                return _UNKNOWN
            try:
                if isinstance(func, ast.Attribute) and func.attr == "join" and len(args) == 1:
                    sep = self.static(func.value)
                    return sep.join(args[0]) if isinstance(sep, str) else _UNKNOWN
                if name in _STATIC_CALLS and len(args) == 1:
                    return _STATIC_CALLS[name](args[0])
            except (TypeError, ValueError):
                return _UNKNOWN
        return _UNKNOWN

    def text(self, node: ast.expr) -> str | None:
        """The text of a string-like expression: constants filled in, {expr} for values
        known only at run time; None if the expression is not string-like."""
        if isinstance(node, ast.JoinedStr):
            parts = []
            for value in node.values:
                if isinstance(value, ast.Constant):
                    parts.append(str(value.value))
                elif isinstance(value, ast.FormattedValue):
                    parts.append(self._formatted(value))
            return "".join(parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.text(node.left), self.text(node.right)
            if left is None and right is None:
                return None
            return self._part(node.left, left) + self._part(node.right, right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return self.text(node.left)
        if isinstance(node, ast.IfExp):
            body, orelse = self.text(node.body), self.text(node.orelse)
            return None if body is None or orelse is None else f"{body} or {orelse}"
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"
        ):
            return self.text(node.func.value)
        value = self.static(node)
        return value if isinstance(value, str) else None

    def _part(self, node: ast.expr, text: str | None) -> str:
        return text if text is not None else "{" + ast.unparse(node) + "}"

    def _formatted(self, node: ast.FormattedValue) -> str:
        value = self.static(node.value)
        spec = self.text(node.format_spec) if node.format_spec is not None else ""
        if value is not _UNKNOWN and spec is not None:
            converted = _CONVERSIONS.get(node.conversion, lambda v: v)(value)
            try:
                return format(converted, spec)
            except (TypeError, ValueError):
                pass
        conversion = f"!{chr(node.conversion)}" if node.conversion > 0 else ""
        return "{" + ast.unparse(node.value) + conversion + "}"


def _target(node: ast.expr) -> str:
    """A loop target as written: `name, value`, not ast.unparse's `(name, value)`."""
    if isinstance(node, ast.Tuple) and node.elts:
        return ", ".join(ast.unparse(e) for e in node.elts)
    return ast.unparse(node)


class _ReasonReader:
    """Collects the reasons unsupported() can give, following the module's helpers.

    A reason is a string-like expression in a reason position: appended / added / extended /
    += to a list the function returns or was handed (a parameter), yielded, returned, or the
    text of a (condition, text) pair; a (condition, text) table filtered by a comprehension,
    `*helper()` inside such a table and helper calls in a reason position are followed. Each
    reason keeps the code that leads to it: enclosing `if` / `for`, the pair's condition.
    """

    def __init__(self, module: _Module, path: str) -> None:
        self.module = module
        self.path = path
        self.reasons: list[Reason] = []
        self.unreadable: list[str] = []
        self._active: list[str] = []
        self._sinks: list[set[str]] = []
        self._expanding: set[str] = set()

    def function(self, name: str, conditions: list[str]) -> None:
        if name in self._active:
            return
        node = self.module.functions[name]
        arguments = node.args
        sinks = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Return) and isinstance(sub.value, ast.Name):
                sinks.add(sub.value.id)
        self._active.append(name)
        self._sinks.append(sinks)
        self.block(node.body, conditions)
        self._sinks.pop()
        self._active.pop()

    def block(self, statements: list[ast.stmt], conditions: list[str]) -> None:
        for statement in statements:
            self.statement(statement, conditions)

    def _add(self, text: str, conditions: list[str], line: int) -> None:
        self.reasons.append(Reason(" ".join(text.split()), "; ".join(conditions), line))

    def reason(self, node: ast.expr, conditions: list[str]) -> None:
        """Read the reason(s) an expression in a reason position gives."""
        text = self.module.text(node)
        if text is not None:
            self._add(text, conditions, node.lineno)
            return
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            first, second = (self.module.text(e) for e in node.elts)
            if (first is None) != (second is None):
                condition = node.elts[0] if second is not None else node.elts[1]
                reason = second if second is not None else first
                assert reason is not None
                self._add(reason, [*conditions, ast.unparse(condition)], node.lineno)
                return
        if isinstance(node, ast.Starred):
            self.reason(node.value, conditions)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in self.module.functions:
            self.function(node.func.id, conditions)  # type: ignore[attr-defined]
        elif isinstance(node, ast.List | ast.Tuple | ast.Set):
            for element in node.elts:
                self.reason(element, conditions)
        elif isinstance(node, ast.ListComp | ast.GeneratorExp | ast.SetComp):
            self._comprehension(node, conditions)
        elif isinstance(node, ast.IfExp):
            test = ast.unparse(node.test)
            self.reason(node.body, [*conditions, test])
            self.reason(node.orelse, [*conditions, f"not ({test})"])
        elif isinstance(node, ast.Name) and node.id not in self._expanding:
            value = self._assigned(node.id)
            if value is None:
                self._unreadable(node)
                return
            self._expanding.add(node.id)
            self.reason(value, conditions)
            self._expanding.discard(node.id)
        else:
            self._unreadable(node)

    def _unreadable(self, node: ast.expr) -> None:
        self.unreadable.append(
            f"{self.path}:{node.lineno}: `{ast.unparse(node)}` is not a string, f-string, "
            "(condition, text) pair or call of a helper in this module"
        )

    def _comprehension(
        self, node: ast.ListComp | ast.GeneratorExp | ast.SetComp, conditions: list[str]
    ) -> None:
        loops = []
        for generator in node.generators:
            loops.append(f"for {_target(generator.target)} in {ast.unparse(generator.iter)}")
            loops += [ast.unparse(test) for test in generator.ifs]
        if self.module.text(node.elt) is not None or len(node.generators) != 1:
            self.reason(node.elt, [*conditions, *loops])
            return
        # [why for failed, why in checks if failed]: the reasons are the table's.
        (generator,) = node.generators
        bound = {n.id for n in ast.walk(generator.target) if isinstance(n, ast.Name)}
        if isinstance(node.elt, ast.Name) and node.elt.id in bound:
            self.reason(generator.iter, conditions)
        else:
            self.reason(node.elt, [*conditions, *loops])

    def _assigned(self, name: str) -> ast.expr | None:
        """The value last assigned to `name` in the function being read."""
        value = None
        for node in ast.walk(self.module.functions[self._active[-1]]):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == name
            ):
                value = node.value
        return value

    def _is_sink(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id in self._sinks[-1]

    def statement(self, node: ast.stmt, conditions: list[str]) -> None:
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            self.block(node.body, [*conditions, test])
            self.block(node.orelse, [*conditions, f"not ({test})"])
        elif isinstance(node, ast.For | ast.AsyncFor):
            loop = f"for {_target(node.target)} in {ast.unparse(node.iter)}"
            self.block(node.body, [*conditions, loop])
            self.block(node.orelse, conditions)
        elif isinstance(node, ast.While):
            self.block(node.body, [*conditions, f"while {ast.unparse(node.test)}"])
        elif isinstance(node, ast.With | ast.AsyncWith):
            self.block(node.body, conditions)
        elif isinstance(node, ast.Try):
            for body in (node.body, node.orelse, node.finalbody):
                self.block(body, conditions)
            for handler in node.handlers:
                caught = ast.unparse(handler.type) if handler.type else "an exception"
                self.block(handler.body, [*conditions, f"on {caught}"])
        elif isinstance(node, ast.Expr):
            self._expression_statement(node.value, conditions)
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.op, ast.Add | ast.BitOr) and self._is_sink(node.target):
                self.reason(node.value, conditions)
        elif isinstance(node, ast.Assign):
            literal = ast.List | ast.Tuple | ast.Set | ast.ListComp | ast.GeneratorExp
            if (
                any(self._is_sink(t) for t in node.targets)
                and isinstance(node.value, literal)
                and getattr(node.value, "elts", True)  # an empty list to fill holds none
            ):
                self.reason(node.value, conditions)
        elif isinstance(node, ast.Return) and node.value is not None:
            value = node.value
            if not (isinstance(value, ast.Constant) and value.value is None) and not (
                self._is_sink(value)
            ):
                self.reason(value, conditions)

    def _expression_statement(self, value: ast.expr, conditions: list[str]) -> None:
        if isinstance(value, ast.Yield | ast.YieldFrom):
            if value.value is not None:
                self.reason(value.value, conditions)
            return
        if not isinstance(value, ast.Call):
            return
        func = value.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in ("append", "add", "extend")
            and len(value.args) == 1
            and self._is_sink(func.value)
        ):
            self.reason(value.args[0], conditions)
        elif (
            isinstance(func, ast.Name)
            and func.id in self.module.functions
            and any(self._is_sink(a) for a in value.args)
        ):
            self.function(func.id, conditions)  # a helper filling the list it is handed


def read_runtime(pin: Pin, plan: dict[str, Path]) -> RuntimeFacts:
    """The reasons of the runtime's unsupported(), read from its source (never retyped)."""
    target = (Path(pin.kernels_dest.strip("/")).parent / RUNTIME_PACKAGE / "__init__.py").as_posix()
    src = plan.get(target)
    if src is None:
        raise HdError(
            f"the overlay has no {target} (vllm_overlay/{target}), so the supported and rejected "
            f"configurations cannot be read from its {RUNTIME_FUNCTION}(); it comes with the "
            "integration (issue 6)"
        )
    shown = _rel(src)
    text = src.read_text(encoding="utf-8")
    try:
        tree = ast.parse(text, filename=str(src))
    except SyntaxError as e:
        raise HdError(f"{shown}: cannot parse it ({e})") from e
    for needle in (DECODE_BACKEND_KEY, DECODE_BACKEND_VALUE):
        if needle not in text:
            raise HdError(
                f"{shown} never mentions {needle!r}; the description's enable instructions "
                f"(--additional-config '{ENABLE_JSON}') would not match the runtime"
            )
    module = _Module(tree)
    if RUNTIME_FUNCTION not in module.functions:
        raise HdError(f"{shown} defines no {RUNTIME_FUNCTION}() at module level")
    reader = _ReasonReader(module, shown)
    reader.function(RUNTIME_FUNCTION, [])
    if reader.unreadable:
        raise HdError(
            f"{RUNTIME_FUNCTION}() gives reasons the description cannot read from the source; "
            "write each as a string or f-string (appended to the returned list, yielded, "
            "returned, or in (condition, text) pairs):\n  " + "\n  ".join(reader.unreadable)
        )
    if not reader.reasons:
        raise HdError(
            f"found no reasons in {RUNTIME_FUNCTION}() of {shown} (read: reasons.append(...), "
            "reasons += [...], yield ..., return [...], (condition, text) tables filtered by a "
            "comprehension, and the same in helpers of the module it calls there)"
        )
    doc = ast.get_docstring(module.functions[RUNTIME_FUNCTION]) or ""
    constants = [(n, v) for n, v in module.constants.items() if not n.startswith("_")]
    return RuntimeFacts(target, " ".join(doc.split("\n\n")[0].split()), reader.reasons, constants)


# --- the branch -------------------------------------------------------------------------------


@dataclass
class PrCommit:
    sha: str
    subject: str
    kind: str  # "hook" or "feature"
    source: str  # the patch file name, or "vllm_overlay/ + kernels/"
    summary: str  # first paragraph of the message body
    files: list[tuple[str, str, str, str]] = field(default_factory=list)  # status, path, +, -


@dataclass
class Export:
    branch: str
    head: str
    commits: list[PrCommit]
    spdx_fixed: list[str]  # tree paths whose SPDX header the export added
    touched: list[tuple[str, str, str, str]]  # status, path, added, deleted (vs the tag)
    patch_file: Path


def upstream_message(patch: PatchFile) -> tuple[str, str]:
    """(commit message for upstream, its first body paragraph): this project's fields dropped."""
    kept = []
    for line in patch.message.splitlines():
        key, sep, _ = line.partition(":")
        if not (sep and key in PROJECT_FIELDS):
            kept.append(line)
    body = "\n".join(kept).strip()
    summary = " ".join(body.split("\n\n")[0].split())
    return (f"{patch.subject}\n\n{body}\n" if body else f"{patch.subject}\n"), summary


def _changes(repo: Path, old: str, new: str) -> list[tuple[str, str, str, str]]:
    """(status A/M/D, path, lines added, lines deleted) between two commits."""
    status_out = git(
        "diff", "--name-status", "-z", "--no-renames", old, new, cwd=repo
    ).stdout.decode("utf-8", errors="surrogateescape")
    fields = [f for f in status_out.split("\0") if f]
    status = dict(zip(fields[1::2], fields[0::2]))
    numstat = git("diff", "--numstat", "-z", "--no-renames", old, new, cwd=repo).stdout.decode(
        "utf-8", errors="surrogateescape"
    )
    out = []
    for entry in numstat.split("\0"):
        if not entry:
            continue
        added, deleted, path = entry.split("\t", 2)
        out.append((status.get(path, "M"), path, added, deleted))
    return sorted(out, key=lambda row: row[1])


def _git_text(
    *args: str, cwd: Path, env: dict[str, str] | None = None, input: bytes | None = None
) -> str:
    """git_out with extra environment (a private GIT_INDEX_FILE)."""
    return git(*args, cwd=cwd, env=env, input=input).stdout.decode().rstrip("\n")


def _hash_blob(repo: Path, data: bytes) -> str:
    return git_out("hash-object", "-w", "--no-filters", "--stdin", cwd=repo, input=data)


def _spdx_in_index(repo: Path, env: dict[str, str], parent: str) -> list[str]:
    """Add the SPDX header to .py files the index adds on top of parent; returns their paths."""
    added = git(
        "diff-index", "--cached", "--name-only", "-z", "--diff-filter=A", parent, cwd=repo, env=env
    ).stdout.decode("utf-8", errors="surrogateescape")
    fixed = []
    for path in sorted(p for p in added.split("\0") if p.endswith(".py")):
        stage = git("ls-files", "--stage", "-z", "--", path, cwd=repo, env=env).stdout.decode()
        mode, blob = stage.split()[0], stage.split()[1]
        data = git("cat-file", "blob", blob, cwd=repo).stdout
        try:
            new = spdx_fixed(data)
        except UnicodeDecodeError as e:
            raise HdError(f"{path}: not UTF-8 text, cannot check its SPDX header") from e
        if new is None:
            continue
        git(
            "update-index",
            "--cacheinfo",
            f"{mode},{_hash_blob(repo, new)},{path}",
            cwd=repo,
            env=env,
        )
        fixed.append(path)
    return fixed


def _commit_tree(repo: Path, env: dict[str, str], parent: str, message: str, who: dict) -> str:
    tree = _git_text("write-tree", cwd=repo, env=env)
    return _git_text(
        "commit-tree", tree, "-p", parent, cwd=repo, input=message.encode(), env={**env, **who}
    )


def build_branch(
    pin: Pin,
    patches: list[PatchFile],
    plan: dict[str, Path],
    author: tuple[str, str] | None = None,
) -> Export:
    """Commits on the tag, built in a private index (no work tree is touched). The feature
    commit's author is `author` (name, email), else the tooling's identity."""
    repo = pin.upstream_repo
    tag = pin.upstream_tag
    tag_commit = git_out("rev-parse", f"{tag}^{{commit}}", cwd=repo)
    branch = pr_branch(pin)
    commits: list[PrCommit] = []
    spdx: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hd-upstream-pr-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", tag_commit, cwd=repo, env=env)
        parent = tag_commit
        for patch in patches:
            proc = git(
                "apply", "--cached", "--whitespace=error", str(patch.path), cwd=repo, env=env,
                check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                raise HdError(
                    f"{patch.name} does not apply to {tag}:\n"
                    f"{proc.stderr.decode(errors='replace').strip()}\n"
                    f"Run {hd_command(pin, 'apply')} for the per-patch report."
                )
            spdx += _spdx_in_index(repo, env, parent)
            message, summary = upstream_message(patch)
            date = patch.date or git_out("log", "-1", "--format=%cI", parent, cwd=repo)
            who = {
                "GIT_AUTHOR_NAME": patch.author,
                "GIT_AUTHOR_EMAIL": patch.email,
                "GIT_AUTHOR_DATE": date,
                "GIT_COMMITTER_DATE": date,
            }
            sha = _commit_tree(repo, env, parent, message, who)
            commits.append(PrCommit(sha, patch.subject, "hook", patch.name, summary))
            parent = sha

        entries = []
        for target, src in sorted(plan.items()):
            data = src.read_bytes()
            if target.endswith(".py"):
                try:
                    new = spdx_fixed(data)
                except UnicodeDecodeError as e:
                    raise HdError(f"{_rel(src)}: not UTF-8 text, cannot check SPDX") from e
                if new is not None:
                    data = new
                    spdx.append(target)
            mode = "100755" if os.access(src, os.X_OK) else "100644"
            entries.append(f"{mode} {_hash_blob(repo, data)}\t{target}")
        if entries:
            git(
                "update-index", "--add", "-z", "--index-info", cwd=repo, env=env,
                input=("\0".join(entries) + "\0").encode(),
            )  # fmt: skip
            date = git_out("log", "-1", "--format=%cI", parent, cwd=repo)
            n_kernels = sum(1 for t in plan if t.startswith(pin.kernels_dest.strip("/") + "/"))
            message = (
                f"{FEATURE_SUBJECT}\n\n"
                "Adds the latency-specialized decode for KimiLinearForCausalLM on SM90,\n"
                f"enabled with --additional-config '{ENABLE_JSON}':\n"
                f"- {len(plan) - n_kernels} files of the runtime and model integration;\n"
                f"- {n_kernels} files of CuTe DSL kernels under\n"
                f"  {pin.kernels_dest}/.\n"
            )
            who = {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
            if author:
                who.update(GIT_AUTHOR_NAME=author[0], GIT_AUTHOR_EMAIL=author[1])
            sha = _commit_tree(repo, env, parent, message, who)
            commits.append(
                PrCommit(sha, FEATURE_SUBJECT, "feature", "vllm_overlay/ + kernels/", "")
            )
            parent = sha
    if not commits:
        raise HdError("the series, vllm_overlay/ and kernels/ are all empty: nothing to export")
    for commit, previous in zip(commits, [tag_commit] + [c.sha for c in commits[:-1]]):
        commit.files = _changes(repo, previous, commit.sha)
    touched = _changes(repo, tag_commit, parent)
    return Export(branch, parent, commits, sorted(set(spdx)), touched, out_dir(pin) / PATCH_NAME)


def _check_touched(pin: Pin, export: Export, patches: list[PatchFile], plan: dict) -> None:
    """The touched files are exactly what the series and the overlay imply, and nothing of the
    project's own tooling is among them."""
    expected = {p for patch in patches for p in patch.paths} | set(plan)
    actual = {path for _, path, _, _ in export.touched}
    if actual != expected:
        raise HdError(
            "the exported branch touches other files than the series and overlay imply:\n"
            f"  only in the branch: {sorted(actual - expected)}\n"
            f"  only implied:       {sorted(expected - actual)}\n"
            "(a patch that undoes another's change leaves no trace; merge those patches)"
        )
    tooling = sorted(actual & {pin.build_info_module, VERSION_MODULE})
    if tooling:
        raise HdError(
            f"the pull request would touch {', '.join(tooling)}, which only this project's "
            "tooling writes; drop that change from the series"
        )


def _set_branch(pin: Pin, export: Export) -> str | None:
    """Point the PR branch at the new head; returns the previous head if it moved."""
    repo = pin.upstream_repo
    ref = f"refs/heads/{export.branch}"
    old = git("rev-parse", "--verify", "--quiet", ref, cwd=repo, check=False).stdout.decode()
    old = old.strip() or None
    checked_out = current_branch(repo) == export.branch
    if checked_out and old != export.head:
        dirty = dirty_paths(repo)
        if dirty:
            raise HdError(
                f"{_rel(repo)} has {export.branch} checked out with uncommitted changes; "
                f"commit or drop them (git -C {_rel(repo)} stash), then run upstream-pr again"
            )
    git("update-ref", "-m", "hd.py upstream-pr", ref, export.head, cwd=repo)
    if checked_out:
        git("reset", "-q", "--hard", export.head, cwd=repo)
    return old if old and old != export.head else None


def write_patch_file(pin: Pin, export: Export) -> None:
    """The branch as one mbox, checked by rebuilding the branch's tree from it."""
    repo = pin.upstream_repo
    tag = pin.upstream_tag
    mbox = git(
        "format-patch", *FORMAT_PATCH_OPTIONS, "--stdout", f"{tag}..{export.head}", cwd=repo
    ).stdout
    export.patch_file.parent.mkdir(parents=True, exist_ok=True)
    export.patch_file.write_bytes(mbox)
    with tempfile.TemporaryDirectory(prefix="hd-upstream-pr-check-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", tag, cwd=repo, env=env)
        proc = git("apply", "--cached", str(export.patch_file), cwd=repo, env=env, check=False)
        rebuilt = _git_text("write-tree", cwd=repo, env=env) if proc.returncode == 0 else None
    expected = git_out("rev-parse", f"{export.head}^{{tree}}", cwd=repo)
    if rebuilt != expected:
        detail = proc.stderr.decode(errors="replace").strip() or "the trees differ"
        raise HdError(f"{_rel(export.patch_file)} does not rebuild {export.branch}: {detail}")


# --- vLLM's lint configuration ----------------------------------------------------------------


@dataclass
class HookResult:
    hook: str
    files: int
    status: str  # "passed", "findings", "not run"
    detail: list[str] = field(default_factory=list)  # one line per finding, or why not run
    extra: list[str] = field(default_factory=list)  # e.g. the diff ruff format wants


@dataclass
class LintResult:
    config: str  # where the configuration came from
    ruff_version: str
    pinned_ruff: str | None
    hooks: list[HookResult]
    notes: list[str] = field(default_factory=list)

    @property
    def findings(self) -> int:
        return sum(len(h.detail) for h in self.hooks if h.status == "findings")


# File filters of the remote hooks vLLM uses, as their own hook manifests define them
# (a .pre-commit-config.yaml only adds to these).
_REMOTE_HOOK_FILTERS: dict[str, dict] = {
    "ruff-check": {"types_or": ["python", "pyi"]},
    "ruff": {"types_or": ["python", "pyi"]},
    "ruff-format": {"types_or": ["python", "pyi"]},
    "typos": {"types": ["text"]},
    "markdownlint-cli2": {"types": ["markdown"]},
    "actionlint": {"files": r"^\.github/workflows/"},
}
_RUFF_HOOKS = ("ruff-check", "ruff", "ruff-format")
# vLLM's last hook only prints advice on skipping hooks.
_NOT_CHECKS = ("suggestion",)


def _tags(path: Path) -> set[str]:
    try:
        from identify.identify import tags_from_path
    except ImportError as e:  # pragma: no cover - comes with pre-commit in the dev venv
        raise HdError("the `identify` package (pre-commit's) is missing; run make venv-dev") from e
    return set(tags_from_path(str(path)))


def _hook_files(hook: dict, config: dict, tree: Path, files: list[str]) -> list[str]:
    """The files pre-commit would pass this hook (files/exclude/types/types_or filters)."""
    hook = {**_REMOTE_HOOK_FILTERS.get(hook.get("id", ""), {}), **hook}
    include = re.compile(hook.get("files", "") or "")
    exclude = re.compile(hook.get("exclude", "^$") or "^$")
    top_include = re.compile(config.get("files", "") or "")
    top_exclude = re.compile(config.get("exclude", "^$") or "^$")
    types = set(hook.get("types", ["file"]))
    types_or = set(hook.get("types_or", []))
    exclude_types = set(hook.get("exclude_types", []))
    chosen = []
    for path in files:
        if not (top_include.search(path) and not top_exclude.search(path)):
            continue
        if not (include.search(path) and not exclude.search(path)):
            continue
        tags = _tags(tree / path)
        if not types <= tags or (types_or and not types_or & tags) or exclude_types & tags:
            continue
        chosen.append(path)
    return chosen


def _hook_stages(hook: dict, config: dict) -> set[str]:
    return set(hook.get("stages", config.get("default_stages", ["pre-commit", "manual"])))


def _ruff_executable() -> str | None:
    candidate = Path(sys.executable).parent / "ruff"
    if candidate.exists():
        return str(candidate)
    return shutil.which("ruff")


def _python_with(modules: list[str], pin: Pin) -> str | None:
    """An interpreter that imports every module: ours, else the wheel venv's (which has
    vLLM's dependencies, e.g. regex, that several of vLLM's hooks need)."""
    return _first_python_with(tuple(modules), pin.root)


@functools.cache
def _first_python_with(modules: tuple[str, ...], root: Path) -> str | None:
    candidates = [sys.executable, str(root / "build" / "venv-wheel" / "bin" / "python")]
    for python in candidates:
        if not Path(python).exists():
            continue
        code = "".join(f"import {m}\n" for m in modules) or "pass"
        proc = subprocess.run([python, "-c", code], capture_output=True)
        if proc.returncode == 0:
            return python
    return None


def _module_of(requirement: str) -> str:
    """A pre-commit additional_dependency's import name (best effort: regex==x -> regex)."""
    name = re.split(r"[<>=!\[ ;]", requirement, maxsplit=1)[0]
    return name.replace("-", "_").lower()


def _run_ruff(ruff: str, tree: Path, hook_id: str, files: list[str]) -> HookResult:
    if hook_id.startswith("ruff-format"):
        cmd = [ruff, "format", "--check", "--no-cache", *files]
    else:
        cmd = [ruff, "check", "--no-cache", "--no-fix", "--output-format=concise", *files]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise HdError(f"`{shlex.join(cmd[:3])}` failed ({proc.returncode}):\n{proc.stderr}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if hook_id.startswith("ruff-format"):
        detail = [ln for ln in lines if ln.startswith("Would reformat")]
        if detail:
            cmd[2] = "--diff"
            shown = subprocess.run(cmd, cwd=tree, capture_output=True, text=True).stdout
            diff = shown.splitlines()
            if len(diff) > MAX_DIFF_LINES:
                diff = diff[:MAX_DIFF_LINES] + [f"... {len(diff) - MAX_DIFF_LINES} more lines"]
            extra = diff
        else:
            extra = []
    else:
        detail = [ln for ln in lines if re.match(r"^\S+:\d+:\d+: ", ln)]
        extra = []
    return HookResult(hook_id, len(files), "findings" if detail else "passed", detail, extra)


def _run_local_hook(pin: Pin, tree: Path, hook: dict, files: list[str]) -> HookResult:
    hook_id = hook.get("id", "?")
    entry = shlex.split(hook.get("entry", ""))
    deps = [_module_of(d) for d in hook.get("additional_dependencies", [])]
    if not entry or entry[0] not in ("python", "python3"):
        return HookResult(hook_id, len(files), "not run", [f"entry {hook.get('entry')!r}"])
    python = _python_with(deps, pin)
    if python is None:
        needs = ", ".join(hook.get("additional_dependencies", []))
        return HookResult(hook_id, len(files), "not run", [f"needs {needs}"])
    args = [*entry[1:], *hook.get("args", [])]
    if hook.get("pass_filenames", True):
        args += files
    proc = subprocess.run([python, *args], cwd=tree, capture_output=True, text=True)
    output = _ANSI.sub("", proc.stdout + proc.stderr)
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip()]
    if proc.returncode == 0:
        return HookResult(hook_id, len(files), "passed")
    if "Traceback (most recent call last)" in output:
        last = lines[-1] if lines else "(no output)"
        return HookResult(hook_id, len(files), "not run", [f"the hook crashed here: {last}"])
    return HookResult(hook_id, len(files), "findings", lines)


def run_vllm_lint(pin: Pin, export: Export) -> LintResult:
    """vLLM's pre-commit configuration at the pin, on the files the PR adds or changes."""
    import yaml

    repo = pin.upstream_repo
    touched = [path for status, path, _, _ in export.touched if status != "D"]
    with tempfile.TemporaryDirectory(prefix="hd-upstream-pr-lint-") as tmp:
        # The whole tree, as pre-commit would see it: ruff tells first- from third-party
        # imports by what exists, and hooks read files besides the ones they are given.
        tree = Path(tmp) / "tree"
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", export.head, cwd=repo, env=env)
        git("checkout-index", "-a", f"--prefix={tree}/", cwd=repo, env=env)
        ruff = _ruff_executable()
        proc = subprocess.run([ruff, "--version"], capture_output=True, text=True) if ruff else None
        ruff_version = proc.stdout.strip() if proc else "ruff not found"
        config_path = tree / ".pre-commit-config.yaml"
        notes: list[str] = []
        if not (tree / "pyproject.toml").is_file() or "[tool.ruff" not in (
            tree / "pyproject.toml"
        ).read_text(encoding="utf-8"):
            notes.append(f"{pin.upstream_tag} has no [tool.ruff] in pyproject.toml: ruff defaults")
        if config_path.is_file():
            config = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
            source = f".pre-commit-config.yaml and pyproject.toml of {pin.upstream_tag}"
        else:
            notes.append(f"{pin.upstream_tag} has no .pre-commit-config.yaml: ruff only")
            config = {"repos": [{"repo": "ruff", "hooks": [{"id": "ruff-check"}]}]}
            config["repos"][0]["hooks"].append({"id": "ruff-format"})
            source = f"pyproject.toml of {pin.upstream_tag} (no .pre-commit-config.yaml)"
        pinned_ruff = None
        results: list[HookResult] = []
        for repo_entry in config.get("repos", []):
            url = str(repo_entry.get("repo", ""))
            if "ruff" in url:
                pinned_ruff = str(repo_entry.get("rev", "")).lstrip("v") or None
            for hook in repo_entry.get("hooks", []):
                if hook.get("id") in _NOT_CHECKS:
                    continue
                stages = _hook_stages(hook, config)
                if not stages & {"pre-commit", "manual"}:
                    continue  # commit-msg and the like: not about files
                files = _hook_files(hook, config, tree, touched)
                if not files:
                    continue
                hook_id = hook.get("id", "?")
                if hook_id in _RUFF_HOOKS and "ruff" in url:
                    if ruff is None:
                        results.append(HookResult(hook_id, len(files), "not run", ["no ruff"]))
                    else:
                        results.append(_run_ruff(ruff, tree, hook_id, files))
                elif url == "local" and hook.get("language") == "python":
                    results.append(_run_local_hook(pin, tree, hook, files))
                else:
                    why = (
                        f"a local {hook.get('language')} hook; this tool runs only Python ones"
                        if url == "local"
                        else f"needs {url} {repo_entry.get('rev', '')}".strip()
                    )
                    results.append(HookResult(hook_id, len(files), "not run", [why]))
    if pinned_ruff and pinned_ruff not in ruff_version.split():
        notes.append(f"vLLM pins ruff {pinned_ruff}; this run used {ruff_version}")
    return LintResult(source, ruff_version, pinned_ruff, results, notes)


def lint_markdown(pin: Pin, lint: LintResult) -> str:
    lines = [
        f"# vLLM's lint on the upstream PR ({pr_branch(pin)})",
        "",
        f"Configuration: {lint.config}; {lint.ruff_version}. Generated by "
        f"`{hd_command(pin, 'upstream-pr')}`.",
        "",
    ]
    lines += [f"- note: {note}" for note in lint.notes]
    lines += ["", "| hook | files | result |", "|---|---:|---|"]
    for hook in lint.hooks:
        shown = hook.status
        if hook.status == "findings":
            shown = f"{len(hook.detail)} finding(s)"
        elif hook.status == "not run":
            shown = f"not run: {'; '.join(hook.detail)}"
        lines.append(f"| {hook.hook} | {hook.files} | {shown} |")
    for hook in lint.hooks:
        if hook.status == "findings":
            lines += ["", f"## {hook.hook}", "", "```", *hook.detail, "```"]
            if hook.extra:
                lines += ["", "```diff", *hook.extra, "```"]
    return "\n".join(lines) + "\n"


# --- the description --------------------------------------------------------------------------


def _tests_under(root: Path, sub: str) -> list[str]:
    base = root / sub
    if not base.is_dir():
        return []
    return sorted(p.relative_to(root).as_posix() for p in base.rglob("test_*.py"))


def render_description(
    pin: Pin,
    export: Export,
    runtime: RuntimeFacts | None,
    perf: PerfReport | None,
    lint: LintResult,
    gaps: list[str],
    current_fingerprint: str,
    spread: PerfReport | None = None,
    spread_problem: str = "",
) -> str:
    tag = pin.upstream_tag
    hooks = [c for c in export.commits if c.kind == "hook"]
    feature = [c for c in export.commits if c.kind == "feature"]
    kernels_prefix = pin.kernels_dest.strip("/") + "/"
    families = ", ".join(
        f"`{d}/`"
        for d in sorted(
            {
                path[len(kernels_prefix) :].split("/")[0]
                for _, path, _, _ in export.touched
                if path.startswith(kernels_prefix) and path[len(kernels_prefix) :].count("/")
            }
        )
    )
    out: list[str] = []
    if gaps:
        out += ["> [!CAUTION]", "> **DRAFT — NOT FOR SUBMISSION.** Missing:", ">"]
        out += [f"> - {gap}" for gap in gaps]
        out += [""]
    out += [f"# {PR_TITLE}", ""]
    out += [
        "## Purpose",
        "",
        "This PR adds an opt-in decode path for `KimiLinearForCausalLM` (KDA + MLA + MoE) on "
        "Hopper (SM90) aimed at per-step latency at small batch: uniform decode steps of "
        "prepared batch sizes run through CuTe DSL kernels"
        + (f" ({families})" if families else "")
        + " inside the FULL decode CUDA graph; everything else (prefill, mixed batches, eager, "
        "other sizes) runs the existing code, and without the flag nothing changes. vLLM has a "
        "latency-specialized decode of this kind only on Blackwell (#61867).",
        "",
        "## What this PR adds",
        "",
    ]
    for commit in hooks:
        plus = sum(int(a) for _, _, a, _ in commit.files if a.isdigit())
        minus = sum(int(d) for _, _, _, d in commit.files if d.isdigit())
        paths = ", ".join(f"`{p}`" for _, p, _, _ in commit.files)
        summary = f" {commit.summary}" if commit.summary else ""
        out.append(f"- **{commit.subject}** ({paths}, +{plus}/-{minus}).{summary}")
    for commit in feature:
        n_kernels = sum(
            1 for _, p, _, _ in commit.files if p.startswith(pin.kernels_dest.strip("/") + "/")
        )
        out.append(
            f"- **{commit.subject}**: {len(commit.files) - n_kernels} new runtime/integration "
            f"files and {n_kernels} kernel files under `{pin.kernels_dest}/` (all new)."
        )
    out += [
        "",
        "## How to enable",
        "",
        "```bash",
        f"vllm serve <Kimi-Linear checkpoint> --additional-config '{ENABLE_JSON}'",
        "```",
        "",
        f'or `LLM(..., additional_config={ENABLE_JSON})`. `"{DECODE_BACKEND_KEY}": "auto"` '
        "(the default) keeps the stock path.",
        "",
        "## Supported and rejected configurations",
        "",
    ]
    if runtime is None:
        out += [
            "**Not available**: the runtime's `unsupported()` could not be read (see above).",
            "",
        ]
    else:
        out += [
            f"Read from `{RUNTIME_FUNCTION}()` in `{runtime.path}`"
            + (f": {runtime.doc}" if runtime.doc else "."),
            "",
            "Enabling the backend on a deployment for which any of these holds is refused at "
            "engine start with a `ValueError` naming the reason; every other deployment is "
            "supported.",
            "",
            "| # | rejected | condition in the code |",
            "|---:|---|---|",
        ]
        for i, reason in enumerate(runtime.reasons, 1):
            condition = f"`{reason.condition}`" if reason.condition else "always"
            message = reason.message.replace("|", "\\|")
            out.append(f"| {i} | {message} | {condition.replace('|', chr(92) + '|')} |")
        if runtime.constants:
            out += ["", "Constants of the runtime these refer to:", ""]
            tables = []
            for name, value in runtime.constants:
                if isinstance(value, dict):
                    tables += ["", f"`{name}`:", "", "| key | value |", "|---|---|"]
                    tables += [f"| `{k}` | `{v!r}` |" for k, v in value.items()]
                else:
                    out.append(f"- `{name} = {value!r}`")
            out += tables
        out.append("")
    out += ["## Performance", ""]
    if perf is None:
        out += [
            "**NUMBERS MISSING**: no current `docs/perf/decode.json` (see the caution above).",
            "",
        ]
    else:
        data = perf.data
        summary = data["summary"]
        out += [
            f"Decode step time on {data['gpu']}, vLLM {data['vllm']}, {data['date']}"
            + (f", model {data['model']}" if isinstance(data.get("model"), str) else "")
            + ".",
            "",
        ]
        if isinstance(data.get("method"), str):
            out += [f"Method: {data['method']}", ""]
        out += [f"Command: `{data['command']}`", ""]
        out += perf_table(perf)
        out += [
            "",
            f"Prefill throughput, specialized / stock: {summary['prefill_throughput_ratio']:.3f}.",
            f"Patch-set fingerprint measured: `{data['fingerprint']}` (current).",
            "",
        ]
        out += _spread_section(spread, spread_problem)
    out += ["## Correctness", ""]
    correctness = perf.data.get("correctness") if perf else None
    if isinstance(correctness, dict):
        for key in ("command", "result", "gpu", "date"):
            if isinstance(correctness.get(key), str):
                out.append(f"- {key}: `{correctness[key]}`" if key == "command" else
                           f"- {key}: {correctness[key]}")  # fmt: skip
        checks = correctness.get("checks")
        if isinstance(checks, list):
            out += [f"- {check}" for check in checks if isinstance(check, str)]
    else:
        out.append(
            "**Not recorded**: `docs/perf/decode.json` has no `correctness` block (GPU tests of "
            "the specialized vs stock path: logits cosine, greedy tokens, KDA/MLA state)."
        )
    kernel_tests = _tests_under(pin.root, "tests/kernels")
    if kernel_tests:
        out.append(
            "- Kernel tests against reference implementations (patch-set repository, not part "
            "of this PR): " + ", ".join(f"`{t}`" for t in kernel_tests) + "."
        )
    out += [
        "",
        "## Test Plan",
        "",
        "- CPU (any machine): the patch-set repository's `make test` — tooling, the patched wheel "
        "built from this exact series, upstream's own CPU test selection against it.",
        "- H200 (SM90): `make test-gpu` (kernel tests), the correctness tests above, upstream's "
        "GPU subset (`hd.py upstream-tests --subset gpu`), and the benchmark"
        + (f" (`{perf.data['command']}`)." if perf else "."),
        "",
        "## Test Result",
        "",
    ]
    if perf:
        speedups = [row.get("speedup") for _, row in perf.rows if row.get("speedup") is not None]
        if speedups:
            out.append(
                f"Speedup over stock decode: {min(speedups):.2f}x to {max(speedups):.2f}x "
                f"across N = {', '.join(str(n) for n, _ in perf.rows)} (table above)."
            )
        if isinstance(correctness, dict) and isinstance(correctness.get("result"), str):
            out.append(f"Correctness: {correctness['result']}.")
    else:
        out.append("**Missing** (no current perf report).")
    total_plus = sum(int(a) for _, _, a, _ in export.touched if a.isdigit())
    total_minus = sum(int(d) for _, _, _, d in export.touched if d.isdigit())
    upstream_files = [row for row in export.touched if row[0] != "A"]
    new_files = [row for row in export.touched if row[0] == "A"]
    out += [
        "",
        f"## Files touched ({len(export.touched)}: {len(upstream_files)} upstream files changed, "
        f"{len(new_files)} new; +{total_plus}/-{total_minus})",
        "",
        "| file | status | + | - |",
        "|---|---|---:|---:|",
    ]
    status_name = {"A": "new", "M": "modified", "D": "deleted"}
    for status, path, added, deleted in upstream_files + new_files:
        out.append(f"| `{path}` | {status_name.get(status, status)} | {added} | {deleted} |")
    spdx = ", ".join(f"`{p}`" for p in export.spdx_fixed) or "none"
    out += [
        "",
        "## Lint",
        "",
        f"vLLM's pre-commit configuration ({lint.config}; {lint.ruff_version}) on the touched "
        f"files: {lint.findings} finding(s).",
        "",
    ]
    for hook in lint.hooks:
        shown = {"findings": f"{len(hook.detail)} finding(s)", "passed": "passed"}.get(
            hook.status, f"not run ({'; '.join(hook.detail)})"
        )
        out.append(f"- `{hook.hook}` ({hook.files} files): {shown}")
    out += [f"- note: {note}" for note in lint.notes]
    out += [
        "",
        "<!-- Generated by `make upstream-pr` (scripts/hdtool/upstream_pr.py) from the series, "
        f"the overlay and docs/perf/decode.json; branch {export.branch} on {tag}, patch-set "
        f"fingerprint {current_fingerprint}; SPDX headers added by the export: {spdx}. -->",
    ]
    return "\n".join(out) + "\n"


# --- the command ------------------------------------------------------------------------------


def _load_patches(pin: Pin) -> list[PatchFile]:
    problems, _ = lint_problems(pin)
    if problems:
        raise HdError(
            "patches/ does not pass lint; fix it first (make lint):\n  " + "\n  ".join(problems)
        )
    return [parse_patch(path) for path in series_paths(pin)]


_AUTHOR = re.compile(r"^\s*([^<>]*?)\s*<([^<>\s]+@[^<>\s]+)>\s*$")


def parse_author(text: str) -> tuple[str, str]:
    m = _AUTHOR.match(text)
    if not m or not m[1]:
        raise HdError(f"--author {text!r}: expected 'Name <email@example.org>'")
    return m[1], m[2]


def _spread_section(spread: PerfReport | None, problem: str) -> list[str]:
    """The benchmark again with routing that follows the token, or why it is not shown."""
    out = ["### With routing that follows the token", ""]
    if spread is None:
        why = problem or f"no `{SPREAD_REPORT}`"
        out += [
            f"Not shown ({why}): the table above is all there is for this patch set.",
            "",
        ]
        return out
    data = spread.data
    out += [
        "The same benchmark with every MoE router re-drawn after the dummy load, so that a "
        f"token's experts follow the token: {data['gpu']}, vLLM {data['vllm']}, {data['date']}.",
        "",
        f"Command: `{data['command']}`",
        "",
    ]
    out += perf_table(spread)
    out.append("")
    return out


def upstream_pr(pin: Pin, draft: bool, author: str | None = None) -> int:
    started = time.monotonic()
    feature_author = parse_author(author) if author else None
    current = fingerprint(pin)
    gaps: list[str] = []
    perf: PerfReport | None = None
    try:
        perf = load_perf(pin, current)
    except HdError as e:
        if not draft:
            raise
        gaps.append(f"performance: {e}")
    # Optional: a stale or malformed spread-routing report is left out of the description
    # (said there and here), never shown as this patch set's numbers.
    spread: PerfReport | None = None
    spread_problem = ""
    if (pin.root / SPREAD_REPORT).is_file():
        try:
            spread = load_perf(pin, current, SPREAD_REPORT)
        except HdError as e:
            spread_problem = str(e).split(". ")[0]
            print(f"upstream-pr: {SPREAD_REPORT} left out of the description: {e}")
    plan = overlay_plan(pin)
    runtime: RuntimeFacts | None = None
    try:
        runtime = read_runtime(pin, plan)
    except HdError as e:
        if not draft:
            raise
        gaps.append(f"configurations: {e}")
    patches = _load_patches(pin)
    ensure_imported(pin)
    repo = pin.upstream_repo
    tag_files = set(
        git("ls-tree", "-r", "-z", "--name-only", pin.upstream_tag, cwd=repo)
        .stdout.decode("utf-8", errors="surrogateescape")
        .split("\0")
    )
    clashes = collisions(pin, tag_files | {p for patch in patches for p in patch.paths})
    if clashes:
        raise HdError(
            "the overlay collides with upstream or patched files:\n  " + "\n  ".join(clashes)
        )

    export = build_branch(pin, patches, plan, feature_author)
    _check_touched(pin, export, patches, plan)
    previous = _set_branch(pin, export)
    write_patch_file(pin, export)
    lint = run_vllm_lint(pin, export)
    lint_path = out_dir(pin) / LINT_REPORT
    lint_path.write_text(lint_markdown(pin, lint), encoding="utf-8")
    description = render_description(
        pin, export, runtime, perf, lint, gaps, current, spread, spread_problem
    )
    target = (out_dir(pin) / DRAFT_DESCRIPTION) if gaps else (pin.root / DESCRIPTION)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(description, encoding="utf-8")

    print(
        f"upstream-pr: {export.branch} in {_rel(repo)} ({export.head[:12]}) on {pin.upstream_tag}"
    )
    if previous:
        print(f"  (was {previous[:12]})")
    for commit in export.commits:
        print(f"  {commit.kind:<7} {commit.sha[:12]} {commit.subject} ({len(commit.files)} files)")
    added = sum(1 for row in export.touched if row[0] == "A")
    print(
        f"upstream-pr: {len(export.touched)} files touched ({len(export.touched) - added} "
        f"upstream files changed, {added} new)"
    )
    if export.spdx_fixed:
        print(f"upstream-pr: SPDX header added to {len(export.spdx_fixed)} new file(s):")
        for path in export.spdx_fixed:
            print(f"  {path}")
    else:
        print("upstream-pr: every new .py file already has vLLM's SPDX header")
    print(f"upstream-pr: patch {_rel(export.patch_file)} (rebuilds the branch exactly)")
    print(f"upstream-pr: vLLM lint: {lint.findings} finding(s); {_rel(lint_path)}")
    for hook in lint.hooks:
        print(f"  {hook.hook}: {hook.status}" + (f" ({len(hook.detail)})" if hook.detail else ""))
    for note in lint.notes:
        print(f"  note: {note}")
    if gaps:
        print(f"upstream-pr: DRAFT description (NOT for submission): {_rel(target)}")
        for gap in gaps:
            print(f"  missing: {gap.splitlines()[0]}")
    else:
        print(f"upstream-pr: description {_rel(target)}")
    print(f"upstream-pr: done in {time.monotonic() - started:.1f} s.")
    print(
        "Before posting, sign off every commit (vLLM's DCO): "
        f"git -C {_rel(repo)} rebase --signoff {pin.upstream_tag} {export.branch}"
        + ("" if feature_author else " (and pass --author 'Name <email>' for the feature commit)")
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "upstream-pr",
        help="export the patch set as one upstream PR: branch, patch, lint, description",
        description="Build branch upstream-pr/<version> in build/upstream (hook commits, one per "
        "patch, then one feature commit adding vllm_overlay/ and kernels/ at their in-tree "
        "paths, SPDX headers added where missing), write it as one patch file to "
        "build/upstream-pr/, run vLLM's pre-commit configuration from the pinned tree on the "
        "touched files, and write the PR description to reports/upstream-pr.md. Refuses "
        "unless docs/perf/decode.json exists and records the current patch-set fingerprint.",
    )
    p.add_argument(
        "--draft",
        action="store_true",
        help="go on when docs/perf/decode.json or the runtime's unsupported() is missing or "
        "stale: the description goes to build/upstream-pr/upstream-pr-DRAFT.md, headed by "
        "what is missing, and reports/ is not touched",
    )
    p.add_argument(
        "--author",
        metavar="'NAME <EMAIL>'",
        help="author of the feature commit (default: the tooling's identity; the hook commits "
        "keep their patches' authors)",
    )
    p.set_defaults(func=lambda args, pin: upstream_pr(pin, args.draft, args.author))

"""Static import check of the overlay and kernels against an upstream tree, without installing
vLLM and without a GPU.

Every `import vllm.x.y`, `from vllm.x import a, b` and relative import (`from .m import a`) in
a file the overlay commit adds is resolved against a tree: a git revision of build/upstream
with the overlay and kernels laid on top, exactly where apply and the wheel build put them.
A module resolves when its file (x.py or x/__init__.py) or its directory exists; an imported
name resolves when the module binds it at top level (def, class, assignment, import, also
inside module-level if/try/with blocks; star imports are followed) or it is a submodule. A
module with a top-level `__getattr__` (PEP 562) can provide any name; those are reported as
unverifiable rather than missing.

Imports inside functions and `if TYPE_CHECKING:` blocks count too: they fail at run time or
under a type checker just the same.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hdtool.gitutil import git
from hdtool.overlay import overlay_plan
from hdtool.pin import HdError, Pin

ROOT_PACKAGE = "vllm"

OK = "ok"
MISSING_MODULE = "missing module"
MISSING_NAME = "missing name"
UNVERIFIABLE = "unverifiable"


@dataclass
class ModuleNames:
    names: set[str]
    star_from: list[str]  # dotted modules whose public names are re-exported with `import *`
    has_getattr: bool
    syntax_error: str | None = None


class SourceTree:
    """A read-only file tree: a git revision's files, with the overlay files laid on top."""

    def __init__(self, files: set[str], read: Callable[[str], bytes], label: str) -> None:
        self.files = files
        self._read = read
        self.label = label
        self._dirs: set[str] = set()
        for path in files:
            parts = path.split("/")
            for n in range(1, len(parts)):
                self._dirs.add("/".join(parts[:n]))
        self._names: dict[str, ModuleNames] = {}

    @classmethod
    def from_git(cls, repo: Path, rev: str, overlay: dict[str, Path] | None = None) -> SourceTree:
        out = git("ls-tree", "-r", "-z", "--name-only", rev, cwd=repo).stdout.decode(
            "utf-8", errors="surrogateescape"
        )
        files = {p for p in out.split("\0") if p}
        overlay = dict(overlay or {})

        def read(path: str) -> bytes:
            if path in overlay:
                return overlay[path].read_bytes()
            return git("cat-file", "blob", f"{rev}:{path}", cwd=repo).stdout

        return cls(files | set(overlay), read, rev)

    def read(self, path: str) -> bytes:
        return self._read(path)

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in self.files:
                return candidate
        return None

    def module_exists(self, dotted: str) -> bool:
        """A module file, a package, or a directory (namespace package) of that name."""
        return self.module_file(dotted) is not None or dotted.replace(".", "/") in self._dirs

    def names(self, dotted: str) -> ModuleNames | None:
        """Top-level names bound by a module (None if it has no file: a namespace package)."""
        if dotted in self._names:
            return self._names[dotted]
        path = self.module_file(dotted)
        if path is None:
            return None
        try:
            tree = ast.parse(self.read(path), path)
        except SyntaxError as e:
            result = ModuleNames(set(), [], False, f"{path}: {e}")
        else:
            package = dotted if path.endswith("/__init__.py") else dotted.rpartition(".")[0]
            result = _top_level_names(tree, package)
        self._names[dotted] = result
        return result


def _bound_targets(node: ast.expr) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _bound_targets(element)
    elif isinstance(node, ast.Starred):
        yield from _bound_targets(node.value)


def _absolute(module: str | None, level: int, package: str) -> str | None:
    """The absolute module of `from <level dots><module> import ...` inside `package`."""
    if level == 0:
        return module
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    if module:
        base.append(module)
    return ".".join(base) or None


def _top_level_names(tree: ast.Module, package: str) -> ModuleNames:
    result = ModuleNames(set(), [], False)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                result.names.add(node.name)
                if node.name == "__getattr__":
                    result.has_getattr = True
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    result.names.update(_bound_targets(target))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                result.names.update(_bound_targets(node.target))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    result.names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        source = _absolute(node.module, node.level, package)
                        if source:
                            result.star_from.append(source)
                    else:
                        result.names.add(alias.asname or alias.name)
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                result.names.update(_bound_targets(node.target))
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        result.names.update(_bound_targets(item.optional_vars))
                visit(node.body)
            elif isinstance(node, (ast.If, ast.While)):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                visit(node.body)  # type: ignore[attr-defined]
                for handler in node.handlers:  # type: ignore[attr-defined]
                    if handler.name:
                        result.names.add(handler.name)
                    visit(handler.body)
                visit(node.orelse)  # type: ignore[attr-defined]
                visit(node.finalbody)  # type: ignore[attr-defined]

    visit(tree.body)
    return result


# --- resolving one import --------------------------------------------------------------------


@dataclass
class ImportResult:
    file: str  # tree path of the importing file
    origin: str  # the project file it comes from (vllm_overlay/... or kernels/...)
    line: int
    statement: str  # e.g. "from vllm.x import a"
    module: str  # absolute module
    name: str | None  # imported name (None for `import m` / the module itself)
    status: str  # OK, MISSING_MODULE, MISSING_NAME, UNVERIFIABLE
    detail: str = ""
    defined_elsewhere: list[str] = field(default_factory=list)  # for a missing name

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


def _binds(tree: SourceTree, module: str, name: str, seen: set[str]) -> tuple[bool, str]:
    """(found, how) for `name` in `module`, following star imports."""
    if module in seen:
        return False, ""
    seen.add(module)
    info = tree.names(module)
    if info is None:
        return False, ""
    if name in info.names:
        return True, "defined"
    for source in info.star_from:
        found, _ = _binds(tree, source, name, seen)
        if found:
            return True, f"via `from {source} import *`"
    if info.has_getattr:
        return True, "module __getattr__"
    return False, ""


def resolve(tree: SourceTree, module: str, name: str | None) -> tuple[str, str]:
    """(status, detail) of importing `name` from `module` (or the module itself)."""
    parts = module.split(".")
    for n in range(1, len(parts) + 1):
        prefix = ".".join(parts[:n])
        if not tree.module_exists(prefix):
            parent = ".".join(parts[: n - 1])
            where = f"; {parent} exists" if parent else ""
            return MISSING_MODULE, f"no module {prefix} in {tree.label}{where}"
    if name is None:
        return OK, ""
    if tree.module_exists(f"{module}.{name}"):
        return OK, "submodule"
    info = tree.names(module)
    if info is None:
        return MISSING_NAME, f"{module} is a directory without __init__.py and no {name} in it"
    if info.syntax_error:
        return UNVERIFIABLE, f"cannot parse {info.syntax_error}"
    found, how = _binds(tree, module, name, set())
    if not found:
        return MISSING_NAME, f"{module} does not define {name}"
    if how == "module __getattr__":
        return UNVERIFIABLE, f"{module} defines __getattr__; {name} may come from it"
    return OK, how


def _package_of(path: str) -> str:
    dotted = path[: -len(".py")].replace("/", ".")
    return (
        dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted.rpartition(".")[0]
    )


def imports_of(path: str, source: bytes) -> Iterator[tuple[int, str, str, str | None]]:
    """(line, statement, absolute module, name) for each vllm.* or relative import."""
    try:
        tree = ast.parse(source, path)
    except SyntaxError as e:
        raise HdError(f"{path}: not valid Python ({e})") from e
    package = _package_of(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT_PACKAGE:
                    yield node.lineno, f"import {alias.name}", alias.name, None
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, package)
            shown = "." * node.level + (node.module or "")
            if module is None:
                yield node.lineno, f"from {shown} import ...", shown, None
                continue
            if module.split(".")[0] != ROOT_PACKAGE:
                continue
            for alias in node.names:
                name = None if alias.name == "*" else alias.name
                yield node.lineno, f"from {shown} import {alias.name}", module, name


def definitions(repo: Path, rev: str, name: str, *, methods: bool = False) -> list[str]:
    """Where `name` is defined (class/def/assignment at top level; with `methods`, also an
    indented def) under vllm/ at rev, as path:line."""
    indent = r"\s*" if methods else ""
    pattern = (
        rf"^{indent}(class|def|async def) {re.escape(name)}\b"
        rf"|^{re.escape(name)}\s*(:|=[^=])"
    )
    proc = git(
        "grep", "-n", "-E", pattern, rev, "--", f"{ROOT_PACKAGE}/*.py", cwd=repo, check=False
    )
    hits = []
    for line in proc.stdout.decode(errors="replace").splitlines():
        path, _, rest = line.partition(":")[2].partition(":")
        lineno = rest.partition(":")[0]
        hits.append(f"{path}:{lineno}")
    return hits


def _same_named_modules(tree: SourceTree, module: str) -> list[str]:
    """Modules elsewhere in the tree with the missing module's last name (it may have moved)."""
    last = module.rpartition(".")[2]
    hits = sorted(
        p
        for p in tree.files
        if p.startswith(f"{ROOT_PACKAGE}/")
        and (p.endswith(f"/{last}.py") or p.endswith(f"/{last}/__init__.py"))
    )
    return hits[:10]


@dataclass
class CheckResult:
    label: str  # what the tree is, e.g. "rebase/0.30.0 (v0.30.0 + series) + overlay"
    files: dict[str, str]  # tree path -> project origin, for every .py file checked
    results: list[ImportResult]

    @property
    def problems(self) -> list[ImportResult]:
        return [r for r in self.results if r.status in (MISSING_MODULE, MISSING_NAME)]

    @property
    def unverifiable(self) -> list[ImportResult]:
        return [r for r in self.results if r.status == UNVERIFIABLE]


def check_overlay(pin: Pin, repo: Path, rev: str, label: str) -> CheckResult:
    """Import-check every .py file of the overlay and kernels, laid on `rev` of `repo`."""
    plan = {dest: src for dest, src in overlay_plan(pin).items() if dest.endswith(".py")}
    tree = SourceTree.from_git(repo, rev, plan)
    tree.label = label
    files = {dest: src.relative_to(pin.root).as_posix() for dest, src in sorted(plan.items())}
    results: list[ImportResult] = []
    for dest, origin in files.items():
        for line, statement, module, name in imports_of(dest, tree.read(dest)):
            if module.startswith("."):
                status, detail = MISSING_MODULE, "relative import beyond the top package"
            else:
                status, detail = resolve(tree, module, name)
            result = ImportResult(dest, origin, line, statement, module, name, status, detail)
            if status == MISSING_NAME and name:
                result.defined_elsewhere = definitions(repo, rev, name)
            elif status == MISSING_MODULE:
                result.defined_elsewhere = _same_named_modules(tree, module)
            results.append(result)
    return CheckResult(label, files, results)

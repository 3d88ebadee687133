"""The package's import graph shows the architecture (SPEC.md section 7): no import cycles, and data
flowing one way, from the on-disk format up to the command line. Read from the source with ``ast``
(every ``import``, including those inside functions and under ``TYPE_CHECKING``), not by importing."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tracer"

# Each stage's level: a module may import its own stage and the stages below it, never one beside or above.
LEVELS = {
    "errors": 0,
    "format": 1,
    "formulas": 2,
    "record": 3, "read": 3,
    "zero_edit": 4, "integrations": 4, "checks": 4, "diff": 4, "views": 4,
    "demo": 5, "testing": 5, "view_server": 5,
    "guard": 5,  # the live guard runs the checks (4) on what the writer (3) writes; the writer knows only
    # its protocol (tracer.record.observer) and gets the guard from the public constructors (6)
    "cli": 6, "commands": 6, "__main__": 6, "": 6,  # "": the package's own __init__, its public face
}
# Stages of one level that build on another of that level (the arrows of SPEC.md section 7).
ALSO = {("demo", "testing"), ("zero_edit", "integrations"), ("__main__", "cli"), ("cli", "commands")}
MAX_TOP_LEVEL_MODULES = 10


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "tracer" and (found := resolve(target)) and found != name:
                    edges[name].add(found)
    return edges


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    assert _cycles(_edges(_modules())) == []


def test_no_module_imports_a_stage_beside_or_above_its_own():
    wrong = []
    for a, targets in _edges(_modules()).items():
        for b in targets:
            sa, sb = _stage(a), _stage(b)
            if sa == sb and a != "tracer":
                if a.startswith(b + "."):  # a submodule importing its own package's __init__
                    wrong.append(f"{a} -> {b} (its own package)")
                continue
            if LEVELS[sb] > LEVELS[sa] or (LEVELS[sb] == LEVELS[sa] and (sa, sb) not in ALSO):
                wrong.append(f"{a} -> {b}")
    assert wrong == []


def test_the_format_imports_nothing_of_tracer_but_errors():
    edges = _edges(_modules())
    assert {b for a, targets in edges.items() if _stage(a) == "format" for b in targets
            if _stage(b) != "format"} <= {"tracer.errors"}


def test_tracer_has_at_most_ten_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


# Modules that import without torch (issue 49: `tracer --help`, `tracer info` and reading a trace answer
# in a fraction of a second): the package's face, the command line, the format and read stages. torch
# is imported inside the functions that do maths (checks, formulas, capture, the writer).
TORCH_FREE = ("tracer", "tracer.__main__", "tracer.cli", "tracer.errors", "tracer.view_server",
              "tracer.record", "tracer.record.observer", "tracer.format", "tracer.read", "tracer.read.reader",
              "tracer.read.step_table", "tracer.read.metadata_cache", "tracer.read.overview", "tracer.read.tables",
              "tracer.read.trace_info", "tracer.read.rollouts", "tracer.checks", "tracer.checks.finding",
              "tracer.checks.registry", "tracer.checks.catalogue", "tracer.commands", "tracer.commands.info",
              "tracer.commands.trace_paths", "tracer.commands.check", "tracer.commands.diff", "tracer.demo.runner")


def _runs_on_import(tree: ast.Module) -> list[ast.stmt]:
    """The statements executed when a module is imported: its body and the bodies of its classes,
    ``if``/``try``/``with`` blocks, not function bodies nor ``if TYPE_CHECKING:`` blocks."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(getattr(node, field, None) or [])
    return out


def _import_time_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> what importing it imports at once: tracer modules (with the packages above each,
    whose ``__init__`` runs first) and outside modules by full dotted name."""
    def with_parents(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(modules) | (
            {name} if name.split(".")[0] != "tracer" else set())

    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in _runs_on_import(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in names:
                targets |= with_parents(target)
        edges[name] = targets - {name}
    return edges


def test_the_format_and_read_stages_and_the_command_line_import_no_torch():
    modules = _modules()
    edges = _import_time_edges(modules)
    roots = [m for m in modules if m in TORCH_FREE or m.startswith("tracer.format.")]
    wrong = []
    for root in roots:
        seen, path_to = {root}, {root: [root]}
        todo = [root]
        while todo:
            current = todo.pop()
            for target in edges.get(current, ()):
                if target in seen:
                    continue
                seen.add(target)
                path_to[target] = path_to[current] + [target]
                if "torch" in target.split("."):
                    wrong.append(" -> ".join(path_to[target]))
                elif target in modules:
                    todo.append(target)
    assert sorted(set(wrong)) == []

"""servelm/ has no import cycles: the graph of every import of a servelm module (at module
level and inside functions: a lazy import is still an edge of the layering), except those
under `if TYPE_CHECKING:`, has no strongly connected component of more than one module.

Static (ast), so it costs no imports and sees imports that only run on some paths. An
import names its module, not the packages above it: importing servelm.x.y also runs
servelm/__init__.py (which imports the LLM entry point), an edge this graph leaves out."""

from __future__ import annotations

import ast
from pathlib import Path

import servelm

ROOT = Path(servelm.__file__).resolve().parent
PACKAGE = "servelm"


def _modules() -> dict[str, Path]:
    """Dotted name -> file, every module of the package (a package as its __init__)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """The Import / ImportFrom nodes of a module, anywhere but under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The servelm module a dotted name imports: itself, or the longest module prefix
    (`from servelm.x import f` names servelm.x)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """servelm module -> the servelm modules it imports (a package's __init__ counts only
    where it is imported by name, not for the submodules below it)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                for alias in node.names:
                    sub = f"{prefix}.{alias.name}"
                    # `from pkg import module` imports the module; `from mod import name`
                    # the module that defines it.
                    targets.append(sub if sub in modules else prefix)
            for t in targets:
                if not (t == PACKAGE or t.startswith(PACKAGE + ".")):
                    continue
                dep = _resolve(t, modules)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _describe(comp: list[str], graph: dict[str, set[str]]) -> str:
    inside = set(comp)
    edges = [f"    {a} -> {b}" for a in comp for b in sorted(graph[a] & inside)]
    return "  " + ", ".join(comp) + "\n" + "\n".join(edges)


def test_graph_sees_lazy_and_relative_imports():
    g = import_graph()
    # A module-level import, and a lazy one inside a function (the registry's model class).
    assert "servelm.models.family" in g["servelm.models.registry"]
    assert "servelm.spec.draft_model" in g["servelm.engine.engine"]


def test_cycle_finder():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(g) == [["a", "b", "c"]]


def test_no_import_cycles():
    g = import_graph()
    found = cycles(g)
    assert not found, ("import cycles in servelm/ (each: its modules, then the edges "
                       "inside it):\n" + "\n".join(_describe(c, g) for c in found))

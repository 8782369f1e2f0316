"""No import cycle between the project's modules (issue 28): conductor/, workers/ (installed as
conductor.workers) and bench/, read statically with ast, so an import inside a function or under
TYPE_CHECKING counts as much as one at the top of a module.

The check counts the imports a module writes, not the package ``__init__`` Python runs before a
module: ``conductor/__init__.py`` is the public API and imports what it exports, and a package's
``__init__`` that puts a facade together from its modules (conductor/client/__init__.py,
conductor/verify/__init__.py) is an edge from the package to its modules, never back."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

# folder -> the import name of its modules
FOLDERS = {"conductor": "conductor", "workers": "conductor.workers", "bench": "bench"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (a name inside a module counts as that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module ``module`` imports, wherever in the file the import stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            m = _project_module(t, modules)
            if m is not None and m != module:
                found.add(m)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def project_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_no_import_cycle_between_project_modules():
    found = cycles(project_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_check_sees_imports_in_functions_and_under_type_checking(tmp_path):
    # The finder itself, on made-up modules that meet only inside a function and under TYPE_CHECKING.
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    b.write_text("def f():\n    from pkg import a\n    return a\n")
    modules = {"pkg.a": a, "pkg.b": b, "pkg": tmp_path / "__init__.py"}
    graph = {m: imports_of(m, p, modules) for m, p in modules.items() if m != "pkg"}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]

"""No import cycles among VCGA's modules (vcga/, plugins/, formats/, conformance/).

Every import counts, wherever it sits -- at the top, inside a function or a class, through
``importlib.import_module("...")`` -- except under ``if TYPE_CHECKING:``, which never runs. A
deferred import inside a function hides a cycle from the interpreter's start-up, not from the
design: the two modules still cannot be understood, tested or moved one without the other.

An import of ``a.b.c`` is an edge to ``a.b.c`` only: Python runs the parent packages' ``__init__``
first, but a package importing its own submodules is how packages are built, not a cycle.
"""

from __future__ import annotations

import ast

from test_walls import MODULES, imports_of


def _type_checking_lines(source: str) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) blocks."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _resolve(module: str) -> str | None:
    """The VCGA module an import names (``from a import name`` names ``a``), or None if not ours."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        skip = _type_checking_lines(source)
        edges = graph.setdefault(name, set())
        for imp in imports_of(name, source):
            if imp.how == "print" or imp.line in skip:
                continue
            target = _resolve(imp.module)
            if target and target != name:
                edges.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_no_import_cycles():
    graph = import_graph({name: path.read_text() for name, path in MODULES.items()})
    assert len(graph) > 60
    found = cycles(graph)
    assert not found, "import cycles (each line one set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_cycle_finder_sees_deferred_imports_and_skips_type_checking():
    sources = {
        "vcga.convert.engine": "from vcga.convert.detect import detect_source\n",
        "vcga.convert.detect": "def f():\n    from vcga.convert import engine\n",
        "vcga.tensors": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vcga.wire import Frame\n",
        "vcga.wire": "import vcga.tensors\n",
    }
    assert cycles(import_graph(sources)) == [["vcga.convert.detect", "vcga.convert.engine"]]

"""The placement package's modules import one another in layers: no cycle, not even
through an import inside a function or one made only for the type checker, and the core
(tables, search, anytime) imports nothing that renders an answer."""

from __future__ import annotations

import ast
from pathlib import Path

import topoagent.placement

PACKAGE = Path(topoagent.placement.__file__).parent
CORE = {"deadline", "tables", "rings", "bounds", "ksets", "search", "anytime", "live", "request", "latency"}
# Above the core: answers and their rendering (bindings, launch forms, reasons in words),
# tiers, and the objective's helpers for tests and benchmarks.
ABOVE_CORE = {"answer", "binding", "explain", "tiers", "objective"}


def imports() -> dict[str, set[str]]:
    """Per module of the package, the modules of the package it imports anywhere."""
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:2] != ["topoagent", "placement"]:
                    continue
                if len(parts) > 2:
                    deps.add(parts[2])
                else:  # from topoagent.placement import tables
                    deps.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.Import):
                deps.update(
                    alias.name.split(".")[2] for alias in node.names if alias.name.startswith("topoagent.placement.")
                )
        graph[path.stem] = deps - {path.stem}
    return graph


def test_the_placement_modules_import_one_another_without_a_cycle():
    graph = imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            visit(dep, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
    assert {"search", "tables", "anytime"} <= done  # the walk saw the core


def test_the_core_imports_no_rendering():
    graph = imports()
    for module in CORE:
        assert not graph[module] & ABOVE_CORE, (module, graph[module] & ABOVE_CORE)


def test_what_modules_keep_per_tables_goes_with_the_matrix():
    """Each module keeps its memo beside the tables, not on them: when a snapshot's
    matrix goes, its tables and every memo kept for them go at once (no cycle left for
    the garbage collector to find later)."""
    import weakref

    from topoagent.placement import Live, Placement, Request, place, warm
    from topoagent.placement.answer import ANSWERS
    from topoagent.placement.bounds import TERMS
    from topoagent.placement.rings import RINGS
    from topoagent.placement.synthetic import pcie_two_socket_8
    from topoagent.placement.tables import prepare

    memos = (ANSWERS, TERMS, RINGS)
    before = [len(memo) for memo in memos]
    matrix = pcie_two_socket_8()
    warm(matrix)
    answer = place(matrix, Request(gpus=4, nics=1), busy=[1], live=Live(unverified=frozenset({0})))
    assert isinstance(answer, Placement)
    prep = prepare(matrix, None)
    assert all(memo.peek(prep) is not None for memo in memos)
    tables = weakref.ref(prep)
    del matrix, prep
    assert tables() is None
    assert [len(memo) for memo in memos] == before

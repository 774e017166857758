"""The layout the design promises, checked on the code itself: no import cycle between
topoagent's modules (not even through an import inside a function), and a cluster side that
speaks to agents only over HTTP and through the documents."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import topoagent

PACKAGE = Path(topoagent.__file__).parent


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (collectors/, exporters/ and probes/ are
    links into the package, so they are walked as its own)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(("topoagent", *parts))] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(tree: ast.AST, name: str, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that ``name`` imports at run time, wherever the import stands
    (imports under ``if TYPE_CHECKING:`` never run, so they make no cycle)."""
    package = name if known[name].name == "__init__.py" else name.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` runs a, a.b and a.b.c
                target = target.rpartition(".")[0]
            if target.startswith("topoagent") and target != name:
                yield target


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imports(ast.parse(path.read_text(), str(path)), name, known)) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                        found.append(sorted(component))
    return found


def test_the_graph_sees_function_level_imports() -> None:
    """The walk must see an import inside a function, or the cycle test proves nothing."""
    known = {"topoagent.a": Path("a.py"), "topoagent.b": Path("b.py")}
    tree = ast.parse("def f():\n    from topoagent import b\n")
    assert set(imports(tree, "topoagent.a", known)) == {"topoagent.b"}
    assert cycles({"topoagent.a": {"topoagent.b"}, "topoagent.b": {"topoagent.a"}}) == [["topoagent.a", "topoagent.b"]]


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (each line: modules that import each other in a circle):\n" + "\n".join(
        ", ".join(c) for c in found)


# What the cluster side may import of the rest: the shared vocabulary and small helpers, and
# the request grammar the agents' documents share (a /place request is parsed one way).
CLUSTER_MAY_IMPORT = {
    "topoagent.vocabulary", "topoagent.log", "topoagent.text", "topoagent.smallfile", "topoagent.errors",
    "topoagent.placement.request", "topoagent.documents", "topoagent.documents.lease",
    "topoagent.node.cpulist",  # the documents' CPU lists (cpus: "0-3,8"), one reading for all
    "topoagent.connections",  # the listener's guard, the agent's and the extender's alike
}


def test_the_cluster_side_imports_nothing_of_the_agent() -> None:
    graph = import_graph()
    reached = {
        f"{name} -> {target}"
        for name, targets in graph.items() if name.startswith("topoagent.cluster")
        for target in targets
        if not target.startswith("topoagent.cluster") and target not in CLUSTER_MAY_IMPORT
    }
    assert not reached, "the cluster side reaches into the agent:\n" + "\n".join(sorted(reached))

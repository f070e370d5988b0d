"""One floor per package: no import cycle between rlhf's packages (and its top-level modules), read from the
source with `ast`, so a stage importing the orchestration floor (or any other loop) fails here, naming the files."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "rlhf"


def _unit(path: Path) -> str:
    """The floor a file belongs to: its package under rlhf/, or the top-level module's own name."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _edges() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the files importing it (every import, also those inside functions)."""
    edges: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _unit(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "rlhf"
                                         else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "rlhf" and len(parts) > 1 and parts[1] != src:
                    edges.setdefault(src, {}).setdefault(parts[1], set()).add(str(path.relative_to(PACKAGE)))
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_packages():
    edges = _edges()
    cycles = _cycles({src: set(dst) for src, dst in edges.items()})
    detail = [f"{src} -> {dst}: {sorted(edges[src][dst])}" for cycle in cycles for src in cycle
              for dst in sorted(edges.get(src, {})) if dst in cycle]
    assert not cycles, f"import cycles between rlhf's packages {cycles}:\n" + "\n".join(detail)


def test_the_orchestration_floor_is_imported_only_from_above():
    """Stages never import the loop; only the CLI, the profiler and the orchestration floor itself do."""
    above = {"cli", "profiling", "orchestration", "__main__", "testing"}
    users = {src for src, dsts in _edges().items() if "orchestration" in dsts}
    assert users <= above, sorted(users - above)

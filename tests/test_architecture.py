"""The house's layers, checked on the import graph (deferred, function-level imports counted): no circles between
moetplan's packages, the contract at the bottom, the runtime free of the planner's side, typer only in the CLI."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "moetplan"


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "moetplan":
        return parts[0]
    if len(parts) == 1:
        return "moetplan"
    return parts[1].removesuffix(".py")


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{importing unit: {imported unit: ["file:line", ...]}} over every import statement in moetplan/."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG.parent)
        src = _unit(".".join(rel.with_suffix("").parts))
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "moetplan":  # `from moetplan import hwdb`
                    names = [f"moetplan.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                dst = _unit(n)
                if dst and dst != src and dst != "__version__":
                    graph[src][dst].append(f"{rel}:{node.lineno}")
    return graph


def _internal(graph):
    units = {p.name.removesuffix(".py") for p in PKG.iterdir() if p.name != "__pycache__"}
    return {a: {b for b in deps if b in units and b != "moetplan"} for a, deps in graph.items() if a in units}


def test_no_import_circle_between_packages():
    g = _internal(import_graph())
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(g.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (cyc := visit(v)):
                return cyc
        state[u] = 2
        path.pop()
        return None

    for u in sorted(g):
        if u not in state and (cyc := visit(u)):
            raise AssertionError(" -> ".join(cyc))


def test_the_contract_imports_no_other_moetplan_package():
    assert set(_internal(import_graph()).get("contract", set())) == set()


def test_the_runtime_imports_nothing_of_the_planning_side_nor_typer():
    graph = import_graph()
    bad = {u: graph["runtime"][u] for u in ("cli", "launch", "plan", "report", "hwdb", "bench", "typer")
           if u in graph["runtime"]}
    assert bad == {}, bad


def test_typer_is_used_by_the_cli_only():
    graph = import_graph()
    users = {u for u, deps in graph.items() if "typer" in deps}
    assert users <= {"cli"}, {u: graph[u]["typer"] for u in users - {"cli"}}


def test_report_and_launch_stay_below_the_planner():
    g = _internal(import_graph())
    assert not g.get("report", set()) & {"plan", "launch", "bench", "cli", "runtime", "hw"}
    assert not g.get("launch", set()) & {"plan", "bench", "cli", "report", "runtime", "hw"}
    assert not g.get("plan", set()) & {"launch", "hw", "bench", "cli", "report", "runtime"}

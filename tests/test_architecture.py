"""The house's layers, checked on the import graph (deferred, function-level imports counted): no circles between
moetplan's packages, the contract at the bottom, the runtime free of the planner's side, typer only in the CLI."""
from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "moetplan"


@cache
def _tree(f: Path) -> ast.Module:
    return ast.parse(f.read_text())


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
        for node in ast.walk(_tree(f)):
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
    bad = {u: graph["runtime"][u] for u in ("cli", "launch", "plan", "report", "hwdb", "measure", "typer")
           if u in graph["runtime"]}
    assert bad == {}, bad


def test_typer_is_used_by_the_cli_only():
    graph = import_graph()
    users = {u for u, deps in graph.items() if "typer" in deps}
    assert users <= {"cli"}, {u: graph[u]["typer"] for u in users - {"cli"}}


def test_report_and_launch_stay_below_the_planner():
    g = _internal(import_graph())
    assert not g.get("report", set()) & {"plan", "launch", "measure", "cli", "runtime", "hw"}
    assert not g.get("launch", set()) & {"plan", "measure", "cli", "report", "runtime", "hw"}
    assert not g.get("plan", set()) & {"launch", "hw", "measure", "cli", "report", "runtime"}


# --------------------------------------------------------------------------- file level

# Modules of the op, the expert store and the storage format: they run (and are tested) without vLLM, so neither
# they nor anything they import, at any depth, imports vLLM or its adapter (moetplan.vllm_compat). Named by module
# name, found wherever they live under runtime/ (flat today; runtime/op/, runtime/store/, runtime/format/ later:
# every module in those folders is held to the rule as well).
NO_VLLM_ROOMS = ("runtime/op", "runtime/store", "runtime/format")
NO_VLLM_MODULES = (
    # the op and its kernels
    "ops", "reference", "cuda_paths", "kernels", "moe_op", "miss_replay", "graph_counters", "routers",
    # the expert store
    "store", "slots", "backing", "tiers", "reserve", "reserve_sources", "heat", "dummy_experts",
    # the storage format
    "format", "packs", "sources", "checkpoint", "pack_repair",
)
VLLM = ("vllm", "moetplan.vllm_compat")
# Besides hwdb.py, the modules that may parse YAML, and why; none of them reads a file of hwdb/.
YAML_READERS = {
    "moetplan/hwdb.py": "the one reader of hwdb/",
    "moetplan/cost_model/calibration.py": "the user's calibration file (config dir)",
    "moetplan/cost_model/refit.py": "writes a refit calibration file",
}
HWDB_PATHS = ("hwdb_dir", "calibration_dir")


@cache
def _modules() -> dict[str, Path]:
    """{dotted module name: file} for every module of the package (a package's own name for its __init__)."""
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(f: Path, mods: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) per import in f; `from pkg import mod` resolves to pkg.mod."""
    out = []
    for node in ast.walk(_tree(f)):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            plain = []
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in mods:
                    out.append((sub, [], node.lineno))
                else:
                    plain.append(a.name)
            if plain or not node.names:
                out.append((node.module, plain, node.lineno))
    return out


@cache
def file_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module (moetplan's, or a third-party top-level name): line}}, deferred imports counted."""
    mods = _modules()
    g: dict[str, dict[str, int]] = {}
    for name, f in mods.items():
        deps: dict[str, int] = {}
        for mod, _, line in _imports(f, mods):
            if mod.startswith("moetplan"):
                while mod not in mods and "." in mod:
                    mod = mod.rsplit(".", 1)[0]
            else:
                mod = mod.split(".")[0]
            if mod != name:
                deps.setdefault(mod, line)
        g[name] = deps
    return g


def _no_vllm_modules(mods: dict[str, Path]) -> list[str]:
    runtime = PKG / "runtime"
    out = [m for m, f in mods.items() if any(runtime.parent / room in f.parents for room in NO_VLLM_ROOMS)]
    for stem in NO_VLLM_MODULES:
        found = [m for m, f in mods.items() if runtime in f.parents and f.stem == stem]
        assert len(found) == 1, f"NO_VLLM_MODULES names '{stem}', found {found or 'nothing'} under runtime/: update it"
        out += found
    return sorted(set(out))


def test_op_store_and_format_import_no_vllm_at_any_depth():
    g = file_graph()
    bad = {}
    for start in _no_vllm_modules(_modules()):
        seen, stack = {start: [start]}, [start]
        while stack:
            m = stack.pop()
            for dep, line in g.get(m, {}).items():
                if dep in VLLM:
                    bad[start] = " -> ".join(seen[m]) + f" -> {dep} (line {line})"
                    stack.clear()
                    break
                if dep in g and dep not in seen:
                    seen[dep] = seen[m] + [dep]
                    stack.append(dep)
    assert bad == {}, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_no_private_name_is_imported_from_another_file():
    mods = _modules()
    bad = []
    for f in mods.values():
        for mod, names, line in _imports(f, mods):
            if mod.startswith("moetplan"):
                bad += [f"{f.relative_to(PKG.parent)}:{line} takes {n} from {mod}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    assert bad == [], "make these public (or move them where they are used):\n" + "\n".join(bad)


def test_hwdb_yaml_is_read_through_hwdb_py_only():
    bad = []
    for f in PKG.rglob("*.py"):
        rel = str(f.relative_to(PKG.parent))
        tree = _tree(f)
        uses_yaml = any(isinstance(n, ast.Import) and any(a.name == "yaml" for a in n.names) for n in ast.walk(tree))
        if uses_yaml and rel not in YAML_READERS:
            bad.append(f"{rel} parses YAML: read hwdb/ files through moetplan.hwdb (or add it to YAML_READERS "
                       "with the reason)")
        if rel == "moetplan/hwdb.py" or not uses_yaml:
            continue
        for fn in ast.walk(tree):  # a function that parses YAML must not be the one that finds it in hwdb/
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(fn)
                     if isinstance(n, (ast.Name, ast.Attribute))}
            if {"safe_load", "load"} & names and "yaml" in names and set(HWDB_PATHS) & names:
                bad.append(f"{rel}:{fn.lineno} {fn.name} parses a file of hwdb/: use moetplan.hwdb")
    assert bad == [], "\n".join(bad)


def test_no_import_circle_between_files_of_a_package():
    g = file_graph()
    pkg_of = {m: m.rsplit(".", 1)[0] for m in g}
    state: dict[str, int] = {}
    path: list[str] = []
    circles = []

    def visit(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(g[u]):
            # a package's __init__ re-exports its files: edges into and out of it are not file circles
            if v not in g or v == pkg_of[u] or pkg_of.get(v) != pkg_of[u] or u == pkg_of[v]:
                continue
            if state.get(v) == 1:
                circles.append(" -> ".join(path[path.index(v):] + [v]))
            elif v not in state:
                visit(v)
        state[u] = 2
        path.pop()

    for u in sorted(g):
        if u not in state:
            visit(u)
    assert circles == [], "\n".join(circles)

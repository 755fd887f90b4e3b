"""The code's layers, read from its imports (ast; imports under TYPE_CHECKING and inside functions count too):
`schemas/` at the bottom, the shared plumbing above it (the modules at `services/*.py` and the shared packages),
the services side by side above that (they talk only over NATS: none imports another), the CLI on top. No
module cycle anywhere, and no function longer than 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"scheduler", "agent", "registry", "artifacts", "gateway", "dashboard"}  # side by side, over NATS only
SHARED = {"transfer", "graders"}  # shared plumbing packages: the chunk protocol's client side and the stores' read
# side; OpenAI's graders, checked and run (the gateway and the trainer both use them)
TOP = "cli"  # may import anything
MAX_FUNCTION_LINES = 60


def _modules(*bases: str) -> dict[str, Path]:
    """Every module under `bases`, by its dotted name (a package by its own name)."""
    found = {}
    for base in bases:
        for path in (ROOT / base).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `module` imports anywhere in its file. `from pkg import name` is an import of
    pkg.name where that is a module, else of pkg."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != module}
    return out


def import_graph(*bases: str) -> dict[str, set[str]]:
    known = _modules(*bases)
    return {m: _imported(m, p, known) for m, p in known.items()}


def _layer_of(module: str) -> str:
    """schemas, plumbing (services/*.py and the shared packages), a service's package name, or cli."""
    parts = module.split(".")
    if parts[0] == "schemas":
        return "schemas"
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in SERVICES | SHARED | {TOP}) or parts[1] in SHARED:
        return "plumbing"
    return parts[1]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that cross the layers the wrong way: a service into another service (or the CLI), plumbing or
    schemas into a service or the CLI, schemas into plumbing."""
    bad = []
    for module, targets in sorted(graph.items()):
        mine = _layer_of(module)
        for target in sorted(targets):
            theirs = _layer_of(target)
            if mine == TOP or theirs == mine or theirs == "schemas":
                continue
            if theirs == "plumbing" and mine != "schemas":
                continue
            bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
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
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
    return sorted(found)


def long_functions(*bases: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (methods, nested ones) longer than `limit` lines, from `def` to their last line."""
    out = []
    for base in bases:
        for path in sorted((ROOT / base).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > limit:
                        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_services_import_no_other_service_only_plumbing_and_schemas():
    crossings = layer_violations(import_graph("services", "schemas"))
    assert not crossings, "a service reads another's data over NATS or through schemas/, never its modules:\n" + (
        "\n".join(crossings)
    )


def test_no_module_imports_itself_back_through_others():
    found = cycles(import_graph("services", "schemas"))
    assert not found, "import cycles (a Protocol, or the shared part in a module of its own, breaks one):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


def test_no_function_is_longer_than_60_lines():
    found = long_functions("services", "schemas", "trainer")
    assert not found, "split these into named steps:\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for():
    """The walkers catch a crossing, a cycle and a long function on a made-up graph and on this file."""
    graph = {
        "services.agent.a": {"services.registry.store", "services.bus", "schemas.names"},
        "services.registry.store": {"services.scheduler.store"},
        "services.scheduler.store": {"services.registry.store"},
        "services.bus": {"services.agent.a"},
        "services.cli.x": {"services.agent.a"},
        "schemas.names": set(),
    }
    assert layer_violations(graph) == [
        "services.agent.a (agent) imports services.registry.store (registry)",
        "services.bus (plumbing) imports services.agent.a (agent)",
        "services.registry.store (registry) imports services.scheduler.store (scheduler)",
        "services.scheduler.store (scheduler) imports services.registry.store (registry)",
    ]
    assert cycles(graph) == [
        ["services.agent.a", "services.bus"],
        ["services.registry.store", "services.scheduler.store"],
    ]
    assert long_functions("tests", limit=1) != []

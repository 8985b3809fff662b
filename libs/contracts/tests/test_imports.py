"""The contracts package has no import cycle (function-level imports included): each module builds on
lower ones only (envelope/registry → schemas → asyncapi → schema_files → schemas_export)."""

from __future__ import annotations

import ast
from pathlib import Path

import gpuaas.contracts

PACKAGE = Path(gpuaas.contracts.__file__).resolve().parent
PREFIX = "gpuaas.contracts"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PREFIX, *parts))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_no_module_of_the_contracts_imports_back_what_imports_it() -> None:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: imports_of(p, set(paths)) - {m, PREFIX} for m, p in paths.items()}
    cycles: list[list[str]] = []
    done: set[str] = set()  # modules whose imports hold no cycle

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            cycles.append([*trail[trail.index(module) :], module])
            return
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "import cycles in gpuaas.contracts:\n" + "\n".join(" -> ".join(c) for c in cycles)

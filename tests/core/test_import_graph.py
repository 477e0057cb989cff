"""The house's rooms: what imports what inside ``graceful`` (issue 30).

``graceful._core`` is the coordinator and what it is made of: it imports no server
package.  The import graph, read from the sources (``TYPE_CHECKING`` and function-level
imports included: a cycle there is still a knot), has no cycle: where a module needs
what a module above it is, it states it as a protocol (the engine's ``Owner``, uvicorn's
shape's ``Server``, hypercorn's connection's ``_Worker``, aiohttp's middleware's
``_HotPath``), and the one above hands itself in.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import graceful

PACKAGE = Path(graceful.__file__).parent
SERVERS = ("uvicorn", "hypercorn", "aiohttp", "gunicorn", "granian", "trio", "h11", "h2")


def modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def imports(name: str, path: Path, package: bool, known: set[str]) -> Iterator[str]:
    """The modules of ``graceful`` that module ``name`` imports, and every absolute
    import it makes (for the server check)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                yield candidate if candidate in known else target
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def graph() -> dict[str, set[str]]:
    found = modules()
    edges: dict[str, set[str]] = {name: set() for name in found}
    for name, (path, package) in found.items():
        for target in imports(name, path, package, set(found)):
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_the_core_imports_no_server_package() -> None:
    found = modules()
    for name, (path, package) in found.items():
        if not name.startswith("graceful._core"):
            continue
        servers = {
            target
            for target in imports(name, path, package, set(found))
            if target.split(".")[0] in SERVERS
        }
        assert not servers, f"{name} imports {sorted(servers)}"


def test_no_import_cycle() -> None:
    assert cycles(graph()) == set()


def test_gunicorn_worker_names_and_public_paths_unchanged() -> None:
    import importlib

    for module, names in {
        "graceful.gunicorn": (
            "UvicornWorker", "UvicornH11Worker", "HypercornWorker", "HypercornUvloopWorker",
            "HypercornTrioWorker", "AiohttpWorker", "SyncWorker", "ThreadWorker", "WSGIWorker",
        ),
        "graceful.uvicorn": ("Server", "run", "serve"),
        "graceful.hypercorn": ("serve", "run"),
        "graceful.aiohttp": ("run_app", "AppRunner", "setup"),
    }.items():  # fmt: skip
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name), f"{module}.{name}"


def test_graceful_uvicorn_means_uvicorn_inside() -> None:
    """Inside ``graceful.uvicorn`` (a package now), ``import uvicorn`` is uvicorn."""
    import uvicorn

    import graceful.uvicorn

    assert graceful.uvicorn.uvicorn is uvicorn
    assert graceful.uvicorn.Server.__mro__[1] is uvicorn.Server

"""The house's layering, checked on the source: `memory` knows nothing of HTTP, its build and
recall paths never import each other (`memory/__init__.py` says why), and the benchmarks and
the dev kit never import the tests."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imports_of(package: str) -> dict[str, set[str]]:
    """Every module of `package` (a folder of the repository) and the modules it imports."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[module] = names
    return found


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.")


def test_memory_imports_nothing_of_the_edge() -> None:
    offending = {
        module: sorted(name for name in names if under(name, "gateway") or "fastapi" in name)
        for module, names in imports_of("memory").items()
    }
    assert {module: names for module, names in offending.items() if names} == {}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("memory.build", "memory.recall"), ("memory.recall", "memory.build")],
)
def test_build_and_recall_never_import_each_other(package: str, forbidden: str) -> None:
    modules = imports_of("memory")
    offending = {
        module: sorted(name for name in names if under(name, forbidden))
        for module, names in modules.items()
        if under(module, package)
    }
    assert {module: names for module, names in offending.items() if names} == {}


@pytest.mark.parametrize("package", ["bench", "devkit"])
def test_tools_of_development_never_import_the_tests(package: str) -> None:
    """The dev kit serves tests and benchmarks alike; nothing depends on `tests` itself."""
    offending = {
        module: sorted(name for name in names if under(name, "tests"))
        for module, names in imports_of(package).items()
    }
    assert {module: names for module, names in offending.items() if names} == {}


def test_the_foundations_import_no_path() -> None:
    """db, schema, errors, tokens, embeddings, text and postgres serve all three paths."""
    paths = ("memory.write", "memory.build", "memory.recall")
    roots = {
        module: sorted(name for name in names if any(under(name, path) for path in paths))
        for module, names in imports_of("memory").items()
        if module.count(".") == 1
    }
    assert {module: names for module, names in roots.items() if names} == {}


def test_the_edge_runs_no_queries_of_its_own() -> None:
    """The gateway reaches the database through `memory` functions only: no table, no SQL (it
    may hold an engine or a connection, to hand them to those functions)."""
    engine_only = {
        "sqlalchemy.ext.asyncio",
        "sqlalchemy.ext.asyncio.AsyncEngine",
        "sqlalchemy.ext.asyncio.AsyncConnection",
    }
    offending = {
        module: sorted(
            name
            for name in names
            if under(name, "memory.schema")
            or (under(name, "sqlalchemy") and name not in engine_only)
        )
        for module, names in imports_of("gateway").items()
    }
    assert {module: names for module, names in offending.items() if names} == {}

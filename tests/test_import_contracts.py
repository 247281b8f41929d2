"""The import-linter contracts (pyproject.toml) name only modules that exist.

import-linter keeps a contract whose source or forbidden module is missing: a module moved
out from under a contract would pass it vacuously. Each name here must import as a module or
package, and each layer of a layers contract must exist inside every container it names.
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
CONTRACTS = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _layer_modules(contract: dict) -> list[str]:
    names = [
        name.strip()
        for layer in contract["layers"]
        for part in layer.split("|")
        for name in part.split(":")
        if name.strip()
    ]
    containers = contract.get("containers")
    if not containers:
        return names
    return [f"{container}.{name}" for container in containers for name in names]


def _named_modules(contract: dict) -> list[str]:
    if contract["type"] == "layers":
        names = _layer_modules(contract)
    else:
        names = [*contract["source_modules"], *contract["forbidden_modules"]]
    for ignored in contract.get("ignore_imports", []):
        names += [side.strip() for side in ignored.split("->")]
    return names


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c["name"][:60] for c in CONTRACTS])
def test_every_module_a_contract_names_exists(contract: dict) -> None:
    missing = [name for name in _named_modules(contract) if not _exists(name)]
    assert not missing, f"{contract['name']!r} names modules that do not exist: {missing}"


def test_the_floors_put_doors_and_back_office_above_purchases() -> None:
    floors = next(c for c in CONTRACTS if c["name"].startswith("Floors"))
    assert floors["layers"] == [
        "config",
        "doors | backoffice",
        # Signed webhooks listen to the timeline from above (purchases.events' listeners).
        "webhooks",
        "purchases",
        "payments | fulfillment",
        "core",
    ]


def test_a_missing_module_is_caught() -> None:
    # The check itself can fail: a contract naming a module that was moved away.
    contract = {"type": "forbidden", "source_modules": ["purchases.api"], "forbidden_modules": []}
    assert [name for name in _named_modules(contract) if not _exists(name)] == ["purchases.api"]


PRODUCT = ["config", "doors", "backoffice", "purchases", "payments", "fulfillment", "core"]


def _import_cycles(packages: list[str]) -> list[list[str]]:
    """Every set of product modules that import one another in a circle (type-only imports
    included: a reader follows those too), by Tarjan's strongly connected components."""
    import grimp

    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False)
    modules = set(graph.modules)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & modules for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in edges[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_import_cycle_among_the_product_modules() -> None:
    assert _import_cycles(PRODUCT) == []


def test_a_cycle_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "circle_demo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circle_demo import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circle_demo import a\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _import_cycles(["circle_demo"]) == [["circle_demo.a", "circle_demo.b"]]

"""The layer map of docs/architecture.md ("Layout"), enforced: every import runs down a layer,
the packages of one layer (the three roles among them) import none of each other, and no
modules import each other in a circle; and its "Where to change what" has a line for every
module.

Read from the source with `ast`, so an import under `if TYPE_CHECKING:` or inside a function
counts as much as one at the top: the map is about what a module needs, not when it loads it.
`python3 dev.py lint` runs this file too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("txactors", "spark_sinks")

LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "txactors.errors",
        "txactors.faults txactors.durability",
        "txactors.wire",
        "txactors.observe",
        "txactors.embedded",
        "txactors.nats",
        "txactors.actors",
        "txactors.producer txactors.coordinator txactors.consumer",
        "txactors.app txactors.ops txactors.asyncapi spark_sinks",
        "txactors.cli",
        "txactors txactors.testing spark_sinks.__main__",
    )
)
"""Bottom-up. A unit is a package (`txactors.wire`) or a top-level module (`txactors.errors`);
`txactors` alone is its `__init__.py`, the public API, which may import everything below it,
as may the pytest plugin and `python -m spark_sinks` (which shows its flags as `txactors` does)."""


LAYER_OF: dict[str, int] = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str:
    """The unit of the map a module belongs to: `txactors.coordinator.core.table` is in
    `txactors.coordinator`, `spark_sinks.job` in `spark_sinks`."""
    parts = module.split(".")
    if module in LAYER_OF:
        return module
    if parts[0] == "txactors" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(module: str, source: str, known: Iterable[str]) -> set[str]:
    """The project modules `module` imports (`known`: every module there is). `from a import b`
    where `a.b` is a module imports `a.b`; relative imports are resolved."""
    known = set(known)
    is_package = module in known and f"{module}.__init__" in known
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in known else target)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    """Every module of the project's packages and the project modules it imports."""
    paths = {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    known = set(paths) | {
        f"{module_name(path)}.__init__" for path in paths.values() if path.name == "__init__.py"
    }
    return {module: imports_of(module, path.read_text(), known) for module, path in paths.items()}


def layer_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Each import that runs up a layer, or across to another unit of the same layer."""
    found = []
    for module, imported in sorted(graph.items()):
        here = unit_of(module)
        for target in sorted(imported):
            there = unit_of(target)
            if there == here:
                continue
            if here not in LAYER_OF or there not in LAYER_OF:
                found.append(f"{module} -> {target}: {here} or {there} is not on the map")
            elif LAYER_OF[there] == LAYER_OF[here]:
                found.append(f"{module} -> {target}: {here} and {there} must stay independent")
            elif LAYER_OF[there] > LAYER_OF[here]:
                found.append(f"{module} -> {target}: {there} is above {here}")
    return found


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The circles of imports between modules, each once (Tarjan's strongly connected
    components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1 or module in graph.get(module, ()):
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_import_runs_down_the_layer_map() -> None:
    found = layer_violations(import_graph())
    assert not found, "imports against the map (docs/architecture.md, Layout):\n" + "\n".join(found)


def test_no_modules_import_each_other_in_a_circle() -> None:
    found = cycles(import_graph())
    assert not found, "modules importing each other in a circle:\n" + "\n".join(
        " -> ".join(circle) for circle in found
    )


def test_every_package_is_on_the_map() -> None:
    assert {unit_of(module) for module in import_graph()} <= set(LAYER_OF)


def test_where_to_change_what_lists_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `([^`]+)`", section, re.MULTILINE))
    modules = {
        str(path.relative_to(ROOT / "txactors")) for path in (ROOT / "txactors").rglob("*.py")
    }
    required = {m for m in modules if not m.endswith(("/__init__.py", "__main__.py"))}
    if "cli/<command>.py" in listed:
        required = {m for m in required if not m.startswith("cli/")}
    missing = sorted(required - listed)
    assert not missing, f"docs/architecture.md, Where to change what, lacks: {missing}"
    gone = sorted(listed - modules - {"cli/<command>.py"})
    assert not gone, (
        f"docs/architecture.md, Where to change what, lists modules that are gone: {gone}"
    )


def test_the_checks_catch_an_import_up_across_or_in_a_circle() -> None:
    graph = {
        "txactors.wire.layout": {"txactors.nats.topics"},  # up
        "txactors.producer.txlog.log": {"txactors.coordinator.options"},  # across roles
        "txactors.coordinator.writers": {"txactors.coordinator.partition.late"},
        "txactors.coordinator.partition.late": {"txactors.coordinator.writers"},  # a circle
        "txactors.nats.retry": {"txactors.wire.layout", "txactors.errors"},  # down: fine
    }
    assert layer_violations(graph) == [
        "txactors.producer.txlog.log -> txactors.coordinator.options:"
        " txactors.producer and txactors.coordinator must stay independent",
        "txactors.wire.layout -> txactors.nats.topics: txactors.nats is above txactors.wire",
    ]
    assert cycles(graph) == [
        [
            "txactors.coordinator.partition.late",
            "txactors.coordinator.writers",
        ]
    ]
    # the real tree's imports are read as such: a relative import, and a name vs a module
    known = {"txactors.wire", "txactors.wire.__init__", "txactors.wire.layout", "txactors.nats"}
    source = "from . import layout\nfrom txactors.wire import layout as l, NAME\nimport os\n"
    assert imports_of("txactors.wire", source, known) == {"txactors.wire.layout", "txactors.wire"}

"""The package's shape: no import cycles, and lower layers never import higher ones.

Read from the source (every import statement, including those inside functions), not from a
running interpreter, so that an import hidden in a function body counts too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "gpukit"

# Lower layers first. A module may import its own layer and the ones before it, never a later one.
LAYERS = [
    {
        "gpukit.env",
        "gpukit.report",
        "gpukit.files",
        "gpukit.precision",
        "gpukit.runfile",
        "gpukit.hardware.gpus",
        "gpukit.nbval",
        "gpukit.jupyter",
    },
    {"gpukit.data", "gpukit.models", "gpukit.step", "gpukit.optim", "gpukit.plots", "gpukit.doctor", "gpukit.gpucheck"},
    {"gpukit.bench", "gpukit.memory", "gpukit.widgets", "gpukit.hardware.monitor"},
    {"gpukit.distributed", "gpukit.hardware"},
    {"gpukit.train"},
    {"gpukit.cli", "gpukit.__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(name: str) -> set[str]:
    """The gpukit modules `name` imports (a `from package import module` counts as the module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {module for module in found if module in MODULES and module != name}


def layer(name: str) -> int:
    for index, members in enumerate(LAYERS):
        if any(name == member or name.startswith(member + ".") for member in members):
            return index
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in tests/test_layout.py")


@pytest.mark.parametrize("name", sorted(name for name in MODULES if name != "gpukit"))
def test_no_module_imports_a_higher_layer(name):
    higher = {other for other in imports(name) if other != "gpukit" and layer(other) > layer(name)}
    assert not higher, f"{name} (layer {layer(name)}) imports {sorted(higher)} from a higher layer"


def test_no_import_cycles():
    graph = {name: imports(name) - {"gpukit"} for name in MODULES if name != "gpukit"}
    # A package imports its own modules in its __init__; those modules may import the package's
    # siblings but never the package back (that is the cycle that breaks imports).
    state: dict[str, str] = {}

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                cycle = path[path.index(other) :] + [other]
                raise AssertionError("import cycle: " + " → ".join(cycle))
            if other not in state:
                visit(other, path + [other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_nothing_inside_imports_the_top_level_package():
    """gpukit/__init__ imports everything; a module importing it back would be a cycle at import time."""
    offenders = [name for name in MODULES if name != "gpukit" and "gpukit" in imports(name)]
    assert not offenders, offenders

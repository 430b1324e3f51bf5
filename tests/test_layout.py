"""The package's shape: no import cycles, and lower layers never import higher ones.

Read from the source (every import statement, including those inside functions), not from a
running interpreter, so that an import hidden in a function body counts too. Importing a module
first runs its packages' `__init__`s: a module that imports `gpukit.hardware.gpus` also imports
what `gpukit/hardware/__init__.py` imports when it loads (its top-level imports; a package may
load more on first use, in a module `__getattr__`, which cannot make an import-time cycle).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "gpukit"

# Lower layers first. A module may import its own layer and the ones before it, never a later one.
LAYERS = [
    {
        "gpukit.deprecation",
        "gpukit.validation",
        "gpukit.hardware.clocks",
        "gpukit.hardware:init",  # the package's own __init__: the tables only
        "gpukit.data.vision",
        "gpukit.env",
        "gpukit.report",
        "gpukit.files",
        "gpukit.precision",
        "gpukit.runfile",
        "gpukit.hardware.gpus",
        "gpukit.nbval",
        "gpukit.nbval_outputs",
        "gpukit.jupyter",
        "gpukit.shipped",
        "gpukit.figures",  # matplotlib only: the Figure every plot returns
        "gpukit.claims",  # gk.check and its kin: a lesson's check in one line
    },
    {
        "gpukit.data",
        "gpukit.models",
        "gpukit.step",
        "gpukit.optim",
        "gpukit.plots",
        "gpukit.checkup",
        "gpukit.gpucheck",
        "gpukit.site",  # runs the lessons as gpu-check does (its child_environment)
    },
    {"gpukit.bench", "gpukit.memory", "gpukit.widgets", "gpukit.hardware.monitor", "gpukit.inference"},
    {"gpukit.gpuledger"},  # plans make gpu-check's runs within a lease
    {"gpukit.gpulease"},  # runs that plan with gpucheck's steps, writing each as it ends
    {"gpukit.compiling", "gpukit.fp8"},  # regional compilation (uses bench and memory), FP8 numerics
    {"gpukit.distributed", "gpukit.hardware"},
    {"gpukit.train"},
    {"gpukit.practice"},  # the lessons' exercises: their checks train, launch and measure with everything below
    {"gpukit.cli", "gpukit.__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(name: str, top_level_only: bool = False) -> set[str]:
    """The gpukit modules `name` imports (a `from package import module` counts as the module), and
    the packages above each of them, whose `__init__` runs first."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    parents = {".".join(module.split(".")[:end]) for module in found for end in range(2, module.count(".") + 1)}
    inside = {".".join(name.split(".")[:end]) for end in range(1, name.count(".") + 1)}  # already loading
    return {module for module in found | (parents - inside) if module in MODULES and module != name}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def loads(name: str) -> set[str]:
    """What importing `name` runs: its imports, where a package imported for a submodule runs only its
    top-level imports (a package that `name` imports by name counts whole)."""
    edges = set()
    for other in imports(name):
        whole = not is_package(other) or other not in {".".join(m.split(".")[:-1]) for m in imports(name)}
        edges |= {other} if whole else {other + ":init"}
    return edges


def layer(name: str) -> int:
    """The layer of a module, or of a package's `__init__` alone (`name:init`), by its longest listed prefix."""
    matches = [
        (len(member), index)
        for index, members in enumerate(LAYERS)
        for member in members
        if name == member or name.startswith(member + ".") or (name.endswith(":init") and name[:-5] == member)
    ]
    if not matches:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS in tests/test_layout.py")
    return max(matches)[1]


def graph() -> dict[str, set[str]]:
    """Module → what importing it runs; `package:init` → what the package's __init__ runs when it loads."""
    edges = {name: loads(name) - {"gpukit"} for name in MODULES if name != "gpukit"}
    for name in MODULES:
        if name != "gpukit" and is_package(name):
            edges[name + ":init"] = {m for m in imports(name, top_level_only=True) if m != "gpukit"}
    return edges


@pytest.mark.parametrize("name", sorted(graph()))
def test_no_module_imports_a_higher_layer(name):
    higher = {other for other in graph()[name] if layer(other) > layer(name)}
    assert not higher, f"{name} (layer {layer(name)}) imports {sorted(higher)} from a higher layer"


def test_no_import_cycles():
    edges = graph()
    graph_ = {name: {other for other in targets if other in edges} for name, targets in edges.items()}
    # A package imports its own modules in its __init__; those modules may import the package's
    # siblings but never the package back (that is the cycle that breaks imports).
    state: dict[str, str] = {}

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph_[name]):
            if state.get(other) == "open":
                cycle = path[path.index(other) :] + [other]
                raise AssertionError("import cycle: " + " → ".join(cycle))
            if other not in state:
                visit(other, path + [other])
        state[name] = "done"

    for name in sorted(graph_):
        if name not in state:
            visit(name, [name])


def test_nothing_inside_imports_the_top_level_package():
    """gpukit/__init__ imports everything; a module importing it back would be a cycle at import time."""
    offenders = [name for name in MODULES if name != "gpukit" and "gpukit" in imports(name)]
    assert not offenders, offenders


def test_importing_gpukit_leaves_torchvision_for_first_use():
    """torchvision costs about a second to import (measured: `import gpukit` after torch went from 1.5 s to
    0.22 s when it became lazy); only code that decodes images or builds torchvision models loads it."""
    code = "import sys, torch, gpukit; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision'))"
    loaded = _printed_by_a_fresh_python(code)
    assert loaded == "[]", loaded


def test_importing_gpukit_leaves_the_flop_counter_and_triton_for_first_use():
    """torch's FLOP counter imports Triton where it is installed: about 0.3-0.6 s of `import gpukit` on a
    2-core CPU (measured with -X importtime, 2026-11-28), paid by every learner who never counts FLOPs.
    Only what torch itself loads is allowed: the modules are compared before and after `import gpukit`."""
    code = (
        "import sys, torch; before = set(sys.modules); import gpukit; "
        "print(sorted(m for m in set(sys.modules) - before "
        "if m.split('.')[0] == 'triton' or m == 'torch.utils.flop_counter'))"
    )
    loaded = _printed_by_a_fresh_python(code)
    assert loaded == "[]", loaded


def _printed_by_a_fresh_python(code: str) -> str:
    """What `code` prints in a new interpreter: the modules one import loads, with nothing imported before it."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize(
    "old, new",
    [
        ("gpukit.checkpointing", "gpukit.memory.activation_checkpointing"),
        ("gpukit.memory.checkpointing", "gpukit.memory.activation_checkpointing"),
        (
            "gpukit.memory.activation_checkpointing.apply_checkpointing",
            "gpukit.memory.activation_checkpointing.apply_activation_checkpointing",
        ),
        ("gpukit.memory.table", "gpukit.memory.parts.breakdown_table"),
        ("gpukit.memory.plot_timeline", "gpukit.memory.parts.plot_memory_timeline"),
        ("gpukit.data.plot_timeline", "gpukit.data.timeline.plot_trace"),
        ("gpukit.hardware.table", "gpukit.hardware.gpus.gpu_table"),
        ("gpukit.checkup.decode_clock_reasons", "gpukit.hardware.clocks.clock_reasons"),
    ],
)
def test_old_public_names_still_work_for_a_release_and_name_the_new_one(old, new):
    import importlib

    module, _, name = old.rpartition(".")
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        found = getattr(importlib.import_module(module), name)
    new_module, _, new_name = new.rpartition(".")
    assert found is getattr(importlib.import_module(new_module), new_name)


def test_no_module_is_shadowed_by_a_function_of_its_name():
    """`gpukit.doctor` was both a module and the function it exported; now a name means one thing."""
    import importlib
    import types

    shadowed = []
    for name in MODULES:
        package, _, leaf = name.rpartition(".")
        if package and name != "gpukit":
            value = getattr(importlib.import_module(package), leaf, None)
            if value is not None and not isinstance(value, types.ModuleType):
                shadowed.append(f"{name} is also {package}.{leaf}, a {type(value).__name__}")
    assert not shadowed, shadowed


def test_the_code_is_ruff_formatted_with_few_exceptions():
    """ruff formats everything; a `# fmt: skip` is kept only for a table read better aligned (at most 10)."""
    import subprocess
    import sys

    root = PACKAGE.parent
    folders = ["gpukit", "tests", "benchmarks"]
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *folders], cwd=root, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    skips = [f"{path}:{number}" for folder in folders for path in (root / folder).rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1) if line.rstrip().endswith("# fmt: skip")]  # fmt: skip
    assert len(skips) <= 10, skips


def test_every_function_fits_on_a_screen():
    """A function fits on a screen: at most 80 lines of code after its docstring; in gpukit/train (fit and its
    parts), 60, as STYLE.md asks."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
                lines = node.end_lineno - body[0].lineno + 1
                limit = 60 if path.parent.name == "train" else 80  # fit = setup + an epoch + a step, each on a screen
                if lines > limit:
                    long.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} > {limit} lines)"
                    )
    assert not long, long


NAMESPACES = ["gpukit", "gpukit.bench", "gpukit.step", "gpukit.optim", "gpukit.plots", "gpukit.models"]


@pytest.mark.parametrize("name", NAMESPACES + sorted(name for name in MODULES if is_package(name) and name != "gpukit"))
def test_every_package_and_namespace_module_has_a_curated_all(name):
    """What a learner reaches as gk.<name>.<thing>: listed in __all__, every entry real and public."""
    import importlib

    module = importlib.import_module(name)
    listed = getattr(module, "__all__", None)
    assert listed, f"{name} has no __all__"
    assert len(listed) == len(set(listed)) and all(not entry.startswith("_") for entry in listed), listed
    missing = [entry for entry in listed if not hasattr(module, entry)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"

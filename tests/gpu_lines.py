"""Which statements of gpukit run only with a CUDA GPU (or an NVIDIA driver), and how many tests/test_gpu_paths.py runs.

    python tests/gpu_lines.py            # runs tests/test_gpu_paths.py under coverage, then reports
    python tests/gpu_lines.py .coverage  # reports on coverage data you already have
    python tests/gpu_lines.py --list     # the regions found in gpukit's source, each with its rule

The regions are derived from gpukit's source with `ast`, so that a GPU branch is counted the day it is written:
- CUDA, a *CUDA test* being a comparison with "cuda" or "nccl" (NCCL runs on GPUs only), `….startswith("cuda")`,
  torch.cuda.is_available() or is_initialized(), a name bound to one of these in the function, a name bound to
  torch.cuda.device_count() read as true or above 0, an `and` holding one or an `or` of only such:
  - the body of an `if` whose test is a CUDA test, and the `else` of one whose test is its negation;
  - after a negated `if` whose body ends in `return` or `raise` (a guard): the rest of its block;
  - after a call to a guard function (one whose top level holds such a guard that raises): the rest of the block;
  - a statement that calls torch.cuda's device functions (GPU_CALLS) or torch._C._cuda_*: they raise without a GPU;
- NVML: the rest of a block after a call to `….nvmlInit()`, and a statement that calls an `nvml…` function other than
  nvmlInit and nvmlShutdown (or names one in a string, as ask_nvml(pynvml, "nvmlDeviceGetName", …) does);
- either: the body of a function, or every method of a class, whose every use in gpukit (imports aside) lies in
  regions of that kind: code that only GPU code calls.
SEMANTIC adds what no rule can see (a GPU list that came from NVML), and NOT_GPU_ONLY takes out what a rule finds
but a CPU reaches (a prediction for a CUDA target), each with its reason. Not every GPU path is a GPU-only
statement: a function whose lines all run on a CPU too, with other arguments (bench._generators_kept's CUDA
generators, compiling._warm_up_compiler compiling for CUDA, fp8.compare_speed emulated), has none to count. The
lines counted are those coverage itself calls statements, so comments and docstrings never count.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpukit"
KINDS = ("CUDA", "NVML")

# torch.cuda's functions that need a CUDA device (called without one they raise); is_available, device_count and
# is_initialized are not among them: they answer on any machine.
GPU_CALLS = set(
    """synchronize Event Stream stream current_stream default_stream set_stream set_device current_device
    memory_allocated max_memory_allocated memory_reserved max_memory_reserved reset_peak_memory_stats
    reset_max_memory_allocated memory_stats mem_get_info get_device_properties get_device_capability get_device_name
    set_per_process_memory_fraction get_per_process_memory_fraction empty_cache CUDAGraph graph make_graphed_callables
    _record_memory_history _snapshot memory_snapshot caching_allocator_alloc caching_allocator_delete cudart
    get_rng_state set_rng_state ipc_collect utilization temperature power_draw clock_rate""".split()
)
NVML_QUIET = {"nvmlInit", "nvmlShutdown", "NVMLError"}  # reached on any machine: they fail, or are a name

# (file, function, locator, kind, why): what the rules cannot see. Locators: None, the whole body; ("if", test) the
# body of the `if` whose test is `test` (ast.unparse form); ("else", test) its else branch; ("after", statement) what
# follows the statement that starts with `statement` in the same block.
SEMANTIC = [
    ("env.py", "detect", ("if", "gpus and (not problem)"), "CUDA", "GPUs that NVML lists and CUDA can use"),
    ("env.py", "resolve_device", ("after", "if count == 0:"), "CUDA", "past the last no-GPU check (then the index's)"),
    ("hardware/contention.py", "measure_contention", ("else", "device_name == 'cpu'"), "CUDA", "both on the GPU"),
    ("memory/measuring.py", "cublas_workspace_bytes", None, "CUDA", "no caller in gpukit: tests and lessons on a GPU"),
    ("memory/allocator.py", "_expandable_now", None, "CUDA", "no caller in gpukit: tests on a GPU"),
    (
        "memory/parts.py",
        "MemoryBreakdown.workspace",
        ("after", "if not self.allocated_timeline:"),
        "CUDA",
        "a CUDA run",
    ),
    ("memory/plan.py", "_check_budget", ("after", "if not on_gpu:"), "CUDA", "on_gpu: the caller's CUDA test"),
    ("distributed/launcher.py", "_check_backend_and_nprocs", ("if", "backend == 'nccl'"), "CUDA", "NCCL, GPUs seen"),
    ("distributed/parallel.py", "setup", ("if", "backend == 'nccl'"), "CUDA", "one GPU per process (two blocks)"),
    ("data/decoding.py", "decode_table", ("if", "cuda"), "CUDA", "gpu=True is refused without a GPU: nvJPEG rows"),
    ("hardware/monitor.py", "Monitor.start", ("if", "self._nvml is not None"), "NVML", "NVML opened a GPU"),
    ("hardware/monitor.py", "Monitor.close", ("if", "self._nvml is not None"), "NVML", "NVML opened a GPU"),
    ("hardware/monitor.py", "Monitor.lap", ("else", "self._rapl is not None"), "NVML", "GPU samples"),
    ("hardware/monitor.py", "Monitor.sample", None, "NVML", "NVML queries ('sample' is also a variable elsewhere)"),
    ("hardware/monitor.py", "Monitor._summarise", None, "NVML", "GPU samples"),
]

NOT_GPU_ONLY = [
    (
        "memory/prediction.py",
        "predict",
        ("if", "target.type == 'cuda'"),
        "CUDA",
        "a CUDA target predicted on any machine",
    ),
]


# ---------------------------------------------------------------------------------------------
# CUDA tests


def _dotted(node: ast.AST) -> str:
    """ "torch.cuda.synchronize" for that attribute chain; "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _is_call_of(node: ast.AST, *names: str) -> bool:
    return isinstance(node, ast.Call) and _dotted(node.func) in names


class Scope:
    """A function's names bound to a CUDA test ("cuda = device.type == 'cuda'") or to the CUDA device count."""

    def __init__(self, function: ast.AST | None):
        bound: dict[str, set[str]] = defaultdict(set)
        for node in ast.walk(function) if function is not None else ():
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = node.value
                kind = "count" if _is_call_of(value, "torch.cuda.device_count") else "other"
                bound[node.targets[0].id].add("test" if kind == "other" and self._plain_test(value) else kind)
        self.tests = {name for name, kinds in bound.items() if kinds == {"test"}}
        self.counts = {name for name, kinds in bound.items() if kinds == {"count"}}

    @staticmethod
    def _plain_test(node: ast.AST) -> bool:
        return Scope(None).truth(node) is True

    def truth(self, test: ast.AST) -> bool | None:
        """True: `test` holds only on CUDA; False: only off CUDA (its negation is a CUDA test); None: can't tell."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self.truth(test.operand)
            return None if inner is None else not inner
        if isinstance(test, ast.BoolOp):
            parts = {self.truth(value) for value in test.values}
            if isinstance(test.op, ast.And):  # holds only on CUDA if one part does (and none only off it)
                return True if True in parts and False not in parts else False if parts == {False} else None
            return False if False in parts and True not in parts else True if parts == {True} else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            return self._comparison(test)
        if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "startswith":
            return True if [_constant(arg) for arg in test.args] == ["cuda"] else None
        if _is_call_of(test, "torch.cuda.is_available", "torch.cuda.is_initialized"):
            return True
        if isinstance(test, ast.Name):
            return True if test.id in self.tests | self.counts else None
        return None

    def _comparison(self, test: ast.Compare) -> bool | None:
        op, sides = test.ops[0], [test.left, test.comparators[0]]
        constants = [_constant(side) for side in sides]
        if "cuda" in constants and any(_names_a_device(side) for side in sides):
            return {ast.Eq: True, ast.NotEq: False}.get(type(op))
        named = [side for side in sides if isinstance(side, ast.Name) and side.id in self.counts]
        if named and 0 in constants:
            return {ast.Gt: True, ast.NotEq: True, ast.Eq: False}.get(type(op))
        return None


def _names_a_device(node: ast.AST) -> bool:
    """`device.type`, `self.device`, `device`, `target_device`: a device's kind, not any string ("cuda" rows)."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name == "type" or "device" in name


def _constant(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) else None


# ---------------------------------------------------------------------------------------------
# Regions of one module


def _lines(statements) -> set[int]:
    return {line for stmt in statements for line in range(stmt.lineno, stmt.end_lineno + 1)}


def _exits(block: list[ast.stmt]) -> bool:
    return bool(block) and isinstance(block[-1], (ast.Return, ast.Raise))


def _header(stmt: ast.stmt) -> list[ast.AST]:
    """The expressions a statement evaluates itself (for a compound one: its test, iterator or context)."""
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [stmt.iter]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return [item.context_expr for item in stmt.items]
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try)):
        return []
    return [stmt]


def _calls(stmt: ast.stmt) -> list[ast.Call]:
    """The calls a statement always makes: not those in one branch of `a if c else b`, after the first operand of
    `and`/`or`, or inside a lambda or comprehension (a CPU reaches the statement, and not that call)."""
    found, todo = [], list(_header(stmt))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.IfExp):
            todo.append(node.test)
        elif isinstance(node, ast.BoolOp):
            todo.append(node.values[0])
        elif not isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            found += [node] if isinstance(node, ast.Call) else []
            todo += ast.iter_child_nodes(node)
    return found


def _gpu_call(call: ast.Call) -> bool:
    name = _dotted(call.func)
    return (name.startswith("torch.cuda.") and name.rsplit(".", 1)[1] in GPU_CALLS) or name.startswith(
        "torch._C._cuda_"
    )


def _nvml_call(call: ast.Call) -> bool:
    name = _dotted(call.func).rsplit(".", 1)[-1]
    strings = [_constant(arg) for arg in call.args if isinstance(_constant(arg), str)]
    named = [text for text in [name, *strings] if text.startswith("nvml")]
    return bool(named) and not set(named) <= NVML_QUIET


def _nvml_started(stmt: ast.Try) -> bool:
    """`try: ….nvmlInit() except …: return/raise`: past it, NVML answered."""
    started = any(_dotted(call.func).endswith("nvmlInit") for s in stmt.body for call in _calls(s))
    return started and all(_exits(handler.body) for handler in stmt.handlers)


def _blocks(node: ast.AST):
    for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            yield block
    for handler in getattr(node, "handlers", []):
        yield handler.body


def _functions(tree: ast.AST):
    """(function or None for the module's top level, its own statements' blocks), nested functions apart."""
    found = [(None, tree)]
    found += [(node, node) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return found


def guard_functions(trees: dict[Path, ast.AST]) -> set[str]:
    """Names of functions whose own top level raises unless CUDA (`if <off CUDA>: raise …`)."""
    guards = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scope = Scope(node)
                raises = [s for s in node.body if isinstance(s, ast.If) and _exits(s.body)]
                if any(isinstance(s.body[-1], ast.Raise) and scope.truth(s.test) is False for s in raises):
                    guards.add(node.name)
    return guards


def module_regions(tree: ast.AST, guards: set[str]) -> dict[str, set]:
    """{"CUDA": lines, "NVML": lines} that the statement rules (not the function rule) find in one module, and
    "uses": (name, line) of the names used in the CUDA branch of `a if <CUDA test> else b`."""
    found = {kind: set() for kind in (*KINDS, "uses")}
    for function, root in _functions(tree):
        scope = Scope(function)
        for node in ast.walk(root):
            truth = scope.truth(node.test) if isinstance(node, ast.IfExp) else None
            branch = node.body if truth is True else node.orelse if truth is False else None
            found["uses"] |= {(name, line) for name, line in _names(branch)} if branch is not None else set()
        stack = [root]
        while stack:
            node = stack.pop()
            for block in _blocks(node):
                _block_regions(block, scope, guards, found)
                stack += [s for s in block if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return found


def _checked(statements: list[ast.stmt], scope: Scope) -> list[ast.stmt]:
    """A GPU region's statements that only a GPU reaches. What comes before its last `if …: raise`, or its last
    `if` off CUDA that returns (`if not torch.cuda.is_available(): return …`), runs where a CPU was asked for CUDA,
    unless a statement before it calls a CUDA device function: that raises on a CPU, so a CPU stops there."""
    checks = [
        index
        for index, stmt in enumerate(statements)
        if isinstance(stmt, ast.If)
        and _exits(stmt.body)
        and (isinstance(stmt.body[-1], ast.Raise) or scope.truth(stmt.test) is False)
    ]
    calls = [index for index, stmt in enumerate(statements) if any(_gpu_call(call) for call in _calls(stmt))]
    start = checks[-1] + 1 if checks else 0
    return statements[min([start, *calls[:1]]) :]


def _block_regions(block: list[ast.stmt], scope: Scope, guards: set[str], found: dict) -> None:
    for index, stmt in enumerate(block):
        calls, rest = _calls(stmt), block[index + 1 :]
        if isinstance(stmt, ast.If):
            truth = scope.truth(stmt.test)
            branch = stmt.body if truth is True else stmt.orelse if truth is False else []
            found["CUDA"] |= _lines(_checked(branch, scope))
            if truth is False and _exits(stmt.body):
                found["CUDA"] |= _lines(_checked(rest, scope))
        if any(_gpu_call(call) for call in calls):  # it raises on a CPU: so does the rest of its block
            found["CUDA"] |= _lines([stmt, *rest])
        if isinstance(stmt, ast.Try) and _nvml_started(stmt):
            found["NVML"] |= _lines(rest)
        if any(_dotted(call.func).rsplit(".", 1)[-1] in guards for call in calls):
            found["CUDA"] |= _lines(_checked(rest, scope))
        if any(_dotted(call.func).endswith("nvmlInit") for call in calls):
            found["NVML"] |= _lines(rest)
        if any(_nvml_call(call) for call in calls):
            found["NVML"] |= _lines([stmt])


# ---------------------------------------------------------------------------------------------
# Code that only GPU code uses, and the whole of gpukit


def _names(tree: ast.AST):
    """(name, line) of every name read and attribute in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno


def _uses(trees: dict[Path, ast.AST]) -> dict[str, list[tuple[Path, int]]]:
    """Every use of a name in gpukit (a Name read, or an attribute), with where; imports are no use."""
    uses = defaultdict(list)
    for path, tree in trees.items():
        for name, line in _names(tree):
            uses[name].append((path, line))
    return uses


def _definitions(trees: dict[Path, ast.AST]):
    """(path, name, lines of its body) for every function and class; a class's lines are its methods' bodies."""
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
                yield path, node.name, _lines(node.body), (node.lineno, node.end_lineno)
            elif isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                yield path, node.name, _lines([s for m in methods for s in m.body]), (node.lineno, node.end_lineno)


def derived_lines() -> dict[str, dict[Path, set[int]]]:
    """{"CUDA": {file: lines}, "NVML": {file: lines}}: every rule of the module's docstring, SEMANTIC, NOT_GPU_ONLY."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    guards = guard_functions(trees)
    lines, branch_uses = {kind: defaultdict(set) for kind in KINDS}, set()
    for path, tree in trees.items():
        found = module_regions(tree, guards)
        branch_uses |= {(path, name, line) for name, line in found.pop("uses")}
        for kind, kind_lines in found.items():
            lines[kind][path] |= kind_lines
    for file, function, locator, kind, _ in SEMANTIC:
        lines[kind][PACKAGE / file] |= _lines(_statements(_function(trees[PACKAGE / file], function), locator))
    for file, function, locator, kind, _ in NOT_GPU_ONLY:
        lines[kind][PACKAGE / file] -= _lines(_statements(_function(trees[PACKAGE / file], function), locator))
    _add_code_only_gpu_code_uses(trees, lines, branch_uses)
    for path, found in lines["NVML"].items():  # a line counts once: as NVML's where both rules find it
        lines["CUDA"][path] -= found
    return {kind: {path: found for path, found in files.items() if found} for kind, files in lines.items()}


def _add_code_only_gpu_code_uses(trees: dict, lines: dict, branch_uses: set) -> None:
    """Add to `lines` the body of every function and class that only GPU code of one kind uses, until none is left
    (a chain of helpers). `branch_uses`: (file, name, line) used in the CUDA branch of a conditional expression."""
    uses, definitions = _uses(trees), list(_definitions(trees))
    for _ in range(10):
        changed = False
        for path, name, body, (first, last) in definitions:
            where = [(p, line) for p, line in uses.get(name, []) if not (p == path and first <= line <= last)]
            for kind in KINDS:
                gpu = [
                    line in lines[kind][p] or (kind == "CUDA" and (p, name, line) in branch_uses) for p, line in where
                ]
                if where and all(gpu) and not body <= lines[kind][path]:
                    lines[kind][path] |= body
                    changed = True
        if not changed:
            return


def _function(tree: ast.Module, qualname: str) -> ast.AST:
    """The (possibly nested or method) function `qualname` ("Class.method", or a function anywhere)."""
    *owners, name = qualname.split(".")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            if not owners or any(
                isinstance(o, ast.ClassDef) and o.name == owners[-1] and node in o.body for o in ast.walk(tree)
            ):
                return node
    raise LookupError(f"no function {qualname}")


def _statements(function: ast.AST, locator) -> list[ast.stmt]:
    if locator is None:
        return function.body
    kind, text = locator
    found: list[ast.stmt] = []
    for node in ast.walk(function):
        if kind in ("if", "else") and isinstance(node, ast.If) and ast.unparse(node.test) == text:
            found += node.body if kind == "if" else node.orelse
        for block in _blocks(node):
            if kind == "after":
                starts = [i for i, stmt in enumerate(block) if ast.unparse(stmt).startswith(text)]
                found += block[starts[0] + 1 :] if starts else []
    if not found:
        raise LookupError(f"{locator} matches nothing in {function.name}")
    return found


# ---------------------------------------------------------------------------------------------
# Reports


def report(data_file: str) -> None:
    import coverage

    measured = coverage.Coverage(data_file=data_file)
    measured.load()
    derived = derived_lines()
    counts = {kind: _count(measured, derived[kind]) for kind in KINDS}
    for name, (executed, total) in counts.items():
        print(f"{name}-only statements executed: {executed} of {total} ({executed / total:.0%})")
    executed, total = (sum(column) for column in zip(*counts.values()))
    print(f"GPU-only statements executed: {executed} of {total} ({executed / total:.0%})")


def _count(measured, files: dict[Path, set[int]]) -> tuple[int, int]:
    total = executed = 0
    for path, lines in sorted(files.items()):
        _, statements, _, missing, _ = measured.analysis2(str(path))
        gpu, missed = lines & set(statements), lines & set(missing)
        if not gpu:
            continue
        total, executed = total + len(gpu), executed + len(gpu - missed)
        ranges = ", ".join(map(str, sorted(missed)))
        print(
            f"{path.relative_to(ROOT)}: {len(gpu) - len(missed)}/{len(gpu)}" + (f"  missed: {ranges}" if missed else "")
        )
    return executed, total


def print_regions() -> None:
    for kind, files in derived_lines().items():
        for path, lines in sorted(files.items()):
            print(f"{kind} {path.relative_to(ROOT)}: {', '.join(map(str, sorted(lines)))}")


def run_under_coverage() -> None:
    with tempfile.TemporaryDirectory() as folder:
        data = str(Path(folder) / ".coverage")
        command = [sys.executable, "-m", "coverage", "run", f"--data-file={data}", "--source=gpukit", "-m", "pytest"]
        tests = [
            "tests/test_gpu_paths.py",
            "-m",
            "not slow",
            "-q",
            "-p",
            "no:cacheprovider",
        ]  # not the test running this
        subprocess.run([*command, *tests], cwd=ROOT, check=True)
        report(data)


if __name__ == "__main__":
    if sys.argv[1:] == ["--list"]:
        print_regions()
    elif len(sys.argv) > 1:
        report(sys.argv[1])
    else:
        run_under_coverage()

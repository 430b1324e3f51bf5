"""Which CUDA-only uses in a piece of Python no CUDA test guards: a static check for the machines without CUDA.

On a Mac (Apple silicon, MPS) torch is built without CUDA: torch.cuda.is_available() answers False,
device_count() 0 and is_initialized() False, but any other CUDA call, a tensor made on "cuda" and a
backend named "nccl" raise. So every such use in a lesson must sit where only a CUDA machine gets:

- in the body of an `if` (or `x if test else y`, or the operand after `and`) whose test is a CUDA test:
  `device == "cuda"`, `device.type == "cuda"`, `BACKEND == "nccl"`, `env.gpu_count >= 2`, `tensor.is_cuda`,
  `torch.cuda.is_available()`, or a name assigned such a test earlier (`MULTI_GPU = BACKEND == "nccl"`);
- in the `else` of an `if` whose test is the negation (`device.type != "cuda"`), or after `or` behind one.

A CUDA-only use is a reference to `torch.cuda.X` (X other than the three queries above), a `.cuda()` call,
and the strings "cuda", "cuda:N" and "nccl" used as values (as a comparison's operand they are the test).
`device="cuda"` given to a memory prediction (`estimate`, `max_batch_size`) is not one: it plans for a GPU with
fake tensors on the CPU, on any machine; nor is `device_type="cuda"` (torch.random.fork_rng with no devices).
The check reads one piece of source at a time and follows no call: a gpukit function a lesson calls with its device
is checked on its own (`unguarded_in_functions`; the functions CUDA-only by contract, such as those that refuse a
device other than CUDA first, are listed with their reasons in tests/test_where_learners_are.py).
"""

from __future__ import annotations

import ast
import re

QUERIES = {"is_available", "is_initialized", "device_count"}  # a Mac's torch answers these: False, False, 0
PREDICTIONS = {"estimate", "max_batch_size"}  # gk.memory functions that predict for device="cuda" on any machine
_CUDA_VALUE = re.compile(r"cuda(:\d+)?|nccl")


def _cuda_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(_CUDA_VALUE.fullmatch(node.value))


def _dotted(node: ast.AST) -> str:
    """'torch.cuda.synchronize' for the expression torch.cuda.synchronize; '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


class _Guards:
    def __init__(self, cuda_names: set[str]):
        self.cuda_names = cuda_names  # names assigned a CUDA test

    def polarity(self, test: ast.AST) -> int:
        """+1: true only on a CUDA machine; -1: false only on one; 0: neither, as far as this check can tell."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return -self.polarity(test.operand)
        if isinstance(test, ast.BoolOp):
            signs = [self.polarity(value) for value in test.values]
            # `a and b` is true only where a is; `a or b` is false only where a is
            wanted = 1 if isinstance(test.op, ast.And) else -1
            return wanted if wanted in signs else 0
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, right, op = test.left, test.comparators[0], test.ops[0]
            if _cuda_literal(left) or _cuda_literal(right):
                return {ast.Eq: 1, ast.In: 1, ast.NotEq: -1, ast.NotIn: -1}.get(type(op), 0)
            if _dotted(left).endswith("gpu_count") and isinstance(op, (ast.Gt, ast.GtE)):
                return 1  # CUDA GPUs this process can use: 0 on a Mac
        if isinstance(test, ast.Name):
            return 1 if test.id in self.cuda_names else 0
        if isinstance(test, ast.Attribute):
            return 1 if test.attr in ("is_cuda", "gpu_count") else 0
        if isinstance(test, ast.Call) and _dotted(test.func) == "torch.cuda.is_available":
            return 1
        if isinstance(test, ast.Call) and _dotted(test.func).endswith(".startswith") and test.args:
            return 1 if _cuda_literal(test.args[0]) else 0  # device_name.startswith("cuda")
        return 0


class _Finder(ast.NodeVisitor):
    def __init__(self, guards: _Guards, lines: list[str]):
        self.guards, self.lines, self.found, self.guarded = guards, lines, [], False

    def _visit_under(self, nodes, guarded: bool) -> None:
        before, self.guarded = self.guarded, self.guarded or guarded
        for node in nodes if isinstance(nodes, list) else [nodes]:
            self.visit(node)
        self.guarded = before

    def _report(self, node: ast.AST) -> None:
        if not self.guarded:
            self.found.append((node.lineno, self.lines[node.lineno - 1].strip()))

    def visit_If(self, node: ast.If | ast.IfExp) -> None:
        self.visit(node.test)
        sign = self.guards.polarity(node.test)
        self._visit_under(node.body, sign > 0)
        self._visit_under(node.orelse, sign < 0)

    visit_IfExp = visit_If

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        wanted = 1 if isinstance(node.op, ast.And) else -1
        behind_a_guard = False
        for value in node.values:
            self._visit_under(value, behind_a_guard)
            behind_a_guard = behind_a_guard or self.guards.polarity(value) == wanted

    def visit_Compare(self, node: ast.Compare) -> None:
        for operand in (node.left, *node.comparators):
            if isinstance(operand, (ast.Tuple, ast.List, ast.Set)):
                operand = [item for item in operand.elts if not _cuda_literal(item)]
            elif _cuda_literal(operand):  # "cuda" compared with is the test itself
                continue
            self._visit_under(operand, False)

    def _visit_body(self, statements: list[ast.stmt]) -> None:
        """Statements in order; after `if <not CUDA>: raise/return` the rest runs only on CUDA."""
        before = self.guarded
        for statement in statements:
            self.visit(statement)
            exits = isinstance(statement, ast.If) and not statement.orelse
            if exits and isinstance(statement.body[-1], (ast.Raise, ast.Return)):
                self.guarded = self.guarded or self.guards.polarity(statement.test) < 0
        self.guarded = before

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        self.visit(node.args)
        self._visit_body(node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Module(self, node: ast.Module) -> None:
        self._visit_body(node.body)

    def _visit_comprehension(self, node) -> None:
        for generator in node.generators:
            self.visit(generator)
        guarded = any(self.guards.polarity(test) > 0 for generator in node.generators for test in generator.ifs)
        self._visit_under([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt], guarded)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _visit_comprehension

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if isinstance(node.func, ast.Attribute) and name == "cuda":
            self._report(node)
        self.visit(node.func)
        for argument in node.args:
            if not (name == "startswith" and _cuda_literal(argument)):  # a test, as a comparison's operand is
                self.visit(argument)
        for keyword in node.keywords:
            if name in PREDICTIONS and keyword.arg == "device" and _cuda_literal(keyword.value):
                continue  # a prediction for a GPU, made with fake tensors on the CPU
            if keyword.arg == "device_type":
                continue  # torch.random.fork_rng(devices=[], device_type="cuda") forks no CUDA generator
            self.visit(keyword.value)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        if dotted.startswith("torch.cuda.") and dotted.count(".") == 2 and node.attr not in QUERIES:
            self._report(node)
            return
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if _cuda_literal(node):
            self._report(node)


def cuda_names(sources: list[str]) -> set[str]:
    """Names assigned a CUDA test anywhere in `sources` (`MULTI_GPU = BACKEND == "nccl"`)."""
    names: set[str] = set()
    for _ in range(2):  # a name may be built from another
        guards = _Guards(names)
        for source in sources:
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    if guards.polarity(node.value) > 0:
                        names.add(node.targets[0].id)
    return names


def unguarded_in_functions(source: str) -> dict[str, list[tuple[int, str]]]:
    """unguarded_cuda_uses of a module's source, by the innermost function or class holding each ("<module>" for
    none); the names assigned CUDA tests are the module's own."""
    tree = ast.parse(source)
    scopes = [
        node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    found: dict[str, list[tuple[int, str]]] = {}
    for line, text in unguarded_cuda_uses(source, cuda_names([source])):
        holding = [scope for scope in scopes if scope.lineno <= line <= scope.end_lineno]
        name = min(holding, key=lambda scope: scope.end_lineno - scope.lineno).name if holding else "<module>"
        found.setdefault(name, []).append((line, text))
    return found


def unguarded_cuda_uses(source: str, names: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line number, line) of every CUDA-only use in `source` that no CUDA test guards; `names`: see cuda_names."""
    finder = _Finder(_Guards(set(names)), source.splitlines())
    finder.visit(ast.parse(source))
    return finder.found

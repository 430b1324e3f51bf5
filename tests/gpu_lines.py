"""Which statements of gpukit run only with a CUDA GPU, and how many of them tests/test_gpu_paths.py executes.

    python tests/gpu_lines.py            # runs tests/test_gpu_paths.py under coverage, then reports
    python tests/gpu_lines.py .coverage  # reports on coverage data you already have

A statement is GPU-only when no CPU machine can reach it: the body of a branch taken only on CUDA (or with an
NVIDIA driver: NVML), the statements after a guard that raises without one, or a function that only such code
calls. CUDA_REGIONS and NVML_REGIONS name each by function and source text (not line numbers, which move), with
the reason; the executable lines come from coverage's own statement list, so comments and docstrings never count.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (file, function, locator, why). Locators: None, the whole body; ("if", test) the body of the `if` whose test
# is `test` (ast.unparse form); ("else", test) its else branch; ("after", statement) what follows the statement
# that starts with `statement` in the same block.
CUDA_REGIONS = [
    ("memory/allocator.py", "_record_refusal", None, "called by the CUDA allocator when it refuses an allocation"),
    ("memory/allocator.py", "watch_out_of_memory", None, "fit calls it on CUDA only"),
    ("memory/allocator.py", "out_of_memory_error", ("if", "device.type == 'cuda'"), "CUDA numbers for the message"),
    (
        "memory/allocator.py",
        "free_memory",
        ("if", "device is not None and torch.device(device).type == 'cuda' and torch.cuda.is_initialized()"),
        "empty the CUDA cache",
    ),
    ("memory/allocator.py", "_cuda_device", ("after", "if device.type != 'cuda'"), "past the no-GPU guard"),
    ("memory/allocator.py", "limit_gpu_memory", ("after", "device = _cuda_device("), "past the no-GPU guard"),
    ("memory/allocator.py", "allocator_settings", None, "expandable_segments calls it past its guard"),
    ("memory/allocator.py", "_expandable_in", None, "expandable_segments calls it past its guard"),
    ("memory/allocator.py", "_expandable_now", None, "tests call it on a GPU (the allocator's setting)"),
    ("memory/allocator.py", "_apply", None, "expandable_segments calls it past its guard"),
    ("memory/allocator.py", "expandable_segments", ("after", "_cuda_device("), "past the no-GPU guard"),
    ("memory/allocator.py", "record_snapshot", ("after", "device = _cuda_device("), "past the no-GPU guard"),
    ("memory/measuring.py", "measure", ("if", "device.type == 'cuda'"), "allocator statistics"),
    ("memory/measuring.py", "allocate_cublas_workspaces", None, "breakdown calls it on CUDA only"),
    ("memory/measuring.py", "cublas_workspace_bytes", None, "breakdown calls it on CUDA only"),
    ("memory/measuring.py", "_chosen_cublas_workspace_bytes", None, "cublas_workspace_bytes calls it (torch 2.11)"),
    ("memory/measuring.py", "_cublaslt_workspace_bytes", None, "cublas_workspace_bytes calls it (torch 2.11)"),
    ("memory/measuring.py", "breakdown", ("if", "cuda"), "allocator statistics (three blocks)"),
    ("memory/parts.py", "MemoryBreakdown.workspace", ("after", "if not self.allocated_timeline:"), "a CUDA breakdown"),
    ("memory/workspaces.py", "layer_workspaces", ("after", "if device.type != 'cuda':"), "past the no-GPU guard"),
    ("memory/workspaces.py", "_layer_calls", None, "layer_workspaces calls it past its guard"),
    ("memory/workspaces.py", "_layer_scratch", None, "layer_workspaces calls it past its guard"),
    ("memory/workspaces.py", "_spec", None, "layer_workspaces calls it past its guard"),
    ("memory/workspaces.py", "_TensorSpec.make", None, "layer_workspaces calls it past its guard"),
    ("memory/workspaces.py", "OperatorScratch.__init__", None, "made on a CUDA device only"),
    ("memory/workspaces.py", "OperatorScratch.__torch_dispatch__", None, "reads the CUDA allocator's statistics"),
    ("memory/plan.py", "_free_for_training", None, "free memory of the GPU"),
    ("memory/plan.py", "_check_budget", ("after", "if not on_gpu:"), "the budget read from the GPU"),
    ("memory/plan.py", "max_batch_size", ("if", "on_gpu and probe"), "real steps on the GPU"),
    ("memory/plan.py", "_probe", None, "called only on a GPU"),
    ("env.py", "synchronize", ("if", "device.type == 'cuda'"), "CUDA synchronisation"),
    ("bench.py", "timeit", ("if", "device.type == 'cuda'"), "CUDA-event timing"),
    ("precision.py", "_check_supported", ("if", "device.type == 'cuda'"), "compute capability"),
    ("precision.py", "has_fast_kernels", ("after", "if device.type != 'cuda':"), "compute capability"),
    ("runfile.py", "device_name", ("if", "device.type == 'cuda'"), "the GPU's name"),
    ("env.py", "detect", ("if", "gpus and (not problem)"), "a usable GPU was found"),
    ("env.py", "_automatic_profile", ("if", "device == 'cuda'"), "a GPU was found"),
    ("env.py", "resolve_device", ("after", "if count == 0:"), "past the no-GPU guard"),
    ("env.py", "cuda_index", None, "called by CUDA code only"),
    ("hardware/monitor.py", "_nvml_index", None, "a CUDA device's NVML index"),
    ("hardware/monitor.py", "Monitor.__init__", ("if", "device.type == 'cuda'"), "a GPU to watch"),
    ("hardware/planning.py", "_present_machine", ("if", "device.type == 'cuda'"), "the GPU's datasheet"),
    ("hardware/contention.py", "measure_contention", ("else", "device_name == 'cpu'"), "both processes on the GPU"),
    ("data/timeline.py", "kernel_seconds", None, "diagnose calls it on CUDA only"),
    ("data/bottleneck.py", "_time_step_alone", ("after", "if device.type != 'cuda':"), "past the no-GPU return"),
    ("data/prefetching.py", "CUDAPrefetcher.__init__", ("after", "if device.type != 'cuda':"), "past the guard"),
    ("data/prefetching.py", "CUDAPrefetcher.__len__", None, "a CUDAPrefetcher exists on CUDA only"),
    ("data/prefetching.py", "CUDAPrefetcher._copy", None, "side-stream copies"),
    ("data/prefetching.py", "CUDAPrefetcher.__iter__", None, "side-stream copies"),
    ("data/decoding.py", "decode_table", ("if", "cuda"), "nvJPEG rows (two blocks)"),
    ("data/bottleneck.py", "_advice", ("if", "device.type == 'cuda' and (not loader.pin_memory)"), "pinning advice"),
    ("data/timeline.py", "trace_steps", ("if", "device.type == 'cuda'"), "CUDA synchronisation"),
    ("data/timeline.py", "_intervals", ("if", "device.startswith('cuda')"), "device rows"),
    ("train/run.py", "Run.start_reporting", ("if", "self.device.type == 'cuda'"), "the out-of-memory observer"),
    ("train/run.py", "Run.begin_epoch", ("if", "self.device.type == 'cuda'"), "peak statistics"),
    ("distributed/launcher.py", "_check_backend_and_nprocs", ("if", "backend == 'nccl'"), "NCCL with GPUs present"),
    ("distributed/launcher.py", "fork_refusal", ("if", "torch.cuda.is_initialized()"), "CUDA initialised"),
    ("distributed/launcher.py", "fork_refusal", ("if", "devices"), "a CUDA device visible"),
    ("distributed/parallel.py", "setup", ("if", "backend == 'nccl'"), "one GPU per process (two blocks)"),
    ("distributed/parallel.py", "data_parallel", ("after", "if device.type != 'cuda':"), "SyncBatchNorm on GPUs"),
    ("distributed/scaling.py", "measure", ("if", "device.type == 'cuda'"), "peak statistics"),
]
# Statements that need an NVIDIA driver (NVML) rather than CUDA: detection, the doctor and the Monitor.
NVML_REGIONS = [
    (
        "env.py",
        "_read_nvml",
        ("after", "handle = ask_nvml(pynvml, 'nvmlDeviceGetHandleByIndex', index)"),
        "NVML lists a GPU",
    ),
    ("checkup.py", "_nvml_facts", ("after", "try:\n    pynvml.nvmlInit()"), "NVML found a driver"),
    ("checkup.py", "_gpu_status", None, "one GPU NVML lists"),
    ("hardware/monitor.py", "Monitor._open_nvml", ("after", "try:\n    pynvml.nvmlInit()"), "NVML reached the GPU"),
    ("hardware/monitor.py", "Monitor._ask", None, "NVML queries"),
    ("hardware/monitor.py", "Monitor._energy_mj", None, "NVML queries"),
    ("hardware/monitor.py", "Monitor.sample", None, "NVML queries"),
    ("hardware/monitor.py", "Monitor._run", None, "the NVML sampling thread"),
    ("hardware/monitor.py", "Monitor.start", ("if", "self._nvml is not None"), "the NVML sampling thread"),
    ("hardware/monitor.py", "Monitor.close", ("if", "self._nvml is not None"), "NVML shutdown"),
    ("hardware/monitor.py", "Monitor.lap", ("else", "self._rapl is not None"), "GPU samples"),
    ("hardware/monitor.py", "Monitor._summarise", None, "GPU samples"),
]


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
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if kind == "after" and isinstance(block, list):
                starts = [i for i, stmt in enumerate(block) if ast.unparse(stmt).startswith(text)]
                found += block[starts[0] + 1 :] if starts else []
    if not found:
        raise LookupError(f"{locator} matches nothing in {function.name}")
    return found


def gpu_only_lines(regions: list[tuple]) -> dict[Path, set[int]]:
    """File → the line numbers of `regions` (every line of each statement; intersect with coverage's statements)."""
    lines: dict[Path, set[int]] = {}
    for file, function, locator, _ in regions:
        path = ROOT / "gpukit" / file
        tree = ast.parse(path.read_text())
        for stmt in _statements(_function(tree, function), locator):
            lines.setdefault(path, set()).update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def report(data_file: str) -> None:
    import coverage

    measured = coverage.Coverage(data_file=data_file)
    measured.load()
    counts = {name: _count(measured, regions) for name, regions in (("CUDA", CUDA_REGIONS), ("NVML", NVML_REGIONS))}
    for name, (executed, total) in counts.items():
        print(f"{name}-only statements executed: {executed} of {total} ({executed / total:.0%})")
    executed, total = (sum(column) for column in zip(*counts.values()))
    print(f"GPU-only statements executed: {executed} of {total} ({executed / total:.0%})")


def _count(measured, regions: list[tuple]) -> tuple[int, int]:
    total = executed = 0
    for path, lines in sorted(gpu_only_lines(regions).items()):
        _, statements, _, missing, _ = measured.analysis2(str(path))
        gpu, missed = lines & set(statements), lines & set(missing)
        total, executed = total + len(gpu), executed + len(gpu - missed)
        ranges = ", ".join(map(str, sorted(missed)))
        print(
            f"{path.relative_to(ROOT)}: {len(gpu) - len(missed)}/{len(gpu)}" + (f"  missed: {ranges}" if missed else "")
        )
    return executed, total


if __name__ == "__main__":
    if len(sys.argv) > 1:
        report(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as folder:
            data = str(Path(folder) / ".coverage")
            command = [
                sys.executable,
                "-m",
                "coverage",
                "run",
                f"--data-file={data}",
                "--source=gpukit",
                "-m",
                "pytest",
            ]
            tests = [
                "tests/test_gpu_paths.py",
                "-m",
                "not slow",
                "-q",
                "-p",
                "no:cacheprovider",
            ]  # not the test that runs this
            subprocess.run([*command, *tests], cwd=ROOT, check=True)
            report(data)

"""Compiling a model by regions, and what CUDA graphs remove: the cost of launching each operator.

Regional compilation compiles each repeated block (a transformer's layers, a CNN's stages: what
gk.memory.find_blocks finds) instead of the whole model. Blocks of one class share one compiled graph
(torch.compile reuses the code for modules of the same code, the parameters being inputs), so a 24-layer
model compiles about as fast as a 1-layer one, while whole-model compilation traces every layer. The code
between blocks (embeddings, the head) stays eager, and no fusion crosses a block's edge: the steps run at
nearly the whole-model speed. It is how torchtitan and Hugging Face compile large models.

Each operator PyTorch runs eagerly costs a fixed overhead on the host (Python, the dispatcher, a kernel
launch: a few microseconds) on top of its work. A small model whose operators each take less than that is
*launch-bound*: the GPU waits for the CPU. torch.compile fuses operators (fewer launches), and
mode="reduce-overhead" records the step's kernels once in a CUDA graph and replays them with one launch.
`launch_overhead` measures the per-operator cost on any device.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .bench import Timing, compare
from .env import synchronize
from .memory.blocks import find_blocks
from .step import Loss, split_batch

__all__ = [
    "COMPILE_MODES",
    "CompiledVariant",
    "LaunchOverhead",
    "compare_compilation",
    "compile_regions",
    "count_operators",
    "launch_overhead",
    "remove_compiled_regions",
]

# fit(compile=...): True or "whole" compiles the model, "regional" each block, "reduce-overhead" the model with
# CUDA graphs (torch.compile's mode), a dict is torch.compile's options for the whole model.
COMPILE_MODES = ("whole", "regional", "reduce-overhead")


def compile_regions(model: nn.Module, **options) -> list[str]:
    """Compile each block of `model` in place (nn.Module.compile, with torch.compile's `options`); returns the
    names of the blocks compiled. Undo with remove_compiled_regions(model)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}.")
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks to compile one by one (children with parameters and "
            "submodules of their own, in an nn.Sequential or nn.ModuleList): compile the whole model instead "
            "(fit(compile='whole'))."
        )
    for _, block, _ in blocks:
        block.compile(**options)
    return [name for name, *_ in blocks]


def remove_compiled_regions(model: nn.Module) -> None:
    """Make every block compiled by compile_regions run eagerly again."""
    for _, block, _ in find_blocks(model):
        block._compiled_call_impl = None  # what nn.Module.compile set: its __call__ goes back to _call_impl


@dataclass
class CompiledVariant:
    """One way of running a model's training step (forward and backward), measured by compare_compilation."""

    mode: str  # "eager", "regional" or "whole"
    first_step: float  # seconds of the first step: compilation included
    traced_operators: int  # operators torch.compile captured into graphs (0 eagerly)
    loss: float  # the first step's loss
    gradients: list[torch.Tensor] = field(repr=False)  # after the first step, one per parameter
    step: Timing | None = None  # the steady state, timed interleaved with the other variants

    @property
    def compile_seconds(self) -> float:
        """The first step's time beyond a steady step's: what compiling cost."""
        return self.first_step - self.step.median


def _warm_up_compiler(device: torch.device) -> None:
    """Pay torch.compile's one-time costs (importing Inductor, starting its compile workers, building its C++
    header on a CPU: up to a minute the first time) on a throwaway function, so that they are not counted against
    whichever mode compare_compilation compiles first. Measured here: without it, "regional" (compiled first)
    took 34 s against 19 s for "whole" on a machine that had never compiled."""
    torch._dynamo.reset()
    torch.compile(lambda tensor: (tensor * 2).sin().sum())(torch.ones(8, device=device, requires_grad=True)).backward()
    torch._dynamo.reset()


def _training_step(model, batch, loss: Loss) -> torch.Tensor:
    model_loss = loss(batch.call(model), batch.target)
    model_loss.backward()
    return model_loss.detach()


def compare_compilation(
    model: nn.Module,
    batch,
    *,
    modes=("eager", "regional", "whole"),
    device: str | torch.device = "cpu",
    repeats: int = 5,
    loss_fn=None,
) -> dict[str, CompiledVariant]:
    """A copy of `model` run eagerly, compiled block by block ("regional") and whole: the first training step
    (forward and backward) of each, compilation included, then the steady steps of all, interleaved. `batch` is
    any form fit takes. Each mode starts from an empty in-memory compile cache (torch._dynamo.reset), after the
    compiler's one-time costs were paid on a throwaway function; the compiled code cached on disk by an earlier
    run makes a later first step faster."""
    device = torch.device(device)
    batch = split_batch(tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, batch))
    loss, variants, steps = Loss(loss_fn), {}, {}
    counters = torch._dynamo.utils.counters["stats"]
    if set(modes) - {"eager"}:
        _warm_up_compiler(device)
    for mode in modes:
        if mode not in ("eager", *COMPILE_MODES[:2]):
            raise ValueError(f"mode {mode!r} is unknown; use 'eager', 'regional' or 'whole'.")
        torch._dynamo.reset()
        copied = copy.deepcopy(model).to(device).train()
        traced_before = counters["calls_captured"]
        run = torch.compile(copied) if mode == "whole" else copied
        if mode == "regional":
            compile_regions(copied)
        started = time.perf_counter()
        first_loss = _training_step(run, batch, loss)
        synchronize(device)
        first_step = time.perf_counter() - started
        gradients = [parameter.grad.detach().clone() for parameter in copied.parameters() if parameter.grad is not None]
        traced = counters["calls_captured"] - traced_before
        variants[mode] = CompiledVariant(mode, first_step, traced, first_loss.item(), gradients)
        steps[mode] = lambda run=run, copied=copied: (_training_step(run, batch, loss), copied.zero_grad())
    for mode, timing in compare(steps, device=device, warmup=1, repeats=repeats).items():
        variants[mode].step = timing
    return variants


@dataclass
class LaunchOverhead:
    """Many small operators against one operator doing the same work (seconds per call)."""

    operators: int  # how many small operators the unfused version runs
    unfused: float  # seconds for `operators` small operators, one after another
    fused: float  # seconds for one operator over the same elements
    device: str

    @property
    def per_operator(self) -> float:
        """Seconds each launch adds: what fusion and CUDA graphs save per operator removed."""
        return max(self.unfused - self.fused, 0.0) / self.operators

    def __str__(self) -> str:
        return (
            f"{self.operators} small operators: {self.unfused * 1e6:,.0f} µs; one fused operator: "
            f"{self.fused * 1e6:,.0f} µs on {self.device}; about {self.per_operator * 1e6:.1f} µs per launch"
        )


def launch_overhead(
    device: str | torch.device = "cpu", *, operators: int = 200, elements: int = 1024, repeats: int = 15
) -> LaunchOverhead:
    """Time `operators` additions of a small tensor, one after another, against one multiplication doing the
    same arithmetic (x + c + c … = x + operators·c): the difference is the launch overhead of the rest."""
    device = torch.device(device)
    x = torch.randn(elements, device=device)
    step = torch.full((elements,), 1e-3, device=device)

    def unfused():
        y = x
        for _ in range(operators):
            y = y + step
        return y

    def fused():
        return torch.add(x, step, alpha=operators)

    torch.testing.assert_close(unfused(), fused(), rtol=1e-4, atol=1e-4)  # the same result, both ways
    timings = compare({"unfused": unfused, "fused": fused}, device=device, warmup=3, repeats=repeats)
    return LaunchOverhead(operators, timings["unfused"].median, timings["fused"].median, str(device))


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def count_operators(fn) -> int:
    """How many operators `fn()` runs eagerly (backward included): each is a launch (a kernel on a GPU) that
    fusion or a CUDA graph can remove."""
    with _Counting() as counting:
        fn()
    return counting.calls

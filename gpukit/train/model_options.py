"""What fit does to the model around training (fit's `transforms`, a gk.ModelTransforms), each off unless asked, and
undone when fit returns:

    fp8=True | a torchao Float8LinearConfig        FP8 matmuls in every plain nn.Linear whose dimensions are
                                                    multiples of 16 (gk.fp8.convert: torchao's Float8Linear);
    activation_checkpointing="full" | "selective"   gk.memory.apply_activation_checkpointing on every block;
    compile=True | "whole" | "regional" | "reduce-overhead" | {torch.compile options}
                                                    the whole model, each block (gk.compiling.compile_regions),
                                                    or the whole model with CUDA graphs;
    offload_activations=True                        saved activations in host memory (gk.memory.offload);
and, with gk.Saving(in_background=True), the thread that writes the saves (gpukit.train.async_checkpoint).

They compose in torchtitan's order: converting to FP8, checkpointing, then compiling, then the data-parallel
wrapper (torch.compile then traces the FP8 casts and fuses them with their neighbours).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .. import fp8 as float8
from ..compiling import compile_regions, remove_compiled_regions
from ..memory.activation_checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from ..memory.offload import OffloadActivations
from .async_checkpoint import BackgroundWriter
from .options import ModelTransforms
from .tally import callers_stacklevel, predictions_can_wait


class ModelOptions:
    """The transforms applied to `model` (FP8 layers, checkpointing and regional compiling, in place), the callable the
    step runs (`forward`), and `undo` for when training ends. `fp8_config`: gk.fp8.training_config's answer."""

    def __init__(self, model: nn.Module, device: torch.device, transforms: ModelTransforms, fp8_config):
        activation_checkpointing, compile = transforms.activation_checkpointing, transforms.compile
        offload_activations = transforms.offload_activations
        self.model, self.compile = model, compile
        self.predictions_can_wait = predictions_can_wait(model, device, compile)  # before fit compiles any block
        self.writer: BackgroundWriter | None = None
        self.fp8_layers = float8.convert(model, fp8_config) if fp8_config is not None else []
        self.checkpointed = False
        try:
            if activation_checkpointing is not None:
                apply_activation_checkpointing(model, policy=activation_checkpointing)
                self.checkpointed = True
            if compile == "regional":
                compile_regions(model)
        except (TypeError, ValueError):
            self.undo()  # the model as it came, then the error that says what to do
            raise
        self.offload = offload_activations and device.type == "cuda"
        if offload_activations and not self.offload:
            warnings.warn(
                f"offload_activations=True moves saved activations from a GPU to host memory; on {device.type} they "
                "are in host memory already, so nothing is offloaded.",
                stacklevel=callers_stacklevel(),  # the line of yours that called fit
            )

    def forward(self, parallel: nn.Module):
        """What the training step calls: `parallel` (the model or its DDP wrapper), compiled whole if asked,
        offloading if asked."""
        forward = parallel
        if self.compile is True or self.compile == "whole" or isinstance(self.compile, dict):
            forward = torch.compile(parallel, **(self.compile if isinstance(self.compile, dict) else {}))
        elif self.compile == "reduce-overhead":
            forward = torch.compile(parallel, mode="reduce-overhead")
        return OffloadActivations(forward) if self.offload else forward

    def save_in_background(self, checkpointer) -> None:
        self.writer = checkpointer.writer = BackgroundWriter()

    def undo(self) -> None:
        """Wait for a save in flight, then give the model back as it came (without checkpointing, compiled blocks or
        FP8 layers: the same Parameters in nn.Linear layers again)."""
        try:
            if self.writer is not None:
                self.writer.wait()
        finally:
            if self.compile == "regional":
                remove_compiled_regions(self.model)  # (blocks never compiled are left as they are)
            if self.checkpointed:
                remove_activation_checkpointing(self.model)
            if self.fp8_layers:
                float8.unconvert(self.model)

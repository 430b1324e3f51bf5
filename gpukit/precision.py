"""Numeric precision as one small object: autocast context, loss scaling, optimizer step.

"fp32"        plain float32.
"tf32"        float32 storage, TF32 tensor-core matmuls and convolutions (CUDA, Ampere or newer).
"bf16-mixed"  autocast to bfloat16; same exponent range as fp32, so no loss scaling is needed.
"fp16-mixed"  autocast to float16 with dynamic loss scaling (torch.amp.GradScaler): fp16's
              small range makes small gradients underflow to zero unless the loss is scaled up.

A disabled feature is an object that does nothing (a disabled GradScaler, autocast with
enabled=False), so the training loop has one code path for every precision.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator

import torch

PRECISIONS = ("fp32", "tf32", "bf16-mixed", "fp16-mixed")
_AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
# The number format a precision's matrix multiplies run in: what a datasheet's peak TFLOP/s and a matmul
# benchmark are quoted in. "fp8" is a format for matmuls only (no training precision of that name yet).
MATMUL_FORMAT = {"fp32": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8": "fp8"}


def matmul_format(precision: str) -> str:
    """The matmul number format of a precision name ("bf16-mixed" -> "bf16"); the bare formats "bf16" and
    "fp16" still work for one release, with a DeprecationWarning (one vocabulary: the precision names)."""
    if precision in ("bf16", "fp16"):
        warnings.warn(
            f"precision {precision!r} is deprecated here; use {precision + '-mixed'!r} (the names of "
            "gk.PRECISIONS, which fit takes too).",
            DeprecationWarning,
            stacklevel=3,
        )
        return precision
    if precision not in MATMUL_FORMAT:
        raise ValueError(f"precision={precision!r} is unknown; use one of {', '.join(map(repr, MATMUL_FORMAT))}.")
    return MATMUL_FORMAT[precision]


class Precision:
    """Autocast, backward with loss scaling, and the optimizer step for one precision."""

    def __init__(self, name: str, device: torch.device, *, loss_scaling: bool = True):
        self.name = name
        self.device = torch.device(device)
        self.dtype = _AUTOCAST_DTYPE.get(name)  # None: no autocast
        # loss_scaling=False: fp16 without a scaler (gk.memory's fake tensors have no values to scale).
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=name == "fp16-mixed" and loss_scaling)
        self.skipped_steps = 0  # optimizer steps skipped because fp16 gradients overflowed
        self._last_scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, device={str(self.device)!r})"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass and the loss. Without a dtype: autocast switched off (fp32 stays fp32 inside
        an autocast region of yours), and where none is on, nothing (entering torch.autocast costs 15 µs a step)."""
        if (
            self.dtype is None
            and self.device.type in ("cpu", "cuda")
            and not torch.is_autocast_enabled(self.device.type)
        ):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)

    @contextlib.contextmanager
    def flags(self) -> Iterator[None]:
        """Set the global matmul/convolution flags this precision needs, and restore them after.

        "fp32" is strict fp32: PyTorch lets cuDNN use TF32 for convolutions by default on
        Ampere and newer GPUs, which would make "fp32" quietly run at TF32 precision.
        "tf32" turns TF32 on for matmuls and convolutions. Mixed precisions change nothing.
        """
        if self.name not in ("fp32", "tf32"):
            yield
            return
        matmul_before = torch.get_float32_matmul_precision()
        cudnn_before = torch.backends.cudnn.allow_tf32
        torch.set_float32_matmul_precision("high" if self.name == "tf32" else "highest")
        torch.backends.cudnn.allow_tf32 = self.name == "tf32"
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(matmul_before)
            torch.backends.cudnn.allow_tf32 = cudnn_before

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(
        self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor], clip: float | None = None
    ) -> None:
        """Unscale (fp16), clip the gradient norm if asked, step, and update the loss scale.

        Gradients are unscaled before clipping so that `clip` is a bound on the true
        gradient norm, not on the scaled one.
        """
        if clip is not None:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip)
        self.scaler.step(optimizer)  # skips the step if fp16 gradients hold inf or NaN
        self.scaler.update()
        if self.scaler.is_enabled():
            # GradScaler.step already synchronised to check for overflow, so reading the
            # scale costs little; the scale drops exactly when a step was skipped.
            scale = self.scaler.get_scale()
            self.skipped_steps += scale < self._last_scale
            self._last_scale = scale

    def state_dict(self) -> dict:
        return {"name": self.name, "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state["name"] != self.name:
            raise ValueError(
                f"this checkpoint was trained with precision={state['name']!r}, not {self.name!r}; "
                f"pass precision={state['name']!r} to resume it."
            )
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state["skipped_steps"]
        self._last_scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0


def _check_supported(name: str, device: torch.device) -> None:
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} is unknown; use one of {', '.join(map(repr, PRECISIONS))}.")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if name in ("tf32", "bf16-mixed") and capability < (8, 0):
            instead = "'fp16-mixed'" if name == "bf16-mixed" else "'fp32' or 'fp16-mixed'"
            raise ValueError(
                f"precision={name!r} needs a GPU of compute capability 8.0 (Ampere) or newer; "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. Use {instead}."
            )
    elif name == "tf32":
        raise ValueError(
            f"precision='tf32' is a mode of NVIDIA GPUs (Ampere or newer) and does nothing on {device.type}; "
            "use 'fp32', or 'bf16-mixed' for reduced precision."
        )


def get_precision(precision: str | Precision, device: torch.device | str) -> Precision:
    """The one place where a precision string becomes a Precision object for a device."""
    device = torch.device(device)
    if isinstance(precision, Precision):
        if precision.device.type != device.type:
            raise ValueError(f"{precision!r} was made for {precision.device}, not {device}; pass the name instead.")
        return precision
    _check_supported(precision, device)
    return Precision(precision, device)


def has_fast_kernels(
    precision: str,
    device: torch.device | str,
    compute_capability: tuple[int, int] | None = None,
    *,
    measured_speedup: float | None = None,
) -> tuple[bool, str]:
    """Whether `device` trains in `precision` at least as fast as in fp32, and why.

    On CUDA it is decided from what the hardware has: NVIDIA tensor cores run fp16 from compute capability
    7.0 (Volta) and bf16/TF32 from 8.0 (Ampere); pass `compute_capability` (e.g. from `gk.detect().gpus[0]`)
    to avoid asking CUDA. A CPU may or may not have 16-bit matrix units (Intel AMX runs bf16 about 1.4x fp32;
    an AMD EPYC without them, 11-30x slower), which nothing gpukit reads tells reliably: there it is decided
    from `measured_speedup`, fp32's step time divided by `precision`'s, timed interleaved (`gk.bench.compare`)
    so that other load hits both alike. Without a measurement a CPU or MPS device answers False.
    Use it to decide whether a long run in `precision` is worth starting.
    """
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown; use one of {', '.join(map(repr, PRECISIONS))}.")
    if measured_speedup is not None and not measured_speedup > 0:
        raise ValueError(
            f"measured_speedup={measured_speedup!r} is not a positive number; pass fp32's step time divided by "
            f"{precision}'s (both in seconds), or None."
        )
    if precision == "fp32":
        return True, "fp32 is the reference"
    if device.type != "cuda":
        if measured_speedup is None:
            return False, (
                f"PyTorch has no {precision} training kernels for {device.type} that are fast everywhere: "
                "pass measured_speedup to decide from a timing"
            )
        verdict = "at least as fast as" if measured_speedup >= 1 else "slower than"
        return (
            measured_speedup >= 1,
            f"a {precision} step measured {measured_speedup:.2f}x fp32's speed: {verdict} fp32",
        )
    capability = compute_capability or torch.cuda.get_device_capability(device)
    needed = (7, 0) if precision == "fp16-mixed" else (8, 0)
    if tuple(capability) >= needed:
        return True, f"tensor cores for {precision} (compute capability {capability[0]}.{capability[1]})"
    return False, (
        f"{precision} needs tensor cores of compute capability {needed[0]}.{needed[1]} or newer; "
        f"this GPU has {capability[0]}.{capability[1]}"
    )

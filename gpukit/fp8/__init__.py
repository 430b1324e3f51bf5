"""FP8 numerics, measurable on any machine: what 8-bit floats do to a model's weights, activations and gradients.

Two 8-bit formats (OCP FP8, on H100, H200, B200 and newer): e4m3 (4 exponent bits, 3 mantissa bits:
largest 448, relative step 2^-3) for weights and activations, and e5m2 (5 and 2: largest 57,344, relative
step 2^-2) for gradients, whose range is wider. Either range is far narrower than bf16's, so each tensor is
multiplied by a *scale* before the cast: per-tensor scaling maps the tensor's largest magnitude (amax) to
the format's largest value, and the matmul divides it out again. Without a scale, small values (gradients
of 1e-6) fall below the smallest FP8 number and become zero.

`numerics(model, batch)` runs one training step, captures every Linear layer's weight, input and output
gradient, and measures the relative error of each cast (bf16, e4m3 and e5m2 with a per-tensor scale, and
e4m3 without one) against the fp32 values.

FP8 *training* needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, L40S, H100, H200, B200)
and torchao (the `fp8` extra: pip install 'gpukit[fp8]'). `convert(model)` swaps each plain nn.Linear whose
dimensions are multiples of 16 for torchao's Float8Linear (`convert_to_float8_training` with `linear_filter`
as its module_filter_fn; tensorwise scales), in place, and `unconvert` swaps them back; `fit(..., fp8=True)`
does both around training, converting before it compiles. `compare_speed` times a Linear layer's training
step in FP8 and bf16, compiled and not, at a small and a large shape: FP8 pays only on large matmuls, compiled.
On a machine without FP8 tensor cores, torchao's `Float8LinearConfig(emulate=True)` runs the same casts with
fp32 matmuls: the numerics of FP8 training, slowly (what the tests on a CPU use).

casts.py     quantize, dequantize, relative_error; numerics(model, batch): every cast's error, measured
training.py  supported, training_config, convert and unconvert: FP8 training with torchao
speed.py     compare_speed: a Linear layer's step in FP8 against bf16, compiled and not
"""

from .casts import FORMATS, Numerics, TensorErrors, dequantize, numerics, quantize, relative_error
from .speed import SPEED_SHAPES, Speed, compare_speed
from .training import (
    MIN_COMPUTE_CAPABILITY,
    TORCHAO_REQUIREMENT,
    convert,
    convertible,
    linear_filter,
    supported,
    torchao_available,
    training_config,
    unconvert,
)

__all__ = [
    "FORMATS",
    "MIN_COMPUTE_CAPABILITY",
    "SPEED_SHAPES",
    "TORCHAO_REQUIREMENT",
    "Numerics",
    "Speed",
    "TensorErrors",
    "compare_speed",
    "convert",
    "convertible",
    "dequantize",
    "linear_filter",
    "numerics",
    "quantize",
    "relative_error",
    "supported",
    "torchao_available",
    "training_config",
    "unconvert",
]

"""FP8 numerics (issue 21 §3), on any machine: per-tensor scaled casts to e4m3 and e5m2 round within their formats'
steps, unscaled tiny values vanish, and a training step's weights, activations and gradients of a CNN and a GPT are
measured against bf16; torchao's FP8 training is asked for by name where it is not installed."""

import importlib.util

import pytest
import torch

import gpukit as gk
from gpukit import fp8
from tests.helpers import images, tiny_gpt, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_scaled_cast_rounds_within_the_formats_step_and_keeps_the_range():
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e-5  # gradient-sized
    for name, mantissa_bits in (("e4m3", 3), ("e5m2", 2)):
        quantized, scale = fp8.quantize(values, name)
        assert quantized.dtype == fp8.FORMATS[name]
        assert quantized.float().abs().max() == torch.finfo(quantized.dtype).max  # amax maps to the largest value
        error = (fp8.dequantize(quantized, scale) - values).abs() / values.abs()
        assert error[values.abs() > 1e-6].max() <= 2.0 ** -(mantissa_bits + 1) + 1e-6  # half a step, relative
    assert fp8.relative_error(values, "e4m3", scaled=False) == pytest.approx(1.0)  # below e4m3's smallest: zeros
    assert fp8.relative_error(values, "e4m3") < fp8.relative_error(values, "e5m2") < 0.1
    assert fp8.relative_error(values, "bf16") < fp8.relative_error(values, "e4m3")


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="'e4m3', 'e5m2'"):
        fp8.quantize(torch.ones(2), "e3m4")


@pytest.mark.parametrize(
    "build, batch",
    [
        (lambda: gk.models.fast_cnn(8), lambda: (images(8), torch.arange(8) % 10)),
        (tiny_gpt, lambda: (tokens(4, 32), tokens(4, 32, seed=1))),
    ],
    ids=["cnn", "gpt"],
)
def test_numerics_of_a_training_step_rank_bf16_e4m3_e5m2(build, batch):
    model = build()
    measured = fp8.numerics(model, batch())
    linear_layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    for kind in ("weights", "activations", "gradients"):
        errors = measured[kind]
        assert errors.layers == linear_layers
        assert 0 < errors.bf16 < errors.e4m3 < errors.e5m2 < 0.1, errors
    # small gradients fall below e4m3's smallest numbers (2^-9) without a scale
    assert measured["gradients"].e4m3_unscaled > measured["gradients"].e4m3
    assert all(parameter.grad is None for parameter in model.parameters())
    assert len(measured.table()) == 3


def test_numerics_names_a_model_without_linear_layers():
    with pytest.raises(ValueError, match="no nn.Linear"):
        fp8.numerics(torch.nn.Conv2d(3, 3, 1), (images(2), images(2)))


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao is installed here")
def test_convert_without_torchao_says_what_to_install():
    with pytest.raises(ImportError, match="pip install torchao"):
        fp8.convert(tiny_gpt())

import math

import pytest
import torch

import gpukit as gk
from gpukit.bench import Timing, compare, flops_per_step, matmul_tflops, mfu, peak_tflops, ratios, timeit


def test_timeit_measures_what_runs():
    timing = timeit(lambda: sum(range(20_000)), repeats=5, warmup=1)
    assert len(timing.times) == 5 and timing.median > 0 and timing.iqr >= 0
    assert "median of 5" in str(timing)


def test_compare_interleaves():
    order = []
    timings = compare({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, warmup=1)
    assert order == ["a", "b"] + ["a", "b"] * 3  # warm-up, then A, B, A, B, …
    assert set(ratios(timings)) == {"a", "b"} and ratios(timings)["a"] == 1.0


def test_timing_statistics():
    timing = Timing([1.0, 2.0, 3.0, 4.0, 100.0])
    assert timing.median == 3.0 and timing.min == 1.0 and timing.iqr < 60


def test_median_error_matches_the_spread_of_medians():
    # The standard error read from one sample's IQR, against the spread of the medians of many samples.
    generator = torch.Generator().manual_seed(0)
    samples = torch.randn(2000, 25, generator=generator, dtype=torch.float64)
    medians = samples.median(dim=1).values
    estimated = [Timing(row.tolist()).median_error for row in samples[:200]]
    assert 0.8 < sorted(estimated)[100] / medians.std().item() < 1.25


def test_matmul_tflops_is_plausible_on_cpu():
    tflops = matmul_tflops("cpu", n=256, repeats=3)
    assert math.isfinite(tflops) and 0 < tflops < 50  # no CPU core does 50 TFLOP/s


def test_flops_of_a_linear_layer_forward_and_backward():
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    forward = flops_per_step(layer, x, backward=False)
    assert forward == 2 * 16 * 64 * 32
    # Backward computes the weight gradient; the input needs none, so it adds one more matmul.
    assert flops_per_step(layer, x) == 2 * forward
    assert layer.weight.grad is None  # gradients left as they were


def test_cnn_backward_costs_about_twice_the_forward():
    model = gk.models.fast_cnn(8)
    x = torch.randn(4, 3, 32, 32)
    ratio = flops_per_step(model, x) / flops_per_step(model, x, backward=False)
    assert 2.5 < ratio <= 3.0  # the first conv needs no input gradient


def test_peaks_and_mfu():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe") == pytest.approx(756.0)
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156.0)
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16-mixed") is None  # V100 has no bf16 tensor cores
    assert peak_tflops("Some Unknown GPU") is None
    assert mfu(1e12, 0.01, 1000.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        mfu(1e12, 0.0, 100.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="repeats"):
        timeit(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="int8"):
        matmul_tflops("cpu", precision="int8")
    with pytest.warns(DeprecationWarning, match="'bf16-mixed'"):  # the old format name, for one release
        assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed")
    with pytest.raises(ValueError, match="tf32"):
        matmul_tflops("cpu", precision="tf32")


@pytest.mark.gpu
def test_cuda_timing_uses_events_and_sees_the_work():
    a = torch.randn(4096, 4096, device="cuda")
    timing = timeit(lambda: a @ a, device="cuda", repeats=5)
    assert timing.median > 1e-5  # an unsynchronised host timer would see only the launch
    assert matmul_tflops("cuda", "fp32", n=2048, repeats=3) > 1


class DictModel(torch.nn.Module):
    """model(input_ids=…, labels=…) → {"loss", "logits"}: one matmul per token (the head)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256, bias=False)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_flops_per_step_for_any_batch_form():
    tokens = torch.zeros(4, 8, dtype=torch.long)
    # The head's matmul: 2·16·256 FLOPs per token forward, twice that backward (input and weight gradients).
    expected = 6 * 16 * 256 * tokens.numel()
    assert flops_per_step(DictModel(), {"input_ids": tokens, "labels": tokens}) == expected
    assert flops_per_step(DictModel(), {"input_ids": tokens, "labels": tokens}, backward=False) == expected // 3
    model = gk.models.gpt(max_seq_len=8, width=32, depth=2, heads=2)
    tuple_count = flops_per_step(model, (tokens, tokens))
    assert tuple_count == flops_per_step(model, tokens) > 0  # the loss adds no matmul
    assert all(p.grad is None for p in model.parameters())  # counted on a copy on the meta device

import math

import pytest
import torch

import gpukit as gk
from gpukit.bench import Timing, compare, flops_per_step, matmul_tflops, mfu, peak_tflops, ratios, timeit
from tests.helpers import tiny_gpt
from tests.helpers import tokens as helpers_tokens


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


class CheckedAttention(torch.nn.Module):
    """Self-attention with F.scaled_dot_product_attention on (B, T, width) inputs; with `check` it reads a number from
    its own outputs (`if not torch.isfinite(...).all()`), which the meta device cannot answer: the count falls back
    to a real run."""

    def __init__(self, width: int = 16, heads: int = 2, check: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.heads, self.check = torch.nn.Linear(width, 3 * width, bias=False), heads, check

    def forward(self, inputs):
        batch, length, width = inputs.shape
        queries, keys, values = (
            part.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for part in self.qkv(inputs).chunk(3, dim=-1)
        )
        attended = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        if self.check and not torch.isfinite(attended).all():
            raise ValueError("non-finite attention")
        return attended


def test_flops_of_attention_are_the_same_on_the_meta_device_and_on_a_real_run():
    inputs = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0), device="cpu")
    batch, length, width, heads = 2, 8, 16, 2
    # The projection's forward; its backward is the weight gradient alone (the inputs need none).
    projection = 2 * batch * length * width * 3 * width
    attention = 2 * (2 * batch * heads * length * length * (width // heads))  # q·kᵀ and scores·v, forward
    by_hand = projection * 2 + attention * 3  # attention's backward: four matmuls (dq, dk, dscores, dv), no recompute
    meta = flops_per_step(CheckedAttention(check=False), inputs)
    with pytest.warns(UserWarning, match="meta device cannot run"):
        real = flops_per_step(CheckedAttention(check=True), inputs)
    assert meta == by_hand
    assert real == meta
    assert flops_per_step(CheckedAttention(check=False), inputs, backward=False) == projection + attention


class GroupedQueryAttention(CheckedAttention):
    """CheckedAttention with 4 query heads and 2 key/value heads (enable_gqa=True): each k/v head serves 2 queries."""

    def __init__(self, width: int = 16, check: bool = True):
        super().__init__(width, heads=4, check=check)
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(width, 2 * width, bias=False)  # q: width; k and v: width / 2 each

    def forward(self, inputs):
        batch, length, width = inputs.shape
        size = width // self.heads
        queries, keys, values = self.qkv(inputs).split([width, width // 2, width // 2], dim=-1)
        queries = queries.view(batch, length, self.heads, size).transpose(1, 2)
        keys, values = (part.view(batch, length, self.heads // 2, size).transpose(1, 2) for part in (keys, values))
        attended = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, enable_gqa=True)
        if self.check and not torch.isfinite(attended).all():
            raise ValueError("non-finite attention")
        return attended


def test_flops_of_grouped_query_attention_broadcast_the_key_value_heads(monkeypatch):
    """GQA counted by hand: every one of the 4 query heads does q·kᵀ and scores·v against its group's k/v head. On a
    real CPU run (the fused kernel) and on the meta device alike, and with a torch whose own formula asserts equal
    head counts (as torch's sdpa_flop_count did), which gpukit's count must not depend on."""

    def equal_heads_only(query_shape, key_shape, value_shape):
        assert query_shape[1] == key_shape[1], "sdpa_flop_count: q and k/v head counts differ"
        return 0

    monkeypatch.setattr(gk.bench, "sdpa_flop_count", equal_heads_only, raising=False)
    batch, length, width, heads = 2, 8, 16, 4
    inputs = torch.randn(batch, length, width, generator=torch.Generator().manual_seed(0), device="cpu")
    projection = 2 * batch * length * width * 2 * width
    attention = 2 * (2 * batch * heads * length * length * (width // heads))  # per query head, k/v broadcast
    with pytest.warns(UserWarning, match="meta device cannot run"):
        real = flops_per_step(GroupedQueryAttention(check=True), inputs)
    meta = flops_per_step(GroupedQueryAttention(check=False), inputs)
    assert real == meta == projection * 2 + attention * 3  # backward: the weights' gradient; attention's 2x
    with pytest.warns(UserWarning, match="meta device cannot run"):
        assert flops_per_step(GroupedQueryAttention(check=True), inputs, backward=False) == projection + attention


class CheckedGPT(torch.nn.Module):
    """tests/helpers.tiny_gpt that refuses non-finite logits: a number read from its outputs, so counted for real."""

    def __init__(self, check: bool = True):
        super().__init__()
        self.gpt, self.check = tiny_gpt(), check

    def forward(self, tokens):
        logits = self.gpt(tokens)
        if self.check and not torch.isfinite(logits).all():
            raise ValueError("non-finite logits")
        return logits


def test_flops_of_a_gpt_that_only_a_real_run_can_count_include_its_attention():
    tokens = helpers_tokens(2, 16).to("cpu")
    meta = flops_per_step(CheckedGPT(check=False), (tokens, tokens))
    with pytest.warns(UserWarning, match="meta device cannot run"):
        real = flops_per_step(CheckedGPT(check=True), (tokens, tokens))
    assert real == meta > 0

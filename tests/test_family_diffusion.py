"""A further family of model end to end: a diffusion denoiser (DDPM's training objective) through fit, evaluate,
gk.memory.estimate and saved_bytes, gk.bench.flops_per_step, activation checkpointing and resume.

What sets it apart from the families already covered: the batch is unlabelled ({"clean": (B, 8)}, target None),
and the model draws its own training inputs inside forward (a timestep per sample from torch.randint, Gaussian
noise from torch.randn_like) on top of dropout in its residual blocks. Every check below therefore also checks
that fit, evaluate, checkpointing's recomputation and a resumed run draw exactly what a hand-written loop draws,
in the same order. The loss is your function of the whole output tuple (predicted noise, drawn noise).

Everything runs on the CPU (named explicitly), seeded, on one thread: a step is well under a millisecond.
"""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten

import gpukit as gk
from gpukit.train.checkpoint import read_checkpoint
from tests.helpers import raising_at

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons, not seconds (conftest.py)

CPU = torch.device("cpu")
FEATURES, WIDTH, DEPTH, TIMESTEPS = 8, 32, 2, 50  # data dimension, hidden width, residual blocks, noise levels


class ResidualBlock(nn.Module):
    """h + dropout(W2 silu(W1 layernorm(h))): the block activation checkpointing finds and recomputes."""

    def __init__(self, width: int, dropout: float = 0.1):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, W) -> (B, W)
        return hidden + self.dropout(self.down(F.silu(self.up(self.norm(hidden)))))


class Denoiser(nn.Module):
    """DDPM's noise prediction: for clean samples x0 (B, F), draw t ~ U{0..T-1} and noise ~ N(0, I), make
    x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) noise, and predict the noise from (x_t, t). Returns (predicted, drawn)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        betas = torch.linspace(1e-4, 0.02, TIMESTEPS)  # DDPM's linear schedule, shortened to 50 steps
        self.register_buffer("signal_kept", torch.cumprod(1 - betas, 0))  # ᾱ_t, (T,)
        self.time = nn.Embedding(TIMESTEPS, WIDTH)
        self.input = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(ResidualBlock(WIDTH) for _ in range(DEPTH))
        self.output = nn.Linear(WIDTH, FEATURES)

    def forward(self, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.randint(0, TIMESTEPS, (clean.shape[0],), device=clean.device)  # (B,) int64
        noise = torch.randn_like(clean)  # (B, F)
        kept = self.signal_kept[steps, None]  # (B, 1)
        noisy = kept.sqrt() * clean + (1 - kept).sqrt() * noise
        hidden = self.input(noisy) + self.time(steps)
        for block in self.blocks:
            hidden = block(hidden)
        return self.output(hidden), noise


def noise_error(outputs, target):
    """The DDPM loss: mean squared error of the predicted noise. No target: the batch is unlabelled (None)."""
    assert target is None
    predicted, noise = outputs
    return F.mse_loss(predicted, noise)


def clean_batches(sizes: list[int], seed: int = 0) -> list[dict]:
    """Dict batches {"clean": (B, F)} of a 2-cluster mixture (a shape the denoiser can learn), one per size."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for size in sizes:
        centres = torch.where(torch.rand(size, 1, generator=generator) < 0.5, -2.0, 2.0)
        batches.append({"clean": centres + 0.3 * torch.randn(size, FEATURES, generator=generator)})
    return batches


TRAIN = clean_batches([6] * 8)
SGD = dict(optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.05, momentum=0.9), lr=None)
PLAIN = dict(schedule="constant", warmup=0, progress=False, device=CPU, seed=0, loss_fn=noise_error)


def by_hand(model: nn.Module, batches: list[dict], *, accumulate: int = 1, autocast_dtype=None) -> list[float]:
    """The loop fit runs, written out: seeded as fit's seed=0 seeds, each loss divided by `accumulate`, an
    optimizer step every `accumulate` micro-batches. Returns each micro-batch's loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    model.train()
    losses = []
    for number, batch in enumerate(batches, 1):
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = noise_error(model(**batch), None).float()
        (loss / accumulate if accumulate > 1 else loss).backward()
        losses.append(loss.item())
        if number % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return losses


def assert_bit_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), name


# ---------------------------------------------------------------------------------------------
# fit and evaluate


@pytest.mark.parametrize(
    ("precision", "accumulate", "autocast_dtype"),
    [("fp32", 1, None), ("fp32", 2, None), ("bf16-mixed", 1, torch.bfloat16)],
)
def test_fit_trains_the_denoiser_as_a_hand_written_loop(precision, accumulate, autocast_dtype):
    model, hand = Denoiser(), Denoiser()
    history = gk.fit(model, TRAIN, precision=precision, accumulate=accumulate, log_every=1, **SGD, **PLAIN)
    losses = by_hand(hand, TRAIN, accumulate=accumulate, autocast_dtype=autocast_dtype)
    assert_bit_equal(model, hand)  # the same timesteps, noise and dropout masks drawn in the same order
    assert not torch.equal(model.output.weight, Denoiser().output.weight)  # it trained
    if autocast_dtype is not None:  # and in bf16: the same loop in fp32 ends elsewhere
        in_fp32 = Denoiser()
        by_hand(in_fp32, TRAIN, accumulate=accumulate)
        assert not torch.equal(model.output.weight, in_fp32.output.weight)
    assert len(history.steps) == len(TRAIN) // accumulate
    # Each logged loss is the mean of its step's micro-batch losses; the epoch's the mean over all samples.
    steps = [sum(losses[i : i + accumulate]) / accumulate for i in range(0, len(losses), accumulate)]
    assert [row["loss"] for row in history.steps] == pytest.approx(steps, rel=1e-6)
    assert history.epochs[0]["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    assert "train_accuracy" not in history.epochs[0]  # noise is no class scores
    assert history.micro_batch_size == 6


def test_evaluate_is_the_mean_noise_error_over_samples_of_unequal_batches():
    model, batches = Denoiser(), clean_batches([2, 11, 5], seed=3)
    torch.manual_seed(7)
    result = gk.evaluate(model, batches, loss_fn=noise_error, device=CPU)
    assert model.training  # put back in training mode
    torch.manual_seed(7)  # evaluate draws the timesteps and noise from torch's generator, in batch order
    model.eval()
    with torch.no_grad():
        means = [noise_error(model(**batch), None).item() for batch in batches]
    sizes = [len(batch["clean"]) for batch in batches]
    by_samples, by_batches = sum(m * s for m, s in zip(means, sizes)) / sum(sizes), sum(means) / len(means)
    assert abs(by_samples - by_batches) > 1e-3  # the data tells the two weightings apart
    assert result["loss"] == pytest.approx(by_samples, rel=1e-6)
    assert result["samples"] == 18 and "accuracy" not in result


# ---------------------------------------------------------------------------------------------
# Memory: estimate, breakdown and saved_bytes against a count by hand


def saved_bytes_by_hand(batch_size: int) -> int:
    """The storages autograd keeps, per sample, in fp32 unless said. No gradient flows into x_t (neither x0 nor the
    buffer ᾱ nor the drawn noise needs one), so nothing of its arithmetic is saved:
    - the input Linear's input x_t (F) and the timesteps (8 bytes, int64) for the embedding's gradient;
    - per block: LayerNorm's input (W), mean and 1/std (1 + 1), the up Linear's input (W), SiLU's input (2W), the
      down Linear's input (2W), dropout's mask (W: on the CPU, dropout is input × a float mask, not the fused
      kernel's bool mask, 1 byte each, that CUDA keeps);
    - the output Linear's input (W); the MSE's two inputs, predicted and drawn noise (F + F)."""
    per_block = 4 * (WIDTH + 2 + WIDTH + 2 * WIDTH + 2 * WIDTH + WIDTH)
    return batch_size * (4 * FEATURES + 8 + DEPTH * per_block + 4 * WIDTH + 4 * 2 * FEATURES)


def test_estimate_breakdown_and_saved_bytes_agree_with_a_count_by_hand():
    (batch,) = clean_batches([12], seed=1)
    model = Denoiser()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    counted = gk.memory.saved_bytes(model, batch, noise_error, device=CPU)
    predicted = gk.memory.estimate(model, batch, loss_fn=noise_error, optimizer="adamw", device=CPU)
    measured = gk.memory.breakdown(model, batch, loss_fn=noise_error, optimizer="adamw", device=CPU)
    assert counted == saved_bytes_by_hand(12)
    assert predicted.activations == measured.activations == counted
    params = sum(p.numel() * 4 for p in model.parameters())
    assert predicted.params == measured.params == params
    assert predicted.grads == measured.grads == params
    assert predicted.optimizer_state == measured.optimizer_state == 2 * params + 4 * len(list(model.parameters()))
    assert predicted.buffers == measured.buffers == TIMESTEPS * 4  # ᾱ
    assert predicted.total == measured.total  # the peak of tensor storages alive, exactly
    large, small = gk.memory.estimate(model, batch, loss_fn=noise_error, device=CPU, batch_sizes=[48, 12])
    assert large.activations == saved_bytes_by_hand(48) and small.activations == counted
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


@pytest.mark.parametrize("function", ["estimate", "breakdown", "saved_bytes"])
def test_memory_functions_leave_torchs_generator_as_it_was(function):
    """The model's draws (torch.randint and torch.randn_like here; dropout in any model) run on torch's global
    generator: a run seeded before estimate() must draw after it what it would have drawn without it."""
    (batch,), model = clean_batches([12], seed=1), Denoiser()  # (building it draws its weights: before, not in)
    generator = torch.get_rng_state()
    getattr(gk.memory, function)(model, batch, loss_fn=noise_error, device=CPU)
    assert torch.equal(torch.get_rng_state(), generator)


# ---------------------------------------------------------------------------------------------
# FLOPs


def test_flops_per_step_are_the_matmuls_counted_by_hand():
    """2 FLOPs per multiply-add of each Linear: B×F×W (input), per block B×W×2W twice, B×W×F (output). Backward
    computes each weight's gradient (as many FLOPs as the forward) and each input's gradient, except the input
    Linear's: x_t needs none. The embedding, LayerNorm, SiLU and the draws are no matmuls."""
    (batch,) = clean_batches([10], seed=2)
    size, model = 10, Denoiser()
    first = 2 * size * FEATURES * WIDTH
    rest = 2 * size * (DEPTH * 2 * (WIDTH * 2 * WIDTH) + WIDTH * FEATURES)
    generator = torch.get_rng_state()
    forward = gk.bench.flops_per_step(model, batch, backward=False, loss_fn=noise_error)
    step = gk.bench.flops_per_step(model, batch, loss_fn=noise_error)
    assert torch.equal(torch.get_rng_state(), generator)  # the model's draws ran on the meta device: none taken here
    assert forward == first + rest
    assert step == forward + (first + rest) + rest  # weight gradients everywhere, input gradients after the first
    assert all(parameter.grad is None for parameter in model.parameters())


# ---------------------------------------------------------------------------------------------
# Activation checkpointing and resume


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_leaves_the_weights_bit_equal(policy):
    """Recomputing a block in backward must replay its dropout masks: the same weights as without it."""
    plain, checkpointed = Denoiser(), Denoiser()
    gk.fit(plain, TRAIN, **SGD, **PLAIN)
    history = gk.fit(checkpointed, TRAIN, activation_checkpointing=policy, **SGD, **PLAIN)
    assert_bit_equal(plain, checkpointed)
    assert not gk.memory.has_activation_checkpointing(checkpointed)  # undone when fit returned
    assert len(history.steps) >= 1
    # What the regions keep, counted by hand: outside the blocks, x_t (F), the timesteps (8 bytes), the output
    # Linear's input (W), the MSE's inputs (2F); each block's input (W); "selective" also each block's matmul
    # outputs (2W up, W down). The rest of each block is recomputed in backward, hidden from saved_bytes' hooks.
    applied = Denoiser()
    plan = gk.memory.apply_activation_checkpointing(applied, policy=policy)
    assert len(plan.regions) == DEPTH
    (batch,) = clean_batches([12], seed=1)
    per_sample = 4 * FEATURES + 8 + 4 * WIDTH + 4 * 2 * FEATURES + DEPTH * 4 * WIDTH
    if policy == "selective":
        per_sample += DEPTH * 4 * (2 * WIDTH + WIDTH)
    assert gk.memory.saved_bytes(applied, batch, noise_error, device=CPU) == 12 * per_sample < saved_bytes_by_hand(12)


def interrupt_at(call: int):
    """noise_error, raising KeyboardInterrupt (Ctrl-C) at its `call`-th call: the run stops mid-epoch."""
    return raising_at(call, noise_error, KeyboardInterrupt)


ADAMW = dict(optimizer="adamw", lr=3e-3, epochs=2, log_every=1, save_every=3, progress=False, device=CPU)


@pytest.mark.parametrize("call", [9, 12])
def test_a_run_interrupted_mid_epoch_resumes_bit_equal(call, tmp_path):
    """Stopped by Ctrl-C at loss call 9 (epoch 2's first; the last save is epoch 1's, made after its evaluation drew
    noise too) or 12 (step 4 of epoch 2; the last save at step 3), run again with other generators: the timesteps,
    noise and dropout masks after the save are drawn again as the straight run drew them."""
    options = dict(ADAMW, eval_data=clean_batches([5, 7], seed=4))
    straight = Denoiser()
    straight_history = gk.fit(straight, TRAIN, checkpoint_dir=tmp_path / "straight", loss_fn=noise_error, **options)
    with pytest.raises(KeyboardInterrupt):
        gk.fit(Denoiser(), TRAIN, checkpoint_dir=tmp_path / "resumed", loss_fn=interrupt_at(call), **options)
    torch.manual_seed(123)  # a new process starts with other generators
    resumed = Denoiser()
    resumed_history = gk.fit(resumed, TRAIN, checkpoint_dir=tmp_path / "resumed", loss_fn=noise_error, **options)
    assert_bit_equal(straight, resumed)
    a, b = read_checkpoint(tmp_path / "straight" / "last.pt"), read_checkpoint(tmp_path / "resumed" / "last.pt")
    for key in ("model", "optimizer", "scheduler", "ranks", "step", "epoch"):  # AdamW's moments, every generator
        (a_leaves, a_shape), (b_leaves, b_shape) = tree_flatten(a[key]), tree_flatten(b[key])
        assert a_shape == b_shape, key
        for x, y in zip(a_leaves, b_leaves, strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, key
    assert [row["loss"] for row in resumed_history.steps] == [row["loss"] for row in straight_history.steps]
    assert [row["eval_loss"] for row in resumed_history.epochs] == [row["eval_loss"] for row in straight_history.epochs]


def test_a_finished_run_extended_by_an_epoch_equals_one_run_of_two_epochs(tmp_path):
    """epochs=1 then epochs=2 in the same folder (a constant schedule: the extension's new schedule is the same)."""
    options = dict(checkpoint_dir=tmp_path / "extended", **SGD, **PLAIN)
    straight, extended = Denoiser(), Denoiser()
    gk.fit(straight, TRAIN, epochs=2, **SGD, **PLAIN)
    gk.fit(extended, TRAIN, epochs=1, **options)
    torch.manual_seed(123)
    extended = Denoiser()
    with pytest.warns(UserWarning, match=r"going on from the finished run .*optimizer step 8\) to step 16"):
        history = gk.fit(extended, TRAIN, epochs=2, **options)
    assert_bit_equal(straight, extended)
    assert [row["epoch"] for row in history.epochs] == [1, 2] and math.isfinite(history.epochs[-1]["train_loss"])

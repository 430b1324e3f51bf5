"""Every mistake reported before any work (issue 18 §3): gpukit/train/checks.py and the checks it drives.

Each bad input is a row of a table: what fit (or evaluate, or plan) is given, the error type and the words the
message must hold. Checks that depend on the model run on four kinds of model: an MLP on features, an LSTM on
(B, T, F) sequences, a tiny GPT on (B, T) tokens and a Hugging Face-style model on dict batches. "Before any
work" is checked against the weights: fit's optimizer (SGD with weight decay) changes every weight at its first
step, so weights equal to the ones before the call mean that no optimizer step was taken.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import pytest
import torch
from helpers import CausalLM, small_mlp, tiny_gpt, tokens
from torch import nn
from torch.nn import functional as F

import gpukit as gk
from gpukit.hardware import calibration, planning
from gpukit.optim import make_schedule
from gpukit.train.checks import NonFiniteInputError

DEVICE = "cpu"  # every check here is about arguments and data, not the device


class LSTMClassifier(nn.Module):
    """(B, T, 4) sequences of features → (B, 3) class scores, from the last time step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


@dataclass
class Kind:
    """A kind of model, its batches, and batches of another shape and another form than it takes."""

    build: callable
    batch: callable  # n → a batch of n examples
    wrong_shape: callable
    wrong_form: callable
    float_inputs: bool  # whether its inputs are floating point (dtype and NaN checks apply)


def _features(n, width=4, seed=0):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def _classes(n, seed=0):
    return torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(seed))


KINDS = {
    "mlp": Kind(
        lambda: nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)),
        lambda n, seed=0: (_features(n, seed=seed), _classes(n, seed)),
        lambda n: (_features(n, width=5), _classes(n)),
        lambda n: {"x": _features(n), "labels": _classes(n)},
        True,
    ),
    "lstm": Kind(
        LSTMClassifier,
        lambda n, seed=0: (torch.randn(n, 6, 4, generator=torch.Generator().manual_seed(seed)), _classes(n, seed)),
        lambda n: (torch.randn(n, 6, 5), _classes(n)),
        lambda n: (torch.randn(n, 6, 4), torch.randn(n, 6, 4), _classes(n)),  # two inputs for a one-input model
        True,
    ),
    "gpt": Kind(
        tiny_gpt,
        lambda n, seed=0: (tokens(n, 16, seed), tokens(n, 16, seed + 1)),
        lambda n: (tokens(n, 64), tokens(n, 64)),  # longer than the model's 32-token windows
        lambda n: {"input_ids": tokens(n, 16), "labels": tokens(n, 16)},
        False,
    ),
    "hf": Kind(
        CausalLM,
        lambda n, seed=0: {"input_ids": tokens(n, 16, seed), "labels": tokens(n, 16, seed)},
        lambda n: {"input_ids": tokens(n, 24), "labels": tokens(n, 16)},  # labels shorter than the inputs
        lambda n: {"ids": tokens(n, 16), "labels": tokens(n, 16)},  # a key the model does not take
        False,
    ),
}


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _untouched(model, before):
    return all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _fit(kind: Kind, model=None, *, batches=4, **options):
    model = model if model is not None else kind.build()
    data = [kind.batch(8, seed) for seed in range(batches)]
    return model, gk.fit(model, data, **({"progress": False, "device": DEVICE, "log_every": 1} | options))


def per_example(outputs, target):
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs  # a user's loss_fn gets outputs as returned
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")


# (case, fit's arguments for a kind, error, words). A function of the kind where the data depends on the model.
MODEL_CASES = [
    ("eval_data of another shape", lambda k: {"eval_data": [k.wrong_shape(8)]}, ValueError, "eval_data's first batch"),
    ("eval_data of another form", lambda k: {"eval_data": [k.wrong_form(8)]}, ValueError, "eval_data's first batch"),
    ("eval_data empty", lambda k: {"eval_data": []}, ValueError, "eval_data: it gives no batch"),
    (
        "eval_data read once, two epochs",
        lambda k: {"eval_data": iter([k.batch(8)]), "epochs": 2},
        ValueError,
        "eval_data is a list_iterator, which can be read only once",
    ),
    ("loss_fn returns None", lambda k: {"loss_fn": lambda o, t: None}, ValueError, "loss_fn '<lambda>' returned None"),
    (
        "loss_fn per example",
        lambda k: {"loss_fn": per_example},
        ValueError,
        r"loss_fn 'per_example' returned a tensor of shape \(\d+,\); the loss must be a scalar",
    ),
    (
        "metric returns None",
        lambda k: {"metrics": {"hits": lambda o, t: None}},
        ValueError,
        "metric 'hits' returned None",
    ),
    (
        "metric per example",
        lambda k: {"metrics": {"hits": lambda o, t: torch.ones(t.shape[0])}},
        ValueError,
        r"metric 'hits' returned a tensor of shape \(8,\); a metric returns one number per batch",
    ),
    (
        "metric returns None, seen on eval_data first",
        lambda k: {"metrics": {"hits": lambda o, t: None}, "eval_data": [k.batch(8)]},
        ValueError,
        "failed on eval_data's first batch.*metric 'hits' returned None",
    ),
]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("case, options, error, words", MODEL_CASES, ids=[case[0] for case in MODEL_CASES])
def test_model_dependent_mistakes_fail_before_the_first_step(kind, case, options, error, words):
    kind = KINDS[kind]
    model = kind.build()
    before = _weights(model)
    with pytest.raises(error, match=words):
        _fit(kind, model, **options(kind))
    assert _untouched(model, before), "an optimizer step ran before the mistake was reported"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_all_parameters_frozen(kind):
    model = KINDS[kind].build().requires_grad_(False)
    with pytest.raises(ValueError, match=r"all \d+ parameters of the model are frozen \(requires_grad=False\)"):
        _fit(KINDS[kind], model)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_good_eval_data_trains_and_is_evaluated(kind):
    """The check does not refuse what evaluation takes: the same kinds train and report eval_loss."""
    _, history = _fit(KINDS[kind], eval_data=[KINDS[kind].batch(8, seed=9)])
    assert math.isfinite(history.final_eval_loss)


def test_eval_check_leaves_the_random_state_alone():
    """Training with dropout draws from torch's generator: a shuffled eval loader read by the check must not move it,
    so the weights after an epoch are those of the same fit without eval_data."""
    data = [KINDS["mlp"].batch(8, seed) for seed in range(4)]
    shuffled = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*KINDS["mlp"].batch(32)), 8, shuffle=True)
    weights = []
    for eval_data in (None, shuffled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3))
        gk.fit(model, data, progress=False, device=DEVICE, eval_data=eval_data)
        weights.append(_weights(model))
    assert all(torch.equal(a, b) for a, b in zip(*weights))


# Arguments whose check does not depend on the model: one model, a table of (arguments, error, words).
ARGUMENT_CASES = [
    (dict(clip="1.0"), ValueError, r"clip must be a positive number .* got '1.0' \(a str\)"),
    (dict(clip=math.nan), ValueError, "clip must be a positive number"),
    (dict(seed="zero"), ValueError, r"seed must be an integer in 0\.\.4294967295 .*got 'zero' \(a str\)"),
    (dict(seed=1.5), ValueError, r"seed must be an integer in 0\.\.4294967295 .*got 1.5"),
    (dict(warmup=-0.1), ValueError, r"warmup must be a number >= 0 .*got -0.1"),
    (dict(warmup=math.nan), ValueError, r"warmup must be a number >= 0 .*got nan"),
    (dict(warmup="0.2"), ValueError, r"warmup must be a number >= 0 .*got '0.2' \(a str\)"),
    (dict(warmup_steps=-1), ValueError, r"warmup_steps must be an integer >= 0, got -1"),
    (dict(checkpoint_dir=3), ValueError, r"checkpoint_dir must be a folder path \(a str or Path\), got 3 \(a int\)"),
]


@pytest.mark.parametrize("options, error, words", ARGUMENT_CASES, ids=[str(case[0]) for case in ARGUMENT_CASES])
def test_bad_arguments_fail_before_any_work(options, error, words):
    model = KINDS["mlp"].build()
    before = _weights(model)
    with pytest.raises(error, match=words):
        _fit(KINDS["mlp"], model, **options)
    assert _untouched(model, before)


def _unwritable_folders(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    return {
        "a file": (a_file, "is a file, not a folder"),
        "inside a file": (a_file / "checkpoints", "cannot be written: Not a directory"),
        # sysfs refuses new entries to every user, root included (chmod does not stop root)
        "read-only": ("/sys/gpukit-test-checkpoints", "cannot be written"),
    }


@pytest.mark.parametrize("case", ["a file", "inside a file", "read-only"])
def test_unusable_checkpoint_dir_fails_before_any_work(tmp_path, case):
    folder, words = _unwritable_folders(tmp_path)[case]
    model = KINDS["mlp"].build()
    before = _weights(model)
    with pytest.raises(ValueError, match=rf"checkpoint_dir '{re.escape(str(folder))}' {words}"):
        _fit(KINDS["mlp"], model, checkpoint_dir=folder)
    assert _untouched(model, before)


def test_checkpoint_dir_is_created_and_used(tmp_path):
    folder = tmp_path / "new" / "run"
    _fit(KINDS["gpt"], checkpoint_dir=folder)
    # last.pt, and the file fit locks while it trains there (kept: see gpukit.files.lock_folder); no temporary file.
    assert (folder / "last.pt").is_file() and sorted(p.name for p in folder.iterdir()) == [".gpukit.lock", "last.pt"]


# Data of another dtype than the model's weights: both named, before the first step; a model that casts
# its inputs itself is not refused.
class CastsItsInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x.float())


@pytest.mark.parametrize("kind", ["mlp", "lstm"])
@pytest.mark.parametrize(
    "model_dtype, data_dtype, words",
    [
        (torch.float32, torch.float64, r"inputs are float64 but the model's weights are float32"),
        (torch.float16, torch.float32, r"inputs are float32 but the model's weights are float16.*bf16-mixed"),
    ],
)
def test_model_and_data_dtypes_that_differ_are_named(kind, model_dtype, data_dtype, words):
    model = KINDS[kind].build().to(model_dtype)
    data = [(inputs.to(data_dtype), target) for inputs, target in (KINDS[kind].batch(8, seed) for seed in range(2))]
    before = _weights(model)
    with pytest.raises(ValueError, match="the training data does not match the model. Its floating-point " + words):
        gk.fit(model, data, progress=False, device=DEVICE)
    assert _untouched(model, before)


def test_a_model_that_casts_its_inputs_trains_on_float64_data():
    model = CastsItsInputs()
    data = [(inputs.double(), target) for inputs, target in (KINDS["mlp"].batch(8, seed) for seed in range(2))]
    history = gk.fit(model, data, progress=False, device=DEVICE)
    assert len(history.steps) == 1 and math.isfinite(history.steps[-1]["loss"])


# NaN or inf in the data: named as a problem in the data with the step, not as "try a lower lr".
@pytest.mark.parametrize("kind", ["mlp", "lstm"])
def test_nan_in_the_inputs_is_a_data_problem(kind):
    data = [KINDS[kind].batch(8, seed) for seed in range(4)]
    data[2][0].view(-1)[5] = math.nan  # the third batch: read by optimizer step 3
    words = r"by optimizer step 3 \(epoch 1\).*input 0 holds 1 NaN and 0 infinite values.*not in the learning rate"
    with pytest.raises(NonFiniteInputError, match=words):
        gk.fit(KINDS[kind].build(), data, progress=False, device=DEVICE, log_every=1)


def test_inf_in_a_regression_target_is_a_data_problem():
    features, target = _features(16), torch.randn(16, 1)
    target[9, 0] = math.inf
    data = [(features[:8], target[:8]), (features[8:], target[8:])]
    with pytest.raises(NonFiniteInputError, match=r"step 2 .*the target holds 0 NaN and 1 infinite values") as error:
        gk.fit(nn.Linear(4, 1), data, loss_fn="mse", progress=False, device=DEVICE, log_every=1)
    assert isinstance(error.value, ValueError) and isinstance(error.value, gk.NonFiniteLossError)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_divergence_on_finite_data_still_blames_the_lr(kind):
    with pytest.raises(gk.NonFiniteLossError, match="lower lr.*last batch read holds no NaN or inf") as error:
        _fit(KINDS[kind], lr=1e12, batches=8)
    assert not isinstance(error.value, NonFiniteInputError)


# Warm-up that rounds to one step: OneCycleLR divided 0 by 0 (max_steps=5 with warmup=0.2, ...).
@pytest.mark.parametrize(
    "steps, warmup", [(5, 0.2), (10, 0.1), (2, 0.5), (1, 1), (3, 1), (4, 0.0), (999_999, 0.0), (7, 1 / 7)]
)
def test_onecycle_with_a_warmup_of_one_step(steps, warmup):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = make_schedule(optimizer, "onecycle", steps, warmup)
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(min(steps, 6)):
        optimizer.step()
        schedule.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert all(0 <= rate <= 1.0 for rate in rates), rates
    if warmup * steps <= 1:  # a warm-up of at most one step: the first step is at the peak, then only decays
        assert rates[0] == pytest.approx(1.0, rel=1e-9) and rates == sorted(rates, reverse=True), rates
    if warmup * steps < 1:  # below one step, exactly: the peak / 25 / 10**4 at the end, as OneCycleLR ends
        assert rates[0] == 1.0, rates
        assert schedule.lr_lambdas[0](steps) == pytest.approx(1 / 250_000), steps


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("options", [dict(max_steps=5), dict(max_steps=10, warmup=0.1), dict(warmup_steps=1)])
def test_fit_with_a_warmup_of_one_step(kind, options):
    _, history = _fit(KINDS[kind], batches=20 if "max_steps" in options else 5, **options)
    assert len(history.steps) == options.get("max_steps", 5)
    assert all(math.isfinite(row["lr"]) and row["lr"] > 0 for row in history.steps)


# evaluate on a model without parameters: a baseline, not a bare StopIteration.
class OneHot(nn.Module):
    """Scores each token as itself: (B, T) tokens → (B, T, 256) one-hot logits."""

    def forward(self, ids):
        return F.one_hot(ids, 256).float()


def test_evaluate_a_model_without_parameters():
    ids = tokens(4, 16)
    result = gk.evaluate(OneHot(), [(ids, ids)])
    expected_loss = -math.log(math.e / (math.e + 255))  # the target's score 1, the 255 others 0
    assert result["accuracy"] == 1.0 and result["loss"] == pytest.approx(expected_loss, rel=1e-6)
    features = _features(8)
    result = gk.evaluate(nn.Flatten(), [(features, _classes(8))], device=DEVICE)
    assert result["loss"] == pytest.approx(F.cross_entropy(features, _classes(8)).item())
    with pytest.raises(TypeError, match="expected a torch.nn.Module to evaluate, got function"):
        gk.evaluate(lambda x: x, [(features, _classes(8))])


# plan(mfu="measured") predicts the memory of the steps it would measure, and never runs what does not fit here.
def _never_measure(*args, **kwargs):
    raise AssertionError("plan measured a model that does not fit in the memory free here")


@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_plan_does_not_measure_what_does_not_fit(monkeypatch, capsys, kind):
    monkeypatch.setattr(calibration, "_free_bytes", lambda device: 2**20)  # 1 MiB free: nothing fits
    monkeypatch.setattr(calibration, "_measure_here", _never_measure)
    model, batch = (
        (gk.models.fast_cnn(4), (torch.randn(4, 3, 32, 32), _classes(4)))
        if kind == "cnn"
        else (tiny_gpt(), (tokens(4, 32), tokens(4, 32)))
    )
    result = gk.hardware.plan(model, batch, gpus=["H100 SXM"], device=DEVICE)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan: measuring the MFU here would need about")
    assert "1 MiB is free" in lines[0] or "1.0 MiB is free" in lines[0], lines[0]
    assert result.mfu == planning.TYPICAL_MFU and result.check == {} and "TYPICAL_MFU" in result.mfu_source


def test_plan_of_a_billion_parameters_assumes_rather_than_runs(monkeypatch, capsys):
    """The model of the report, 1.07 B parameters, built on the meta device (nothing allocated): with 8 GiB
    free here its AdamW steps (16 bytes per parameter before activations) cannot fit, so nothing runs."""
    monkeypatch.setattr(calibration, "_free_bytes", lambda device: 8 * 2**30)
    monkeypatch.setattr(calibration, "_measure_here", _never_measure)
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Embedding(32_768, 4096),
            nn.Linear(4096, 8192),
            *[nn.Linear(8192, 8192) for _ in range(13)],
            nn.Linear(8192, 4096),
        )
    assert 1.0e9 < sum(p.numel() for p in model.parameters()) < 1.1e9
    ids = torch.zeros(1, 8, dtype=torch.long)
    result = gk.hardware.plan(model, (ids, torch.zeros(1, 8, 4096)), gpus=["H200"], device=DEVICE, loss_fn="mse")
    assert "would need about" in capsys.readouterr().out and result.mfu == planning.TYPICAL_MFU


def test_free_memory_is_read_here():
    free = calibration._free_bytes(torch.device("cpu"))
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert free is None or 0 < free <= total


@pytest.mark.gpu
def test_checks_on_cuda():
    """The CUDA paths: the eval check keeps the CUDA generator as it was, and free GPU memory is read."""
    with torch.device("cuda"):
        torch.cuda.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    state = torch.cuda.get_rng_state()
    with pytest.raises(ValueError, match="eval_data's first batch"):
        _fit(KINDS["mlp"], model, device="cuda", eval_data=[KINDS["mlp"].wrong_shape(8)])
    assert torch.equal(torch.cuda.get_rng_state(), state)
    _, history = _fit(KINDS["lstm"], device="cuda", eval_data=[KINDS["lstm"].batch(8, seed=9)])
    assert math.isfinite(history.final_eval_loss)
    free = calibration._free_bytes(torch.device("cuda"))
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory


# ---------------------------------------------------------------------------------------------
# An optimizer built for another model's parameters (issue "Never lose or corrupt a run", 6)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_an_optimizer_of_another_models_parameters_is_refused(kind):
    """It was accepted and nothing trained (loss 1.3828 → 1.3828), without a word."""
    generator = torch.Generator().manual_seed(0)
    if kind == "mlp":
        make_model, loss_fn = small_mlp, None
        data = [(torch.randn(8, 6, generator=generator), torch.randint(0, 4, (8,), generator=generator))] * 2
    else:
        make_model, loss_fn = tiny_gpt, gk.step.cross_entropy
        text = torch.randint(0, 256, (4, 17), generator=generator)
        data = [(text[:, :-1], text[:, 1:])] * 2
    model, other = make_model(), make_model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.Adam(other.parameters(), lr=1e-2)
    options = dict(loss_fn=loss_fn, progress=False, device=DEVICE, log_every=1)
    with pytest.raises(ValueError, match=r"the optimizer updates \d+ of its \d+ parameters .* not this model's"):
        gk.fit(model, data, optimizer=optimizer, **options)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert not optimizer.state  # nothing trained with it either
    history = gk.fit(model, data, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), **options)
    assert history.steps[-1]["loss"] < history.steps[0]["loss"]  # one built from the model trains it

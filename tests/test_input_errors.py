"""Bad training data named with its batch and what to do, instead of an error from deep inside torch or a NaN loss
blamed on the learning rate: targets out of range on a later batch, integer targets of other dtypes, every target
ignored, empty batches, a batch of one under BatchNorm, token ids beyond the vocabulary.

Each case on the CPU, seeded, with the MLP of tests/helpers.py and with a second kind of model (the tiny GPT on
(B, T) tokens, or the Hugging Face-style CausalLM on dict batches)."""

import math
import os
import signal
from functools import partial

import numpy as np
import pytest
import torch
from helpers import CausalLM, images, small_mlp, tiny_gpt, tokens
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit.step import Loss
from gpukit.train import NonFiniteLossError
from gpukit.train.batch_checks import check_host_targets
from gpukit.train.checkpoint import read_checkpoint
from gpukit.train.checks import check_arguments
from gpukit.train.data import batches

CPU = torch.device("cpu")


def features(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, 6, generator=torch.Generator().manual_seed(seed))


def classes(count: int, seed: int = 0, high: int = 4) -> torch.Tensor:
    return torch.randint(0, high, (count,), generator=torch.Generator().manual_seed(seed))


def train(model, data, **options):
    return gk.fit(model, data, device=CPU, progress=False, **({"log_every": 1} | options))


# The two kinds of model, each with a good batch and a batch whose class targets are out of the model's range.
KINDS = {
    "mlp": (small_mlp, lambda: (features(8), classes(8)), lambda: (features(8, 1), classes(8, 1) + 4), 4),
    "gpt": (tiny_gpt, lambda: (tokens(2, 16), tokens(2, 16)), lambda: (tokens(2, 16, 1), tokens(2, 16, 1) + 256), 256),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_target_out_of_range_in_a_later_batch_names_the_batch_and_the_outputs(kind):
    build, good, bad, outputs = KINDS[kind]
    model = build()
    with pytest.raises(ValueError, match=rf"batch 3 of epoch 1 .*out of range for the model's {outputs} outputs"):
        train(model, [good(), good(), bad()])
    with pytest.raises(ValueError, match=r"fix the labels, or give the model \d+ outputs"):
        train(build(), [good(), bad()])


def test_negative_targets_are_named_too():
    with pytest.raises(ValueError, match=r"batch 2 of epoch 1 .*found -4\.\.-1.*fix the negative labels"):
        train(small_mlp(), [(features(8), classes(8)), (features(8, 1), classes(8, 1) - 4)])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("kind", KINDS)
def test_integer_targets_of_other_dtypes_train_as_int64_ones(kind, dtype):
    build, good, _, _ = KINDS[kind]
    batches = [good(), good()]
    expected = train(build(), batches, eval_data=batches)
    converted = [(inputs, target.to(dtype)) for inputs, target in batches]
    history = train(build(), converted, eval_data=converted)
    assert history.losses == expected.losses and history.final_train_accuracy == expected.final_train_accuracy
    assert history.final_eval_loss == expected.final_eval_loss


def test_bool_targets_are_refused_naming_the_dtype_and_the_fix():
    model = small_mlp()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    with pytest.raises(ValueError, match=r"got torch\.bool.*target\.long\(\).*binary_cross_entropy_with_logits"):
        train(model, [(features(8), classes(8) > 1)])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before any step


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_batch_whose_targets_are_all_ignored_is_refused_before_any_step(kind):
    build, good, _, _ = KINDS[kind]
    model = build()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    inputs, target = good()
    with pytest.raises(ValueError, match=r"batch 1 of epoch 1 .*targets equals -100 \(ignored\).*NaN.*leave out"):
        train(model, [(inputs, torch.full_like(target, -100)), good()])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_a_later_batch_whose_targets_are_all_ignored_is_not_blamed_on_the_lr(kind):
    build, good, _, _ = KINDS[kind]
    inputs, target = good()
    with pytest.raises(
        NonFiniteLossError, match=r"step 2 .*targets ignored \(equal to -100\).*not in the learning rate"
    ):
        train(build(), [good(), (inputs, torch.full_like(target, -100))])


def test_all_ignored_labels_with_the_models_own_loss_are_named():
    """A dict batch whose labels the model scores itself (model(**batch).loss): no kit loss looks at them first."""
    ids = tokens(2, 16)
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": ids, "labels": torch.full_like(ids, -100)}]
    with pytest.raises(NonFiniteLossError, match=r"targets ignored \(equal to -100\).*not in the learning rate"):
        train(CausalLM(), batches)


@pytest.mark.parametrize("where", [0, 1])
def test_an_empty_batch_is_named_before_its_step(where):
    batches = [(features(8), classes(8)), (features(8, 1), classes(8, 1))]
    batches.insert(where, (features(0), classes(0)))
    model = small_mlp()
    with pytest.raises(ValueError, match=rf"batch {where + 1} of epoch 1 .*holds 0 samples.*Leave empty batches out"):
        train(model, batches)


def test_evaluate_leaves_an_empty_batch_out():
    model, batches = small_mlp(), [(features(8), classes(8)), (features(8, 1), classes(8, 1))]
    with_empty = gk.evaluate(model, [batches[0], (features(0), classes(0)), batches[1]], device=CPU)
    assert with_empty == gk.evaluate(model, batches, device=CPU)


@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_leaves_a_batch_whose_targets_are_all_ignored_out(kind):
    """A batch of padding only (every target -100) scores nothing: its mean loss would be 0/0 = NaN. It adds no loss,
    token or sample, wherever it comes (first or later); a set of only such batches is an error that says so."""
    build, good, _, _ = KINDS[kind]
    model, batches = build(), [good(), good()]
    inputs, target = good()
    ignored = (inputs, torch.full_like(target, -100))
    expected = gk.evaluate(model, batches, device=CPU)
    for where in (0, 1, 2):
        measured = gk.evaluate(model, [*batches[:where], ignored, *batches[where:]], device=CPU)
        assert measured == expected, where  # the loss a finite number, tokens and samples as without it
    assert all(value == value for value in expected.values())  # (no NaN to compare equal by accident)
    with pytest.raises(ValueError, match=r"every one of its 2 batches has all its targets equal to -100"):
        gk.evaluate(model, [ignored, ignored], device=CPU)


def test_a_target_out_of_range_in_evaluation_names_the_batch():
    batches = [(features(8), classes(8)), (features(8, 1), classes(8, 1) + 4)]
    with pytest.raises(ValueError, match=r"batch 2 of the evaluation data.*out of range for the model's 4 outputs"):
        gk.evaluate(small_mlp(), batches, device=CPU)


def batch_norm_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def test_batch_norm_on_a_last_batch_of_one_names_the_batch_and_drop_last():
    loader = DataLoader(TensorDataset(features(9), classes(9)), batch_size=8)  # 8 + 1
    with pytest.raises(ValueError, match=r"batch 2 of epoch 1 .*single sample.*BatchNorm layer '1'.*drop_last=True"):
        train(batch_norm_mlp(), loader)
    history = train(batch_norm_mlp(), DataLoader(loader.dataset, batch_size=8, drop_last=True))
    assert len(history.steps) == 1  # what the message says to do trains


def test_token_ids_beyond_the_vocabulary_name_the_embedding():
    batches = [(tokens(2, 16), tokens(2, 16)), (tokens(2, 16, 1) + 256, tokens(2, 16, 1))]
    with pytest.raises(
        ValueError, match=r"batch 2 of epoch 1 .*token ids\) lie in \d+\.\.511.*256 rows.*vocab_size=512"
    ):
        train(tiny_gpt(), batches)


def test_another_failure_on_a_later_batch_carries_its_number():
    """No cause in the data to name: the original error, with the batch it happened on as a note."""
    batches = [(features(8), classes(8)), (features(8, 1)[:, :5], classes(8, 1))]  # 5 features, not 6
    with pytest.raises(RuntimeError) as caught:
        train(small_mlp(), batches)
    assert any("batch 2 of epoch 1: input (8, 5) float32" in note for note in caught.value.__notes__)


@pytest.mark.parametrize("bad_target", ["out of range", "all ignored"])
def test_a_refused_first_batch_leaves_batch_norm_statistics_as_they_were(bad_target):
    """The first batch's forward moved BatchNorm's running statistics before its loss refused the batch: a refused
    call changes nothing of the model (issue "Any model, any batch, third wave", 8)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    target = classes(8) + 4 if bad_target == "out of range" else torch.full((8,), -100)
    with pytest.raises(ValueError):
        train(model, [(features(8), target), (features(8, 1), classes(8, 1))])
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items()), bad_target


def checked_loss(classes: int) -> gk.step.Loss:
    """The training loss after its first batch: it has read the number of classes (and checked that batch)."""
    loss = gk.step.Loss()
    loss(torch.zeros(2, classes), torch.tensor([0, classes - 1]))
    return loss


@pytest.mark.parametrize(
    ("target", "wrong"),
    [(torch.tensor([0, 4, 1]), 4), (torch.tensor([-1, 2, 3]), -1), (torch.tensor([-100, -3, 2]), -3)],
)
def test_on_a_gpu_each_batchs_targets_are_checked_on_the_host_before_the_copy(target, wrong):
    """On a GPU a target out of range in a later batch would end in a device-side assert: each CPU batch is read on
    the host (min and max) and refused naming the batch, the value and the classes. -100 (ignored) passes."""
    check = partial(check_host_targets, loss=checked_loss(4), device=torch.device("cuda", 0), epoch=1)
    good = (features(3), torch.tensor([0, 3, -100]))
    assert check(good, 1) is good
    with pytest.raises(ValueError, match=rf"batch 7 of epoch 2 holds the class target {wrong}, .* 4 outputs \(0\.\.3"):
        check((features(3), target), 7)
    assert Loss().classes is None  # before a first batch: nothing is known, nothing is checked
    assert check_host_targets((features(3), target), 1, loss=Loss(), device=torch.device("cuda"), epoch=0)


def test_the_refused_batch_is_never_copied_to_the_gpu(fake_cuda):
    """Through fit's batches on a (fake) GPU: the prefetcher copies batch k+1 while step k runs; batch 3's targets are
    refused before its copy, after batches 1 and 2 were copied."""
    data = DataLoader(TensorDataset(features(12), torch.tensor([0, 1, 2, 3] * 2 + [0, 9, 1, 2])), batch_size=4)
    check = partial(check_host_targets, loss=checked_loss(4), device=torch.device("cuda", 0), epoch=0)
    read = []
    with pytest.raises(ValueError, match=r"batch 3 of epoch 1 holds the class target 9"):
        for batch in batches(data, torch.device("cuda", 0), check=check):
            read.append(batch.target.is_cuda)
    assert read == [True, True] and len(fake_cuda.copies) == 4  # two batches of (inputs, target)


# ---------------------------------------------------------------------------------------------
# Arguments and commands (issue "Never silently wrong, third round"): refused before any work, naming the argument,
# what it must be and what to do; NaN data and a crashed loader worker named as what they are.

SEED_TAKERS = {  # every function of the kit that takes a seed, run as little as each allows
    "seed_everything": lambda seed: gk.seed_everything(seed),
    "fit's argument checks": lambda seed: check_arguments(small_mlp(), seed=seed, checkpoint_dir=None),
    "DeviceLoader": lambda seed: gk.data.DeviceLoader(gk.data.shapes(16, 4)[0], 8, seed=seed),
    "TextLoader": lambda seed: gk.data.TextLoader(
        gk.data.TokenDataset(tokens(1, 64)[0].to(torch.uint8), seq_len=8), 2, seed=seed
    ),
    "dataloader": lambda seed: gk.data.dataloader(TensorDataset(features(16), classes(16)), 8, seed=seed),
    "lr_find": lambda seed: gk.lr_find(small_mlp(), [(features(8), classes(8))], steps=20, device=CPU, seed=seed),
}
SEEDS = {  # seed: whether it is one (NumPy's integers are; 2**32 and beyond overflow NumPy, 2**64 torch)
    "0": (0, True),
    "2**32-1": (2**32 - 1, True),
    "np.int64": (np.int64(3), True),
    "np.uint32": (np.uint32(7), True),
    "2**32": (2**32, False),
    "2**64": (2**64, False),
    "-1": (-1, False),
    "True": (True, False),
    "3.0": (3.0, False),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("taker", SEED_TAKERS)
def test_every_seed_is_checked_by_one_rule(taker, seed):
    """A NumPy int64 seed was refused by fit's check of the data order's seed and accepted by its argument check;
    seed=2**64 passed both and overflowed in torch.manual_seed after the model had moved."""
    value, accepted = SEEDS[seed]
    if accepted:
        SEED_TAKERS[taker](value)
        return
    with pytest.raises(ValueError, match=r"seed must be an integer in 0\.\.4294967295 \(2\*\*32 - 1") as refused:
        SEED_TAKERS[taker](value)
    assert f"got {value!r}" in str(refused.value)


@pytest.mark.parametrize("seed", [2**64, 2**32])  # (-1: refused by the data order's own check)
def test_fit_refuses_a_seed_out_of_range_before_any_work(seed):
    model, generator = small_mlp(), torch.get_rng_state()
    before = [parameter.clone() for parameter in model.parameters()]
    with pytest.raises(ValueError, match=rf"seed must be an integer in 0\.\.4294967295 .*got {seed}\."):
        train(model, [(features(8), classes(8))], seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(generator, torch.get_rng_state())  # no draw, no seeding: nothing ran


def test_fit_takes_a_numpy_seed_and_resumes_from_its_save(tmp_path):
    data = [(features(8, i), classes(8, i)) for i in range(4)]
    train(small_mlp(), data, epochs=1, seed=np.int64(3), checkpoint_dir=tmp_path)
    history = train(small_mlp(), data, epochs=2, seed=np.int64(3), checkpoint_dir=tmp_path)  # resumes at step 4
    assert [row["step"] for row in history.steps] == [1, 2, 3, 4, 5, 6, 7, 8]


LOG_DIRS = {
    "an int": (3, "log_dir must be a folder path (a str or Path) for TensorBoard's files, got 3 (a int)"),
    "empty": ("", "log_dir='' names no folder (TensorBoard would fill the current folder"),
    "blank": ("  ", "log_dir='  ' names no folder"),
}


@pytest.mark.parametrize("log_dir, said", LOG_DIRS.values(), ids=LOG_DIRS)
def test_a_log_dir_that_names_no_folder_is_refused_before_training(log_dir, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # log_dir="" wrote TensorBoard's files here, with no word
    model = small_mlp()
    before = [parameter.clone() for parameter in model.parameters()]
    with pytest.raises((TypeError, ValueError)) as refused:  # TypeError for 3, ValueError for ""
        train(model, [(features(8), classes(8))], log_dir=log_dir)
    assert said in str(refused.value) and "log_dir='runs/my_run'" in str(refused.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not list(tmp_path.iterdir())


class Moves(nn.Module):
    """small_mlp's layers; each move or cast of the model (.to(), .cuda(), .float(): nn.Module._apply) counted."""

    def __init__(self):
        super().__init__()
        self.layers, self.moves = small_mlp(), 0

    def forward(self, inputs):
        return self.layers(inputs)

    def _apply(self, fn, recurse=True):
        self.moves += 1
        return super()._apply(fn, recurse)


@pytest.mark.parametrize("case", [*LOG_DIRS, "a file"])
def test_a_log_dir_is_refused_before_the_model_is_moved_or_anything_built(case, tmp_path, monkeypatch):
    """log_dir's type is checked where gk.Reporting is made (fit's flat keyword makes one first), and whether the folder
    can be written before the model moves: a file given as log_dir was refused only once the model had moved to the
    device and the optimizer was built."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    log_dir, said = (
        LOG_DIRS[case] if case in LOG_DIRS else ("notes.txt", f"log_dir={str(tmp_path / 'notes.txt')!r} is a file")
    )
    model, built = Moves(), []

    def optimizer(parameters):
        built.append(True)
        return torch.optim.SGD(parameters, lr=0.1)

    with pytest.raises((TypeError, ValueError)) as refused:
        train(model, [(features(8), classes(8))], log_dir=log_dir, optimizer=optimizer)
    assert said in str(refused.value)
    assert model.moves == 0 and not built  # nothing moved, nothing built
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"] and (
        tmp_path / "notes.txt"
    ).read_text() == "mine"


def with_nan(inputs: torch.Tensor, every: int = 3) -> torch.Tensor:
    inputs = inputs.clone()
    inputs[::every] = float("nan")
    return inputs


LR_FIND_KINDS = {  # a model, and batches whose inputs hold NaN in every third example
    "mlp": (small_mlp, lambda: [(with_nan(features(8, i)), classes(8, i)) for i in range(4)]),
    "cnn": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4)),
        lambda: [(with_nan(images(8, 8, i)), classes(8, i)) for i in range(4)],
    ),
}


@pytest.mark.parametrize("kind", LR_FIND_KINDS)
def test_lr_find_on_nan_data_names_the_data_not_a_divergence(kind):
    """It said "the loss diverged after 1 steps ... start lower (start_lr=...)": advice about the lr for bad data."""
    build, data = LR_FIND_KINDS[kind]
    model = build()
    model(data()[0][0][:1].nan_to_num())  # (a lazy layer takes its shape)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(gk.train.NonFiniteInputError) as refused:
        gk.lr_find(model, data(), device=CPU)
    message = str(refused.value)
    assert message.startswith("lr_find's loss became non-finite at step 1 (lr 1e-05), and a batch that step read")
    assert (
        "input 0 holds" in message and "NaN" in message and "a problem in the data, not in the learning rate" in message
    )
    assert "diverged" not in message and "start_lr" not in message
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())  # put back


@pytest.mark.parametrize("kind", LR_FIND_KINDS)
def test_nan_in_a_later_batch_of_eval_data_is_named_after_the_epoch(kind):
    """Training was finite; eval_loss was nan and eval_accuracy counted from NaN outputs, with no word."""
    build, data = LR_FIND_KINDS[kind]
    batches = [(inputs.nan_to_num(), target) for inputs, target in data()]
    eval_data = batches[:1] + data()[1:2]  # its second batch holds NaN
    with pytest.raises(gk.train.NonFiniteInputError) as refused:
        train(build(), batches, eval_data=eval_data)
    message, note = str(refused.value), " ".join(refused.value.__notes__)
    assert message.startswith("the evaluation loss is nan, and its accuracy would count NaN outputs: batch 2 of the ")
    assert "evaluation data" in message and "input 0 holds" in message and "NaN" in message, message
    assert "fit stopped in epoch 1 after optimizer step 4 of 4" in note, note  # after the epoch's training
    with pytest.raises(gk.train.NonFiniteInputError, match="batch 2 of the evaluation data"):
        gk.evaluate(build(), eval_data, device=CPU)  # (a lazy layer takes its shape from the first batch)


@pytest.mark.parametrize("kind", LR_FIND_KINDS)
def test_nan_in_the_first_batch_of_eval_data_is_refused_before_any_step(kind):
    build, data = LR_FIND_KINDS[kind]
    model, batches = build(), [(inputs.nan_to_num(), target) for inputs, target in data()]
    model(batches[0][0][:1])  # (a lazy layer takes its shape)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(gk.train.NonFiniteInputError, match=r"eval_data's first batch \(input .*\) is not finite"):
        train(model, batches, eval_data=data()[:1])
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_a_non_finite_evaluation_of_finite_data_warns_that_the_outputs_are_not_finite():
    model, batches = small_mlp(), [(features(8, i), classes(8, i)) for i in range(2)]
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")  # weights that diverged
    with pytest.warns(UserWarning, match="no batch of the evaluation data holds NaN or inf: the model's outputs"):
        result = gk.evaluate(model, batches, device=CPU)
    assert math.isnan(result["loss"])


# NaN that reaches the weights before the step whose loss is logged: the batch in hand at the log is finite, and the
# loss was blamed on the lr. An earlier batch of the epoch is named now (the epoch read again, only after the failure).
NAN_KINDS = {  # a model, and 4 batches of 8 examples; the second holds NaN in example 2 of its inputs
    "mlp": (small_mlp, lambda i: features(8, i)),
    "cnn": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 4)),
        lambda i: images(8, 8, i),
    ),
}


def nan_in_batch_2(kind: str, ignored: bool = False) -> list:
    """NAN_KINDS' batches; with `ignored`, the target of the NaN example is ignored (-100), so its loss is finite."""
    batches = [(NAN_KINDS[kind][1](i), classes(8, i)) for i in range(4)]
    batches[1][0][2] = float("nan")
    if ignored:
        batches[1][1][2] = -100
    return batches


@pytest.mark.parametrize("kind", NAN_KINDS)
def test_nan_inputs_inside_a_log_window_are_named_not_blamed_on_the_lr(kind):
    """log_every=4: the row at step 4 was nan, the batch read last finite: "Try a lower lr"."""
    with pytest.raises(gk.train.NonFiniteInputError) as refused:
        train(NAN_KINDS[kind][0](), nan_in_batch_2(kind), log_every=4)
    message = str(refused.value)
    assert message.startswith("the loss became non-finite by optimizer step 4 (epoch 1), and batch 2 of the epoch ("), (
        message
    )
    assert "is not finite: input 0 holds" in message and "not in the learning rate" in message, message
    assert "lower lr" not in message and "only in examples whose targets are all ignored" not in message, message


@pytest.mark.parametrize("kind", NAN_KINDS)
def test_nan_only_in_an_example_whose_target_is_ignored_is_named_not_blamed_on_the_lr(kind):
    """Its loss leaves the example out, so batch 2's loss is finite; its gradient carries the NaN into the weights, and
    step 3's loss, of a finite batch, was blamed on the lr even with log_every=1."""
    with pytest.raises(gk.train.NonFiniteInputError) as refused:
        train(NAN_KINDS[kind][0](), nan_in_batch_2(kind, ignored=True))
    message = str(refused.value)
    assert message.startswith("the loss became non-finite by optimizer step 3 (epoch 1), and batch 2 of the epoch ("), (
        message
    )
    assert "only in examples whose targets are all ignored: the loss leaves them out, but not their gradient" in message


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_whose_targets_are_all_ignored_inside_a_log_window_is_named(kind):
    build, good, _, _ = KINDS[kind]
    inputs, target = good()
    batches = [good(), (inputs, torch.full_like(target, -100)), good(), good()]
    with pytest.raises(gk.train.NonFiniteInputError) as refused:
        train(build(), batches, log_every=4)
    message = str(refused.value)
    assert "by optimizer step 4 (epoch 1), and batch 2 of the epoch (" in message, message
    assert "targets ignored (equal to -100)" in message and "not in the learning rate" in message, message


class Recorded(torch.utils.data.Dataset):
    """48 examples of 6 features, example 29 NaN; the order of the examples read is recorded."""

    def __init__(self):
        self.inputs, self.targets, self.read = features(48, 5), classes(48, 5), []
        self.inputs[29] = float("nan")

    def __len__(self):
        return 48

    def __getitem__(self, index):
        self.read.append(index)
        return self.inputs[index], self.targets[index]


def test_nan_in_a_shuffled_dataset_is_named_with_the_batch_that_held_it():
    """fit's own shuffled loader draws each epoch's order as the epoch begins: read again from that state, the batch
    numbers are those training read (here checked against the order the Dataset recorded)."""
    data = Recorded()
    with pytest.raises(gk.train.NonFiniteInputError) as refused:
        train(small_mlp(), data, batch_size=8, log_every=6)  # one row, at the end of the epoch's 6 steps
    number = data.read[:48].index(29) // 8 + 1  # the batch that held example 29 in training's order
    assert f"and batch {number} of the epoch (input (8, 6) float32, target (8,) int64)" in str(refused.value)


def test_nan_in_a_shuffled_loader_is_found_without_a_trace_on_its_generators():
    """The epoch read again only after the failure (a finite run reads each example once), and the generators put
    back: after it, torch's generator (which the model's Dropout drew from at each step, the reading again not) and
    the loader's are where a run whose last batch showed the NaN leaves them."""

    def loader(data):
        return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))

    def model():
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4))

    order = Recorded()
    order.inputs[29] = 0.0
    train(model(), loader(order), log_every=6)
    assert sorted(order.read) == list(range(48))  # no batch read twice on the normal path
    named, after = {0: "and batch 1 of the epoch", 5: "and the batch that step read last"}, {}
    for where in (0, 5):  # the NaN in the first batch (read again), or in the last (named at once)
        data = Recorded()
        data.inputs[29], data.inputs[order.read[8 * where]] = 0.0, float("nan")
        shuffled = loader(data)
        with pytest.raises(gk.train.NonFiniteInputError, match=rf"by optimizer step 6 \(epoch 1\), {named[where]} "):
            train(model(), shuffled, log_every=6)
        after[where] = (shuffled.generator.get_state(), torch.get_rng_state(), len(data.read))
    assert after[0][2] > 48 == after[5][2]  # the epoch read again only where the last batch showed no NaN
    assert torch.equal(after[0][0], after[5][0]) and torch.equal(after[0][1], after[5][1])


SAVE_CASES = {  # a model, 4 batches whose second makes the weights NaN, and what the message says of that batch
    "mlp": (small_mlp, lambda: nan_in_batch_2("mlp"), "is not finite: input 0 holds 6 NaN"),
    "cnn": (NAN_KINDS["cnn"][0], lambda: nan_in_batch_2("cnn"), "is not finite: input 0 holds 192 NaN"),
}  # (a batch whose targets are all ignored has a NaN loss but zero gradients: the weights stay finite)


@pytest.mark.parametrize("kind", SAVE_CASES)
def test_a_save_after_a_bad_batch_inside_a_log_window_names_it_and_keeps_the_last_good_save(tmp_path, kind):
    """save_every=1 saves before the log reads the loss: the save refused the NaN weights and blamed the lr."""
    build, data, said = SAVE_CASES[kind]
    with pytest.raises(gk.train.NonFiniteInputError) as refused:
        train(build(), data(), log_every=4, checkpoint_dir=tmp_path, save_every=1)
    message, notes = str(refused.value), " ".join(refused.value.__notes__)
    assert message.startswith("the weights became non-finite by optimizer step 2 (epoch 1), and batch 2 of the epoch")
    assert said in message and "not in the learning rate" in message, message
    assert "They were not saved: " in notes and "keeps the last good save: optimizer step 1 (epoch 1)" in notes, notes
    assert read_checkpoint(tmp_path / "last.pt")["step"] == 1


def test_nan_only_where_ignored_in_the_last_batch_is_named_by_the_save_at_the_epochs_end(tmp_path):
    """The last batch's loss is finite (its NaN example is ignored) and so is every row; the save at the end of the
    epoch finds the weights NaN and names the batch, in the epoch that trained it."""
    data = nan_in_batch_2("mlp", ignored=True)
    data.append(data.pop(1))  # the bad batch last: batch 4
    with pytest.raises(gk.train.NonFiniteInputError) as refused:
        train(small_mlp(), data, checkpoint_dir=tmp_path)
    message = str(refused.value)
    assert message.startswith("the weights became non-finite by optimizer step 4 (epoch 1), and batch 4 of the epoch")
    assert "only in examples whose targets are all ignored" in message and "read before" not in message, message


class SegfaultingDataset(torch.utils.data.Dataset):
    """16 examples of 6 features; reading example 12 crashes the process in C code (a segmentation fault)."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        if index == 12:
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV, as a broken C extension does
        return features(1, index)[0], index % 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["evaluate", "lr_find", "fit"])
def test_a_loader_worker_that_segfaults_says_what_happened_and_what_to_do(where):
    """torch says only "DataLoader worker (pid(s) N) exited unexpectedly"; the note names the signal and the fix."""
    loader = DataLoader(SegfaultingDataset(), batch_size=4, num_workers=1)  # batch 4 holds example 12
    run = {
        "evaluate": lambda: gk.evaluate(small_mlp(), loader, device=CPU),
        "lr_find": lambda: gk.lr_find(small_mlp(), loader, device=CPU, steps=20),
        "fit": lambda: train(small_mlp(), loader),
    }[where]
    # RuntimeError as torch reports a dead worker; EOFError where the parent was still fetching an earlier batch's
    # shared-memory file descriptor from the worker as it died (multiprocessing's resource sharer: seen once in CI,
    # 2026-11-29). The note is the same either way.
    with pytest.raises((RuntimeError, OSError, EOFError)) as failed:
        run()
    note = " ".join(getattr(failed.value, "__notes__", []))
    assert "A DataLoader worker process died" in note, (failed.value, note)
    assert "SIGSEGV" in note or "a worker process ended" in note, note
    assert "num_workers=0" in note and "segmentation fault" in note


class KilledInEpoch2(torch.utils.data.Dataset):
    """16 examples of 6 features; a loader worker is killed (SIGKILL: the kernel's out-of-memory killer) as it reads
    its 21st example, the second batch of epoch 2 at batch 4: a persistent worker counts across epochs."""

    def __init__(self, kill: bool = True):
        self.kill, self.read = kill, 0

    def __len__(self):
        return 16

    def __getitem__(self, index):
        self.read += 1
        if self.kill and self.read == 21 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return features(1, index)[0], index % 4


@pytest.mark.timeout(120)
def test_a_persistent_loader_worker_killed_in_epoch_2_says_what_to_do_and_the_save_resumes(tmp_path):
    """torch said only "DataLoader worker (pid(s) N) exited unexpectedly"."""

    def loader(kill: bool) -> DataLoader:
        return DataLoader(KilledInEpoch2(kill), batch_size=4, num_workers=1, persistent_workers=True)

    # torch raises RuntimeError ("exited unexpectedly"), or ConnectionResetError where the worker dies as it sends a
    # batch through the pipe (2 runs in 8 at load 4.6): both get the note
    with pytest.warns(UserWarning, match="persistent_workers=True"):  # (a resume replays it only in part: said)
        with pytest.raises((RuntimeError, ConnectionResetError)) as failed:
            train(small_mlp(), loader(kill=True), epochs=3, checkpoint_dir=tmp_path)
    note = " ".join(getattr(failed.value, "__notes__", []))
    assert "A DataLoader worker process died" in note and "killed by SIGKILL" in note, (failed.value, note)
    assert "out of memory" in note and "fit resumes from the last save" in note, note
    assert "keeps the last good save: optimizer step 4 (epoch 1)" in note, note
    with pytest.warns(UserWarning, match="persistent_workers=True"):
        history = train(small_mlp(), loader(kill=False), epochs=3, checkpoint_dir=tmp_path)
    assert [row["step"] for row in history.steps] == list(range(1, 13)) and len(history.epochs) == 3


def test_a_worker_killed_as_torch_s_sigchld_handler_reports_it_is_named_with_its_signal():
    """Under load torch's SIGCHLD handler can report the death before the loader's wait does, naming the worker and
    its signal only in words: the note says them as the wait's path does (seen in the suite at load 4-8)."""
    module = {"__name__": "torch.utils.data._utils.signal_handling"}  # where torch's handler is defined
    exec("def handler():\n    raise RuntimeError('DataLoader worker (pid 4242) is killed by signal: Killed. ')", module)
    with pytest.raises(RuntimeError) as failed:
        module["handler"]()
    assert "A DataLoader worker process died (pid 4242 killed by SIGKILL)" in gk.data.worker_crash(failed.value)
    exec("def handler():\n    raise RuntimeError('DataLoader worker (pid(s) 4242) exited unexpectedly')", module)
    with pytest.raises(RuntimeError) as failed:
        module["handler"]()
    assert "A DataLoader worker process died (a worker process ended)" in gk.data.worker_crash(failed.value)


def test_a_worker_crash_note_is_only_for_a_dead_worker():
    """Any other error (one that a worker raised in Python, here) gets no such note."""

    class Raising(SegfaultingDataset):
        def __getitem__(self, index):
            raise ValueError("a bad example")

    with pytest.raises(ValueError, match="a bad example") as failed:
        gk.evaluate(small_mlp(), DataLoader(Raising(), batch_size=4, num_workers=1), device=CPU)
    assert gk.data.worker_crash(failed.value) is None
    assert not any("worker process died" in note for note in getattr(failed.value, "__notes__", []))


BREAKDOWN_KINDS = {
    "mlp": (
        small_mlp,
        lambda device: (torch.randn(8, 6, device=device), torch.zeros(8, dtype=torch.long, device=device)),
    ),
    "gpt": (tiny_gpt, lambda device: (tokens(2, 16).to(device), tokens(2, 16, 1).to(device))),
}


@pytest.mark.parametrize("kind", BREAKDOWN_KINDS)
def test_breakdown_of_a_batch_on_the_meta_device_points_to_estimate(kind):
    """It raised torch's "Cannot copy out of meta tensor; no data!"; estimate takes the same batch."""
    build, batch = BREAKDOWN_KINDS[kind]
    with pytest.raises(ValueError) as refused:
        gk.memory.breakdown(build(), batch("meta"), device=CPU)
    message = str(refused.value)
    assert "on the meta device (shapes without values" in message and "gk.memory.estimate" in message
    assert "torch.zeros_like(tensor, device='cpu')" in message
    predicted = gk.memory.estimate(build(), batch("meta"), device=CPU)  # what the message offers works
    assert predicted.total == gk.memory.estimate(build(), batch(CPU), device=CPU).total > 0


class Batches:
    """A re-iterable of batches without len(): each iteration starts afresh."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("kind", KINDS)
def test_data_without_len_that_ends_before_max_steps_says_where_the_schedule_stopped(kind):
    """10 batches and max_steps=100: the onecycle schedule warms up over 20 steps, so the run ended at step 10 with the
    lr at about half its peak, and said nothing."""
    build, good, _, _ = KINDS[kind]
    peak = {"mlp": 0.05, "gpt": 1e-3}[kind]
    with pytest.warns(UserWarning, match="ended after 10 optimizer steps") as said:
        history = train(build(), Batches([good()] * 10), max_steps=100, lr=peak)
    message, lr = str(said[0].message), history.steps[-1]["lr"]
    assert history.steps[-1]["step"] == 10 and 0.4 < lr / peak < 0.6  # mid-warm-up, as the issue saw it
    assert "short of max_steps=100" in message and "Pass max_steps=10 " in message, message
    assert f"with the lr at {lr:g}, {lr / peak:.0%} of its peak {peak:g}" in message, message


# Batches a loader gives that cannot be read (issue 47): each named with its number and what to do.


def on_meta(batch):
    return tuple(tensor.to("meta") for tensor in batch)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_on_the_meta_device_is_named_with_what_to_pass_instead(kind):
    build, good, _, _ = KINDS[kind]
    batches = [good(), good(), good()]
    assert len(train(build(), batches).steps) == 3  # the same batches with values train
    with pytest.raises(
        ValueError, match=r"batch 3 of epoch 1: .*meta device \(shapes without values.*gk\.memory\.estimate"
    ):
        train(build(), [*batches[:2], on_meta(batches[2])])
    with pytest.raises(ValueError, match=r"batch 2 of the evaluation data: .*meta device.*real tensors"):
        gk.evaluate(build(), [batches[0], on_meta(batches[1])], device=CPU)


class Items(torch.utils.data.Dataset):
    """A map-style dataset of `items` (a list), as a reader's __getitem__ returns them."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


# Per kind: a model, and 32 items (inputs, target) of one form; item 19 is made None or another shape.
ITEMS = {
    "mlp": (small_mlp, lambda: [(row, int(label)) for row, label in zip(features(32), classes(32))], (6,), (5,)),
    "gpt": (tiny_gpt, lambda: [(row, row) for row in tokens(32, 16)], (16,), (15,)),
}


@pytest.mark.parametrize("bad", ["None", "shape"])
@pytest.mark.parametrize("kind", ITEMS)
def test_an_item_the_loader_cannot_collate_is_named_with_its_index(kind, bad):
    """Item 19 (in batch 3 of 8 items) None, or of another shape than the others: default_collate's TypeError or
    "stack expects each tensor to be equal size" become the dataset index, what it returned and what to do."""
    build, make, usual, other = ITEMS[kind]
    items = make()
    assert len(train(build(), DataLoader(Items(items), batch_size=8)).steps) == 4  # the good items train
    inputs, target = items[19]
    items[19] = None if bad == "None" else (inputs[: other[0]], target[: other[0]] if kind == "gpt" else target)
    returned = "None" if bad == "None" else rf"\(a tensor of shape \({other[0]},\)"
    said = (
        rf"dataset\[19\] returned {returned}.*, where its other 7 items are \(a tensor of shape \({usual[0]},\).*"
        r"Fix the dataset's __getitem__.*collate_fn that pads"
    )
    with pytest.raises(ValueError, match=rf"batch 3 of epoch 1: .*{said}"):
        train(build(), DataLoader(Items(items), batch_size=8))
    with pytest.raises(ValueError, match=rf"batch 3 of the evaluation data: .*{said}"):
        gk.evaluate(build(), Items(items), batch_size=8, device=CPU)


def test_a_collate_failure_whose_items_look_alike_is_left_as_it_was():
    """Nothing is said where the items show no cause: the collate_fn's own error stands, with fit's note."""

    def collate(items):
        raise RuntimeError("my collate_fn failed")

    items = [(row, int(label)) for row, label in zip(features(16), classes(16))]
    with pytest.raises(RuntimeError, match="my collate_fn failed") as raised:
        train(small_mlp(), DataLoader(Items(items), batch_size=8, collate_fn=collate))
    assert not isinstance(raised.value, ValueError)


class Recurrent(nn.Module):
    """A GRU over (B, T, 6) float sequences, classifying each by its last state into 4 classes: a second model whose
    inputs are floats (the GPT's token ids cannot carry a graph)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gru, self.head = nn.GRU(6, 8, batch_first=True), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


GRAPH_KINDS = {"mlp": (small_mlp, lambda: features(32)), "gru": (Recurrent, lambda: features(32 * 5).view(32, 5, 6))}


@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_batches_that_share_an_autograd_graph_are_told_to_detach_not_to_retain_it(kind):
    """Batches cut from one tensor computed from a weight that requires grad (x = base * w, once) share its graph: the
    second batch's backward finds it freed, and torch advises retain_graph=True, which is wrong here."""
    build, make = GRAPH_KINDS[kind]
    weight = torch.ones(6, requires_grad=True)
    inputs, target = make() * weight, classes(32)
    with torch.no_grad():
        detached = make() * weight
    assert len(train(build(), [(detached[i : i + 8], target[i : i + 8]) for i in range(0, 32, 8)]).steps) == 4
    with pytest.raises(ValueError, match=r"batch 2 of epoch 1 .*carries an autograd graph.*Do not pass retain_graph"):
        train(build(), [(inputs[i : i + 8], target[i : i + 8]) for i in range(0, 32, 8)])
    with pytest.raises(ValueError, match=r"detach the inputs \(x\.detach\(\)\), or build them under torch\.no_grad"):
        train(build(), [(inputs[i : i + 8], target[i : i + 8]) for i in range(0, 32, 8)])


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))


FLOAT_KINDS = {  # models whose inputs are floating point: a dtype that changes mid-run
    "mlp": (small_mlp, lambda seed: (features(8, seed), classes(8, seed))),
    "cnn": (
        tiny_cnn,
        lambda seed: (torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(seed)), classes(8)),
    ),
}


@pytest.mark.parametrize("kind", FLOAT_KINDS)
def test_inputs_that_turn_float64_after_the_first_batch_are_named_with_both_dtypes(kind):
    """The dtype check covers the first batch; batch 3 in float64 gave the kernel's "must have the same dtype"."""
    build, batch = FLOAT_KINDS[kind]
    good = [batch(seed) for seed in range(3)]
    assert len(train(build(), good).steps) == 3  # the same batches in float32 train
    changed = [*good[:2], (good[2][0].double(), good[2][1])]
    with pytest.raises(ValueError, match=r"batch 3 of epoch 1 .*changed dtype after the first batch") as raised:
        train(build(), changed)
    message = str(raised.value)
    assert "inputs are float64 but the model's weights are float32" in message, message
    assert "inputs.to(torch.float32)" in message, message

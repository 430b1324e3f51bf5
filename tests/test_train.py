import copy
import math

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.data import DeviceLoader, ImageDataset, shapes
from gpukit.env import PROFILES


@pytest.fixture(scope="module")
def small_data():
    return shapes(512, 128, seed=1)


def mlp(num_classes=10, seed=0):
    """A model without BatchNorm: accumulation must match a larger batch exactly."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.GELU(), nn.Flatten(), nn.Linear(8 * 15 * 15, num_classes))


# ---------------------------------------------------------------------------------------------
# The lesson claims: a CNN learns shapes, a linear classifier does not


def test_shapes_cnn_reaches_80_percent_and_linear_stays_below_50_in_tiny_profile():
    tiny = PROFILES["tiny"]
    train, test = shapes(tiny.train_size, tiny.test_size, seed=0)
    gk.seed_everything(0)
    cnn = gk.fit(
        gk.models.fast_cnn(tiny.width), train, epochs=tiny.epochs, batch_size=tiny.batch_size, lr=0.1,
        eval_data=test, progress=False,
    )  # fmt: skip
    assert cnn.final_eval_accuracy >= 0.8
    best_linear = 0.0
    for optimizer, lr in (("adamw", 1e-3), ("sgd", 0.01)):  # the baseline gets a fair try at two settings
        history = gk.fit(
            gk.models.linear_classifier(), train, epochs=5, batch_size=128, lr=lr, optimizer=optimizer,
            eval_data=test, progress=False,
        )  # fmt: skip
        best_linear = max(best_linear, history.final_eval_accuracy)
    assert best_linear < 0.5


# ---------------------------------------------------------------------------------------------
# Results and history


def test_fit_learns_and_records_history(small_data):
    train, test = small_data
    history = gk.fit(
        gk.models.fast_cnn(8), train, epochs=2, batch_size=32, lr=0.1, eval_data=test, progress=False, log_every=4
    )
    assert len(history.epochs) == 2
    steps = [row["step"] for row in history.steps]
    assert steps == sorted(steps) and steps[-1] == 2 * (512 // 32)
    for row in history.steps:
        assert row["step_time"] > 0 and row["images_per_second"] > 0 and math.isfinite(row["loss"])
    assert history.losses[-1] < history.losses[0]  # it learns something in 32 steps
    assert 0 <= history.final_eval_accuracy <= 1
    assert history.epochs[0]["peak_memory"] is None  # not measured on CPU: None, not a made-up number
    assert "eval_accuracy" in str(history.table()) and history.images_per_second > 0


def test_fit_does_not_synchronise_every_step(small_data, monkeypatch):
    """Reading a tensor's value (.item()) waits for the GPU; fit does it once per logged window."""
    train, _ = small_data
    calls = 0
    original = torch.Tensor.item

    def counting_item(self):
        nonlocal calls
        calls += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    gk.fit(mlp(), train, epochs=1, batch_size=16, lr=0.01, progress=False, log_every=8)  # 32 steps
    assert calls <= 32 // 8 + 3  # one per window plus the per-epoch totals


def test_evaluate(small_data):
    train, test = small_data
    model = gk.models.fast_cnn(8)
    result = gk.evaluate(model, test)
    assert 0 <= result["accuracy"] <= 1 and result["images"] == len(test) and result["loss"] > 0
    assert model.training  # evaluate restores the mode it found
    assert gk.evaluate(model, DeviceLoader(test, 50, shuffle=False))["images"] == len(test)


# ---------------------------------------------------------------------------------------------
# Gradient accumulation


def test_accumulation_matches_a_larger_batch_without_batchnorm(small_data):
    train, _ = small_data
    models = [mlp(seed=3), mlp(seed=3)]
    common = dict(epochs=1, lr=0.05, optimizer="sgd", schedule="linear", warmup=2, progress=False)
    gk.fit(models[0], DeviceLoader(train, 64, shuffle=False), **common)
    gk.fit(models[1], DeviceLoader(train, 16, shuffle=False), accumulate=4, **common)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_accumulation_differs_with_batchnorm(small_data):
    """BatchNorm normalises each micro-batch with its own statistics, so k micro-batches are not one big batch."""
    train, _ = small_data
    torch.manual_seed(0)
    models = [gk.models.fast_cnn(4), None]
    models[1] = copy.deepcopy(models[0])
    common = dict(epochs=1, lr=0.05, schedule="constant", warmup=0, progress=False)
    gk.fit(models[0], DeviceLoader(train, 64, shuffle=False), **common)
    gk.fit(models[1], DeviceLoader(train, 16, shuffle=False), accumulate=4, **common)
    difference = max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert difference > 1e-4


# ---------------------------------------------------------------------------------------------
# Precision, memory format


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_trains_on_cpu(precision):
    train, _ = shapes(128, 0)
    history = gk.fit(mlp(), train, epochs=1, batch_size=32, lr=0.05, precision=precision, progress=False, log_every=1)
    assert history.precision == precision and all(math.isfinite(r["loss"]) for r in history.steps)


def test_channels_last_gives_the_same_model():
    train, _ = shapes(128, 0)
    torch.manual_seed(0)
    a = gk.models.fast_cnn(4)
    b = copy.deepcopy(a)
    gk.fit(a, DeviceLoader(train, 32, shuffle=False), lr=0.05, progress=False)
    gk.fit(b, DeviceLoader(train, 32, shuffle=False), lr=0.05, channels_last=True, progress=False)
    assert b[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# Failing loudly


def test_non_finite_loss_stops_with_the_step(small_data):
    train, _ = small_data
    calls = 0

    def loss_that_breaks(logits, labels):
        nonlocal calls
        calls += 1
        loss = nn.functional.cross_entropy(logits, labels)
        return loss * float("nan") if calls == 7 else loss

    with pytest.raises(gk.NonFiniteLossError, match=r"between optimizer steps 5 and 8.*lower lr") as error:
        gk.fit(mlp(), train, epochs=1, batch_size=32, lr=0.01, loss_fn=loss_that_breaks, progress=False, log_every=4)
    assert "clip" in str(error.value)


def test_diverging_lr_is_reported_not_silent(small_data):
    train, _ = small_data
    with pytest.raises(gk.NonFiniteLossError, match="loss became"):
        gk.fit(
            mlp(), train, epochs=3, batch_size=32, lr=1e12, schedule="constant", warmup=0, progress=False, log_every=2
        )


def _untouched(model, before):
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), "batch_size must be a positive integer"),
        (dict(batch_size=-3), "batch_size must be a positive integer"),
        (dict(epochs=-1), "epochs must be an integer >= 0"),
        (dict(precision="fp8"), "precision='fp8' is unknown"),
        (dict(precision="tf32"), "use 'fp32', or 'bf16-mixed'"),
        (dict(device="cuda:5"), "use device='cpu'"),
        (dict(device="tpu"), "is not a device|not supported"),
        (dict(accumulate=0), "accumulate must be an integer >= 1"),
        (dict(schedule="cosine-ish"), "schedule='cosine-ish' is unknown"),
        (dict(optimizer="lion"), "optimizer='lion' is unknown"),
        (dict(clip=-1.0), "clip must be a positive"),
    ],
)
def test_bad_input_fails_before_any_work(small_data, kwargs, message):
    train, _ = small_data
    model = gk.models.fast_cnn(4)
    before = [p.detach().clone() for p in model.parameters()]
    arguments = dict(epochs=1, batch_size=32, progress=False) | kwargs
    with pytest.raises(ValueError, match=message):
        gk.fit(model, train, **arguments)
    assert _untouched(model, before)


def test_labels_outside_the_models_classes(small_data):
    train, _ = small_data
    model = gk.models.fast_cnn(4, num_classes=5)  # the data has 10 classes
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.4, found 0\.\.9"):
        gk.fit(model, train, batch_size=32, progress=False)


def test_empty_dataset_and_too_big_batch(small_data):
    train, _ = small_data
    with pytest.raises(ValueError, match="empty"):
        gk.fit(gk.models.fast_cnn(4), train.subset(0), batch_size=32, progress=False)
    with pytest.raises(ValueError, match="no batch"):
        gk.fit(gk.models.fast_cnn(4), train.subset(10), batch_size=32, progress=False)
    with pytest.raises(ValueError, match="empty"):
        gk.fit(
            gk.models.fast_cnn(4),
            torch.utils.data.TensorDataset(torch.zeros(0, 3, 32, 32), torch.zeros(0)),
            batch_size=4,
        )


def test_loader_and_batch_size_must_agree(small_data):
    train, _ = small_data
    with pytest.raises(ValueError, match="differs from the loader"):
        gk.fit(gk.models.fast_cnn(4), DeviceLoader(train, 32), batch_size=64, progress=False)


def test_model_without_parameters(small_data):
    train, _ = small_data
    with pytest.raises(ValueError, match="no parameters"):
        gk.fit(nn.Flatten(), train, batch_size=32, progress=False)


def test_generic_dataset_goes_through_a_dataloader():
    images = torch.randn(64, 3, 32, 32)
    labels = torch.randint(0, 10, (64,))
    history = gk.fit(mlp(), torch.utils.data.TensorDataset(images, labels), batch_size=16, progress=False, log_every=1)
    assert len(history.steps) == 4


# ---------------------------------------------------------------------------------------------
# Checkpoints and resume


class Crash(Exception):
    pass


def test_resume_after_a_crash_equals_an_uninterrupted_run(small_data, tmp_path):
    train, _ = small_data
    common = dict(epochs=2, batch_size=64, lr=0.05, progress=False, seed=7)
    torch.manual_seed(0)
    straight = gk.models.fast_cnn(4)
    crashed = copy.deepcopy(straight)
    resumed = copy.deepcopy(straight)
    gk.fit(straight, train, **common)
    calls = 0

    def crash_in_epoch_two(logits, labels):
        nonlocal calls
        calls += 1
        if calls == 10:  # epoch 1 has 8 batches
            raise Crash
        return nn.functional.cross_entropy(logits, labels)

    with pytest.raises(Crash):
        gk.fit(crashed, train, **common, loss_fn=crash_in_epoch_two, checkpoint_dir=tmp_path)
    history = gk.fit(resumed, train, **common, checkpoint_dir=tmp_path)  # picks up at epoch 2
    assert [row["epoch"] for row in history.epochs] == [1, 2]
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_corrupt_or_mismatched_checkpoint_is_an_error(small_data, tmp_path):
    train, _ = small_data
    gk.fit(gk.models.fast_cnn(4), train, epochs=1, batch_size=64, progress=False, checkpoint_dir=tmp_path)
    with pytest.raises(RuntimeError, match="cannot resume"):
        gk.fit(gk.models.fast_cnn(8), train, epochs=2, batch_size=64, progress=False, checkpoint_dir=tmp_path)
    with pytest.raises(RuntimeError, match="resume with the same epochs"):
        gk.fit(gk.models.fast_cnn(4), train, epochs=3, batch_size=32, progress=False, checkpoint_dir=tmp_path)
    (tmp_path / "last.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="cannot resume"):
        gk.fit(gk.models.fast_cnn(4), train, epochs=2, batch_size=64, progress=False, checkpoint_dir=tmp_path)


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    gk.train.save_atomic({"value": 1}, path)

    def broken_save(obj, file):
        file.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        gk.train.save_atomic({"value": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["value"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temporary file left behind


# ---------------------------------------------------------------------------------------------
# CUDA paths (skipped without a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16-mixed", "fp16-mixed"])
def test_fit_on_cuda_every_precision(precision):
    if precision in ("tf32", "bf16-mixed") and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs compute capability 8.0")
    train, test = shapes(1024, 256)
    history = gk.fit(
        gk.models.fast_cnn(16),
        train,
        epochs=2,
        batch_size=128,
        lr=0.2,
        precision=precision,
        device="cuda",
        eval_data=test,
        progress=False,
    )
    assert history.peak_memory > 0 and history.final_eval_accuracy > 0.2
    assert torch.get_float32_matmul_precision() == "highest"  # tf32 flags restored after fit


@cuda
def test_device_loader_on_cuda_keeps_data_on_the_gpu():
    train, _ = shapes(256, 0)
    loader = DeviceLoader(train, 64, augment=True, device="cuda")
    images, labels = next(iter(loader))
    assert loader.images.is_cuda and images.is_cuda and labels.is_cuda


def test_image_dataset_subset_keeps_normalisation(small_data):
    train, _ = small_data
    part = train.subset(10)
    assert isinstance(part, ImageDataset) and len(part) == 10 and torch.equal(part.mean, train.mean)


def test_leftover_micro_batches_do_not_leak_into_the_next_step():
    """10 batches with accumulate=4 make 2 steps per epoch; batches 9 and 10 must not run backward."""
    train, _ = shapes(160, 0)
    models = [mlp(seed=5), mlp(seed=5)]
    common = dict(epochs=2, lr=0.05, schedule="constant", warmup=0, progress=False)
    gk.fit(models[0], DeviceLoader(train, 16, shuffle=False), accumulate=4, **common)
    gk.fit(models[1], DeviceLoader(train.subset(128), 16, shuffle=False), accumulate=4, **common)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b)

import hashlib
import pickle
import tarfile
import time

import numpy as np
import pytest
import torch
from torchvision.datasets import CIFAR10

import gpukit as gk
from gpukit.data import DeviceLoader, ImageDataset, dataloader, random_crop_flip, shapes


def test_shapes_is_deterministic_and_balanced():
    train_a, test_a = shapes(600, 100, seed=3)
    train_b, _ = shapes(600, 100, seed=3)
    train_c, _ = shapes(600, 100, seed=4)
    assert torch.equal(train_a.images, train_b.images) and torch.equal(train_a.labels, train_b.labels)
    assert not torch.equal(train_a.images, train_c.images)
    assert train_a.images.shape == (600, 3, 32, 32) and train_a.images.dtype == torch.uint8
    assert len(test_a) == 100 and torch.equal(test_a.mean, train_a.mean)  # test uses train statistics
    counts = torch.bincount(train_a.labels, minlength=10)
    assert counts.min() > 30  # every class present in roughly equal numbers
    assert not torch.equal(train_a.images[:100], test_a.images)  # held-out images differ


def test_shapes_bad_sizes():
    with pytest.raises(ValueError, match="train_size"):
        shapes(0, 10)


def test_image_dataset_rejects_labels_outside_classes():
    images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.9"):
        ImageDataset(images, torch.tensor([0, 1, 10, 2]), [str(i) for i in range(10)])
    with pytest.raises(ValueError, match="uint8"):
        ImageDataset(images.float(), torch.tensor([0, 1, 1, 2]), ["a", "b", "c"])


def test_device_loader_covers_epoch_and_normalises():
    train, _ = shapes(256, 0)
    loader = DeviceLoader(train, 64, shuffle=True, seed=1, device="cpu")
    seen = torch.cat([labels for _, labels in loader])
    assert len(loader) == 4 and len(seen) == 256
    assert torch.equal(torch.sort(seen).values, torch.sort(train.labels).values)  # a permutation
    images, _ = next(iter(DeviceLoader(train, 256, shuffle=False, device="cpu")))
    assert images.dtype == torch.float32 and images.shape == (256, 3, 32, 32)
    assert images.mean((0, 2, 3)).abs().max() < 0.05 and (images.std((0, 2, 3)) - 1).abs().max() < 0.05
    unshuffled = DeviceLoader(train, 256, shuffle=False, device="cpu")
    reference = (train.images.float() / 255 - train.mean[:, None, None]) / train.std[:, None, None]
    assert torch.allclose(next(iter(unshuffled))[0], reference, atol=1e-5)  # same as the Dataset's own view


def test_device_loader_epochs_replay_and_differ():
    train, _ = shapes(128, 0)
    loader = DeviceLoader(train, 32, augment=True, seed=5, device="cpu")
    loader.set_epoch(2)
    first = [b[0] for b in loader]
    loader.set_epoch(2)
    again = [b[0] for b in loader]
    loader.set_epoch(3)
    other = [b[0] for b in loader]
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # an epoch can be replayed exactly
    assert not torch.equal(first[0], other[0])


def test_device_loader_shards_are_disjoint_and_cover_the_data():
    train, _ = shapes(100, 0)
    shards = [DeviceLoader(train, 10, shuffle=True, seed=0, rank=r, world_size=2, device="cpu") for r in range(2)]
    for shard in shards:
        shard.set_epoch(1)
    images = [torch.cat([b[0] for b in shard]) for shard in shards]
    assert len(images[0]) == len(images[1]) == 50
    flat = torch.cat(images).flatten(1)
    assert len(torch.unique(flat, dim=0)) == 100  # no image in both shards


def test_random_crop_flip_shifts_and_flips():
    images = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).reshape(2, 1, 6, 6)
    generator = torch.Generator().manual_seed(0)
    out = random_crop_flip(images, padding=0, flip=True, generator=generator)
    for original, result in zip(images, out):
        assert torch.equal(result, original) or torch.equal(result, original.flip(-1))
    shifted = random_crop_flip(images, padding=2, flip=False, generator=generator)
    assert shifted.shape == images.shape
    # Each crop is a 6×6 window of the reflect-padded image.
    padded = torch.nn.functional.pad(images, (2,) * 4, mode="reflect")
    for b in range(2):
        windows = [padded[b, :, y : y + 6, x : x + 6] for y in range(5) for x in range(5)]
        assert any(torch.equal(shifted[b], w) for w in windows)


def test_loaders_reject_bad_input():
    train, _ = shapes(64, 0)
    with pytest.raises(ValueError, match="batch_size"):
        DeviceLoader(train, 0, device="cpu")
    with pytest.raises(ValueError, match="empty"):
        DeviceLoader(train.subset(0), 8, device="cpu")
    with pytest.raises(ValueError, match="batch_size"):
        dataloader(train, -1)
    with pytest.raises(TypeError, match="ImageDataset"):
        DeviceLoader(torch.utils.data.TensorDataset(torch.zeros(4, 3)), 2)
    with pytest.raises(ValueError, match="device"):
        DeviceLoader(train, 8, device="cuda:3")


def test_dataloader_path_matches_device_loader_contents():
    train, _ = shapes(128, 0)
    standard = dataloader(train, 32, shuffle=False, num_workers=0)
    device = DeviceLoader(train, 32, shuffle=False, device="cpu")
    for (a, la), (b, lb) in zip(standard, device):
        assert torch.allclose(a, b, atol=1e-5) and torch.equal(la, lb)
    augmented = next(iter(dataloader(train, 32, augment=True, num_workers=0)))[0]
    assert augmented.shape == (32, 3, 32, 32)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 through torchvision, on a small archive in CIFAR-10's own format


def _write_cifar_batches(folder, per_batch=20, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        # The keys the real files give under pickle.load(..., encoding="latin1"), as torchvision reads them.
        entry = {
            "batch_label": name,
            "labels": rng.integers(0, 10, per_batch).tolist(),
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [f"{i}.png" for i in range(per_batch)],
        }
        with open(folder / name, "wb") as file:
            pickle.dump(entry, file)
    with open(folder / "batches.meta", "wb") as file:
        pickle.dump({"label_names": list(gk.data.CIFAR10_CLASSES)}, file)
    return names


def _md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture
def small_cifar(tmp_path, monkeypatch):
    """A 120-image CIFAR-10 in the real on-disk layout, with torchvision's checksums pointed at it."""
    folder = tmp_path / "cifar-10-batches-py"
    names = _write_cifar_batches(folder)
    sums = {name: _md5(folder / name) for name in names}
    monkeypatch.setattr(CIFAR10, "train_list", [[n, sums[n]] for n in names[:5]])
    monkeypatch.setattr(CIFAR10, "test_list", [[names[5], sums[names[5]]]])
    monkeypatch.setattr(
        CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names", "md5": _md5(folder / "batches.meta")}
    )
    return tmp_path


def test_cifar10_loads_real_format(small_cifar):
    train, test = gk.data.cifar10(small_cifar, download=False)
    assert len(train) == 100 and len(test) == 20
    assert train.images.shape == (100, 3, 32, 32) and train.images.dtype == torch.uint8
    assert train.classes == gk.data.CIFAR10_CLASSES
    # Pixel layout: the first 1024 bytes of a row are the red plane, row-major.
    raw = pickle.load(open(small_cifar / "cifar-10-batches-py" / "data_batch_1", "rb"))
    assert torch.equal(train.images[0, 0].flatten(), torch.from_numpy(raw["data"][0, :1024]))
    assert train.labels[0] == raw["labels"][0]
    history = gk.fit(gk.models.fast_cnn(4), train, epochs=1, batch_size=50, progress=False, device="cpu")
    assert len(history.epochs) == 1


def test_cifar10_extracts_archive_without_network(tmp_path, monkeypatch):
    """download=True with the archive already in root: torchvision checks it and extracts it."""
    build = tmp_path / "build"
    names = _write_cifar_batches(build / "cifar-10-batches-py")
    archive = tmp_path / "root" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(build / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    folder = build / "cifar-10-batches-py"
    monkeypatch.setattr(CIFAR10, "tgz_md5", _md5(archive))
    monkeypatch.setattr(CIFAR10, "url", "http://127.0.0.1:9/never-used.tar.gz")
    monkeypatch.setattr(CIFAR10, "train_list", [[n, _md5(folder / n)] for n in names[:5]])
    monkeypatch.setattr(CIFAR10, "test_list", [[names[5], _md5(folder / names[5])]])
    monkeypatch.setattr(
        CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names", "md5": _md5(folder / "batches.meta")}
    )
    train, test = gk.data.cifar10(tmp_path / "root", download=True)
    assert len(train) == 100 and len(test) == 20


def test_cifar10_missing_offline_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        gk.data.cifar10(tmp_path / "empty", download=False)
    message = str(error.value)
    assert "cifar-10-python.tar.gz" in message and str((tmp_path / "empty").resolve()) in message


def test_cifar10_download_failure_is_clear_and_fast(tmp_path, monkeypatch):
    # Port 9 on loopback refuses at once: the real download code runs and fails like an offline machine.
    monkeypatch.setattr(CIFAR10, "url", "http://127.0.0.1:9/cifar-10-python.tar.gz")
    started = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="download failed"):
        gk.data.cifar10(tmp_path / "data", download=True, timeout=5)
    assert time.perf_counter() - started < 60  # it gave up, not hung; the margin holds on a loaded 2-core machine
    assert not any(p.name.endswith(".tar.gz") for p in (tmp_path / "data").iterdir())  # no half-written file


@pytest.mark.gpu
def test_the_data_order_is_the_same_on_a_gpu_as_on_the_cpu(shapes_train):
    """CUDA's generator gives other numbers than the CPU's for one seed: the loaders draw their order on the
    CPU, so that a run on a GPU sees the batches a CPU run (or CPU DDP ranks) sees."""
    bytes_ = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    tokens = gk.data.TokenDataset(bytes_, 16)
    for make in (
        lambda device: gk.data.TextLoader(tokens, 8, device=device, seed=3),
        lambda device: DeviceLoader(shapes_train, 32, device=device, seed=3),
    ):
        on_cpu, on_gpu = make("cpu"), make("cuda")
        for _ in range(2):  # two epochs
            for (inputs, target), (gpu_inputs, gpu_target) in zip(on_cpu, on_gpu, strict=True):
                assert torch.equal(target, gpu_target.cpu()) and torch.allclose(inputs, gpu_inputs.cpu())

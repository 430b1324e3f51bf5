"""image_folder(): real JPEG/PNG files in tmp_path, decoding, the on-disk cache, bad input; ImageDataset.split()."""

import os
import random
import warnings

import pytest
import torch
from PIL import Image
from torch import nn
from torchvision.io import encode_jpeg, encode_png

import gpukit as gk
from gpukit.data import ImageDataset, folder, image_folder

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec; gpukit still uses them (not installed here).
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def solid(colour, height=12, width=12) -> torch.Tensor:
    """An RGB uint8 image (3, height, width) of one colour."""
    return torch.tensor(colour, dtype=torch.uint8)[:, None, None].expand(3, height, width).contiguous()


def write(path, image: torch.Tensor) -> None:
    """Write a (C, H, W) uint8 image as PNG or JPEG, chosen by the extension (any case)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    encoded = encode_png(image) if path.suffix.lower() == ".png" else encode_jpeg(image, quality=95)
    path.write_bytes(encoded.numpy().tobytes())


def make_folder(root, counts: dict[str, int], colours=None):
    """root/<class>/<i>.png, class k's images all of colours[k]; returns root."""
    colours = colours or [RED, GREEN, BLUE]
    for k, (name, count) in enumerate(counts.items()):
        for i in range(count):
            write(root / name / f"{i}.png", solid(colours[k % len(colours)], 10 + i, 14))
    return root


def load(root, **options):
    options.setdefault("progress", False)
    return image_folder(root, 16, **options)


@pytest.fixture
def root(tmp_path):
    return make_folder(tmp_path / "pets", {"dog": 3, "cat": 2})


@pytest.fixture
def decodes(monkeypatch):
    """Counts the files image_folder decodes (a cache hit decodes none)."""
    calls = []
    decode = folder._decode

    def counting(path, size):
        calls.append(path.name)
        return decode(path, size)

    monkeypatch.setattr(folder, "_decode", counting)
    return calls


# ---------------------------------------------------------------------------------------------
# Layout, decoding


def test_layout_classes_and_labels(root):
    data = load(root)
    assert isinstance(data, ImageDataset)
    assert data.classes == ("cat", "dog")  # sorted folder names; label = index
    assert data.labels.tolist() == [0, 0, 1, 1, 1]
    assert data.images.dtype == torch.uint8 and data.images.shape == (5, 3, 16, 16)
    assert (data.images[:2] == torch.tensor(GREEN, dtype=torch.uint8)[:, None, None]).all()  # cat: colours[1]
    assert (data.images[2:] == torch.tensor(RED, dtype=torch.uint8)[:, None, None]).all()
    reference = ImageDataset(data.images, data.labels, data.classes)
    assert torch.allclose(data.mean, reference.mean) and torch.allclose(data.std, reference.std)


def test_nested_folders_count_for_their_class(root):
    write(root / "cat" / "indoor" / "sofa.png", solid(GREEN))
    data = load(root)
    assert data.labels.tolist() == [0, 0, 0, 1, 1, 1]


def test_modes_and_sizes_all_become_rgb(tmp_path):
    root = tmp_path / "modes"
    (root / "all").mkdir(parents=True)
    palette = Image.new("P", (40, 20))
    palette.putpalette([255, 0, 0] * 256)  # every palette entry red
    palette.save(root / "all" / "palette.png")
    Image.new("RGBA", (30, 50), (0, 0, 255, 128)).save(root / "all" / "rgba.png")  # alpha dropped
    Image.new("L", (25, 25), 200).save(root / "all" / "grey.jpg")
    Image.new("LA", (8, 8), (100, 255)).save(root / "all" / "grey_alpha.png")
    Image.new("I;16", (20, 20), 65535).save(root / "all" / "sixteen_bit.png")  # decodes to uint16
    write(root / "all" / "rgb.jpg", solid(GREEN, 90, 60))
    write(root / "all" / "tiny.png", solid((10, 20, 30), 3, 5))  # smaller than size: scaled up

    data = load(root)
    assert data.images.shape == (7, 3, 16, 16) and data.images.dtype == torch.uint8
    expected = {  # sorted by file name
        "grey.jpg": (200, 200, 200),
        "grey_alpha.png": (100, 100, 100),
        "palette.png": RED,
        "rgb.jpg": GREEN,
        "rgba.png": BLUE,
        "sixteen_bit.png": (255, 255, 255),
        "tiny.png": (10, 20, 30),
    }
    for image, (name, colour) in zip(data.images, expected.items()):
        difference = (image.int() - torch.tensor(colour)[:, None, None]).abs().max()
        assert difference <= 2, f"{name}: {image[:, 0, 0].tolist()} is not {colour}"  # JPEG: ±2


def test_resizes_shorter_side_then_crops_the_centre(tmp_path):
    image = torch.cat([solid(RED, 32, 12), solid(GREEN, 32, 40), solid(BLUE, 32, 12)], dim=2)  # 32×64
    write(tmp_path / "wide" / "a" / "stripes.png", image)
    data = load(tmp_path / "wide")  # 32×64 → 16×32 → centre 16×16: only the green middle, not squashed
    assert (data.images[0].int() - torch.tensor(GREEN)[:, None, None]).abs().max() <= 1


def test_upper_case_extensions_and_hidden_files(root):
    write(root / "cat" / "A.JPG", solid(GREEN))
    write(root / "cat" / "B.JPEG", solid(GREEN))
    write(root / "cat" / "C.Png", solid(GREEN))
    (root / "cat" / ".DS_Store").write_bytes(b"\0\1junk")
    write(root / "cat" / ".hidden.png", solid(RED))
    write(root / ".ipynb_checkpoints" / "x.png", solid(RED))  # hidden folder: not a class
    write(root / "dog" / ".ipynb_checkpoints" / "y.png", solid(RED))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # hidden files are ignored silently
        data = load(root)
    assert data.classes == ("cat", "dog")
    assert data.labels.tolist() == [0] * 5 + [1] * 3


def test_other_files_are_ignored_with_one_warning(root):
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "README.md").write_text("my pets")
    write(root / "dog" / "clip.gif", solid(RED))
    with pytest.warns(UserWarning, match=r"Ignored 3 file\(s\).*README.md") as record:
        data = load(root)
    assert len([w for w in record if "Ignored" in str(w.message)]) == 1
    assert len(data) == 5


def test_progress_bar_can_be_silenced(root, capsys):
    load(root, cache=False, progress=False)
    assert "Decoding" not in capsys.readouterr().err
    load(root, cache=False, progress=True)
    assert "Decoding" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The cache


def test_cache_is_written_then_reused(root, decodes, monkeypatch):
    first = load(root)
    assert len(decodes) == 5
    assert (root / ".gpukit-cache-16px.pt").is_file()
    assert sorted(p.name for p in root.iterdir()) == [".gpukit-cache-16px.pt", "cat", "dog"]  # no temporary files

    def fail(path, size):
        raise AssertionError("decoded although the cache matches")

    monkeypatch.setattr(folder, "_decode", fail)
    second = load(root)
    assert torch.equal(first.images, second.images) and torch.equal(first.labels, second.labels)
    assert second.classes == first.classes and torch.equal(first.mean, second.mean)


def test_each_size_has_its_own_cache(root, decodes):
    load(root)
    image_folder(root, 8, progress=False)
    assert (root / ".gpukit-cache-8px.pt").is_file() and len(decodes) == 10


def touch(path):
    stat = path.stat()
    later = stat.st_mtime_ns + 5_000_000_000  # +5 s: file times can be coarser than a fast test
    os.utime(path, ns=(later, later))


@pytest.mark.parametrize(
    "change, count",
    [
        (lambda root: touch(root / "dog" / "0.png"), 5),
        (lambda root: write(root / "dog" / "new.png", solid(RED)), 6),
        (lambda root: (root / "dog" / "1.png").unlink(), 4),
        (lambda root: write(root / "cat" / "0.png", solid(BLUE, 10, 14)), 5),  # same byte count, later mtime
        (lambda root: write(root / "bird" / "0.png", solid(BLUE)), 6),
    ],
    ids=["touch", "add", "remove", "rewrite", "new-class"],
)
def test_cache_is_invalidated_by_a_changed_file(root, decodes, change, count):
    load(root)
    decodes.clear()
    change(root)
    data = load(root)
    assert len(decodes) == count == len(data)  # decoded again, all of them
    decodes.clear()
    load(root)
    assert decodes == []  # and cached again


@pytest.mark.parametrize("damage", ["random", "truncated", "empty"])
def test_unreadable_cache_is_rebuilt_with_a_warning(root, decodes, damage):
    first = load(root)
    cache = root / ".gpukit-cache-16px.pt"
    content = cache.read_bytes()
    # Random bytes fail in many ways inside the unpickler (IndexError, KeyError, …): try several.
    damaged = [random.Random(seed).randbytes(300) for seed in range(8)] if damage == "random" else []
    damaged += {"random": [], "truncated": [content[: len(content) // 2]], "empty": [b""]}[damage]
    for data in damaged:
        decodes.clear()
        cache.write_bytes(data)
        with pytest.warns(UserWarning, match="cannot be read"):
            again = load(root)
        assert torch.equal(first.images, again.images) and len(decodes) == 5
    decodes.clear()
    load(root)
    assert decodes == []  # the rebuilt cache is good


def test_cache_with_unexpected_contents_is_rebuilt(root, decodes):
    load(root)
    cache = root / ".gpukit-cache-16px.pt"
    state = torch.load(cache, weights_only=True)
    torch.save(state | {"images": state["images"].float()}, cache)  # the right fingerprint, the wrong tensor
    with pytest.warns(UserWarning, match="unexpected contents"):
        data = load(root)
    assert data.images.dtype == torch.uint8 and len(decodes) == 10


def test_cache_that_cannot_be_written_warns_and_goes_on(root, monkeypatch):
    def read_only(state, path):  # tests run as root, where chmod would not stop a write
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(folder, "save_atomic", read_only)
    with pytest.warns(UserWarning, match="Could not write the image cache") as record:
        data = load(root)
    assert len([w for w in record if "Could not write" in str(w.message)]) == 1
    assert len(data) == 5 and not (root / ".gpukit-cache-16px.pt").exists()


def test_cache_false_neither_reads_nor_writes(root, decodes):
    load(root, cache=False)
    assert not (root / ".gpukit-cache-16px.pt").exists()
    (root / ".gpukit-cache-16px.pt").write_bytes(b"garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an unreadable cache would warn if it were read
        load(root, cache=False)
    assert (root / ".gpukit-cache-16px.pt").read_bytes() == b"garbage" and len(decodes) == 10


# ---------------------------------------------------------------------------------------------
# Bad input


def test_missing_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load(tmp_path / "nowhere")


def test_root_that_is_a_file(tmp_path):
    (tmp_path / "pets.zip").write_bytes(b"PK")
    with pytest.raises(NotADirectoryError, match="pets.zip"):
        load(tmp_path / "pets.zip")


def test_root_without_class_folders(tmp_path):
    write(tmp_path / "flat" / "1.png", solid(RED))
    with pytest.raises(ValueError, match=r"no class subfolders.*root/<class name>/<image files>"):
        load(tmp_path / "flat")


@pytest.mark.parametrize("content", [None, "notes.txt"])
def test_class_without_images(root, content):
    (root / "empty").mkdir()
    if content:
        (root / "empty" / content).write_text("no images here")
    with pytest.raises(ValueError, match=r"empty.*no usable images.*\.jpg, \.jpeg, \.png"):
        load(root)


def corrupt_files(root):
    (root / "cat" / "x.jpg").write_bytes(os.urandom(500))
    png = encode_png(solid(RED, 40, 40)).numpy().tobytes()
    (root / "dog" / "truncated.png").write_bytes(png[: len(png) // 2])
    (root / "dog" / "empty.jpeg").write_bytes(b"")


def test_corrupt_files_are_skipped_with_a_warning_that_names_them(root):
    corrupt_files(root)
    with pytest.warns(UserWarning, match=r"Skipped 3 of 8 .*x\.jpg") as record:
        data = load(root)
    message = str(next(w.message for w in record if "Skipped" in str(w.message)))
    assert "truncated.png" in message and "empty.jpeg" in message
    assert data.labels.tolist() == [0, 0, 1, 1, 1]
    with pytest.warns(UserWarning, match=r"Skipped 3 of 8"):  # from the cache: warned again
        assert len(load(root)) == 5


def test_corrupt_file_raises_without_skip_corrupt(root):
    (root / "cat" / "x.jpg").write_bytes(os.urandom(500))
    with pytest.raises(ValueError, match=r"x\.jpg could not be decoded"):
        load(root, skip_corrupt=False)
    with pytest.warns(UserWarning, match="Skipped"):
        load(root)  # writes a cache that knows x.jpg is corrupt ...
    with pytest.raises(ValueError, match=r"x\.jpg could not be decoded"):
        load(root, skip_corrupt=False)  # ... so the cached path fails the same way


def test_class_left_empty_by_skipping(root):
    write(root / "bird" / "only.png", solid(BLUE))
    (root / "bird" / "only.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.warns(UserWarning, match="Skipped"), pytest.raises(ValueError, match=r"bird.*no usable images"):
        load(root)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda cat: os.symlink("loop.png", cat / "loop.png"), OSError, "symbolic link in a loop"),
        (
            lambda cat: (os.symlink("b.png", cat / "a.png"), os.symlink("a.png", cat / "b.png")),
            OSError,
            "symbolic link in a loop",
        ),
        (lambda cat: os.symlink("gone.png", cat / "broken.png"), FileNotFoundError, "broken symbolic link"),
        (lambda cat: os.symlink("mouse", cat.parent / "mouse"), OSError, "symbolic link in a loop"),
    ],
    ids=["file-to-itself", "two-files-in-a-circle", "broken", "class-folder-to-itself"],
)
def test_a_link_loop_or_a_broken_link_names_the_file_and_the_fix(root, make, error, message):
    make(root / "cat")
    with pytest.raises(error, match=rf"image_folder cannot read {root}/\S+: it is a {message}.*or delete it"):
        load(root)


def test_a_class_folder_linked_to_the_root_is_refused(root):
    """Not a loop for os.walk (it does not follow links below the top), but the class would hold every image."""
    os.symlink(".", root / "all")
    with pytest.raises(ValueError, match=r"Class folder \S+/all is a symbolic link to .*every other class's images"):
        load(root)


def test_an_unreadable_image_file_names_the_file_and_the_fix(root, monkeypatch):
    read_bytes = folder.Path.read_bytes

    def refuse_one(path):  # tests run as root, where chmod would not stop a read
        if path.name == "1.png" and path.parent.name == "cat":
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(folder.Path, "read_bytes", refuse_one)
    with pytest.raises(PermissionError, match=rf"cannot read {root / 'cat' / '1.png'}: permission denied.*chmod a\+r"):
        load(root, cache=False)


@pytest.mark.parametrize("size", [0, -3, 2.5, "32", True, None])
def test_bad_size(root, size):
    with pytest.raises(ValueError, match="size must be a positive int"):
        image_folder(root, size, progress=False)


# ---------------------------------------------------------------------------------------------
# split()


def numbered(counts: list[int]) -> ImageDataset:
    """Images whose first pixel holds their index (red + 256 × green), class k repeated counts[k] times, mixed."""
    labels = torch.cat([torch.full((count,), k) for k, count in enumerate(counts)])
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))]
    images = torch.randint(0, 256, (len(labels), 3, 4, 4), dtype=torch.uint8, generator=torch.Generator())
    index = torch.arange(len(labels))
    images[:, 0, 0, 0], images[:, 1, 0, 0] = (index % 256).to(torch.uint8), (index // 256).to(torch.uint8)
    return ImageDataset(images, labels, [f"class{k}" for k in range(len(counts))])


def identities(data: ImageDataset) -> list[int]:
    return (data.images[:, 0, 0, 0].long() + 256 * data.images[:, 1, 0, 0].long()).tolist()


def test_split_is_stratified_disjoint_and_complete():
    data = numbered([50, 30, 20, 7])
    train, held = data.split(0.2, seed=0)
    assert torch.bincount(held.labels).tolist() == [10, 6, 4, 1]  # round(0.2 × count) of each class
    assert torch.bincount(train.labels).tolist() == [40, 24, 16, 6]
    assert sorted(identities(train) + identities(held)) == list(range(len(data)))
    assert identities(train) == sorted(identities(train))  # original order kept
    for part in (train, held):
        assert part.classes == data.classes
        assert torch.equal(part.labels, data.labels[identities(part)])


def test_split_is_deterministic_for_a_seed():
    data = numbered([40, 40])
    assert identities(data.split(0.25, seed=3)[1]) == identities(data.split(0.25, seed=3)[1])
    assert identities(data.split(0.25, seed=3)[1]) != identities(data.split(0.25, seed=4)[1])


def test_split_normalises_with_the_training_part():
    data = numbered([30, 30])
    train, held = data.split(0.5)
    floats = train.images.float() / 255
    assert torch.allclose(train.mean, floats.mean((0, 2, 3))) and torch.allclose(train.std, floats.std((0, 2, 3)))
    assert torch.equal(held.mean, train.mean) and torch.equal(held.std, train.std)


def test_split_keeps_one_image_of_each_class_in_each_part():
    train, held = numbered([3, 40]).split(0.05)  # round(0.15) = 0 would leave class0 out of held
    assert torch.bincount(held.labels).tolist() == [1, 2]
    train, held = numbered([3, 40]).split(0.9)
    assert torch.bincount(train.labels).tolist() == [1, 4]


@pytest.mark.parametrize("held_out", [0, 1, -0.1, 1.5])
def test_split_bad_fraction(held_out):
    with pytest.raises(ValueError, match="held_out"):
        numbered([10, 10]).split(held_out)


def test_split_needs_two_images_per_class():
    with pytest.raises(ValueError, match="'class1' has 1 image"):
        numbered([10, 1]).split(0.5)


# ---------------------------------------------------------------------------------------------
# It trains


def test_a_loaded_folder_trains(tmp_path):
    root = make_folder(tmp_path / "colours", {"red": 12, "green": 12, "blue": 12})
    train, held = load(root).split(0.25)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    history = gk.fit(model, train, batch_size=9, epochs=2, eval_data=held, device="cpu", progress=False)
    assert len(history.epochs) == 2 and history.final_eval_accuracy is not None
    assert all(torch.isfinite(torch.tensor(loss)) for loss in history.losses)

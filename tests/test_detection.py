"""Detection-style batches and outputs end to end (issue 24 §2), with a real torchvision detector.

torchvision's detectors take (list of images, list of {"boxes", "labels"} targets) and return a dict of
losses in training mode and a list of dicts of detections in eval mode. Here: the batch moves to the device
element by element and reaches the model as model(images, targets); fit trains as a hand-written loop does
and logs each loss; evaluate reports your metrics of the detections and says what it got without them;
gk.memory.estimate and gk.bench.flops_per_step measure a real step where fake and meta tensors cannot, and
say so; the shapes dataset knows its boxes. Small images (32 px, resized to 64 by the detector) keep each
step well under a second on one CPU thread.
"""

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn

import gpukit as gk
from gpukit.data.images import _bounding_boxes
from gpukit.step import split_batch, to_device

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons, not seconds (conftest.py)


def detector(seed: int = 0) -> nn.Module:
    """A Faster R-CNN with a MobileNetV3 backbone, from scratch, for the shapes' 10 classes + background."""
    torch.manual_seed(seed)
    return fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=len(gk.data.SHAPE_CLASSES) + 1, min_size=64, max_size=64
    )


@pytest.fixture(scope="module")
def shapes_with_boxes():
    return gk.data.shapes(16, 8, seed=2)


def batches(dataset, batch_size: int = 2, count: int | None = None) -> list:
    """The detection batches of `dataset` in order, as a DataLoader with collate_lists yields them."""
    loader = DataLoader(dataset.detection(), batch_size=batch_size, collate_fn=gk.data.collate_lists)
    return list(loader)[:count]


def first_label_right(detections, targets) -> float:
    """The share of images whose highest-scoring detection has the target's label (0 where none is found)."""
    hits = [len(d["labels"]) > 0 and int(d["labels"][0]) == int(t["labels"][0]) for d, t in zip(detections, targets)]
    return sum(hits) / len(hits)


def box_counts(detections, targets) -> dict:
    """A metric that returns a dict: a column per key."""
    return {"found": sum(len(d["boxes"]) for d in detections) / len(detections), "targets": float(len(targets))}


# ---------------------------------------------------------------------------------------------
# The batch


def test_a_detection_batch_moves_element_by_element_and_reaches_the_model_as_written(shapes_with_boxes):
    images, targets = batches(shapes_with_boxes[0], batch_size=3, count=1)[0]
    batch = split_batch((images, targets))
    assert batch.size == 3 and batch.target_to_model and batch.sample_name == "image"
    moved = to_device(batch, torch.device("meta"))  # a device other than the CPU, with no GPU needed
    assert isinstance(moved.args[0], list) and isinstance(moved.target, list) and isinstance(moved.target[0], dict)
    assert all(t.device.type == "meta" for t in moved.tensors()) and len(moved.tensors()) == 3 + 3 * 2
    assert all(t.device.type == "cpu" for t in batch.tensors())  # the batch you gave is left where it was

    calls = []

    class Recorder(nn.Module):
        def forward(self, *args):
            calls.append(args)
            return {"loss_a": torch.zeros(())}

    batch.call(Recorder())
    assert len(calls[0]) == 2 and calls[0][0] is images and calls[0][1] is targets


def test_default_collate_of_detection_examples_is_refused_naming_collate_lists(shapes_with_boxes):
    stacked = next(iter(DataLoader(shapes_with_boxes[0].detection(), batch_size=2)))  # ((2, 3, 32, 32), {boxes, …})
    with pytest.raises(TypeError, match=r"a tensor, or a list of dicts .*collate_fn=gk\.data\.collate_lists"):
        split_batch(stacked)


# ---------------------------------------------------------------------------------------------
# fit and evaluate


def test_fit_trains_a_detector_as_a_hand_written_loop_and_logs_each_loss(shapes_with_boxes):
    data = batches(shapes_with_boxes[0], count=3)
    options = dict(optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.01), lr=None)
    model, by_hand = detector(), detector()
    history = gk.fit(
        model, data, schedule="constant", warmup=0, log_every=1, progress=False, device="cpu", seed=0, **options
    )

    torch.manual_seed(0)  # what fit's seed=0 seeds: the detector's proposal sampling draws from it
    optimizer, expected = torch.optim.SGD(by_hand.parameters(), lr=0.01), []
    by_hand.train()
    for images, targets in data:
        losses = by_hand(images, targets)
        loss = sum(losses.values())
        expected.append({"loss": loss.item()} | {name: value.item() for name, value in losses.items()})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    columns = ["loss", "loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"]
    for row, hand in zip(history.steps, expected, strict=True):
        assert [name for name in row if name.startswith("loss")] == columns
        assert all(math.isclose(row[name], hand[name], rel_tol=1e-5, abs_tol=1e-7) for name in columns), (row, hand)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), by_hand.state_dict().values()))
    epoch = history.epochs[0]
    assert math.isclose(epoch["train_loss"], sum(epoch[f"train_{name}"] for name in columns[1:]), rel_tol=1e-6)
    assert history.sample_name == "image" and history.micro_batch_size == 2


def test_evaluate_a_detector_reports_your_metrics_of_its_detections(shapes_with_boxes):
    model, data = detector(), batches(shapes_with_boxes[1], batch_size=4)
    result = gk.evaluate(model, data, metrics={"label": first_label_right, "boxes": box_counts}, device="cpu")
    assert model.training  # evaluate ran it in eval mode, and put it back in training mode
    assert set(result) == {"label", "boxes_found", "boxes_targets", "samples"}  # no loss: none computed in eval mode
    model.eval()
    with torch.no_grad():
        detections = [(model(images), targets) for images, targets in data]
    images = sum(len(targets) for _, targets in detections)
    assert result["samples"] == images == 8
    assert math.isclose(result["label"], sum(first_label_right(*d) * len(d[1]) for d in detections) / images)
    found = sum(len(box) for outputs, _ in detections for box in (d["boxes"] for d in outputs)) / images
    assert math.isclose(result["boxes_found"], found) and result["boxes_targets"] == 4.0


def test_evaluate_a_detector_without_metrics_names_the_list_of_dicts_it_got(shapes_with_boxes):
    data = batches(shapes_with_boxes[1], batch_size=4)
    with pytest.raises(
        ValueError, match=r"returned a list of 4 dicts \('boxes', 'labels', 'scores'\) in eval mode"
    ) as error:
        gk.evaluate(detector(), data, device="cpu")
    assert "tuple" not in str(error.value) and "metrics=" in str(error.value)


def test_fit_with_held_out_detection_data_and_no_metric_fails_before_training(shapes_with_boxes):
    model = detector()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"eval_data's first batch .*a list of 2 dicts .*metrics=\{'name'"):
        gk.fit(
            model,
            batches(shapes_with_boxes[0], count=1),
            eval_data=batches(shapes_with_boxes[1]),
            progress=False,
            device="cpu",
        )
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())  # no step taken


def test_fit_reports_a_detectors_metric_as_an_eval_column_only(shapes_with_boxes):
    history = gk.fit(
        detector(),
        batches(shapes_with_boxes[0], count=2),
        eval_data=batches(shapes_with_boxes[1], batch_size=4),
        metrics={"label": first_label_right},
        max_steps=2,
        progress=False,
        device="cpu",
    )
    epoch = history.epochs[0]
    assert "eval_label" in epoch and "train_label" not in epoch  # training outputs are losses: nothing to measure
    assert "eval_loss" not in epoch and "train_loss_classifier" in epoch


# ---------------------------------------------------------------------------------------------
# Memory and FLOPs: measured on a real step, saying so


def test_estimate_of_a_detector_measures_real_steps_and_says_so(shapes_with_boxes):
    model, (batch,) = detector(), batches(shapes_with_boxes[0], count=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match="measured one real training step per batch size on cpu instead") as caught:
        small, large = gk.memory.estimate(model, batch, device="cpu", batch_sizes=[1, 4])
    assert len([w for w in caught if "gk.memory.estimate" in str(w.message)]) == 1
    assert "instead of a prediction" in small.source and "boxes" in small.source
    assert small.batch_size == 1 and large.batch_size == 4
    assert small.params == sum(p.nbytes for p in model.parameters())  # counted from a copy, against the model's own
    assert 0 < small.activations < large.activations
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_estimate_of_a_detection_batch_for_a_gpu_not_here_says_what_to_do(shapes_with_boxes):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the real step would be measured on it")
    (batch,) = batches(shapes_with_boxes[0], count=1)
    with pytest.raises(
        ValueError, match="no CUDA device here: measure it on the GPU machine, or here with device='cpu'"
    ):
        gk.memory.estimate(detector(), batch, device="cuda")


def test_flops_of_a_detector_are_counted_on_a_real_step_and_say_so(shapes_with_boxes):
    model, (batch,) = detector(), batches(shapes_with_boxes[0], count=1)
    images, targets = batch
    before = copy.deepcopy(model.state_dict())
    counter = FlopCounterMode(display=False)
    with torch.random.fork_rng(), counter:  # the same draws as flops_per_step's (it leaves the generator as it was)
        sum(copy.deepcopy(model)(images, targets).values()).backward()
    with pytest.warns(UserWarning, match="meta device cannot run this model .*counted on a real forward and backward"):
        flops = gk.bench.flops_per_step(model, batch)
    assert flops == counter.get_total_flops() > 0
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())


# ---------------------------------------------------------------------------------------------
# The shapes' boxes


def test_a_box_spans_its_masks_first_and_last_pixels():
    mask = torch.zeros(2, 6, 8, dtype=torch.bool)
    mask[0, 1:3, 2:7] = True  # rows 1-2, columns 2-6
    mask[1, 5, 0] = True  # one pixel, bottom left
    assert _bounding_boxes(mask).tolist() == [[2.0, 1.0, 7.0, 3.0], [0.0, 5.0, 1.0, 6.0]]


def test_shapes_have_boxes_that_follow_every_split_and_serve_a_detector(shapes_with_boxes):
    train, test = shapes_with_boxes
    for dataset in (train, test):
        boxes = dataset.boxes
        assert boxes.shape == (len(dataset), 4) and boxes.dtype == torch.float32
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 32).all() and (boxes[:, 2:] > boxes[:, :2]).all()
    larger = gk.data.shapes(60, 0, seed=3)[0]  # split needs two images of every class
    for piece in (*larger.split(held_out=0.25, seed=0), larger.subset(5)):
        rows = [next(i for i in range(len(larger)) if torch.equal(larger.images[i], image)) for image in piece.images]
        assert torch.equal(piece.boxes, larger.boxes[rows])
    image, target = train.detection()[3]
    assert torch.equal(image, train[3][0]) and torch.equal(target["boxes"], train.boxes[3:4])
    assert target["labels"].tolist() == [int(train.labels[3]) + 1]  # torchvision keeps label 0 for the background
    with pytest.raises(ValueError, match="no boxes"):
        gk.data.ImageDataset(train.images, train.labels, train.classes).detection()

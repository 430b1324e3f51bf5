"""A further family end to end: self-supervised learning with an EMA teacher (BYOL, DINO). The student learns to
match a teacher's centred, sharpened outputs on another view; the teacher is not trained by the optimizer but moves
towards the student after every optimizer step (an exponential moving average), and the centre is a running mean of
the teacher's outputs.

The form gpukit documents (README, fit's docstring): the teacher and the centre live in the model (a submodule and a
buffer), so fit moves, saves, resumes and puts them back with the rest; the update after each optimizer step is
torch's own Optimizer.register_step_post_hook on the optimizer you pass: fit adds no option for it, the same code runs
in a hand-written loop, and a step that fp16's loss scaling skips moves no teacher. Everything runs on the CPU,
seeded, on one thread.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpukit as gk
from tests.helpers import raising_at

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons (conftest.py)

CPU = torch.device("cpu")
FEATURES, WIDTH, PROTOTYPES = 6, 16, 8


class Dino(nn.Module):
    """DINO's objective on two views: the student's log-softmax against the teacher's sharpened softmax of its
    outputs less the centre. Returns (student logits (B, K), teacher targets (B, K)); the centre moves in training."""

    def __init__(self, seed: int = 0, momentum: float = 0.9):
        super().__init__()
        torch.manual_seed(seed)
        self.student = nn.Sequential(
            nn.Linear(FEATURES, WIDTH), nn.GELU(), nn.Dropout(0.1), nn.Linear(WIDTH, PROTOTYPES)
        )
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.register_buffer("center", torch.zeros(PROTOTYPES))
        self.momentum = momentum

    def forward(self, view_a: torch.Tensor, view_b: torch.Tensor):
        student = self.student(view_a)
        with torch.no_grad():
            teacher = self.teacher(view_b)
            targets = F.softmax((teacher - self.center) / 0.04, dim=-1)
            if self.training:
                self.center.mul_(0.9).add_(teacher.mean(0), alpha=0.1)
        return student, targets

    @torch.no_grad()
    def update_teacher(self) -> None:
        for teacher, student in zip(self.teacher.parameters(), self.student.parameters()):
            teacher.lerp_(student, 1 - self.momentum)


def dino_loss(outputs, target):
    """Cross-entropy of the student against the teacher's targets; the batch is unlabelled (target None)."""
    student, targets = outputs
    return -(targets * F.log_softmax(student / 0.1, dim=-1)).sum(-1).mean()


def with_teacher_update(model: Dino) -> torch.optim.Optimizer:
    """The student's optimizer, the teacher moved after each of its steps (torch's documented step post-hook)."""
    optimizer = torch.optim.AdamW(model.student.parameters(), lr=1e-2)
    optimizer.register_step_post_hook(lambda optimizer, args, kwargs: model.update_teacher())
    return optimizer


def views(count: int, size: int = 6, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "view_a": torch.randn(size, FEATURES, generator=generator),
            "view_b": torch.randn(size, FEATURES, generator=generator),
        }
        for _ in range(count)
    ]


TRAIN = views(6)
PLAIN = dict(lr=None, schedule="constant", warmup=0, progress=False, device=CPU, seed=0, loss_fn=dino_loss)


def assert_bit_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fit_moves_the_teacher_after_each_optimizer_step_as_a_hand_loop(accumulate):
    model, hand = Dino(), Dino()
    gk.fit(model, TRAIN, optimizer=with_teacher_update(model), accumulate=accumulate, **PLAIN)
    optimizer = torch.optim.AdamW(hand.student.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for number, batch in enumerate(TRAIN, 1):
        loss = dino_loss(hand(**batch), None)
        (loss / accumulate if accumulate > 1 else loss).backward()
        if number % accumulate == 0:
            optimizer.step()
            hand.update_teacher()  # once per optimizer step, not per micro-batch
            optimizer.zero_grad()
    assert_bit_equal(model, hand)  # the student, the teacher and the centre
    assert not torch.equal(model.teacher[0].weight, Dino().teacher[0].weight)  # the teacher moved
    assert not torch.equal(model.teacher[0].weight, model.student[0].weight)  # behind the student


@pytest.mark.parametrize("call", [4, 9])
def test_a_dino_run_stopped_midway_resumes_bit_equal_teacher_and_centre_included(call, tmp_path):
    """Ctrl-C at loss call 4 (after the save at step 2) or 9 (epoch 2); the same cell run again builds a new model,
    a new optimizer and its hook, as after a kernel restart: the teacher and the centre resume with the student."""
    options = dict(PLAIN, epochs=2, save_every=2, log_every=1)
    straight = Dino()
    gk.fit(straight, TRAIN, optimizer=with_teacher_update(straight), checkpoint_dir=tmp_path / "a", **options)
    stopped = Dino()
    with pytest.raises(KeyboardInterrupt):
        gk.fit(
            stopped,
            TRAIN,
            optimizer=with_teacher_update(stopped),
            checkpoint_dir=tmp_path / "b",
            **dict(options, loss_fn=raising_at(call, dino_loss, KeyboardInterrupt)),
        )
    torch.manual_seed(123)
    resumed = Dino()
    gk.fit(resumed, TRAIN, optimizer=with_teacher_update(resumed), checkpoint_dir=tmp_path / "b", **options)
    assert_bit_equal(straight, resumed)
    assert not torch.equal(resumed.center, torch.zeros(PROTOTYPES))


def test_an_optimizer_of_an_earlier_model_is_refused_before_any_work():
    """The notebook mistake: the model's cell run again, the optimizer's (and its hook's) not. Its steps would move
    the earlier model's student and teacher while this one stays where it is."""
    earlier, model = Dino(), Dino()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"updates 4 of its 4 parameters .* that are not this model's"):
        gk.fit(model, TRAIN, optimizer=with_teacher_update(earlier), **PLAIN)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())

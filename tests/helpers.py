"""Models and batches the tests share: one place, so that every test file builds them the same way.

The second kinds of model every feature is tried with besides the lessons' CNN:
- `tiny_gpt()`: gk.models.gpt on (B, T) byte tokens, seeded;
- `CausalLM`: Hugging Face-style, model(input_ids=…, attention_mask=…, labels=…) returns a ModelOutput
  with .loss and .logits (or a plain dict with `as_dict=True`);
- `images(batch)`: a seeded (B, 3, size, size) image batch; `tokens(batch, length)`: seeded byte tokens.
- `lesson_cells(path)`, `run_lesson_cells(path, ids)`: a lesson's code cells, and some of them run here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import gpukit as gk


def tiny_gpt(seed: int = 0, vocab_size: int = 256, **sizes) -> nn.Module:
    """A small GPT (32-token windows, width 32, 2 blocks, 2 heads unless `sizes` says otherwise)."""
    torch.manual_seed(seed)
    return gk.models.gpt(vocab_size, **({"max_seq_len": 32, "width": 32, "depth": 2, "heads": 2} | sizes))


def small_mlp(seed: int = 0) -> nn.Module:
    """An MLP from 6 features to 4 classes, the same weights for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


def images(batch: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def tokens(batch: int, length: int, seed: int = 0, vocab_size: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


class ModelOutput(dict):
    """The shape of a Hugging Face ModelOutput: a dict whose entries are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class CausalLM(nn.Module):
    """A Hugging Face-style causal LM: model(input_ids=…, attention_mask=…, labels=…) returns .loss and
    .logits; with `shift` the labels are shifted inside (position t predicts token t + 1), else labels are
    the targets of each position. `as_dict` returns a plain dict instead of a ModelOutput."""

    def __init__(self, vocab: int = 256, width: int = 16, seed: int = 0, shift: bool = True, as_dict: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.shift, self.as_dict = shift, as_dict

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.embed(input_ids))  # (B, T, V)
        output = ModelOutput(logits=logits)
        if labels is not None:
            scores, targets = (logits[:, :-1], labels[:, 1:]) if self.shift else (logits, labels)
            output["loss"] = F.cross_entropy(scores.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return dict(output) if self.as_dict else output


def lesson_cells(path: str | Path) -> dict[str, str]:
    """A lesson's code cells, source by cell id, in reading order."""
    cells = json.loads(Path(path).read_text())["cells"]
    return {cell["id"]: "".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"}


def run_lesson_cells(path: str | Path, cell_ids: list[str]) -> dict:
    """Run the code cells `cell_ids` of a lesson, in that order, in one namespace here (what the lesson's own code
    decides, without a kernel); returns the namespace. Temporary folders the cells made (gpukit-* under the system's
    temporary folder) are removed afterwards."""
    cells, namespace = lesson_cells(path), {"__name__": "__main__", "display": lambda *objects: None}
    try:
        for cell_id in cell_ids:
            exec(compile(cells[cell_id], f"{Path(path).name}[{cell_id}]", "exec"), namespace)
    finally:
        made = [value for value in namespace.values() if isinstance(value, Path) and value.name.startswith("gpukit-")]
        for folder in made:
            if folder.parent == Path(tempfile.gettempdir()):
                shutil.rmtree(folder, ignore_errors=True)
    return namespace


def raising_at(call: int, loss_fn, error: type[BaseException]):
    """`loss_fn`, raising `error` at its `call`-th call (a crash, a Ctrl-C): the run stops after call - 1 micro-batches."""
    calls = 0

    def raising(outputs, target):
        nonlocal calls
        calls += 1
        if calls == call:
            raise error
        return loss_fn(outputs, target)

    return raising

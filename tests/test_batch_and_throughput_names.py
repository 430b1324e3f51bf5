"""Names that say what they hold: History.micro_batch_size (what fit's batch_size means) beside
global_batch_size (samples per optimizer step: micro × accumulate × ranks), the old History.batch_size
deprecated; and throughput named by what is counted: tokens/s for (B, T) token targets only, a segmentation's
(B, C, H, W) outputs against (B, H, W) targets count images, not pixels as tokens.
(Ranks: tests/test_distributed.py checks global = micro × 2 on two processes.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import gpukit as gk
from tests.helpers import tiny_gpt

pytestmark = pytest.mark.timeout(300)


class Segmenter(nn.Module):
    """Per-pixel classes: (B, 3, H, W) images → (B, 4, H, W) logits, scored against (B, H, W) labels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


def segmentation_batches(count: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(count, 4, 3, 16, 16, generator=generator)
    return [(batch, (batch[:, 0] > 0).long() + (batch[:, 1] > 0).long()) for batch in images]


RUN = dict(progress=False, log_every=2, device="cpu", lr=0.05)


@pytest.fixture(scope="module")
def segmentation():
    batches = segmentation_batches()
    return gk.fit(Segmenter(), batches, accumulate=2, eval_data=batches[:2], **RUN), batches


@pytest.fixture(scope="module")
def text(corpus):
    return gk.fit(tiny_gpt(max_seq_len=16, width=16), corpus[0], batch_size=8, accumulate=2, max_steps=4, **RUN)


def test_a_segmentation_run_counts_images_not_pixels_as_tokens(segmentation):
    history, batches = segmentation
    assert history.sample_name == "image"
    assert history.steps and all("tokens_per_second" not in row for row in history.steps)
    assert history.tokens_per_second is None and history.images_per_second > 0
    assert "tokens_per_second" not in history.summary() and "images_per_second" in history.summary()
    result = gk.evaluate(Segmenter(), batches[:2], device="cpu")
    assert "tokens" not in result and result["samples"] == 8 and "accuracy" in result  # pixel accuracy still


def test_a_token_run_counts_tokens(text):
    assert text.sample_name == "sequence"
    assert all(row["tokens_per_second"] > 0 for row in text.steps)
    assert text.summary()["tokens_per_second"] == text.tokens_per_second


@pytest.mark.parametrize("kind", ["segmentation", "text"])
def test_micro_and_global_batch_sizes(segmentation, text, kind):
    history, micro = (segmentation[0], 4) if kind == "segmentation" else (text, 8)
    assert (history.micro_batch_size, history.global_batch_size) == (micro, 2 * micro)  # accumulate=2, one rank
    summary = history.summary()
    assert (summary["micro_batch_size"], summary["global_batch_size"]) == (micro, 2 * micro)
    with pytest.warns(DeprecationWarning, match="History.batch_size is deprecated.*global_batch_size"):
        assert history.batch_size == 2 * micro  # the old name keeps its old value for a release


def test_compares_table_shows_both_batch_sizes(segmentation, text):
    _, table = gk.plots.compare({"segmentation": segmentation[0], "text": text})
    assert table.column("micro_batch_size") == [4, 8] and table.column("global_batch_size") == [8, 16]


def test_a_file_saved_with_the_old_name_loads_into_global_batch_size(text, tmp_path):
    path = text.save(tmp_path / "run.json")
    record = json.loads(path.read_text())
    record["history"]["batch_size"] = record["history"].pop("global_batch_size")  # as gpukit wrote it before
    del record["history"]["micro_batch_size"]
    path.write_text(json.dumps(record))
    loaded = gk.History.load(path)
    assert (loaded.global_batch_size, loaded.micro_batch_size) == (16, 0)  # 0: not recorded then

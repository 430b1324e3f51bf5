"""Live views: in Jupyter the progress bar is a widget while training runs and becomes its final text line when
training ends (one bar on the screen, and a saved notebook shows what was done); its rate is History's, named."""

from __future__ import annotations

import re

import pytest
import torch
import tqdm.auto
import tqdm.notebook

import gpukit as gk
from gpukit import widgets
from gpukit.widgets import Progress


class FakeHistory:
    sample_name = "image"
    metric_names = ["eval_accuracy"]
    epochs = [{"epoch": 0}]
    samples_per_second = 1234.0
    tokens_per_second = None

    def final(self, name):
        return 0.875


def row(loss):
    return {"loss": loss, "samples_per_second": 99.0, "tokens_per_second": None}  # one window: not what the bar shows


class Handle:
    """IPython's DisplayHandle as a kernel returns it: what was shown, then what replaced it."""

    def __init__(self, shown):
        self.shown, self.updates = shown, []

    def update(self, data, raw=False):
        self.updates.append((data, raw))


@pytest.fixture
def in_jupyter(monkeypatch):
    """tqdm.auto's widget bar and a kernel's display(): each output shown is recorded with its handle."""
    import IPython.display

    handles = []

    def display(obj, display_id=None):
        assert display_id is True, "the bar's output must be replaceable: display(..., display_id=True)"
        handles.append(Handle(obj))
        return handles[-1]

    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.notebook.tqdm)  # what tqdm.auto picks in a Jupyter kernel
    monkeypatch.setattr(IPython.display, "display", display)
    return handles


def test_the_widget_becomes_one_text_line_of_what_was_done(in_jupyter, capsys):
    progress = Progress(total=6)
    for _ in range(3):
        progress.update(2, row(0.5), FakeHistory())
    progress.epoch_done(FakeHistory())
    progress.close()
    (handle,) = in_jupyter  # one output for the bar
    assert handle.shown is progress.bar.container  # the widget, while training ran
    ((data, raw),) = handle.updates  # then the same output, replaced once
    line = data["text/plain"]
    assert raw and set(data) == {"text/plain"} and "100%" in line and "6/6" in line, data
    assert "loss=0.500" in line and "median img/s=1234" in line and "eval_accuracy 0.875" in line
    assert capsys.readouterr().out == ""  # no second copy printed beside it


def test_outside_a_kernel_the_widget_bar_prints_its_last_line(monkeypatch, capsys):
    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.notebook.tqdm)
    progress = Progress(total=2)
    progress.update(2, row(0.25), FakeHistory())
    progress.close()
    assert "100%" in capsys.readouterr().out.strip().splitlines()[-1]


def test_text_bar_prints_no_extra_line(capsys):
    progress = Progress(total=2)
    progress.update(2, row(0.25), FakeHistory())
    progress.close()
    assert capsys.readouterr().out == ""  # a terminal bar already shows its final state (on stderr)


def final_rate(handles, unit: str) -> float:
    (handle,) = handles
    line = handle.updates[-1][0]["text/plain"]
    found = re.search(rf"median {re.escape(unit)}=(\d+)", line)
    assert found, line
    return float(found[1])


def test_the_bars_rate_is_historys_on_a_cnn_run(in_jupyter):
    gk.seed_everything(0)
    train, _ = gk.data.shapes(448, 0)  # 14 steps of 32, logged every 2: 7 windows, 6 after the first
    history = gk.fit(gk.models.fast_cnn(width=8), train, batch_size=32, epochs=1, device="cpu", log_every=2)
    assert len(history.steps) == 7
    assert final_rate(in_jupyter, "img/s") == round(history.samples_per_second)
    # An even count: the median is the mean of the middle two, not the last window's rate (what the bar showed).
    assert history.samples_per_second != history.steps[-1]["samples_per_second"]


def test_the_bars_rate_is_historys_in_tokens_for_a_small_gpt(in_jupyter):
    gk.seed_everything(0)
    tokens = torch.randint(0, 256, (64, 17), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])  # (B, T) inputs and next-token targets
    model = gk.models.gpt(max_seq_len=16, width=32, depth=1)
    history = gk.fit(model, data, batch_size=8, max_steps=8, device="cpu", log_every=2, optimizer="adamw")
    assert history.tokens_per_second is not None
    assert final_rate(in_jupyter, "tok/s") == round(history.tokens_per_second)


def test_the_rate_is_named_in_the_datas_unit():
    class Text(FakeHistory):
        sample_name, tokens_per_second = "sequence", 5e4

    assert widgets.throughput(FakeHistory()) == {"median img/s": "1234"}
    assert widgets.throughput(Text()) == {"median tok/s": "50000"}


@pytest.mark.timeout(300)
def test_in_a_kernel_the_saved_cell_holds_one_bar_its_final_line(tmp_path):
    """A real Jupyter kernel (nbclient applies the output's replacement as JupyterLab does): the training cell
    keeps one output for the bar, the final text line, and no widget beside it."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    source = (
        "import gpukit as gk\n"
        "train, _ = gk.data.shapes(256, 0)\n"
        "history = gk.fit(gk.models.fast_cnn(width=8), train, batch_size=32, epochs=1, device='cpu', log_every=2)\n"
        "print(f'History: {history.samples_per_second:.0f} img/s')"
    )
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3").execute()
    outputs = notebook.cells[0].outputs
    bars = [output for output in outputs if "100%|" in output.get("data", {}).get("text/plain", "")]
    widgets_left = [
        output for output in outputs if "application/vnd.jupyter.widget-view+json" in output.get("data", {})
    ]
    assert len(bars) == 1 and not widgets_left, outputs
    printed = "".join(output.get("text", "") for output in outputs if output.output_type == "stream")
    history_rate = re.search(r"History: (\d+) img/s", printed)[1]
    assert f"median img/s={history_rate}" in bars[0].data["text/plain"], (bars, printed)

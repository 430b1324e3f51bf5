"""Live views: the progress bar leaves a final text line in a saved notebook."""

import tqdm.auto
import tqdm.notebook

from gpukit.widgets import Progress


class FakeHistory:
    sample_name = "image"
    metric_names = ["eval_accuracy"]
    epochs = [{"epoch": 0}]

    def final(self, name):
        return 0.875


def row(loss):
    return {"loss": loss, "samples_per_second": 1234.0, "tokens_per_second": None}


def test_notebook_bar_ends_with_a_text_line_of_what_was_done(monkeypatch, capsys):
    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.notebook.tqdm)  # what tqdm.auto picks in a Jupyter kernel
    progress = Progress(total=6)
    drawn = capsys.readouterr().out  # the widget's text form, saved when it was first drawn
    for _ in range(3):
        progress.update(2, row(0.5), FakeHistory())
    progress.epoch_done(FakeHistory())
    progress.close()
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "0/6" in drawn and "6/6" not in drawn
    assert "100%" in last_line and "6/6" in last_line
    assert "loss=0.500" in last_line and "img_s=1234" in last_line and "eval_accuracy 0.875" in last_line


def test_text_bar_prints_no_extra_line(capsys):
    progress = Progress(total=2)
    progress.update(2, row(0.25), FakeHistory())
    progress.close()
    assert capsys.readouterr().out == ""  # a terminal bar already shows its final state (on stderr)

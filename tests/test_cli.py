"""The `gpukit` command, run as a user would: `python -m gpukit …` in a subprocess."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpukit
from gpukit.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA_GPU = gpukit.detect().device == "cuda"  # asks NVML, not the CUDA runtime
# Small enough for a 2-core CPU: one epoch of 8 steps.
SMALL_RUN = [
    "--train-size",
    "512",
    "--test-size",
    "128",
    "--epochs",
    "1",
    "--width",
    "8",
    "--batch-size",
    "64",
    "--device",
    "cpu",
]


def run_gpukit(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    environment = dict(os.environ, GPUKIT_PROFILE="tiny")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "gpukit", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,  # seconds; a hang fails the test instead of stalling the suite
    )


def test_doctor_prints_the_report(tmp_path):
    result = run_gpukit("doctor", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert torch.__version__ in result.stdout
    assert "no problems found" in result.stdout or "Warnings:" in result.stdout


@pytest.fixture(scope="module")
def small_training(tmp_path_factory):
    """One short training run shared by the tests below (each subprocess costs seconds)."""
    folder = tmp_path_factory.mktemp("train")
    result = run_gpukit("train", *SMALL_RUN, "--no-progress", "--checkpoint-dir", "checkpoints", cwd=folder)
    return result, folder


def test_train_prints_accuracy_and_throughput(small_training):
    result, _ = small_training
    assert result.returncode == 0, result.stderr
    last_line = result.stdout.strip().splitlines()[-1]
    fields = dict(field.split("=") for field in last_line.split())
    assert set(fields) == {"eval_accuracy", "images_per_second"}
    assert 0.0 <= float(fields["eval_accuracy"]) <= 1.0
    assert float(fields["images_per_second"]) > 0


def test_train_writes_a_checkpoint(small_training):
    result, folder = small_training
    assert result.returncode == 0, result.stderr
    assert (folder / "checkpoints" / "last.pt").is_file()


def _assert_clean_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("gpukit: error: ")]
    assert len(error_lines) == 1, result.stderr
    for word in words:
        assert word in error_lines[0], error_lines[0]


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["--batch-size", "0"], ["--batch-size", "positive"]),
        (["--device", "cpu", "--precision", "tf32"], ["tf32", "'fp32'"]),
    ],
    ids=["batch-size-0", "tf32-on-cpu"],
)
def test_bad_input_is_one_clear_line(tmp_path, arguments, words):
    _assert_clean_error(run_gpukit("train", *arguments, "--no-progress", cwd=tmp_path, timeout=60), *words)


def test_missing_cifar10_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_gpukit(
        "train", "--dataset", "cifar10", "--data-dir", str(empty), "--no-download", cwd=tmp_path, timeout=60
    )
    _assert_clean_error(result, "CIFAR-10", str(empty))


@pytest.mark.skipif(HAS_CUDA_GPU, reason="this machine has a CUDA GPU")
def test_cuda_without_gpu_is_a_clear_error(tmp_path):
    _assert_clean_error(run_gpukit("train", "--device", "cuda", cwd=tmp_path, timeout=60), "'cpu'")


# In-process checks of main(): the argument checks run before any data is built, so these are quick.


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["--epochs", "0"], ["--epochs", "positive"]),
        (["--train-size", "-5"], ["--train-size", "-5"]),
        (["--lr", "0"], ["--lr"]),
        (["--model", "resnet18", "--width", "8"], ["--width", "fast_cnn"]),
        (["--dataset", "cifar10", "--train-size", "100"], ["--train-size", "shapes"]),
        (["--model", "gpt"], ["--model gpt", "--dataset text"]),
        (["--dataset", "text", "--model", "fast_cnn"], ["--model gpt", "--dataset text"]),
        (["--dataset", "folder"], ["--data-dir", "subfolder"]),
        (["--seq-len", "64"], ["--seq-len", "text"]),
        (["--dataset", "text", "--augment"], ["--augment", "images"]),
    ],
    ids=[
        "epochs-0",
        "negative-train-size",
        "lr-0",
        "width-with-resnet18",
        "size-with-cifar10",
        "gpt-on-images",
        "cnn-on-text",
        "folder-without-path",
        "seq-len-on-images",
        "augment-text",
    ],
)
def test_main_rejects_bad_arguments(monkeypatch, capsys, arguments, words):
    monkeypatch.setenv("GPUKIT_PROFILE", "tiny")
    assert main(["train", *arguments]) == 2
    error = capsys.readouterr().err
    assert error.startswith("gpukit: error: ") and error.count("\n") == 1
    for word in words:
        assert word in error


@pytest.mark.parametrize("case", ["a file", "inside a file", "read-only"])
def test_unusable_checkpoint_dir_is_one_line_before_any_data(monkeypatch, capsys, tmp_path, case):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    # sysfs refuses new entries to every user, root included (chmod does not stop root)
    folder = {"a file": a_file, "inside a file": a_file / "runs", "read-only": "/sys/gpukit-test-runs"}[case]
    monkeypatch.setenv("GPUKIT_PROFILE", "tiny")
    monkeypatch.setattr("gpukit.cli._data", lambda *args: pytest.fail("the data was built before the check"))
    assert main(["train", "--checkpoint-dir", str(folder), "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"gpukit: error: --checkpoint-dir '{folder}' ") and error.count("\n") == 1, error
    assert "is a file, not a folder" in error if case == "a file" else "cannot be written" in error


def test_main_without_a_command_shows_usage(capsys):
    with pytest.raises(SystemExit) as exit:
        main([])
    assert exit.value.code == 2
    assert "usage: gpukit" in capsys.readouterr().err


def test_main_doctor(capsys):
    assert main(["doctor"]) == 0
    assert torch.__version__ in capsys.readouterr().out


def _last_line_fields(output: str) -> dict[str, str]:
    return dict(field.split("=") for field in output.strip().splitlines()[-1].split())


def test_train_a_gpt_on_your_text(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("GPUKIT_PROFILE", "tiny")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    arguments = [
        "--dataset",
        "text",
        "--data-dir",
        str(corpus),
        "--seq-len",
        "32",
        "--width",
        "32",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert main(["train", *arguments]) == 0, capsys.readouterr().err
    fields = _last_line_fields(capsys.readouterr().out)
    assert set(fields) == {"eval_loss", "tokens_per_second"}
    assert 0 < float(fields["eval_loss"]) < math.log(256)  # it learned: below a uniform guess over 256 bytes
    assert float(fields["tokens_per_second"]) > 0


def test_train_on_your_image_folder(monkeypatch, capsys, tmp_path):
    from torchvision.io import write_png

    monkeypatch.setenv("GPUKIT_PROFILE", "tiny")
    for label, colour in enumerate(("red", "blue")):
        (tmp_path / colour).mkdir()
        for index in range(10):
            image = torch.zeros(3, 20, 24, dtype=torch.uint8)
            image[2 * label] = 200 + index  # red or blue
            write_png(image, str(tmp_path / colour / f"{index}.png"))
    arguments = [
        "--dataset",
        "folder",
        "--data-dir",
        str(tmp_path),
        "--image-size",
        "16",
        "--width",
        "4",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert main(["train", *arguments]) == 0, capsys.readouterr().err
    output = capsys.readouterr().out
    assert "16 train / 4 held-out images of 2 classes" in output
    assert set(_last_line_fields(output)) == {"eval_accuracy", "images_per_second"}


def test_lab_copies_the_lessons_into_an_empty_folder_and_hands_over_to_jupyterlab(tmp_path, monkeypatch, capsys):
    from gpukit import jupyter

    started = []
    monkeypatch.setattr("os.execv", lambda path, argv: started.append(argv))
    for as_root in (True, False):
        monkeypatch.setattr(jupyter, "running_as_root", lambda as_root=as_root: as_root)
        assert main(["lab", str(tmp_path / "mine"), "--port=9999", "--no-browser"]) == 0
    root, user = started
    assert root[1:4] == ["-m", "jupyterlab", jupyter.CONTENTS_MANAGER] and "--allow-root" in root
    assert "--allow-root" not in user
    assert root[-3:] == ["--port=9999", "--no-browser", str(tmp_path / "mine")]  # the user's options, then the folder
    out = capsys.readouterr().out
    assert out.count("copied") == 1 and "running as root: JupyterLab starts with --allow-root" in out
    assert len(list((tmp_path / "mine").glob("[0-9][0-9]*_*.ipynb"))) >= 10


def test_lab_without_jupyterlab_says_which_extra_to_install(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "jupyterlab" else real(name))
    assert main(["lab", str(tmp_path)]) == 2
    assert "pip install 'gpukit[lab]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before copying anything


# ---------------------------------------------------------------------------------------------
# Arguments and commands (issue "Never silently wrong, third round"): each a one-line refusal naming the argument,
# where an errno message ("File exists", "Not a directory", "No such file or directory") or a traceback came out.


@pytest.mark.parametrize("command", ["lessons", "lab"])
@pytest.mark.parametrize("case", ["a file", "inside a file", "under /proc", "under /sys"])
def test_lessons_and_lab_refuse_a_dir_that_cannot_be_a_folder_in_one_line(tmp_path, monkeypatch, capsys, command, case):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    folder = {"a file": a_file, "inside a file": a_file / "sub", "under /proc": "/proc/sys", "under /sys": "/sys/x"}
    monkeypatch.setattr("os.execv", lambda *args: pytest.fail("JupyterLab was started"))
    assert main([command, str(folder[case])]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"gpukit: error: DIR '{folder[case]}' ") and error.count("\n") == 1, error
    said = {
        "a file": "is a file, not a folder",
        "inside a file": f"cannot be made: '{a_file}' in its path is a file",
        "under /proc": "lies in /proc",
        "under /sys": "lies in /sys",
    }
    assert said[case] in error and "pass a folder" in error, error
    assert a_file.read_text() == "not a folder" and not (tmp_path / "sub").exists()


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**64)])
def test_train_refuses_a_seed_out_of_range_before_any_data(monkeypatch, capsys, seed):
    monkeypatch.setenv("GPUKIT_PROFILE", "tiny")
    monkeypatch.setattr("gpukit.cli._data", lambda *args: pytest.fail("the data was built before the check"))
    assert main(["train", "--seed", seed, "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error == f"gpukit: error: --seed must be an integer in 0..4294967295 {error.split('4294967295 ', 1)[1]}"
    assert f"got {seed}." in error and error.count("\n") == 1

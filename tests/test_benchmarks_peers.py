"""benchmarks/peers.py: it runs in a tiny configuration, it stops when a contender's parameters are not bit-equal to
the hand-written loop's, and a peer that is not installed is skipped with a printed line. Not its speed: that is
what running it measures (benchmarks/RESULTS.md)."""

import contextlib
import importlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--models", "mlp", "--mlp-steps", "6", "--rounds", "1"]


@pytest.fixture
def peers(monkeypatch):
    """The benchmark as a module (it imports fit_overhead from its own folder); torch's threads restored after."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    threads = torch.get_num_threads()
    yield importlib.import_module("peers")
    torch.set_num_threads(threads)


def in_this_process(peers):
    """A stand-in for peers.run_child that runs the benchmark's fresh-process commands here: a fresh Python took
    5-70 s on this shared 2-core machine (importing torch alone took 36 s at load 11). The command lines are
    still parsed by the benchmark and its printed JSON read back, as from a child."""

    def run(command):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            if command[1] == "-c":  # import a module after torch, print the seconds
                exec(command[2], {})
            else:
                assert command[1] == peers.__file__
                peers.main(command[2:])
        return json.loads(out.getvalue())

    return run


def test_tiny_run_without_peers_prints_skip_lines_and_a_table(peers, monkeypatch, capsys, tmp_path):
    # None in sys.modules makes an import fail with ImportError, as a missing package does, installed or not.
    monkeypatch.setitem(sys.modules, "lightning_fabric", None)
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.setattr(peers, "run_child", in_this_process(peers))
    figures = tmp_path / "peers.json"
    peers.main([*TINY, "--first-step", "1", "--json", str(figures)])
    out = capsys.readouterr().out
    assert "skipped: Lightning Fabric because it cannot be imported" in out
    assert "skipped: Accelerate because it cannot be imported" in out
    assert "mlp: every contender bit-equal to the hand-written loop (hand-written, gpukit.fit)" in out
    summary, steps = json.loads(figures.read_text())["tables"]
    assert [row["loop"] for row in summary["rows"]] == ["hand-written", "gpukit.fit"]
    assert {"mlp ÷ hand", "first step ms", "import beyond torch ms"} <= set(summary["columns"])
    hand, fit = steps["rows"]
    assert hand["ratio"] == 1.0 and hand["bit_equal"] and fit["bit_equal"] and fit["median_step_ms"] > 0
    # gpukit's import beyond torch was measured, the hand-written loop imports nothing.
    assert summary["rows"][0]["import beyond torch ms"] == "0" and summary["rows"][1]["import beyond torch ms"] != "0"


def test_a_contender_with_another_learning_rate_stops_the_benchmark(peers):
    def mutated(model, loader, steps, lr, device, kind):
        peers.hand_loop(model, loader, steps, lr * 1.001, device, kind)

    loops = {peers.HAND: peers.hand_loop, "gpukit.fit": peers.fit_loop, "lr × 1.001": mutated}
    args = peers.parse_arguments(TINY)
    with pytest.raises(SystemExit, match="not bit-equal to the hand-written loop") as stopped:
        peers.measure("mlp", args, torch.device("cpu"), loops)
    assert "lr × 1.001 (max parameter difference" in str(stopped.value) and "gpukit.fit" not in str(stopped.value)


def test_installed_peers_do_the_same_work_as_the_hand_written_loop(peers):
    pytest.importorskip("lightning_fabric", reason="Lightning Fabric is not installed (pip install 'gpukit[bench]')")
    pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install 'gpukit[bench]')")
    loops, skipped = peers.contenders()
    assert not skipped and set(loops) == {"hand-written", "gpukit.fit", "Lightning Fabric", "Accelerate"}
    args = peers.model_args("mlp", peers.parse_arguments(TINY))
    loader, initial, lr = peers.setup("mlp", args, torch.device("cpu"))
    differences = peers.same_work(loops, initial, loader, args.steps, lr, torch.device("cpu"), "mlp")
    assert differences == dict.fromkeys(loops, 0.0)

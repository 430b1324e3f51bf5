"""Lesson 04's checks that a CPU machine cannot make whole, run here on made-up measurements: the bytes a ring
all-reduce writes (counted by the kernel; a formula without 2(n-1)/n, with n for n - 1, or a count 2x or 0.5x off
fails), the DDP variants' wire_bytes against that count, and the two GPU-only checks, SyncBatchNorm's run against
the big batch's and the efficiency measured on several GPUs against the cost model's (each passes on plausible
numbers and fails with the measurement 2x or 0.5x off).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.distributed import scaling
from tests.helpers import lesson_cells

LESSON = Path(__file__).resolve().parents[1] / "notebooks" / "04_multi_gpu_scaling.ipynb"
CELLS = lesson_cells(LESSON)
MESSAGE = 2**20
HEADER = 1.0005  # gloo's headers: what 3 ranks wrote for 1 MiB read 1.0005x the ring's bytes on this machine


def run(cell_id: str, **namespace) -> dict:
    namespace = {"gk": gk, "math": math, "torch": torch, "scaling": scaling, **namespace}
    exec(compile(CELLS[cell_id], f"{LESSON.name}[{cell_id}]", "exec"), namespace)
    return namespace


def definitions(cell_id: str) -> dict:
    """Only the functions a lesson cell defines (the rest of the cell trains, which is not wanted here)."""
    tree = ast.parse(CELLS[cell_id])
    tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    namespace = {"torch": torch, "math": math}
    exec(compile(tree, f"{LESSON.name}[{cell_id}]", "exec"), namespace)
    return namespace


def counts(factor: float = 1.0, sizes=(2, 3)) -> list[dict[int, int]]:
    """What each of max(sizes) ranks wrote, made up: the ring's bytes and gloo's headers, × factor."""
    return [
        {n: round(factor * HEADER * scaling.ring_traffic(n) * MESSAGE) for n in sizes if rank < n}
        for rank in range(max(sizes))
    ]


def wire_check(wire_counts, capsys) -> str:
    run("wire-bytes-check", wire_counts=wire_counts, WIRE_WORLD_SIZES=[2, 3], WIRE_MESSAGE=MESSAGE)
    return capsys.readouterr().out


def test_the_wire_count_passes_at_two_and_three_ranks(capsys):
    out = wire_check(counts(), capsys)
    assert out.count("check passed") == 2, out


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_count_off_by_2x_either_way_fails(factor, capsys):
    with pytest.raises(gk.CheckFailed, match="with 2 ranks"):
        wire_check(counts(factor), capsys)


@pytest.mark.parametrize(
    "formula, ranks",
    [
        (lambda n: 1.0 if n > 1 else 0.0, "with 3 ranks"),
        (lambda n: 2.0, "with 2 ranks"),
        (lambda n: (n - 1) / n, "with 2"),
    ],
    ids=["no factor", "n for n-1", "half the factor"],
)
def test_a_wrong_ring_formula_fails(formula, ranks, monkeypatch, capsys):
    wire_counts = counts()  # what a real ring writes, counted before the formula goes wrong
    monkeypatch.setattr(scaling, "ring_traffic", formula)
    with pytest.raises(gk.CheckFailed, match=ranks):
        wire_check(wire_counts, capsys)


def test_no_proc_self_io_is_said_aloud(capsys):
    assert wire_check(None, capsys).startswith("skipped: every rank sends 2(n−1)/n")


def variant_rows(gradient: int = 4 * 10_000) -> list[dict]:
    return [
        {"variant": "no all-reduce (no_sync)", "wire_bytes": 0, "allreduced_bytes": 0},
        {"variant": "float32", "wire_bytes": gradient * scaling.ring_traffic(2), "allreduced_bytes": gradient},
        {"variant": "fp16", "wire_bytes": gradient * scaling.ring_traffic(2) / 2, "allreduced_bytes": gradient // 2},
    ]


@pytest.mark.parametrize("factor, passes", [(1.0, True), (2.0, False), (0.5, False)])
def test_the_variants_wire_bytes_against_the_count(factor, passes, capsys):
    rows = [{**row, "wire_bytes": row["wire_bytes"] * factor} for row in variant_rows()]
    namespace = {"costs": {"variants": rows}, "wire_counts": counts(), "WORKERS": 2, "WIRE_MESSAGE": MESSAGE}
    if passes:
        run("wire-bytes-variants", **namespace)
        assert "check passed" in capsys.readouterr().out
    else:
        with pytest.raises(gk.CheckFailed, match="wire_bytes"):
            run("wire-bytes-variants", **namespace)


# ---------------------------------------------------------------------------------------------
# SyncBatchNorm (GPU only): made-up parameters after training


def batchnorm_cnn():
    torch.manual_seed(0)
    return gk.models.fast_cnn(4)


def trained(step_scale: float, noise: float = 0.0) -> dict[str, torch.Tensor]:
    """Parameters after a made-up training run: the seeded start plus `step_scale` × a fixed update."""
    generator = torch.Generator().manual_seed(1)
    start = dict(batchnorm_cnn().named_parameters())
    return {
        name: (
            value
            + step_scale * 0.01 * torch.randn(value.shape, generator=generator)
            + noise * torch.randn(value.shape, generator=generator)
        ).detach()
        for name, value in start.items()
    }


class BigBatch:
    """The big batch's model after training, as far as the check reads it (reference_cnn.named_parameters())."""

    def named_parameters(self):
        return iter(trained(1.0).items())


def syncbatchnorm_check(synced: dict, capsys) -> str:
    reference = BigBatch()
    run(
        "syncbatchnorm-check",
        ranks=[{"syncbatchnorm": synced}],
        reference_cnn=reference,
        batchnorm_cnn=batchnorm_cnn,
        batchnorm_difference=1.0,
        **definitions("b7d2e4a1"),
    )  # largest_difference, as the lesson defines it
    return capsys.readouterr().out


def test_syncbatchnorm_passes_where_it_matches_the_big_batch(capsys):
    out = syncbatchnorm_check(trained(1.0, noise=1e-6), capsys)
    assert out.count("check passed") == 2, out


@pytest.mark.parametrize("step_scale", [2.0, 0.5])
def test_syncbatchnorm_steps_2x_either_way_fail(step_scale, capsys):
    with pytest.raises(gk.CheckFailed, match="as far from their start"):
        syncbatchnorm_check(trained(step_scale), capsys)


def test_syncbatchnorm_is_skipped_aloud_without_gpus(capsys):
    run("syncbatchnorm-check", ranks=[{}], batchnorm_difference=1e-2)
    assert capsys.readouterr().out.startswith("skipped: SyncBatchNorm brings the result back")


# ---------------------------------------------------------------------------------------------
# The efficiency on several GPUs against the cost model (GPU only)


def efficiency_check(measured: float, predicted: float, multi_gpu: bool = True) -> None:
    run(
        "efficiency-check",
        BACKEND="nccl",
        WORKERS=8,
        MULTI_GPU=multi_gpu,
        curves={"fast CNN, this machine's nccl link": [{"gpus": 8, "efficiency": predicted}]},
        costs={"workers": [{"efficiency": 1.0}, {"efficiency": measured}]},
    )


@pytest.mark.parametrize("measured, predicted", [(0.93, 0.95), (0.75, 0.95), (1.0, 0.95), (0.6, 0.8)])
def test_the_efficiency_near_the_model_passes(measured, predicted, capsys):
    efficiency_check(measured, predicted)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("measured, predicted", [(0.93, 0.95), (0.75, 0.95), (0.6, 0.8)])
@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_the_efficiency_2x_either_way_fails(measured, predicted, factor):
    with pytest.raises(gk.CheckFailed, match="efficiency measured on 8 GPUs"):
        efficiency_check(measured * factor, predicted)


def test_the_efficiency_is_skipped_aloud_on_a_cpu(capsys):
    efficiency_check(0.4, 0.95, multi_gpu=False)
    assert capsys.readouterr().out.startswith("skipped: measured against predicted efficiency")

"""gk.distributed.launch: results from every rank, their output, failures that surface instead of
hanging, and clear errors for bad input. CPU and gloo only; spawned launches cost a few seconds
each (every worker imports torch), forked ones a fraction of a second."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import gpukit as gk
from gpukit.distributed import WorkerError, launch

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def no_cuda_device(monkeypatch):
    """The tests that fork: as on a machine without a CUDA device, where launch allows fork (elsewhere it refuses,
    see test_fork_is_the_fastest_start_method_only_without_a_cuda_device). Their workers run no backward, the one
    thing autograd's device threads would break in a forked child, so they fork on a GPU machine too."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# A function as a notebook cell defines it: its module cannot be imported by the workers, so it
# must travel by value (cloudpickle), with the global it reads.
NOTEBOOK_CELL = """
import os
import torch
import gpukit as gk

GREETING = "hello"

def cell_function(offset):
    worker = gk.distributed.setup()
    total = torch.tensor([float(worker.rank + offset)])
    torch.distributed.all_reduce(total)
    print(GREETING, "from rank", worker.rank)
    gk.distributed.print0("only rank 0 says this")
    return {
        "rank": worker.rank, "world_size": worker.world_size, "device": str(worker.device), "total": total,
        "threads": torch.get_num_threads(), "port": os.environ["MASTER_PORT"],
    }
"""


def notebook_function():
    namespace = {"__name__": "a_notebook_cell"}
    exec(compile(NOTEBOOK_CELL, "<notebook cell>", "exec"), namespace)
    return namespace["cell_function"]


def test_spawn_returns_every_ranks_result_and_shows_their_output(capsys, monkeypatch):
    # The parent "has touched CUDA": spawned workers do not care (fork would refuse, see below).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    results = launch(notebook_function(), 2, 10, backend="gloo")
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["device"] == "cpu" for r in results)
    assert all(torch.equal(r["total"], torch.tensor([21.0])) for r in results)  # (0+10) + (1+10)
    assert all(r["threads"] == max(1, (os.cpu_count() or 1) // 2) for r in results)  # the cores are split
    assert results[0]["port"] == results[1]["port"]
    output = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in output and "[rank 1] hello from rank 1" in output
    assert output.count("only rank 0 says this") == 1


def raise_on_rank_one():
    worker = gk.distributed.setup()
    print("rank", worker.rank, "is about to wait for the others")
    if worker.rank == 1:
        time.sleep(0.5)
        raise ValueError("rank one is broken")
    torch.distributed.barrier()  # rank 0 waits here for a rank that will never come


def test_failing_rank_stops_the_others_and_raises_its_traceback(capsys):
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        launch(raise_on_rank_one, 2, backend="gloo", timeout=170)
    # Rank 0 was stopped, not left waiting in the barrier until the timeout: the margin covers two spawned
    # workers importing torch on a loaded 2-core machine.
    assert time.monotonic() - started < 120
    error = caught.value
    assert error.rank == 1 and isinstance(error.exception, ValueError)
    assert "rank 1 of 2 failed with ValueError: rank one is broken" in str(error)
    assert "in raise_on_rank_one" in error.remote_traceback  # the worker's own frames
    assert "[rank 0] rank 0 is about to wait" in capsys.readouterr().out  # output before the failure is shown


def die_on_rank_one():
    worker = gk.distributed.setup()
    if worker.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.distributed.barrier()


@pytest.mark.usefixtures("no_cuda_device")
def test_killed_rank_is_reported_and_nothing_hangs():
    with pytest.raises(WorkerError, match=r"rank 1 of 2 was killed by SIGKILL") as caught:
        launch(die_on_rank_one, 2, backend="gloo", start_method="fork", timeout=60)
    assert caught.value.rank == 1 and caught.value.exception is None


def sleep_forever():
    time.sleep(3600)


@pytest.mark.usefixtures("no_cuda_device")
def test_timeout_stops_every_worker():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timeout=1.0 s; rank\(s\) \[0, 1\] were still running"):
        launch(sleep_forever, 2, backend="gloo", start_method="fork", timeout=1.0)
    assert time.monotonic() - started < 60  # stopped soon after the 1 s timeout, not left sleeping for an hour


def all_reduce_ranks():
    worker = gk.distributed.setup()
    total = torch.arange(4.0) * (worker.rank + 1)  # a multi-threaded op would hang a forked worker with 2 threads
    torch.distributed.all_reduce(total)
    gk.distributed.cleanup()
    return total, torch.get_num_threads()


@pytest.mark.usefixtures("no_cuda_device")
def test_fork_after_the_parent_used_openmp_runs_with_one_thread():
    torch.nn.functional.conv2d(torch.randn(8, 3, 32, 32), torch.randn(8, 3, 3, 3)).sum()  # the parent uses OpenMP
    results = launch(all_reduce_ranks, 2, backend="gloo", start_method="fork", timeout=60)
    for total, threads in results:
        assert torch.equal(total, torch.arange(4.0) * 3) and threads == 1


def test_fork_is_the_fastest_start_method_only_without_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU machine
    assert gk.distributed.fork_refusal() is None and gk.distributed.fastest_start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # CUDA never initialised, but devices visible
    assert "2 CUDA device(s)" in gk.distributed.fork_refusal() and gk.distributed.fastest_start_method() == "spawn"


def test_fork_is_refused_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialised") as caught:
        launch(all_reduce_ranks, 2, backend="gloo", start_method="fork")
    for fix in ("start_method='spawn'", "restart the kernel", "torchrun"):
        assert fix in str(caught.value)


def return_a_lock():
    return threading.Lock()


def exit_early():
    sys.exit(0)


@pytest.mark.parametrize(
    "function, message",
    [
        (return_a_lock, "rank 0 returned a lock that cannot be sent back"),
        (exit_early, "rank 0 ended without returning"),
    ],
    ids=["unpicklable-result", "sys-exit"],
)
@pytest.mark.usefixtures("no_cuda_device")
def test_results_that_cannot_come_back_are_clear_errors(function, message):
    with pytest.raises(WorkerError, match=message):
        launch(function, 1, backend="gloo", start_method="fork", timeout=60)


# ---------------------------------------------------------------------------------------------
# Bad input: refused before any process starts


def nothing():
    return None


@pytest.mark.parametrize(
    "arguments, options, error, message",
    [
        ((0,), {}, ValueError, r"nprocs must be a positive integer \(processes\), got 0"),
        ((-2,), {}, ValueError, "nprocs must be a positive"),
        ((1.5,), {}, ValueError, "nprocs must be a positive"),
        ((2,), {"backend": "mpi"}, ValueError, "backend='mpi' is not supported"),
        ((2,), {"start_method": "forkserver"}, ValueError, "start_method='forkserver' is unknown"),
        ((2,), {"timeout": 0}, ValueError, "timeout must be a positive"),
        ((2,), {"port": 70_000}, ValueError, "port must be an integer in 1..65535"),
    ],
)
@pytest.mark.parametrize("gpus", [0, 1])
def test_bad_arguments(arguments, options, error, message, gpus, monkeypatch):
    """The same errors on a machine with no GPU and with one, where launch would pick NCCL."""
    import gpukit.env

    monkeypatch.setattr(gpukit.env, "detect", lambda: gpukit.env.Env("cuda" if gpus else "cpu", gpus))
    with pytest.raises(error, match=message):
        launch(nothing, *arguments, **options)


def test_nccl_needs_gpus():
    if gk.detect().gpu_count:
        pytest.skip("this machine has CUDA GPUs")
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA GPUs.*backend='gloo'"):
        launch(nothing, backend="nccl")


def test_more_nccl_processes_than_gpus(monkeypatch):
    import gpukit.env

    one_gpu = gpukit.env.Env("cuda", 1)
    monkeypatch.setattr(gpukit.env, "detect", lambda: one_gpu)
    with pytest.raises(ValueError, match=r"nprocs=2 but this machine has 1 CUDA GPU.*nprocs <= 1.*backend='gloo'"):
        launch(nothing, 2, backend="nccl")


def test_a_function_that_cannot_be_sent():
    lock = threading.Lock()

    def uses_a_lock():
        with lock:
            return 1

    with pytest.raises(TypeError, match=r"cannot send 'uses_a_lock'.*Create such objects .* inside the function"):
        launch(uses_a_lock, 2, backend="gloo")


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_port_in_use(gpus, monkeypatch):
    import gpukit.env

    monkeypatch.setattr(gpukit.env, "detect", lambda: gpukit.env.Env("cuda" if gpus else "cpu", gpus))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is in use.*port=None"):
            launch(nothing, 2, port=port)


def test_not_a_function():
    with pytest.raises(TypeError, match="needs a function"):
        launch("train.py", 2)


def test_wait_for_jobs_returns_outputs_and_stops_a_hang_with_what_it_printed():
    def start(code):
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    assert gk.distributed.wait_for_jobs([start("print('done')"), start("import sys; sys.exit(3)")], 60) == [
        ("done\n", ""),
        ("", ""),
    ]
    quick, hung = start("print('quick')"), start("print('waiting for rank 1', flush=True); import time; time.sleep(60)")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="waiting for rank 1"):
        gk.distributed.wait_for_jobs([quick, hung], 3)
    assert time.monotonic() - started < 30 and hung.poll() is not None  # stopped, not left running

"""`gpukit train` under torchrun, as on a cluster: two agents acting as two machines, a worker
killed mid-training that the job survives, and a damaged checkpoint that stops the job.

Every run is deterministic (CPU, gloo, one thread per worker, fixed seeds), so the job that was
killed and resumed must end with exactly the parameters of the job that was not.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DRILL = REPO_ROOT / "examples" / "cluster" / "fault_drill.py"
EPOCHS = 4
# Small enough for a 2-core CPU; 16 steps per epoch and rank, so a kill lands mid-training.
TRAIN = [
    "train", "--device", "cpu", "--train-size", "1024", "--test-size", "256", "--epochs", str(EPOCHS),
    "--width", "8", "--batch-size", "32", "--no-progress",
]  # fmt: skip
TIMEOUT = 240  # seconds per torchrun job: a hang fails the test instead of stalling the suite

pytestmark = pytest.mark.timeout(600)


def environment() -> dict[str, str]:
    variables = dict(os.environ, GPUKIT_PROFILE="tiny", OMP_NUM_THREADS="1")  # one thread: same sums every run
    # A fresh rendezvous store per attempt: with torchrun's shared store a restarted group can read the
    # first attempt's addresses and fail or hang (measured with torch 2.14; see gpukit.distributed.setup).
    variables["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    variables["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), variables.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        variables.pop(name, None)  # the test itself may run inside a distributed job
    return variables


def torchrun(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *arguments]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "last.pt", map_location="cpu", weights_only=True)["model"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two torchrun agents on this machine, one worker each, meeting through c10d rendezvous:
    the same commands as on two machines, with 127.0.0.1 for the first machine's address."""
    folder = tmp_path_factory.mktemp("two_nodes")
    port = free_port()
    command = torchrun(
        "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=two-nodes-test", "-m", "gpukit", *TRAIN, "--checkpoint-dir", str(folder / "checkpoints"),
    )  # fmt: skip
    agents = [
        subprocess.Popen(
            command, cwd=folder, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        outputs = [agent.communicate(timeout=TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    return [agent.returncode for agent in agents], outputs, folder / "checkpoints"


def test_two_nodes_train_to_completion_and_only_rank_0_prints(two_nodes):
    codes, outputs, checkpoints = two_nodes
    assert codes == [0, 0], "\n".join(out + err for out, err in outputs)
    stdout = "".join(out for out, _ in outputs)
    assert stdout.count("eval_accuracy=") == 1  # the result line comes from rank 0 only
    assert stdout.count("training fast_cnn") == 1
    state = torch.load(checkpoints / "last.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == EPOCHS and len(state["history"]["epochs"]) == EPOCHS


def test_killed_worker_is_restarted_and_ends_with_the_uninterrupted_parameters(two_nodes, tmp_path):
    """torchrun --max-restarts=1: rank 1 dies by SIGKILL after the first checkpoint, the group restarts,
    resumes from the checkpoint and ends exactly where the uninterrupted two-node job ended."""
    codes, _, uninterrupted = two_nodes
    assert codes == [0, 0]
    checkpoints = tmp_path / "checkpoints"
    result = subprocess.run(
        torchrun("--nproc-per-node=2", "--max-restarts=1", str(DRILL), *TRAIN, "--checkpoint-dir", str(checkpoints)),
        cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    drill = json.loads((checkpoints / "drill.json").read_text())
    assert drill["rank"] == 1 and 1 <= drill["checkpoint_epoch"] < EPOCHS  # it died mid-training
    assert "exitcode: -9" in result.stderr  # torchrun saw the SIGKILL and restarted the group
    assert result.stdout.count("training fast_cnn") == 2  # two attempts, each printed once (rank 0)
    resumed, reference = final_model(checkpoints), final_model(uninterrupted)
    assert resumed.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(resumed[name], tensor), name


def test_damaged_checkpoint_stops_the_job_with_a_clear_error(two_nodes, tmp_path):
    _, _, complete = two_nodes
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    whole = (complete / "last.pt").read_bytes()
    (checkpoints / "last.pt").write_bytes(whole[: len(whole) // 2])  # a write cut off halfway
    result = subprocess.run(
        torchrun("--nproc-per-node=2", "-m", "gpukit", *TRAIN, "--checkpoint-dir", str(checkpoints)),
        cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode != 0 and "eval_accuracy=" not in result.stdout  # never a silent fresh start
    # The first rank to refuse exits with gpukit's bad-input code and its one-line message; torchrun then
    # stops the other rank (which may or may not have printed the same line first).
    assert "gpukit: error: cannot resume from" in result.stderr and "delete the file to start afresh" in result.stderr
    assert "exitcode: 2" in result.stderr
    assert (checkpoints / "last.pt").read_bytes() == whole[: len(whole) // 2]  # left as it was

"""Fault drill: `gpukit train`, with one worker killed once in mid-training, as when a machine dies.

Run it under torchrun with a restart allowed and watch the job resume from its last checkpoint:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 --max-restarts=1 \
        examples/cluster/fault_drill.py train --device cpu --epochs 4 --checkpoint-dir runs/drill --no-progress

Both settings give every attempt a fresh rendezvous store (c10d rendezvous, not sharing its store with the
workers); without either, the restarted group may read the first attempt's addresses and fail to connect
(README.md beside this file, "Surviving a failure").

Everything after the script's name is a `gpukit train` command line (it needs --checkpoint-dir).
In the first attempt, the worker of rank GPUKIT_DRILL_RANK (default 1) sends itself SIGKILL, with
no chance to clean up, as soon as the first checkpoint appears. torchrun sees the worker die,
stops the others, and starts the whole group again; every rank then resumes from the checkpoint.
`drill.json` in the checkpoint folder records which rank died and at which saved epoch; `steps_rank<R>.json`
records, for each rank of the attempt that finished, the restart it was (torchrun's TORCHELASTIC_RESTART_COUNT), the
epoch of the checkpoint it found on starting, and the optimizer steps it took, counted by a torch hook on every
optimizer's step (not by gpukit): a resumed attempt takes only the steps after the checkpoint, a restart from scratch
takes them all.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gpukit.commands.cli import main


def kill_when_checkpointed(folder: Path, record: Path, rank: int) -> None:
    checkpoint = folder / "last.pt"
    while not checkpoint.exists():
        time.sleep(0.01)
    epoch = torch.load(checkpoint, map_location="cpu", weights_only=True)["epoch"]
    record.write_text(json.dumps({"rank": rank, "checkpoint_epoch": epoch, "time": time.time()}))
    os.kill(os.getpid(), signal.SIGKILL)  # like a power cut: no finally blocks, no exit handlers


def count_optimizer_steps() -> list[int]:
    """A one-element counter of optimizer.step() calls in this process, by torch's global hook on every optimizer."""
    steps = [0]
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: steps.__setitem__(0, steps[0] + 1))
    return steps


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--checkpoint-dir" not in arguments:
        sys.exit("fault_drill.py: give --checkpoint-dir: the drill shows resuming from a checkpoint.")
    folder = Path(arguments[arguments.index("--checkpoint-dir") + 1])
    record = folder / "drill.json"
    rank = int(os.environ.get("RANK", 0))
    if rank == int(os.environ.get("GPUKIT_DRILL_RANK", 1)) and not record.exists():  # first attempt only
        threading.Thread(target=kill_when_checkpointed, args=(folder, record, rank), daemon=True).start()
    checkpoint = folder / "last.pt"  # what this attempt resumes from, if it exists
    found = torch.load(checkpoint, map_location="cpu", weights_only=True)["epoch"] if checkpoint.exists() else None
    steps = count_optimizer_steps()
    code = main(arguments)
    attempt = {"restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "checkpoint_epoch_found": found}
    (folder / f"steps_rank{rank}.json").write_text(
        json.dumps({**attempt, "optimizer_steps": steps[0], "exit_code": code})
    )
    sys.exit(code)

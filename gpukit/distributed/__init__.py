"""Training on several processes: launch from a notebook, setup inside a worker, data
parallelism (DDP), sharded data, collectives, FSDP2, a two-stage pipeline, and what scaling costs.

launcher.py    `launch(fn, nprocs)`: run a function in several processes, notebook-safe; inside each
               worker: launch_worker.py; the parent watching them: launch_watch.py
process_group.py  setup/cleanup inside a worker, rank and world size, collectives for metrics
parallel.py    DDP and FSDP2, sharded loaders
pipeline.py    a model split over two ranks, micro-batches flowing between them
scaling.py     measured: all-reduce bandwidth, throughput by workers, DDP variants
zero.py        optimizer state sharded over ranks: ZeRO-1 with DDP, against DDP and FSDP2
collectives.py count_collectives: what a piece of code sends, counted at the dispatcher
jobs.py        wait_for_jobs: command-line jobs (torchrun) started from a notebook, never hanging
costmodel.py   predicted: a ring all-reduce cost model against published scaling figures
stragglers.py  a slow rank sets the pace: measured waiting against a cost model, and local SGD

One worker function runs everywhere: under `launch` (a notebook or a script), under torchrun on
one or many machines, and in a cluster job, because `setup()` reads everything from the
environment variables that all of them set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT):

    def train():
        worker = gk.distributed.setup()     # rank, world_size, device; one GPU per process
        model = gk.models.fast_cnn(16)
        history = gk.fit(model, train_set, batch_size=64)  # DDP, each rank its shard of the data
        gk.distributed.cleanup()
        return history.summary()

    results = gk.distributed.launch(train)  # one result per rank

`gk.fit` notices the process group and wraps the model in DistributedDataParallel, shards the
data, skips the gradient all-reduce on accumulation micro-batches, averages the logged metrics
over ranks, gives every rank rank 0's buffers (BatchNorm statistics) after each epoch, splits the
held-out data over the ranks and sums the results, so that every rank reports the same metrics of the
whole held-out data, and shows progress and writes checkpoints on rank 0 only.
"""

from . import costmodel, pipeline, scaling, stragglers, zero
from .collectives import count_collectives
from .jobs import wait_for_jobs
from .launcher import WorkerError, fastest_start_method, fork_refusal, launch
from .parallel import (
    COMPRESSIONS,
    DEFAULT_TIMEOUT_SECONDS,
    Worker,
    average_parameters,
    barrier,
    broadcast_buffers,
    check_same,
    check_same_batches,
    cleanup,
    data_parallel,
    default_device,
    is_main,
    is_sharded,
    mean_over_ranks,
    names_over_ranks,
    no_sync,
    objects_over_ranks,
    prepare,
    print0,
    rank,
    setup,
    shard,
    sharded_data_parallel,
    sharded_loader,
    state_bytes,
    sum_over_ranks,
    world_size,
)
from .zero import compare_sharding, zero_optimizer

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_TIMEOUT_SECONDS",
    "Worker",
    "WorkerError",
    "average_parameters",
    "barrier",
    "broadcast_buffers",
    "check_same",
    "check_same_batches",
    "cleanup",
    "compare_sharding",
    "count_collectives",
    "costmodel",
    "data_parallel",
    "default_device",
    "fastest_start_method",
    "fork_refusal",
    "is_main",
    "is_sharded",
    "launch",
    "mean_over_ranks",
    "names_over_ranks",
    "no_sync",
    "objects_over_ranks",
    "pipeline",
    "prepare",
    "print0",
    "rank",
    "scaling",
    "stragglers",
    "setup",
    "shard",
    "sharded_data_parallel",
    "sharded_loader",
    "state_bytes",
    "sum_over_ranks",
    "wait_for_jobs",
    "world_size",
    "zero",
    "zero_optimizer",
]

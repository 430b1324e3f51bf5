"""gk.data.sweep: every setting's rounds interleaved, each round timed as loader_rate times a loader."""

import time
import types

import pytest
import torch
from torch.utils.data import Dataset

import gpukit as gk
from gpukit.data import loader_timing

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


class FakeClock:
    """Seconds that pass only when a sample is built: each costs `cost` × (1 + now / drift) seconds, so the
    machine slows as the sweep goes on, as it does when other programs start beside it (drift None: it never slows)."""

    def __init__(self, cost: float, drift: float | None = None):
        self.now, self.cost, self.drift = 0.0, cost, drift

    def perf_counter(self) -> float:
        return self.now

    def spend(self) -> None:
        self.now += self.cost * (1 + (self.now / self.drift if self.drift else 0))


class TokenWindows(Dataset):
    """Token windows as dicts ({"input_ids": (T,), "labels": (T,)}, int64), drawn with a seed; each sample built
    spends the fake clock's time (0 workers: the sweep's process builds it)."""

    def __init__(self, clock: FakeClock | None, count: int = 64, seq_len: int = 16, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 256, (count, seq_len + 1), generator=generator)
        self.clock = clock

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        if self.clock is not None:
            self.clock.spend()
        return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, 1:]}


def fake_time(monkeypatch, clock: FakeClock) -> None:
    monkeypatch.setattr(loader_timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))


def test_a_round_times_batches_after_one_untimed_as_loader_rate_does(monkeypatch):
    # A constant 2 ms a sample: every setting reads exactly batch_size × 2 ms a batch, whatever the rounds.
    clock = FakeClock(0.002)
    fake_time(monkeypatch, clock)
    table = gk.data.sweep(TokenWindows(clock), 4, num_workers=(0, 0), batches=3, rounds=2, device="cpu")
    assert [row["batches_per_second"] for row in table.rows] == pytest.approx([1 / (4 * 0.002)] * 2, rel=1e-9)
    # Each setting read 2 rounds × (1 untimed + 3 timed) batches of 4: 32 samples, 16 of them its own.
    assert clock.now == pytest.approx(2 * 2 * 4 * 4 * 0.002)


def test_load_that_grows_over_time_falls_on_every_setting_alike(monkeypatch):
    # Two identical settings on a machine that slows as the sweep goes on (a sample costs 1 + t / 0.2 s times 2 ms).
    # Timed one after the other (rounds=1), the second read 1.68x slower than the first; interleaved over the default
    # 4 rounds, the order reversed every other round, 0.96x: the drift falls on both alike.
    clock = FakeClock(0.002, drift=0.2)
    fake_time(monkeypatch, clock)
    table = gk.data.sweep(TokenWindows(clock), 4, num_workers=(0, 0), batches=4, device="cpu")
    first, second = (row["samples_per_second"] for row in table.rows)
    assert first / second == pytest.approx(1, abs=0.05)
    assert clock.now > 0.6  # the machine slowed by more than 4x over the sweep


def test_rounds_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        gk.data.sweep(TokenWindows(None), 4, num_workers=(0,), rounds=0)
    with pytest.raises(ValueError, match="batches must be a positive integer"):
        gk.data.sweep(TokenWindows(None), 4, num_workers=(0,), batches=0)


def _slow_start(_worker_id):  # a worker's start-up of 1 s (a dataset that opens files, a connection)
    time.sleep(1.0)


def test_worker_start_up_and_batches_prefetched_between_rounds_are_not_timed():
    # Worker processes reading token windows behind 5 ms of storage latency each: one worker delivers a batch of 4
    # every 20 ms at best. Its start-up (1 s, in worker_init_fn) counted would make the rate 4x lower or more (16
    # batches timed, 0.32 s at best); the batches it prefetched while the other setting was timed, counted, would
    # make it higher than one worker can deliver (1.33x with prefetch_factor=2, up to 4x with 4). The lower bound
    # leaves room for a loaded machine's late wake-ups.
    slow = gk.data.SlowDataset(TokenWindows(None, count=256), 0.005)
    table = gk.data.sweep(
        slow, 4, num_workers=(1,), prefetch_factor=(2, 4), batches=4, device="cpu", worker_init_fn=_slow_start
    )
    best = 1 / (4 * 0.005)  # batches/s of one worker that only waits
    for row in table.rows:
        assert 0.35 < row["batches_per_second"] / best < 1.05, row
    assert "4 rounds of 4 batches" in table.notes[0]

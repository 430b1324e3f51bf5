"""gk.data.diagnose: input-bound vs compute-bound on loaders built to be one or the other; DataLoader checks."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import gpukit as gk
from gpukit.data.bottleneck import check_workers
from gpukit.train.data import batches

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


class SlowImages(Dataset):
    """Images that take `delay` seconds each to 'load': a loader made slow on purpose."""

    def __init__(self, count=64, delay=0.01):
        self.images = torch.randn(count, 3, 16, 16)
        self.labels = torch.randint(0, 10, (count,))
        self.delay = delay

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        time.sleep(self.delay)
        return self.images[index], self.labels[index]


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
    )


def test_a_slow_loader_is_input_bound(device):
    loader = DataLoader(SlowImages(), batch_size=8)  # 8 × 10 ms = 80 ms per batch; the step takes ~1 ms
    diagnosis = gk.data.diagnose(loader, small_cnn(), steps=4, warmup=1, device=device)
    assert diagnosis.verdict == "input-bound", diagnosis
    assert diagnosis.loader_steps_per_second < diagnosis.step_steps_per_second
    # Measured independently: the loop's time blocked in next(loader) dominates the combined run.
    assert diagnosis.data_wait_fraction > 0.5, diagnosis
    assert "num_workers" in diagnosis.advice[0]  # the first thing to try on a 0-worker DataLoader
    assert "input-bound" in str(diagnosis) and diagnosis.table().rows


def test_resident_data_is_compute_bound(device):
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    train, _ = gk.data.shapes(128, 16, seed=0)
    loader = gk.data.DeviceLoader(train, 16, device=device)  # batches gathered from tensors already in memory
    diagnosis = gk.data.diagnose(loader, model, steps=4, warmup=1, device=device)
    assert diagnosis.verdict == "compute-bound", diagnosis
    assert diagnosis.data_wait_fraction < 0.5, diagnosis
    assert diagnosis.together_steps_per_second <= diagnosis.loader_steps_per_second
    assert diagnosis.kernel_share is None and diagnosis.host_share is None  # no kernels to time on a CPU


@pytest.mark.parametrize(
    "kernel_share, host_share, verdict",
    [
        (0.25, 0.97, "launch-bound"),  # the GPU idles 3/4 of the step while the host launches
        (0.49, 0.80, "launch-bound"),  # at both bounds
        (0.50, 0.97, "compute-bound"),  # kernels half the time: not "idle most of the step"
        (0.95, 0.30, "compute-bound"),  # the host queues ahead and waits for a busy GPU
        (0.20, 0.40, "compute-bound"),  # the GPU idles, but not because the host is busy launching
    ],
)
def test_step_bound_from_made_up_measurements(kernel_share, host_share, verdict):
    assert gk.data.bottleneck.step_bound(kernel_share, host_share) == verdict


@pytest.mark.parametrize("kernel_share, host_share, name", [(1.2, 0.5, "kernel_share"), (0.5, -0.1, "host_share")])
def test_step_bound_refuses_a_share_outside_0_and_1(kernel_share, host_share, name):
    with pytest.raises(ValueError, match=f"{name} must be a share"):
        gk.data.bottleneck.step_bound(kernel_share, host_share)


def test_the_verdict_puts_the_input_first_then_the_launches():
    rates = dict(together_steps_per_second=9.0, data_wait_fraction=0.1, batch_size=8, steps=4, device="cuda")
    launching = dict(kernel_share=0.2, host_share=0.95)
    assert gk.data.Diagnosis(100.0, 10.0, **rates, **launching).verdict == "launch-bound"
    assert gk.data.Diagnosis(5.0, 10.0, **rates, **launching).verdict == "input-bound"  # the loader is slower still
    assert gk.data.Diagnosis(100.0, 10.0, **rates, kernel_share=0.9, host_share=0.95).verdict == "compute-bound"
    assert gk.data.Diagnosis(100.0, 10.0, **rates).verdict == "compute-bound"  # shares not measured


def test_token_batches_of_a_language_model(device):
    model = gk.models.gpt(max_seq_len=16, width=16, depth=1, heads=2)
    tokens = torch.randint(0, 256, (8, 17))
    batches = [(tokens[:, :-1], tokens[:, 1:])] * 2  # (B, T) inputs and targets; a list is read again as needed
    slow = gk.data.diagnose(_slowly(batches, 0.05), model, steps=3, warmup=1, device=device)
    assert slow.verdict == "input-bound" and slow.batch_size == 8
    dict_batches = [{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}]  # model(**batch), labels as target
    model_dict = DictGPT(model)
    assert gk.data.diagnose(dict_batches, model_dict, steps=2, warmup=0, device=device).verdict == "compute-bound"


@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_the_loader_alone_is_timed_over_every_batch_it_counts(device, kind):
    # Each batch takes at least `delay` seconds (a sleep only overruns): the rate can be at most 1 / delay. A clock
    # started after batch `warmup` was fetched times steps - 1 batches and reads steps / (steps - 1) too fast.
    delay, steps = 0.05, 3
    if kind == "cnn":
        model, batch = small_cnn(), (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    else:
        model = gk.models.gpt(max_seq_len=16, width=16, depth=1, heads=2)
        tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
        batch = (tokens[:, :-1], tokens[:, 1:])  # (B, T) inputs and targets
    loader = _slowly([batch] * 2, delay)
    rates = {
        "diagnose": gk.data.diagnose(loader, model, steps=steps, warmup=1, device=device).loader_steps_per_second,
        "loader_rate": gk.data.bottleneck.loader_rate(loader, batches=steps, device=device),
    }
    for name, rate in rates.items():
        assert 0.5 / delay < rate <= 1 / delay, (name, rate)  # 1.5x 1 / delay before the fix


class DictGPT(nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels=None):
        return {"logits": self.gpt(input_ids)}


class _slowly:
    """A re-iterable that sleeps before each batch."""

    def __init__(self, batches, delay):
        self.batches, self.delay = batches, delay

    def __iter__(self):
        for batch in self.batches:
            time.sleep(self.delay)
            yield batch


def test_the_model_is_left_untouched(device):
    model = small_cnn()
    before = [p.detach().clone() for p in model.parameters()]
    gk.data.diagnose([(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))], model, steps=2, device=device)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_a_loader_that_yields_nothing(device):
    with pytest.raises(ValueError, match="yielded no batch"):
        gk.data.diagnose([], small_cnn(), device=device)
    empty = DataLoader(
        TensorDataset(torch.randn(3, 3, 8, 8), torch.zeros(3, dtype=torch.long)), batch_size=4, drop_last=True
    )
    with pytest.raises(ValueError, match="drop_last"):
        gk.data.diagnose(empty, small_cnn(), device=device)
    with pytest.raises(ValueError, match="steps"):
        gk.data.diagnose([1], small_cnn(), steps=0, device=device)


def test_worker_settings_that_cannot_work():
    train, _ = gk.data.shapes(32, 8, seed=0)
    with pytest.raises(ValueError, match="prefetch_factor=4 applies to worker processes"):
        gk.data.dataloader(train, 8, num_workers=0, prefetch_factor=4)
    cores = os.cpu_count()
    with pytest.warns(UserWarning, match=f"more than the {cores} CPU cores"):
        check_workers(cores + 1, None)
    with pytest.raises(ValueError, match="num_workers must be"):
        gk.data.dataloader(train, 8, num_workers=-1)


def test_sweep_measures_every_setting_and_plots():
    dataset = TensorDataset(torch.randn(64, 3, 8, 8), torch.zeros(64, dtype=torch.long))
    table = gk.data.sweep(dataset, 8, num_workers=(0, 1), prefetch_factor=(2,), batches=3)
    settings = [(row["num_workers"], row["prefetch_factor"]) for row in table.rows]
    assert settings == [(0, None), (1, 2)]
    assert all(row["samples_per_second"] > 0 for row in table.rows)
    figure = gk.data.plot_sweep(table)
    assert figure.axes[0].get_xlabel() == "num_workers"


def test_prefetch_is_a_pass_through_off_cuda(device):
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 8, 8), torch.zeros(8, dtype=torch.long)), batch_size=4)
    assert gk.data.prefetch(loader, device) is loader
    assert batches(loader, device) is loader  # what fit iterates over: the DataLoader itself off CUDA
    with pytest.raises(ValueError, match="CUDA device"):
        gk.data.CUDAPrefetcher(loader, device)


def test_trace_steps_draws_the_host_phases_and_exports_a_chrome_trace(device, tmp_path):
    loader = DataLoader(SlowImages(32, delay=0.002), batch_size=4)
    trace = gk.data.trace_steps(loader, small_cnn(), steps=3, device=device, chrome_trace=tmp_path / "trace.json")
    assert trace.steps == 3 and len(trace.rows["data wait"]) == 3 and len(trace.rows["step"]) == 3
    assert trace.total("data wait") >= 3 * 4 * 2 * 0.9  # 4 images × 2 ms slept per batch, in ms
    assert (tmp_path / "trace.json").stat().st_size > 0 and trace.hidden_copy_fraction() is None
    figure = gk.data.plot_trace(trace)
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == ["data wait (host)", "step (host)"]


def test_trace_steps_on_a_machine_without_cuda_writes_nothing_to_stderr():
    # Kineto's "ERROR ... gpuGetDeviceCount failed" and its start/stop lines showed red under lesson 02's trace cell on
    # this CPU; Kineto reads its log level once per process, so the trace runs in a fresh one.
    script = (
        "import torch, gpukit as gk\n"
        "loader = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(3)]\n"
        "model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 10))\n"
        "trace = gk.data.trace_steps(loader, model, steps=2, device='cpu')\n"
        "import os; assert trace.steps == 2 and 'KINETO_LOG_LEVEL' not in os.environ\n"
    )
    environment = {key: value for key, value in os.environ.items() if key != "KINETO_LOG_LEVEL"}
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert "gpuGetDeviceCount" not in ran.stderr and "profiler_start" not in ran.stderr, ran.stderr


def test_a_traces_kernel_share_is_the_kernels_union_over_the_steps_span():
    # Made-up intervals (start, duration) in ms: kernels 0.5-1.7 (two overlapping) and 2.5-4.5, steps from 0.
    trace = gk.data.timeline.Trace({"step": [(0.0, 1.0), (2.0, 1.0)], "compute": [(0.5, 1.0), (1.2, 0.5), (2.5, 2.0)]})
    assert trace.kernel_share() == pytest.approx((1.2 + 2.0) / 4.5)
    assert gk.data.timeline.Trace({"step": [(0.0, 1.0)]}).kernel_share() is None  # no kernels: a CPU trace


class KeepsTheGPUBusy(nn.Module):
    """Identity whose forward queues a spin kernel of `cycles` GPU clock cycles (10 million: ~5 ms at 2 GHz): a step
    whose kernels outlast its launch, so each copy has compute to hide behind. Two small convolutions alone were
    about as long as their own launch on the H100 (2026-11-24): the GPU idled before each copy, 0% hidden."""

    def __init__(self, cycles: int = 10_000_000):
        super().__init__()
        self.cycles = cycles

    def forward(self, inputs):
        torch.cuda._sleep(self.cycles)
        return inputs


@pytest.mark.gpu
def test_the_prefetcher_delivers_the_same_batches_and_hides_the_copy(tmp_path):
    device = torch.device("cuda")
    images, labels = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    loader = DataLoader(TensorDataset(images, labels), batch_size=8, pin_memory=True)
    seen = []
    for batch in gk.data.prefetch(loader, device):
        assert batch.args[0].is_cuda
        seen.append(batch.args[0].cpu())
        torch.cuda._sleep(1_000_000)  # keep the compute stream busy: a missing wait_stream would show stale data
    assert torch.equal(torch.cat(seen), images)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.ReLU(),
        KeepsTheGPUBusy(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    # Batches waiting in pinned host memory: the loader costs nothing, so each copy has a step to hide behind.
    pinned = [(torch.randn(64, 3, 64, 64).pin_memory(), torch.randint(0, 10, (64,)).pin_memory()) for _ in range(8)]
    trace = gk.data.trace_steps(pinned, model, steps=6, device=device, chrome_trace=tmp_path / "trace.json")
    hidden = trace.hidden_copy_fraction()
    # First that the GPU was busy: a launch-bound step leaves nothing to hide a copy behind, whatever the prefetcher.
    assert trace.kernel_share() > 0.5, f"the GPU ran kernels {trace.kernel_share():.0%} of the steps: launch-bound"
    # The same fraction from the exported Chrome trace, by Kineto's categories: the host→device copies' intervals
    # under the kernels' own intervals (never the "gpu_user_annotation" spans, which cover every kernel).
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    assert len(copies) == len(trace.rows["copy"]) and len(kernels) == len(trace.rows["compute"]), trace.rows
    assert hidden == pytest.approx(_covered(copies, kernels) / sum(end - start for start, end in copies), abs=0.02)
    assert hidden >= 0.9, hidden  # each copy is issued right after a step's launch, while the spin kernel runs


def _covered(intervals, cover):
    """Time in `intervals` (start, end) also inside the union of `cover`, by brute force on the sorted ends."""
    ends = sorted({point for interval in intervals + cover for point in interval})
    inside = 0.0
    for left, right in zip(ends, ends[1:]):
        middle = (left + right) / 2
        if any(a <= middle < b for a, b in intervals) and any(a <= middle < b for a, b in cover):
            inside += (right - left) * sum(a <= middle < b for a, b in intervals)
    return inside


@pytest.mark.gpu
def test_fit_trains_through_the_prefetcher_on_cuda():
    loader = DataLoader(
        TensorDataset(torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,))), batch_size=16, pin_memory=True
    )
    history = gk.fit(small_cnn(), loader, epochs=1, device="cuda", progress=False, log_every=1)
    assert len(history.steps) == 4

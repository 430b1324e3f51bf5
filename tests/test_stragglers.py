"""gk.distributed.stragglers: the cost model of waiting for the slowest rank, and real gloo runs against it."""

from __future__ import annotations

import pytest

from gpukit.distributed import stragglers


def test_schedules():
    assert stragglers.schedule(4, 3, "none") == [None] * 3
    assert stragglers.schedule(4, 3, "one") == [1] * 3
    drawn = stragglers.schedule(4, 200, "random", seed=1)
    assert set(drawn) == {0, 1, 2, 3} and drawn == stragglers.schedule(4, 200, "random", seed=1)
    with pytest.raises(ValueError, match="pattern='sometimes'"):
        stragglers.schedule(4, 3, "sometimes")


def test_the_cost_model_by_hand():
    # Two ranks, 4 steps of 1 s, a slow step costs 2 s more. Always rank 1: 4 x 3 s whatever the synchronisation.
    assert stragglers.predict([1, 1, 1, 1], 2, 1.0, 2.0, sync_every=1) == 12.0
    assert stragglers.predict([1, 1, 1, 1], 2, 1.0, 2.0, sync_every=4) == 12.0
    # Alternating ranks: synchronous pays every delay (12 s); one window of 4 pays only each rank's own two (8 s).
    assert stragglers.predict([0, 1, 0, 1], 2, 1.0, 2.0, sync_every=1) == 12.0
    assert stragglers.predict([0, 1, 0, 1], 2, 1.0, 2.0, sync_every=4) == 8.0
    assert stragglers.predict([None] * 4, 2, 1.0, 2.0) == 4.0


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_real_processes_wait_as_the_model_says(start_method):
    """Measured on 2 gloo processes: every run takes at least its prediction (waiting is real), and at most the
    prediction plus a bound for the all-reduces and scheduling (sleeps overshoot by up to ~10 ms on a busy host).
    Forked ranks (lesson 04 forks them where no CUDA device is visible) wait alike."""
    steps, compute, delay = 8, 0.02, 0.06
    slow = stragglers.schedule(2, steps, "random", seed=3)
    variants = {"sync": (slow, 1), "local": (slow, 4), "none": ([None] * steps, 1)}
    measured = stragglers.measure(variants, 2, compute, delay, start_method=start_method)
    for name, (schedule, sync_every) in variants.items():
        predicted = stragglers.predict(schedule, 2, compute, delay, sync_every)
        assert predicted * 0.98 <= measured[name] <= predicted + steps * 0.03 + 0.2, (name, predicted, measured)
    with pytest.raises(ValueError, match="variant 'bad'"):
        stragglers.measure({"bad": ([5], 1)}, 2, compute, delay)

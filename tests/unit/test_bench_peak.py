"""`loom bench peak`'s arithmetic, without timing anything for real: the probe that sizes the measurement is the
best of several products (2·n³ FLOPs over the time each took), so one stalled product cannot leave out every
size; the sizes kept fit the budget; a CPU figure far below the peak this machine reached before (the MFU
cache) is said to come from a busy machine. Compared against: the FLOP counts and budgets written out here,
and the reported case (a probe read 2.1 GFLOP/s on a CPU doing ~180 and kept only n=512)."""

from __future__ import annotations

import itertools

import pytest
import torch

from loom.bench import peak
from loom.metrics import probe_flops

CPU = torch.device("cpu")


def fake_clock(durations: list[float]):
    """A clock whose consecutive (start, end) readings are `durations` apart."""
    ticks = itertools.chain.from_iterable((10.0 * i, 10.0 * i + d) for i, d in enumerate(durations))
    return lambda: next(ticks)


def test_the_probe_is_the_best_of_several_products():
    # one product stalled 16 ms (a thread descheduled for a scheduler slice), the others 0.2 ms and 0.25 ms
    rate = probe_flops(CPU, torch.float32, n=256, reps=3, clock=fake_clock([0.016, 0.0002, 0.00025]))
    assert rate == pytest.approx(2 * 256**3 / 0.0002)  # 168 GFLOP/s, not 2 * 256**3 / 0.016 = 2.1 GFLOP/s
    assert 2 * 256**3 / 0.016 / 1e9 == pytest.approx(2.1, abs=0.01)  # what one timed product read


def test_the_sizes_kept_fit_the_budget():
    # at least 6 products of 2·n³ FLOPs within max(2 s, 10 x seconds): 5 s at --seconds 0.5
    assert peak.affordable_sizes([512, 1024, 2048], 2.1e9, 0.5) == [512]  # 6·2·1024³ / 2.1e9 = 6.1 s
    assert peak.affordable_sizes([2048, 512, 1024], 180e9, 0.5) == [512, 1024, 2048]  # 2048: 0.57 s
    assert peak.affordable_sizes([4096], 1e9, 0.1) == [4096]  # none fits: the smallest is still measured
    assert 6 * 2 * 1024**3 / 2.1e9 > 5 > 6 * 2 * 2048**3 / 180e9


def test_a_busy_machine_is_said(monkeypatch):
    note = peak.busy_note(6e9, 183e9)
    assert note is not None and "6.0 GFLOP/s" in note and "183.0 GFLOP/s" in note and "quiet machine" in note
    assert peak.busy_note(150e9, 183e9) is None  # within half of the cached peak
    assert peak.busy_note(6e9, None) is None  # nothing cached: nothing to compare with
    # in the record: a measurement of 6 GFLOP/s against a cached 183
    monkeypatch.setattr(peak, "probe_flops", lambda device, dt: 2.1e9)
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda device, dtype, n, seconds: 6e9)
    monkeypatch.setattr(peak, "cached_cpu_peak", lambda dtype: 183e9)
    rec = peak.bench_matmul(CPU, "fp32", [512, 1024, 2048], 0.5)
    assert (rec["flops"], rec["size"]) == (6e9, 512)
    assert "sizes [1024, 2048] left out: too slow at 2.1 GFLOP/s" in rec["note"]
    assert "below half of the 183.0 GFLOP/s" in rec["note"]

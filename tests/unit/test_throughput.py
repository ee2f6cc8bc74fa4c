"""Throughput accounting (loom.metrics.Throughput) against hand-computed figures: warm-up steps and the
torch.compile step are left out of tokens/s; the compile step's time is reported apart."""

from __future__ import annotations

import pytest

from loom.metrics import Throughput, format_step


def test_compile_step_is_reported_and_excluded_even_without_warmup():
    tp = Throughput(flops_per_token=6, peak=None, n_devices=2, skip=0, compiled=True)
    first = tp.step(100, 20.0)  # tracing + compiling
    assert first["compile_s"] == 20.0
    for _ in range(4):
        assert "compile_s" not in tp.step(100, 0.5)
    s = tp.summary()
    assert s["compile_s"] == 20.0
    assert s["tokens_per_s"] == pytest.approx(400 / 2.0)
    assert s["tokens_per_s_per_device"] == pytest.approx(100.0)
    assert s["mfu"] is None


def test_warmup_steps_skipped_without_compile():
    tp = Throughput(flops_per_token=10, peak=1e4, n_devices=1, skip=2)
    for dt in (5.0, 5.0, 1.0, 1.0):
        rec = tp.step(100, dt)
    assert "compile_s" not in rec and "compile_s" not in tp.summary()
    assert tp.summary()["tokens_per_s"] == pytest.approx(100.0)
    assert tp.summary()["mfu"] == pytest.approx(100.0 * 10 / 1e4)


def test_console_line_shows_scale_and_compile():
    rec = {
        "step": 1,
        "loss": 2.0,
        "lr": 1e-3,
        "grad_norm": float("nan"),
        "dt": 1.0,
        "dtf": 0.3,
        "dtb": 0.6,
        "tokens_per_s": 10.0,
        "mfu": None,
        "mem_bytes": 2**20,
        "loss_scale": 32768.0,
        "overflow_steps": 3,
        "compile_s": 12.5,
    }
    line = format_step(rec)
    assert "scale 32768 (3 overflow)" in line and "compile 12.5s" in line


def test_an_impossible_mfu_mends_the_cached_cpu_peak(tmp_path, monkeypatch):
    """A CPU peak cached from a busy machine is too low, so every later run showed MFU above 100%: the first
    such step measures the peak again, keeps the higher figure in the cache, and MFU is below 100% from then on."""
    import json

    from loom import metrics

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    measured = iter([1e9, 5e10])  # a busy first measurement, then the real one
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device, dtype: next(measured))
    low = metrics.cpu_peak_flops("fp32")
    assert low == 1e9 and metrics.cpu_peak_flops("fp32") == 1e9  # cached: not measured again
    tp = Throughput(1_000_000, low, 1, 0, remeasure=lambda: metrics.cpu_peak_flops("fp32", again=True))
    mfu = tp.step(tokens=20_000, dt=1.0)["mfu"]  # 2e10 FLOP/s: 2000% of the busy peak, 40% of the real one
    assert mfu == pytest.approx(0.4)
    table = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert list(table.values()) == [5e10]
    assert tp.step(tokens=20_000, dt=1.0)["mfu"] == pytest.approx(0.4)  # measured once only
    # a later measurement that comes out lower never lowers the cached peak
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device, dtype: 1e6)
    assert metrics.cpu_peak_flops("fp32", again=True) == 5e10

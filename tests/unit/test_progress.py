"""Progress people can read (issue 58): the trainer's logger on a terminal (a moving `step k/N` line under
the logged ones, gone at the end), durations, and a line before each slow thing `loom doctor` and
`loom bench optim` do. Compared against what each is handed."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from loom import log
from loom.metrics import clock, format_step
from loom.train.logger import MetricsLogger


def _rec(step: int, loss: float) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "dt": 0.01,
        "dtf": 0.004,
        "dtb": 0.006,
        "tokens_per_s": 1000.0,
        "mfu": None,
    }


def test_clock():
    assert [clock(s) for s in (4.4, 59.6, 185, 7620)] == ["4s", "1m00s", "3m05s", "2h07m"]


def test_format_step_says_k_of_n_time_and_the_interval_mean():
    rec = {**_rec(50, 5.03), "loss_mean": 4.76, "elapsed_s": 12.2, "mem_bytes": 0}
    line = format_step(rec, total=1000, eta_s=225)
    assert line.startswith("step   50/1000 | 12s, ETA 3m45s | loss 4.7600 | "), line
    assert format_step({**_rec(7, 2.5), "mem_bytes": 0}).startswith("step      7 | loss 2.5000 | ")


def test_a_terminal_gets_a_moving_progress_line_that_goes_at_the_end(monkeypatch):
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=100, color_system=None)
    monkeypatch.setitem(log._state, "console", con)
    logger = MetricsLogger(every=2, device=torch.device("cpu"))
    logger.begin(0, 4)
    assert logger.bar is not None
    for step, loss in ((1, 4.0), (2, 2.0), (3, float("nan")), (4, 3.0)):
        rec = _rec(step, loss)
        logger.after_step(rec, final=step == 4, total=4)
    logger.close()
    assert logger.bar is None
    out = buf.getvalue()
    assert "step 2/4 | " in out and "loss 3.0000" in out  # (4 + 2) / 2
    assert "step 4/4 | " in out and "loss 3.0000" in out  # the NaN step left out of the mean
    assert rec["loss_mean"] == 3.0 and rec["loss_steps"] == 1


def test_a_pipe_gets_no_progress_line(monkeypatch, capsys):
    monkeypatch.setitem(log._state, "console", None)
    logger = MetricsLogger(every=1, device=torch.device("cpu"))
    logger.begin(0, 2)
    assert logger.bar is None
    logger.after_step(_rec(1, 1.0), final=False, total=2)
    logger.close()
    assert capsys.readouterr().out.startswith("step 1/2 | ")


def test_doctor_says_the_compile_check_before_it_starts(monkeypatch, capsys):
    from loom import doctor

    def collect(check_compile, *_):
        assert "checking torch.compile" in capsys.readouterr().out  # said before the check ran
        raise SystemExit(0)

    monkeypatch.setitem(log._state, "console", None)
    monkeypatch.setattr(doctor, "collect", collect)
    with pytest.raises(SystemExit):
        doctor.doctor_main(["--no-mpi-check"])


def test_bench_optim_says_each_measurement(monkeypatch, capsys):
    from loom.bench.optim import parse_count, run

    monkeypatch.setitem(log._state, "console", None)
    run(
        parse_count("1M"),
        ["torch-loop"],
        torch.device("cpu"),
        iters=1,
        warmup=0,
        copy_bytes=2**20,
        progress=True,
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("the copy bandwidth first, then torch-loop"), out
    assert out[1] == "torch-loop: 0 warm-up + 1 timed steps ..." and out[2].startswith("torch-loop: "), out

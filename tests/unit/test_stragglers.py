"""loom.distributed.stragglers without processes: the verdict on given phase times (who is named, in what
phase, by how much), the window and streak bookkeeping, and the phase clock on a CPU. Compared against
hand-computed medians."""

from __future__ import annotations

import time

import torch

from loom.distributed.comm import Control
from loom.distributed.stragglers import PHASES, PhaseClock, StragglerMonitor, judge


def _rank(host, **phases):
    return {"host": host, "steps": 1, "phases": {p: phases.get(p, 0.0) for p in PHASES}}


def test_the_slow_rank_is_named_in_its_phase_not_the_ranks_waiting_for_it():
    # rank 2 takes 0.5 s more in forward; the others wait that long in the backward's all-reduce
    ranks = [_rank(f"h{r}", data=0.1, forward=1.0, backward=2.5, optimizer=0.2) for r in range(4)]
    ranks[2]["phases"].update(forward=1.5, backward=2.0)
    v = judge(10, ranks, threshold=0.1)
    assert (v.rank, v.phase, v.hosts[v.rank]) == (2, "forward", "h2")
    assert abs(v.excess_s - 0.5) < 1e-9 and abs(v.excess_frac - 0.5 / 3.8) < 1e-9
    rec = v.record()["stragglers"]
    assert rec["slowest"]["rank"] == 2 and rec["step_s"][2] == rec["step_s"][0]


def test_below_the_threshold_and_two_ranks_name_no_one():
    ranks = [_rank("a", forward=1.0), _rank("b", forward=1.05), _rank("c", forward=1.0)]
    assert judge(5, ranks, threshold=0.1).rank is None
    assert judge(5, [_rank("a", forward=1.0), _rank("b", forward=9.0)], threshold=0.1).rank is None


def test_monitor_windows_and_streak():
    class Three(Control):
        def gather_object(self, obj):
            slow = {**obj, "phases": {**obj["phases"], "forward": obj["phases"]["forward"] + 1.0}}
            return [obj, slow, obj]

    written = []
    m = StragglerMonitor(every=2, threshold=0.2, windows=2, control=Three(), write=written.append)
    base = dict.fromkeys(PHASES, 0.1)
    first = m.after_step(1, dict.fromkeys(PHASES, 99.0))  # the process's first step: left out
    verdicts = [m.after_step(s, base) for s in range(2, 7)]
    assert first is None and verdicts[1] is None and verdicts[3] is None  # mid-window: no gather
    assert [v.in_a_row for v in verdicts[0::2]] == [1, 2, 3] and len(written) == 3
    assert written[0]["stragglers"]["steps"] == 1 and written[1]["stragglers"]["steps"] == 2
    assert written[1]["stragglers"]["slowest"]["in_a_row"] == 2
    assert abs(written[0]["stragglers"]["step_s"][0] - 0.5) < 1e-9  # 99 s of the first step left out


def test_phase_clock_on_cpu():
    clock = PhaseClock(torch.device("cpu"))
    with clock("forward"):
        time.sleep(0.02)
    with clock("data", host=True):
        pass
    took = clock.take()
    assert 0.015 < took["forward"] < 1 and took["backward"] == 0.0 and clock.pending == []
    off = PhaseClock(torch.device("cpu"), enabled=False)
    with off("forward"):
        pass
    assert off.pending == []


def test_plot_draws_the_per_rank_spread(tmp_path):
    import json

    from loom.plot import plot_runs

    ranks = [_rank(f"h{r}", forward=1.0, backward=2.0) for r in range(4)]
    ranks[3]["phases"]["forward"] = 2.0
    lines = [{"step": s, "tokens": 100 * s, "loss": 3.0 - 0.1 * s} for s in range(1, 9)]
    lines += [judge(s, ranks, 0.2).record() for s in (4, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = plot_runs([tmp_path], tmp_path / "p.png")
    assert out.stat().st_size > 10_000

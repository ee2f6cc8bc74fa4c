"""loom.train.spawn's report of a failed job, from how each worker ended: the rank named is the one whose death
started it, not one the launcher stopped afterwards."""

from __future__ import annotations

import os
import signal
import threading

from loom.train.spawn import Exit, _report_failure, _Signals, _watch


def test_the_killed_rank_is_named_before_the_ranks_that_saw_it_die_and_those_the_launcher_stopped(capsys):
    # rank 3 was SIGKILLed; rank 0 saw it die in the same moment; ranks 1 and 2 the launcher stopped
    exits = {
        0: Exit(2, 100, 10),
        1: Exit(-15, 101, 12, True),
        2: Exit(2, 102, 12, True),
        3: Exit(-9, 103, 11),
    }
    assert _report_failure(exits) != 0
    err = capsys.readouterr().err
    assert "rank 3 (pid 103) failed first: SIGKILL" in err and "rank 1 (SIGTERM)" in err


def test_a_rank_the_launcher_stopped_is_never_the_cause(capsys):
    # rank 0 failed (exit 1); the launcher's SIGTERM ended rank 1: seen under fp8 + FSDP
    _report_failure({0: Exit(1, 100, 10), 1: Exit(-15, 101, 11, True)})
    assert "rank 0 (pid 100) failed first: exit code 1" in capsys.readouterr().err


def test_a_sigterm_alone_is_the_cause_and_an_exit_code_yields_to_a_signal(capsys):
    _report_failure({0: Exit(2, 100, 10), 1: Exit(-15, 101, 11)})
    assert "rank 1 (pid 101) failed first: SIGTERM" in capsys.readouterr().err
    _report_failure({0: Exit(1, 100, 10), 1: Exit(1, 101, 11)})
    assert "rank 0 (pid 100) failed first: exit code 1" in capsys.readouterr().err


def test_ranks_that_ended_well_are_not_named(capsys):
    _report_failure({0: Exit(0, 100, 9), 1: Exit(-9, 101, 10)})
    err = capsys.readouterr().err
    assert (
        "rank 1 (pid 101) failed first: SIGKILL; the other ranks were stopped\n" in err
        and "rank 0" not in err
    )


class _Ended:
    """A worker as _watch sees one: a sentinel that becomes readable when it ends, its exit code and pid."""

    def __init__(self, code: int, pid: int):
        self.sentinel, self._w = os.pipe()
        self.exitcode, self.pid = code, pid

    def end(self) -> None:
        os.write(self._w, b"x")

    def join(self) -> None:
        pass


def test_a_sigkill_the_launcher_did_not_send_is_the_cause_though_its_news_came_last(monkeypatch, capsys):
    # rank 0 saw rank 1 die and exited first; rank 1's end (SIGKILL, not the launcher's) reached it 0.3 s later
    sent = []
    monkeypatch.setattr("loom.train.spawn._send", lambda procs, exits, signum: sent.append(signum))
    procs = {0: _Ended(2, 100), 1: _Ended(-9, 101)}
    procs[0].end()
    threading.Timer(0.3, procs[1].end).start()
    exits = _watch(procs, _Signals(), shutdown_s=30)
    assert sent == [signal.SIGTERM] and not exits[1].stopped
    _report_failure(exits)
    assert "rank 1 (pid 101) failed first: SIGKILL" in capsys.readouterr().err


def test_a_rank_that_stopped_on_a_signal_is_not_sent_another(monkeypatch):
    # rank 1 got the SIGTERM; both stop after the same step; rank 0's exit 75 arrives first: rank 1, still
    # saving, must not get a second SIGTERM (it killed it in its exit: seen in a fresh clone's run)
    sent = []
    monkeypatch.setattr("loom.train.spawn._send", lambda procs, exits, signum: sent.append(signum))
    procs = {0: _Ended(75, 100), 1: _Ended(75, 101)}
    procs[0].end()
    threading.Timer(0.3, procs[1].end).start()
    exits = _watch(procs, _Signals(), shutdown_s=30)
    assert sent == [] and _report_failure(exits) == 75

"""loom.train.spawn's report of a failed job, from how each worker ended: the rank named is the one whose death
started it, not one the launcher stopped afterwards."""

from __future__ import annotations

from loom.train.spawn import Exit, _report_failure


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

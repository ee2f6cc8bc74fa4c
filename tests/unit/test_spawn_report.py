"""loom.train.spawn's report of a failed job, against failures as torch's elastic agent records them: the rank
named is the one whose death started it, not one the launcher stopped afterwards."""

from __future__ import annotations

from dataclasses import dataclass

from loom.train.spawn import _report_failure


@dataclass
class _Failure:  # the fields of torch.distributed.elastic.multiprocessing.errors.ProcessFailure it reads
    exitcode: int
    timestamp: int
    pid: int

    def signal_name(self) -> str:
        return {-9: "SIGKILL", -15: "SIGTERM"}.get(self.exitcode, "<N/A>")


class _Error:
    def __init__(self, failures: dict[int, _Failure]):
        self.failures = failures

    def get_first_failure(self):
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]


def test_the_killed_rank_is_named_before_one_the_launcher_stopped(capsys):
    # rank 3 was SIGKILLed; under load the launcher's SIGTERM of rank 1 got the earlier timestamp
    failures = {
        0: _Failure(2, 12, 100),
        1: _Failure(-15, 10, 101),
        2: _Failure(2, 12, 102),
        3: _Failure(-9, 11, 103),
    }
    assert _report_failure(_Error(failures)) != 0
    err = capsys.readouterr().err
    assert "rank 3 (pid 103) failed first: SIGKILL" in err and "rank 1 (SIGTERM)" in err


def test_a_sigterm_alone_is_the_cause_and_an_exit_code_yields_to_a_signal(capsys):
    _report_failure(_Error({0: _Failure(2, 10, 100), 1: _Failure(-15, 11, 101)}))
    assert "rank 1 (pid 101) failed first: SIGTERM" in capsys.readouterr().err
    _report_failure(_Error({0: _Failure(1, 10, 100), 1: _Failure(1, 11, 101)}))
    assert "rank 0 (pid 100) failed first: exit code 1" in capsys.readouterr().err

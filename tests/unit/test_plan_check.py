"""`loom plan --check`: its rows agree with the dry runs it makes (a layout the planner lists as fitting but the
dry run finds too big shows NO and the dry run's reason under it), what the dry runs warn about comes after
the table (once each, not between rows), and every line fits 120 columns. Compared against: the dry run itself
(loom.dryrun.report.dry_run on gpt2's shape), made too big for its GPU by a smaller memory in the wrapper."""

from __future__ import annotations

import dataclasses

from loom import log
from loom.cli import main
from loom.dryrun import check

ARGS = ["plan", "--model", "gpt2", "--gpus", "8", "--gpu-mem", "16", "--top", "2", "--check"]


def test_check_rows_show_the_dry_runs_verdict_and_warnings_after_the_table(monkeypatch, capsys):
    real = check.dry_run

    def small_gpu(cfg, target, *a, **k):
        """The dry run on a GPU of 2 GiB, where the planner's layouts (3.4 GiB) do not fit, warning twice."""
        log.warn("a warning from inside the dry run")
        log.warn("a warning from inside the dry run")
        return real(cfg, dataclasses.replace(target, gpu_mem_gib=2.0), *a, **k)

    monkeypatch.setattr(check, "dry_run", small_gpu)
    assert main(ARGS) == 1  # the planner's first layout does not fit when dry-run
    out = capsys.readouterr().out.splitlines()
    start = out.index(check.HEADER)
    table = out[start:]
    assert all(len(line) <= check.WIDTH for line in table), max(table, key=len)
    rows = [i for i, line in enumerate(table) if line[:2].strip().isdigit()]
    assert len(rows) == 2
    for i in rows:
        assert table[i].split()[-2] == "NO"  # the dry run's verdict, not the planner's "fits"
        assert table[i + 1].startswith("   dry run: DOES NOT FIT: rank ")  # and its reason, right below
        assert "GiB usable" in " ".join(table[i + 1 : i + 4])
    warned = [i for i, line in enumerate(table) if "a warning from inside the dry run" in line]
    assert len(warned) == 1 and warned[0] > max(rows) + 1  # once, after the table


def test_a_row_that_fits_has_no_reason_and_long_layouts_fold():
    layout = " ".join(f"key{i}=value{i}" for i in range(12))  # 131 characters
    lines = check.check_row(1, layout, 3.0 * check.GIB, 3.1 * check.GIB, 2.0)
    assert len(lines) == 3 and all(len(x) <= check.WIDTH for x in lines)  # folded at 74: no reason line
    assert lines[0].split()[-2:] == ["yes", "2"] and all(x.startswith("   key") for x in lines[1:])
    words = lines[0].split()[1:-5] + [w for x in lines[1:] for w in x.split()]
    assert " ".join(words) == layout

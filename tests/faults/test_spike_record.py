"""A loss spike explained (issue 48, item 5): a batch corrupted by fault injection (LOOM_FAULT_CORRUPT_STEP:
random targets) makes the loss spike; the skipped step's record names the batch's global rows, the command that
prints them, the parameters with the largest gradient norms and the learning rate; `loom data inspect --rows`
prints those rows. Compared against the loader's arithmetic (step s of a batch of B rows starts at row (s-1)*B)
and the loader's own rows."""

from __future__ import annotations

import shlex

from faultkit import records, run_inprocess, train_args

from loom.cli import main
from loom.data.loader import ShardLoader

STEP, BATCH, T = 12, 8, 16  # faultkit's tiny model: train.batch_size 8, model.block_size 16


def test_corrupted_batch_record_names_rows_and_layers(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOOM_FAULT_CORRUPT_STEP", str(STEP))
    guard = ["--train.spike_zscore=3", "--train.spike_window=5", "--optim.lr=3e-3"]
    assert run_inprocess(train_args(char_data, tmp_path, "spike", STEP + 2, *guard)) == 0
    console = capsys.readouterr().out
    bad = [r for r in records(tmp_path / "spike") if "skipped" in r]
    assert [r["step"] for r in bad] == [STEP], bad
    rec = bad[0]
    assert rec["skipped"].startswith("loss spike") and rec["lr"] > 0
    first = (STEP - 1) * BATCH
    assert rec["rows"] == [first, first + BATCH - 1]
    assert rec["inspect"] == (
        f"loom data inspect {char_data} --rows {first}-{first + BATCH - 1} --block-size {T} --seed 1337"
    )
    names = [n for n, _ in rec["top_grads"]]
    assert len(names) == 5 and all(g > 0 for _, g in rec["top_grads"])
    assert f"its batch is rows {first}-{first + BATCH - 1}" in console and names[0] in console

    assert main(shlex.split(rec["inspect"])[1:] + ["--json"]) == 0
    import json

    printed = json.loads(capsys.readouterr().out)
    expected = ShardLoader(char_data, BATCH, T, 1337).global_rows(first, BATCH).tolist()
    assert [r["row"] for r in printed] == list(range(first, first + BATCH))
    assert [r["tokens"] for r in printed] == expected and all(r["text"] for r in printed)


def test_spike_recorded_without_the_guard(char_data, tmp_path, monkeypatch, capsys):
    """train.spike_zscore off (the default): the corrupted batch's spike is recorded (rows, largest gradients,
    lr) and its update applied; the steps around it carry no record of the kind."""
    monkeypatch.setenv("LOOM_FAULT_CORRUPT_STEP", str(STEP))
    args = train_args(char_data, tmp_path, "note", STEP + 1, "--train.spike_window=5", "--optim.lr=3e-3")
    assert run_inprocess(args) == 0
    console = capsys.readouterr().out
    recs = [r for r in records(tmp_path / "note") if "loss" in r]
    noted = [r for r in recs if "spike" in r]
    assert [r["step"] for r in noted] == [STEP] and not any("skipped" in r for r in recs), noted
    rec = noted[0]
    first = (STEP - 1) * BATCH
    assert rec["spike"].startswith("loss spike") and rec["lr"] > 0
    assert rec["rows"] == [first, first + BATCH - 1] and len(rec["top_grads"]) == 5
    assert "recorded, not skipped" in console and f"its batch is rows {first}-" in console


def test_nonfinite_step_recorded_without_the_guard(char_data, tmp_path, monkeypatch):
    """A NaN gradient (LOOM_FAULT_NAN_STEPS) with train.spike_zscore off: the skipped step's record names its rows,
    the non-finite parameter first among the largest gradient norms, and the lr."""
    monkeypatch.setenv("LOOM_FAULT_NAN_STEPS", "3")
    assert run_inprocess(train_args(char_data, tmp_path, "nan", 4)) == 0
    bad = [r for r in records(tmp_path / "nan") if "skipped" in r]
    assert [r["step"] for r in bad] == [3]
    rec = bad[0]
    assert rec["skipped"].startswith("non-finite") and rec["lr"] > 0
    assert rec["rows"] == [2 * BATCH, 3 * BATCH - 1]
    assert rec["top_grads"][0][0] == rec["nonfinite_params"][0]


def test_mixture_spike_names_sources(tmp_path, monkeypatch):
    """data.mix: the corrupted batch's record names each row's source and row there, and the commands."""
    from mixkit import make_sources, mix_flags

    sources = make_sources(tmp_path / "src")
    monkeypatch.setenv("LOOM_FAULT_CORRUPT_STEP", str(STEP))
    args = train_args(sources["web"], tmp_path, "mix", STEP, "--train.spike_window=5", "--optim.lr=3e-3")
    args = [a for a in args if not a.startswith("--data.path=")] + mix_flags(sources)
    assert run_inprocess(args) == 0
    rec = next(r for r in records(tmp_path / "mix") if "spike" in r)
    first = (STEP - 1) * BATCH
    assert rec["step"] == STEP and rec["rows"] == [first, first + BATCH - 1]
    assert len(rec["sources"]) == BATCH and {n for n, _ in rec["sources"]} <= {"web", "code", "math"}
    assert all(c.startswith("loom data inspect ") for c in rec["inspect"].split(" && "))

"""TensorBoard and W&B sinks, compared against metrics.jsonl of the same run: every logged loss must be in
the event file (read back with TensorBoard's own EventAccumulator) and in the offline W&B run log (read
back record by record from its LevelDB-style .wandb file)."""

from __future__ import annotations

import json
import struct
import time

import pytest
from tiny import tiny_args

from loom import metrics
from loom.cli import main
from loom.config import Config
from loom.errors import LoomError
from loom.metrics import read_jsonl

TINY = tiny_args(
    {
        "model.n_layer": 1,
        "model.n_embd": 16,
        "model.block_size": 16,
        "train.batch_size": 4,
        "train.eval_batches": 1,
        "train.eval_every": 2,
        "optim.warmup_steps": 1,
        "train.steps": 3,
        "train.sample_tokens": 8,
        "train.warmup_log_steps": 1,
    }
)


def wandb_records(path):
    """Protobuf records of a .wandb file: 7-byte file header, then LevelDB log records (crc32, length,
    type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        if pos + 7 + n > len(data):  # still being written
            return
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def test_missing_package_is_named_before_any_work(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    cfg = Config()
    cfg.metrics.wandb = True
    with pytest.raises(LoomError, match=r"metrics.wandb=true needs the 'wandb' package") as e:
        metrics.check_trackers(cfg.metrics)
    assert "loom[track]" in e.value.hint
    assert main(["train", f"--run.dir={tmp_path}", "--run.name=r", "--metrics.wandb=true", *TINY]) == 2
    assert "loom[track]" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_training_logs_to_tensorboard_and_wandb_offline(char_data, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="the track extra: pip install 'loom[track]'")
    pytest.importorskip("wandb", reason="the track extra: pip install 'loom[track]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=r",
        "--metrics.tensorboard=true",
        "--metrics.wandb=true",
        "--metrics.wandb_project=loomtest",
        *TINY,
    ]
    assert main(args) == 0
    recs = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    loss = {r["step"]: r["loss"] for r in recs if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    assert sorted(loss) == [1, 2, 3] and sorted(val) == [2, 3]

    acc = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert tb.keys() == loss.keys() and all(tb[s] == pytest.approx(loss[s], rel=1e-6) for s in loss)
    assert {e.step: e.value for e in acc.Scalars("val/loss")} == pytest.approx(val, rel=1e-6)
    assert {
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "summary/tokens_per_s",
        "summary/val_loss",
    } <= set(acc.Tags()["scalars"])

    (run_file,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 20  # wandb's service process may still be writing the last records
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_file)):
        assert time.monotonic() < deadline, "the W&B run file was never completed"
        time.sleep(0.2)
    history, config = {}, {}
    for rec in wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            history.setdefault(int(items.get("_step", rec.history.step.num)), {}).update(items)
        elif kind == "run":
            config = {i.key or "/".join(i.nested_key): i.value_json for i in rec.run.config.update}
            assert rec.run.project == "loomtest" and rec.run.display_name == "r"
    assert {s: float(h["train/loss"]) for s, h in history.items() if "train/loss" in h} == loss
    assert {s: float(h["val/loss"]) for s, h in history.items() if "val/loss" in h} == val
    assert '"n_embd": 16' in config["model"] or '"n_embd":16' in config["model"]


def test_read_jsonl_leaves_out_a_line_still_being_written(tmp_path):
    # a reader beside a running (or killed) trainer can see the start of a record without its newline
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 2.5}\n\n{"step": 2, "lo')
    assert read_jsonl(p) == [{"step": 1, "loss": 2.5}]
    p.write_text('{"step": 1, "loss": 2.5}\n{"step": 2}\n')
    assert read_jsonl(p) == [{"step": 1, "loss": 2.5}, {"step": 2}]


def test_read_jsonl_gives_one_timeline_after_resumes(tmp_path):
    """Issue 27 item 7: steps trained again after a resume appeared twice and `loom plot` drew the curve
    doubling back. Records of steps after a resume's step, written before it, are superseded (left in the file)."""
    p = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "loss": 10.0 - s} for s in range(1, 8)]  # killed after step 7, saved at step 4
    lines += [{"summary": {"step": 7}}, {"resumed_from": 4}]
    lines += [{"step": s, "loss": 20.0 - s} for s in range(5, 10)]  # killed after step 9, saved at step 8
    lines += [{"resumed_from": 8}, {"step": 9, "loss": 0.5}, {"step": 9, "val_loss": 0.6}]
    p.write_text("".join(json.dumps(r) + "\n" for r in lines))
    recs = read_jsonl(p)
    assert [(r["step"], r["loss"]) for r in recs if "loss" in r] == [
        *((s, 10.0 - s) for s in range(1, 5)),
        *((s, 20.0 - s) for s in range(5, 9)),
        (9, 0.5),
    ]
    assert not any("summary" in r for r in recs) and [r for r in recs if "val_loss" in r] == [lines[-1]]
    assert read_jsonl(p, superseded=True) == lines  # nothing dropped from the file itself

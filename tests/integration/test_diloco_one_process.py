"""DiLoCo on one process with inner_steps = 1 and the outer optimizer plain SGD at lr 1 (momentum 0) is plain
training: every outer step sets the parameters to anchor - (anchor - params). Compared against: the same run
without DiLoCo, loss by loss (to 1e-6: a - (a - p) is p up to one rounding of fp32) and the final weights."""

from __future__ import annotations

import torch
from tiny import tiny_args

from loom import checkpoint
from loom.cli import main
from loom.metrics import read_jsonl

STEPS = 8


def _run(data, runs, name: str, *extra: str) -> tuple[list[dict], dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = [f"--data.path={data}", f"--run.dir={runs}", f"--run.name={name}", f"--train.steps={STEPS}"]
        assert main(["train", *args, *tiny_args(), "--parallel.dp_impl=none", *extra]) == 0
    finally:
        torch.set_num_threads(threads)
    recs = [r for r in read_jsonl(runs / name / "metrics.jsonl") if "loss" in r]
    return recs, checkpoint.load(checkpoint.latest_valid(runs / name / "ckpt"))[0]["model"]


def test_inner_steps_1_outer_sgd_lr_1_is_plain_training(char_data, tmp_path):
    plain, w_plain = _run(char_data, tmp_path, "plain")
    outer = ["--parallel.diloco_outer_lr=1", "--parallel.diloco_outer_momentum=0"]
    dl, w_dl = _run(char_data, tmp_path, "diloco", "--parallel.diloco_inner_steps=1", *outer)
    assert [r["outer_step"] for r in dl] == list(range(1, STEPS + 1))  # an outer step after every step
    assert all(r["outer_bytes"] == 0 for r in dl)  # one replica: nothing to send
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(plain, dl, strict=True))
    assert worst <= 1e-6, worst
    for k, v in w_plain.items():
        torch.testing.assert_close(w_dl[k], v, rtol=0, atol=1e-6)

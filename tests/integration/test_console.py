"""What `loom train` prints for people (issue 58), read from its piped stdout as a log file would hold it:
`step k/N` with the time so far and the time left, the run folder at the start and the next commands at the
end, a line before the end-of-run sample, and the console's loss as the mean over the logging interval. The
mean is compared against the per-step losses of the same run logged every step (fp32, bit-identical steps)."""

from __future__ import annotations

import math
import re

from loomrun import loom_ok
from tiny import tiny_args

from loom.metrics import read_jsonl


def _run(data, runs, name, *extra):
    args = tiny_args({"train.steps": 10, "train.sample_tokens": 8, **dict(a.split("=", 1) for a in extra)})
    return loom_ok("train", f"--data.path={data}", f"--run.dir={runs}", f"--run.name={name}", *args)


def test_progress_run_folder_next_commands_and_the_interval_mean(char_data, tmp_path):
    every = _run(char_data, tmp_path, "every", "train.log_every=1")
    r = _run(char_data, tmp_path, "five", "train.log_every=5", "train.sample_every=10")
    lines = r.stdout.splitlines()
    run = tmp_path / "five"

    # progress: step k/N, the time so far and, before the last step, the time left
    steps = [line for line in lines if line.startswith("step ") and "/10 |" in line]
    assert [s.split("|")[0].strip() for s in steps] == ["step  5/10", "step 10/10"], r.stdout
    assert re.match(r"step  5/10 \| \d+s, ETA \d+s \| loss ", steps[0]), steps[0]
    assert re.match(r"step 10/10 \| \d+s \| loss ", steps[1]), steps[1]  # nothing left: no ETA

    # the run folder first, the next commands last
    assert f"run folder: {run} (config.toml" in r.stdout
    assert lines[-2:] == [
        f"run folder: {run}",
        f"next: loom generate {run}  |  loom plot {run}  |  loom eval {run}",
    ], lines[-3:]
    said = lines.index("sampling 8 tokens at step 10 (train.sample_tokens)")
    assert lines[said + 1] == "--- sample at step 10 ---", lines[said : said + 2]

    # the console's loss is the interval's mean; metrics.jsonl keeps the step's own loss beside it
    per_step = {x["step"]: x["loss"] for x in read_jsonl(tmp_path / "every" / "metrics.jsonl") if "loss" in x}
    recs = {x["step"]: x for x in read_jsonl(run / "metrics.jsonl") if "loss" in x}
    for step, first in ((5, 1), (10, 6)):
        mean = sum(per_step[s] for s in range(first, step + 1)) / 5
        assert recs[step]["loss"] == per_step[step]
        assert math.isclose(recs[step]["loss_mean"], mean, rel_tol=1e-12), (recs[step], mean)
        assert recs[step]["loss_steps"] == 5
        assert f"loss {mean:.4f}" in steps[step // 5 - 1]
    assert "elapsed_s" in recs[10] and "step  1/10 | " in every.stdout


def test_a_warm_up_longer_than_the_run_and_epochs_are_said(char_data, tmp_path):
    """40 steps of 64 rows of 32 tokens over ~30k training tokens: ~2.7 passes; warm-up 60 > 40 steps."""
    r = _run(
        char_data,
        tmp_path,
        "short",
        "train.steps=40",
        "train.batch_size=64",
        "train.log_every=0",
        "optim.warmup_steps=60",
    )
    assert "warning: 40 steps < 60 warm-up steps: the peak lr 0.001 is never reached" in r.stdout, r.stdout
    said = re.search(r"warning: the run reads its training tokens (\d+\.\d) times \(epochs\)", r.stdout)
    assert said and 2.0 < float(said.group(1)) < 4.0, r.stdout
    quiet = _run(char_data, tmp_path, "fine")  # 10 steps of 8 rows, warm-up 3: nothing to say
    assert "warm-up steps" not in quiet.stdout and "epochs" not in quiet.stdout, quiet.stdout

"""Model-only loading sharded over the processes of a job (`loom eval/generate ... --shard` under torchrun, 2
gloo processes): the model is built on the meta device, FSDP-sharded, and each rank reads its part of the
checkpoint's model/ (optim/ deleted first: never read). Compared against: the same commands in one process
with the whole model. The run's batch is 3 rows at micro-batch 1, so the two ranks' shares of the validation
windows differ by a row and the shorter rank must run a padding forward to stay in step."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loom.cli import main
from loom.env import free_port


def torchrun(*args: str) -> str:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [
        exe,
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "--no-python",
        sys.executable,
        "-m",
        "loom",
        *args,
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory, char_data):
    root = tmp_path_factory.mktemp("sharded_eval")
    assert (
        main(
            [
                "train",
                f"--data.path={char_data}",
                f"--run.dir={root}",
                "--run.name=r",
                "--train.steps=6",
                "--model.n_layer=2",
                "--model.n_head=2",
                "--model.n_embd=32",
                "--model.block_size=32",
                "--train.batch_size=3",
                "--train.micro_batch_size=1",
                "--train.eval_batches=1",
                "--train.sample_every=0",
                "--train.sample_tokens=4",
                "--train.device=cpu",
            ]
        )
        == 0
    )
    step = next((root / "r" / "ckpt").iterdir())
    shutil.rmtree(step / "optim")  # model-only loading: the optimizer's files are never read
    return root / "r"


def _value(out: str, key: str) -> float:
    line = next(ln for ln in out.splitlines() if key in ln)
    return float(line.split(key)[1].split()[0])


def test_val_loss_of_the_sharded_model_equals_the_whole_one(run, capsys):
    assert main(["eval", str(run), "--device", "cpu", "--batches", "1"]) == 0
    one = capsys.readouterr().out
    two = torchrun("eval", str(run), "--device", "cpu", "--batches", "1", "--shard")
    assert "(3 windows of 32 tokens), model sharded over 2 processes (" in two
    here, total = (
        int(x.replace(",", "")) for x in two.split("processes (")[1].split(" parameters")[0].split(" of its ")
    )
    assert (
        abs(here - total / 2) <= 0.02 * total
    )  # each rank holds its half (FSDP's dim-0 shards), not the whole
    assert two.count("val loss") == 1  # printed by rank 0 only
    assert _value(two, "val loss") == pytest.approx(_value(one, "val loss"), abs=2e-4)
    assert _value(two, "bits per byte") == pytest.approx(_value(one, "bits per byte"), abs=2e-4)


def test_val_loss_without_shard_is_split_over_the_ranks_and_printed_once(run, capsys):
    """Issue 42 item 7: `torchrun ... -m loom eval RUN` without --shard did the whole evaluation on every rank
    and printed it once per rank. Each rank now holds the whole model and scores its share of the windows; the
    sum over the ranks gives one process's loss, printed once by rank 0."""
    assert main(["eval", str(run), "--device", "cpu", "--batches", "1"]) == 0
    one = capsys.readouterr().out
    two = torchrun("eval", str(run), "--device", "cpu", "--batches", "1")
    assert two.count("val loss") == 1, two
    assert "(3 windows of 32 tokens), split over 2 processes (each with the whole model" in two
    assert _value(two, "val loss") == pytest.approx(_value(one, "val loss"), abs=2e-4)
    assert _value(two, "bits per byte") == pytest.approx(_value(one, "bits per byte"), abs=2e-4)


def test_greedy_generation_and_hellaswag_of_the_sharded_model(run, capsys, tmp_path):
    gen = [
        "generate",
        str(run),
        "--device",
        "cpu",
        "--prompt",
        "The ",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ]
    assert main(gen) == 0
    one = capsys.readouterr().out
    assert torchrun(*gen, "--shard") == one  # every rank samples in step; rank 0 prints the same text
    rng = random.Random(1)
    words = "the of and to in is that it for as with".split()
    (tmp_path / "hs.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "ctx": " ".join(rng.choices(words, k=5)),
                    "endings": [" ".join(rng.choices(words, k=rng.randint(1, 4))) for _ in range(4)],
                    "label": rng.randrange(4),
                }
            )
            + "\n"
            for _ in range(5)
        )
    )
    hs = ["eval", str(run), "--device", "cpu", "--task", "hellaswag", "--data", str(tmp_path / "hs.jsonl")]
    assert main(hs) == 0
    acc = capsys.readouterr().out.splitlines()[-1]
    out = torchrun(*hs, "--shard")
    assert out.splitlines()[-1] == acc and "5 examples on 2 process(es)" in out


def test_shard_in_one_process_is_refused(run, capsys):
    assert main(["eval", str(run), "--device", "cpu", "--shard"]) == 2
    assert "--shard splits the model over the processes of a job" in capsys.readouterr().err

"""`loom eval --task hellaswag` under torchrun with 2 gloo processes, compared with one process: the ranks
score interleaved examples (an odd count, so the split is uneven) and the summed counts give the same
accuracies."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from loom.cli import main
from loom.env import free_port


def test_two_ranks_give_the_one_process_figures(tmp_path, char_data, capsys):
    assert (
        main(
            [
                "train",
                f"--data.path={char_data}",
                f"--run.dir={tmp_path}",
                "--run.name=r",
                "--train.steps=2",
                "--model.n_layer=1",
                "--model.n_head=2",
                "--model.n_embd=16",
                "--model.block_size=32",
                "--train.batch_size=4",
                "--train.eval_batches=1",
                "--train.sample_every=0",
                "--train.sample_tokens=4",
                "--train.device=cpu",
            ]
        )
        == 0
    )
    words = "the of and to in is that it for as with was on be by at this from".split()
    rng = random.Random(3)
    lines = [
        json.dumps(
            {
                "ctx": " ".join(rng.choices(words, k=6)),
                "endings": [" ".join(rng.choices(words, k=rng.randint(1, 5))) for _ in range(4)],
                "label": rng.randrange(4),
            }
        )
        for _ in range(7)
    ]
    data = tmp_path / "hs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    args = ["eval", str(tmp_path / "r"), "--task", "hellaswag", "--data", str(data), "--device", "cpu"]
    capsys.readouterr()
    assert main(args) == 0
    one = capsys.readouterr().out.splitlines()[-1]
    assert one.startswith("acc ")

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        torchrun,
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
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "7 examples on 2 process(es)" in r.stdout
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("acc ")] == [one]  # printed by rank 0 only

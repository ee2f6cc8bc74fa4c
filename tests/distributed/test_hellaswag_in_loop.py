"""HellaSwag during training (train.hellaswag_every): one process, fsdp x 2 (the examples split across the
ranks, an odd count, so one rank scores one example more and the other keeps its sharded forward in step) and
tp 2 (rank 0 scores every example on a gathered copy) log the same accuracies at the same steps, and the
figures equal `loom eval --task hellaswag` on the run's final checkpoint. A bad hellaswag_data fails at start."""

from __future__ import annotations

import json
import random
import sys

from loomrun import loom_run
from tiny import tiny_args

from loom.cli import main
from loom.metrics import read_jsonl

LOOM = [sys.executable, "-m", "loom"]
TINY = tiny_args(
    {
        "model.n_layer": 1,
        "model.n_embd": 16,
        "train.batch_size": 4,
        "train.eval_batches": 1,
        "train.steps": 4,
        "train.hellaswag_every": 2,
        "precision.dtype": "fp32",
        "optim.warmup_steps": None,
    }
)


def hellaswag_file(path, n=7):
    words = "the of and to in is that it for as with was on be by at this from".split()
    rng = random.Random(5)
    lines = [
        json.dumps(
            {
                "ctx": " ".join(rng.choices(words, k=6)),
                "endings": [" ".join(rng.choices(words, k=rng.randint(1, 5))) for _ in range(4)],
                "label": rng.randrange(4),
            }
        )
        for _ in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def accuracies(run):
    return {
        r["step"]: (r["hellaswag_acc"], r["hellaswag_acc_norm"])
        for r in read_jsonl(run / "metrics.jsonl")
        if "hellaswag_acc" in r
    }


def test_every_layout_logs_the_one_process_accuracies(tmp_path, char_data, capsys):
    hs = hellaswag_file(tmp_path / "hs.jsonl")
    base = [f"--data.path={char_data}", f"--run.dir={tmp_path}", f"--train.hellaswag_data={hs}", *TINY]
    for name, layout in {
        "one": [],
        "fsdp2": ["--nproc=2", "--parallel.dp_impl=fsdp"],
        "tp2": ["--nproc=2", "--parallel.tp=2"],
    }.items():
        r = loom_run("train", f"--run.name={name}", *layout, *base, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    one = accuracies(tmp_path / "one")
    assert sorted(one) == [2, 4]
    assert accuracies(tmp_path / "fsdp2") == one
    assert accuracies(tmp_path / "tp2") == one
    capsys.readouterr()
    assert (
        main(["eval", str(tmp_path / "one"), "--task", "hellaswag", "--data", str(hs), "--device", "cpu"])
        == 0
    )
    acc, acc_norm = one[4]
    assert capsys.readouterr().out.splitlines()[-1] == f"acc {acc:.4f} | acc_norm {acc_norm:.4f}"


def test_bad_hellaswag_data_fails_before_training(tmp_path, char_data, capsys):
    base = [f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=bad", *TINY]
    assert main(["train", *base]) == 2
    assert "needs train.hellaswag_data" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n')
    assert main(["train", *base, f"--train.hellaswag_data={tmp_path / 'bad.jsonl'}"]) == 2
    assert "needs 'ctx'" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()

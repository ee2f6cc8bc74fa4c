"""`loom ckpt average`: the written weights equal the mean of the last N checkpoints' weights computed here (and
with --ema, the newest checkpoint's train.ema tensors); `loom eval` and `loom generate` read the folder; asking
for more checkpoints than the run kept, or for neither --last nor --ema, is a clear error before any write."""

from __future__ import annotations

import pytest
import torch
from loomrun import TINY, loom_here
from safetensors.torch import load_file

from loom.cli import main
from loom.parallel.dcp_state import read_whole


@pytest.fixture(scope="module")
def run(char_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("avg")
    loom_here(
        "train",
        f"--data.path={char_data}",
        f"--run.dir={root}",
        "--run.name=r",
        *TINY,
        "--train.steps=6",
        "--train.ckpt_every=2",
        "--train.keep_last=3",
        "--train.ema=0.5",
    )
    return root / "r"


def test_average_of_the_last_checkpoints(run, tmp_path, capsys):
    out = tmp_path / "avg"
    assert main(["ckpt", "average", str(run), "--last", "3", "--out", str(out)]) == 0
    assert "the mean of steps [2, 4, 6]" in capsys.readouterr().out
    got = load_file(str(out / "model.safetensors"))
    steps = [read_whole(run / "ckpt" / f"step_00000{s}" / "model") for s in (2, 4, 6)]
    assert set(got) == set(steps[0])
    for k, v in got.items():
        want = (steps[0][k].double() + steps[1][k].double() + steps[2][k].double()) / 3
        torch.testing.assert_close(v, want.float(), rtol=0, atol=1e-7, msg=k)
    assert not torch.equal(got["wte.weight"], steps[2]["wte.weight"])  # an average, not the newest
    assert main(["eval", str(out)]) == 0 and "val loss" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "The", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("The")


def test_average_ema_writes_the_moving_average(run, tmp_path):
    out = tmp_path / "ema"
    assert main(["ckpt", "average", str(run), "--ema", "--out", str(out)]) == 0
    got = load_file(str(out / "model.safetensors"))
    optim = read_whole(run / "ckpt" / "step_000006" / "optim")
    assert {f"ema.{k}" for k in got} == {k for k in optim if k.startswith("ema.")}
    for k, v in got.items():
        assert torch.equal(v, optim[f"ema.{k}"]), k


@pytest.mark.parametrize(
    "args,message",
    [
        (["--last", "5"], "has 3 valid checkpoint(s), 5 asked for"),
        ([], "takes --last N (N >= 1) or --ema"),
    ],
)
def test_average_refuses(run, tmp_path, capsys, args, message):
    out = tmp_path / "x"
    assert main(["ckpt", "average", str(run), *args, "--out", str(out)]) != 0
    assert message in capsys.readouterr().err
    assert not out.exists()

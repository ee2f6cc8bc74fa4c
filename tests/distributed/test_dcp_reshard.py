"""Sharded (DCP) checkpoints across layouts: a checkpoint written by fsdp x 4 holds one shard file per rank
and per part, and continues under fsdp x 2, ddp x 2, tp2 x dp2, pp2 x dp2, HSDP 2 x 2 and one process; each
continued curve is compared with the uninterrupted single-process run (fp32, within 1e-5)."""

from __future__ import annotations

import json
import shutil

import pytest
from loomrun import TINY, loom_here

from loom.metrics import read_jsonl

LAYOUTS = {
    "fsdp2": ["--nproc=2", "--parallel.dp_impl=fsdp"],
    "ddp2": ["--nproc=2", "--parallel.dp_impl=ddp"],
    "tp2-dp2": ["--nproc=4", "--parallel.tp=2", "--parallel.dp_impl=fsdp"],
    "pp2-dp2": ["--nproc=4", "--parallel.pp=2", "--parallel.dp_impl=fsdp", "--parallel.pp_microbatches=2"],
    "hsdp2x2": ["--nproc=4", "--parallel.dp_impl=fsdp", "--parallel.dp_replicate=2"],
    "single": ["--parallel.dp_impl=none"],
}


def _losses(run):
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, char_data):
    """(the single-process reference losses, an fsdp x 4 run with checkpoints at steps 4 and 8)."""
    root = tmp_path_factory.mktemp("dcp")
    base = [f"--data.path={char_data}", f"--run.dir={root}", *TINY, "--train.steps=8", "--train.ckpt_every=4"]
    loom_here("train", "--run.name=ref", "--parallel.dp_impl=none", *base)
    loom_here("train", "--run.name=fsdp4", "--nproc=4", "--parallel.dp_impl=fsdp", *base)
    return _losses(root / "ref"), root / "fsdp4"


def test_fsdp4_checkpoint_holds_one_shard_file_per_rank(saved):
    step = saved[1] / "ckpt" / "step_000004"
    for part in ("model", "optim"):
        assert sorted(p.name for p in (step / part).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    files = json.loads((step / "manifest.json").read_text())["files"]
    assert "model/__3_0.distcp" in files and "optim/__2_0.distcp" in files
    assert not (step / "model.pt").exists()  # nothing gathered whole


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp4_checkpoint_continues_on_another_layout(saved, tmp_path, layout):
    reference, run = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "ckpt" / "step_000008")
    (copy / "metrics.jsonl").write_text("")  # only the continued steps
    loom_here("train", "--resume", str(copy / "ckpt" / "step_000004"), *LAYOUTS[layout], "--train.device=cpu")
    continued = _losses(copy)
    assert sorted(continued) == [5, 6, 7, 8]
    worst = max(abs(loss - reference[step]) for step, loss in continued.items())
    print(f"\n[dcp] fsdp x 4 -> {layout}: steps 5-8, max |loss - single process| = {worst:.2e}")
    assert worst <= 1e-5, (layout, continued, reference)

"""Capability scores do not depend on the layout: the harness tasks and CORE scored on one process, under
torchrun with 2 processes each holding the model (the harness splits the requests), with --shard (FSDP over
the 2 processes, forwards in lockstep: the ranks' generation batches differ in number and length), and on a
run trained under tp=2; and the in-loop records of 2-process fsdp and tp runs equal `loom eval` of their
checkpoints."""

from __future__ import annotations

import json

import pytest
from evalkit import TASKS, TINY, prepare_data, torchrun_loom, write_bundle, write_tasks
from loomrun import loom_here

from loom.metrics import read_jsonl

pytest.importorskip("lm_eval", reason="the eval extra (make test installs it)")


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_layouts")
    data = prepare_data(root)
    tasks, bundle = write_tasks(root, n=23), write_bundle(root, n=23)  # odd: the ranks' shares differ
    common = [f"--data.path={data}", f"--run.dir={root}", *TINY, "--train.log_every=4", "--train.steps=8"]
    loom_here("train", *common, "--run.name=one")
    scored = [f"--eval.tasks={TASKS}", f"--eval.include_path={tasks}", f"--eval.core_bundle={bundle}"]
    loom_here("train", "--nproc", "2", *common, "--run.name=tp2", "--parallel.tp=2", *scored)  # at the end
    loom_here(
        "train",
        "--nproc",
        "2",
        *common,
        "--run.name=fsdp2",
        "--parallel.dp_impl=fsdp",
        *scored,
        "--eval.every=4",
        "--train.ckpt_every=4",
        "--train.keep_last=2",
    )
    return root, tasks, bundle


def _scores(root, name: str, *args: str, torchrun: bool = False) -> dict:
    out = root / f"{name}.json"
    cmd = ["eval", *args, "--json", str(out), "--device", "cpu"]
    torchrun_loom(*cmd) if torchrun else loom_here(*cmd)
    return json.loads(out.read_text())["scores"]


def _same(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys() and any(k.endswith("/acc") for k in a)
    for k in a:
        if k.endswith(("acc", "acc_norm", "exact_match")) or k.startswith("core/"):
            assert a[k] == b[k], k  # counts of right answers: exactly
        else:
            assert a[k] == pytest.approx(b[k], rel=rel), k


def test_scores_equal_across_layouts(kit):
    root, tasks, bundle = kit
    what = ["--tasks", TASKS, "--include-path", str(tasks), "--suite", "core", "--bundle", str(bundle)]
    one = _scores(root, "one", str(root / "one"), *what)
    _same(_scores(root, "split", str(root / "one"), *what, torchrun=True), one, 1e-5)
    _same(_scores(root, "shard", str(root / "one"), *what, "--shard", torchrun=True), one, 1e-5)
    # trained under tp=2: the same training to ~1e-6 in the weights (loom verify), so the same answers
    _same(_scores(root, "tp2", str(root / "tp2"), *what), one, 1e-4)


@pytest.mark.parametrize("name, steps, step", [("fsdp2", [4, 8], 4), ("tp2", [8], 8)])
def test_in_loop_record_equals_loom_eval_of_its_checkpoint(kit, name, steps, step):
    """fsdp: every rank scores its share of the requests, forwards in lockstep; tp: rank 0 on a whole copy."""
    root, tasks, bundle = kit
    run = root / name
    recs = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "core" in r}
    assert sorted(recs) == steps
    got = _scores(
        root,
        f"{name}_step{step}",
        str(run),
        "--tasks",
        TASKS,
        "--include-path",
        str(tasks),
        "--suite",
        "core",
        "--bundle",
        str(bundle),
        "--ckpt",
        str(run / "ckpt" / f"step_{step:06d}"),
    )
    _same({k: recs[step][k] for k in got}, got, 1e-5)

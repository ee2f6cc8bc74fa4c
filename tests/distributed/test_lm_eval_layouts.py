"""Capability scores do not depend on the layout: the harness tasks and CORE scored on one process, under
torchrun with 2 processes each holding the model (the harness splits the requests), with --shard (FSDP over
the 2 processes, forwards in lockstep: the ranks' generation batches differ in number and length), and on a
run trained under tp=2; and a 2-process fsdp run's in-loop record equals `loom eval` of its checkpoint."""

from __future__ import annotations

import json

import pytest
from evalkit import TASKS, prepare_data, torchrun_loom, write_bundle, write_tasks
from loomrun import loom_here

from loom.metrics import read_jsonl

pytest.importorskip("lm_eval", reason="the eval extra (make test installs it)")

TINY = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=48",
    "--model.block_size=64",
    "--train.batch_size=8",
    "--train.eval_batches=1",
    "--train.eval_every=0",
    "--train.sample_every=0",
    "--train.log_every=4",
    "--optim.warmup_steps=2",
    "--train.steps=8",
    "--train.device=cpu",
]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_layouts")
    data = prepare_data(root)
    tasks, bundle = write_tasks(root, n=23), write_bundle(root, n=23)  # odd: the ranks' shares differ
    common = [f"--data.path={data}", f"--run.dir={root}", *TINY]
    loom_here("train", *common, "--run.name=one")
    loom_here("train", "--nproc", "2", *common, "--run.name=tp2", "--parallel.tp=2")
    loom_here(
        "train", "--nproc", "2", *common, "--run.name=fsdp2", "--parallel.dp_impl=fsdp",
        f"--eval.tasks={TASKS}", f"--eval.include_path={tasks}", f"--eval.core_bundle={bundle}",
        "--eval.every=4", "--train.ckpt_every=4", "--train.keep_last=2",
    )  # fmt: skip
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


def test_in_loop_fsdp_record_equals_loom_eval_of_its_checkpoint(kit):
    root, tasks, bundle = kit
    run = root / "fsdp2"
    recs = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "core" in r}
    assert sorted(recs) == [4, 8]
    got = _scores(
        root, "fsdp2_step4", str(run), "--tasks", TASKS, "--include-path", str(tasks), "--suite", "core",
        "--bundle", str(bundle), "--ckpt", str(run / "ckpt" / "step_000004"),
    )  # fmt: skip
    _same({k: recs[4][k] for k in got}, got, 1e-5)

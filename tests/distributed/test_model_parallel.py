"""Tensor, sequence and pipeline parallel and their compositions with real processes (gloo, loopback):
`loom verify` against one process, exact resume with the same layout, resume into another layout, and the
layout rules that must fail before any process starts."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from loomrun import loom_here, loom_run
from tiny import tiny_args

from loom.config import load_config, validate
from loom.errors import LoomError
from loom.metrics import read_jsonl
from loom.model.gpt.gpt_parallel import stage_layers
from loom.verify import STRATEGIES

LOOM = [sys.executable, "-m", "loom"]
TINY = tiny_args(
    {
        "model.n_layer": 4,
        "model.n_head": 4,
        "model.block_size": 16,
        "train.micro_batch_size": 2,
    }
)


def loom(*args, timeout=400):
    return loom_run(*args, timeout=timeout)  # a warm fork, not a new interpreter (tests/loomrun.py)


def losses(run: Path) -> dict[int, float]:
    return dict(steps(run))


def steps(run: Path) -> list[tuple[int, float]]:
    """(step, loss) in the order written: a resumed run appends to its metrics.jsonl (every line read, the
    records a resume superseded too)."""
    return [(r["step"], r["loss"]) for r in read_jsonl(run / "metrics.jsonl", superseded=True) if "loss" in r]


def _verify(tmp_path, char_data, strategies: list[str], steps: int) -> list[dict]:
    out = tmp_path / "v"
    r = loom(
        "verify",
        "--strategies",
        ",".join(strategies),
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--data",
        str(char_data),
        "--tol-loss",
        "1e-5",
        "--json",
        str(tmp_path / "v.json"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = json.loads((tmp_path / "v.json").read_text())
    assert [rec["strategy"] for rec in records] == strategies
    for rec in records:
        assert rec["passed"] and rec["max_abs_dloss"] <= 1e-5 and rec["max_abs_dparam"] <= 1e-5, rec
        assert len(losses(out / rec["strategy"])) == steps
    return records


def test_verify_every_model_parallel_strategy(tmp_path, char_data):
    """2 ranks for tp-sp and the pipeline schedules, 4 for dp-tp (FSDP2), dp-pp, tp-pp, 8 for dp-tp-pp (FSDP2).
    5 steps: the verify model's warmup (5 steps) to its peak learning rate; a tensor-parallel step takes ~0.8 s
    on a CPU (DTensor dispatch), 25 times the reference's. Plain tp and pp-1f1b at 2 ranks are verified by
    tests/integration/test_family_plugin.py::test_plugin_family_passes_verify (the GPT plan through a plug-in
    family), not again here."""
    names = [
        "tp-sp",
        "pp-gpipe",
        "pp-interleaved-1f1b",
        "pp-zero-bubble",
        "dp-tp",
        "dp-pp",
        "tp-pp",
        "dp-tp-pp",
    ]
    records = _verify(tmp_path, char_data, names, steps=5)
    layouts = {r["strategy"]: (r["dp"], r["tp"], r["pp"]) for r in records}
    assert layouts["tp-sp"] == (1, 2, 1)
    assert all(layouts[n] == (1, 1, 2) for n in names[1:4])
    assert [layouts[n] for n in names[4:]] == [(2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]


def test_resume_same_layout_is_exact_and_other_layout_continues(tmp_path, char_data):
    """tp=2 x pp=2 (sequence parallel, interleaved 1F1B): steps 4..6 after resuming from step 3 equal the
    straight run bit for bit; the same checkpoint also resumes in one process (full, unsharded state)."""
    layout = [
        "--nproc=4",
        "--parallel.tp=2",
        "--parallel.pp=2",
        "--parallel.sp=true",
        "--parallel.pp_schedule=interleaved-1f1b",
    ]
    common = [
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--train.steps=6",
        "--train.ckpt_every=3",
        "--train.keep_last=5",
        "--model.dropout=0.0",
        *TINY,
    ]
    loom_here("train", *layout, "--run.name=mp", *common)
    straight = steps(tmp_path / "mp")
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]
    shutil.copytree(tmp_path / "mp", tmp_path / "single")
    loom_here("train", *layout, "--resume", str(tmp_path / "mp" / "ckpt" / "step_000003"))
    assert steps(tmp_path / "mp")[6:] == straight[3:]  # exact float equality
    loom_here(
        "train",
        "--resume",
        str(tmp_path / "single" / "ckpt" / "step_000003"),
        "--parallel.tp=1",
        "--parallel.pp=1",
        "--parallel.sp=false",
    )
    single = steps(tmp_path / "single")[6:]
    assert [s for s, _ in single] == [4, 5, 6]
    assert max(abs(a - b) for (_, a), (_, b) in zip(single, straight[3:], strict=True)) < 1e-5


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["parallel.tp=3"], 3, "does not divide model.n_head=4"),
        (["parallel.pp=8"], 8, "only model.n_layer=4 layers"),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "model.n_layer=3"],
            2,
            "4 pipeline stages",
        ),
        (["parallel.tp=2"], 3, "world size 3 is not divisible"),
        (["parallel.sp=true"], 1, "needs parallel.tp > 1"),
        (["parallel.tp=2", "parallel.dp_impl=zero1"], 4, "does not compose"),
        (["parallel.pp=2", "precision.dtype=fp16"], 2, "fp16"),
        (["parallel.dp_impl=fsdp", "parallel.dp_replicate=3"], 4, "must equal the data-parallel degree 4"),
        (["parallel.dp_impl=fsdp", "parallel.dp_replicate=2", "parallel.dp_shard=4"], 4, "must equal"),
        (["parallel.dp_impl=ddp", "parallel.dp_replicate=2"], 4, "replicates the model"),
        (["parallel.dp_impl=fsdp", "parallel.dp_shard=0"], 4, "dp_shard >= 1"),
    ],
)
def test_layout_rules(overrides, world, message):
    cfg = load_config(
        None, [f"--{o}" for o in ["model.n_head=4", "model.n_layer=4", "model.n_embd=64", *overrides]]
    )
    with pytest.raises(LoomError, match=message):
        validate(cfg, world)


def test_pipeline_micro_batch_rules():
    cfg = load_config(
        None, ["--parallel.pp=4", "--model.n_layer=4", "--train.batch_size=8", "--train.micro_batch_size=4"]
    )
    with pytest.raises(LoomError, match="needs at least one per stage"):
        validate(cfg, world=4)  # 2 micro-batches for 4 stages under 1F1B
    cfg.parallel.pp_schedule = "gpipe"
    assert validate(cfg, world=4)[0].pp_microbatches == 2  # GPipe runs any number
    cfg.parallel.pp_schedule, cfg.parallel.pp_microbatches = "1f1b", 8
    d = validate(cfg, world=4)[0]
    assert (d.pp_microbatches, d.micro_batch_size, d.grad_accum) == (8, 1, 1)


@pytest.mark.parametrize(
    "schedule, pp, batch, expected",
    [
        ("1f1b", 2, 16, 2),
        ("gpipe", 2, 16, 2),
        ("1f1b", 4, 6, 6),
        ("interleaved-1f1b", 2, 12, 2),
        ("1f1b", 3, 8, 4),
    ],
)
def test_pipeline_micro_batches_default_to_one_per_stage(schedule, pp, batch, expected):
    """Neither parallel.pp_microbatches nor train.micro_batch_size set: docs/parallelism.md's `--nproc 2
    --parallel.pp=2 --parallel.pp_schedule=1f1b` gets one micro-batch per stage (it got 1, an error), or the
    smallest count above that which divides the local batch."""
    cfg = load_config(
        None,
        [f"--parallel.pp={pp}", f"--parallel.pp_schedule={schedule}", "--model.n_layer=4"]
        + [f"--train.batch_size={batch}"],
    )
    d = validate(cfg, world=pp)[0]
    assert (d.pp_microbatches, d.micro_batch_size, d.grad_accum) == (expected, batch // expected, 1)


def test_unknown_schedule_and_cli_errors_before_any_process(tmp_path, char_data):
    with pytest.raises(LoomError, match="must be one of gpipe, 1f1b"):
        load_config(None, ["--parallel.pp_schedule=looped"])
    r = loom(
        "train", "--nproc=3", "--parallel.tp=3", f"--data.path={char_data}", f"--run.dir={tmp_path}", *TINY
    )
    assert r.returncode != 0 and "does not divide model.n_head=4" in r.stderr
    assert "starting" not in r.stderr and not any(tmp_path.iterdir())


def test_stage_layers_are_balanced_and_contiguous():
    for n_layer in range(2, 13):
        for n_stages in range(1, n_layer + 1):
            ranges = stage_layers(n_layer, n_stages)
            assert [i for r in ranges for i in r] == list(range(n_layer))
            sizes = [len(r) for r in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
            if n_stages > 2 and n_layer % n_stages:
                assert (
                    sizes[0] <= sizes[n_stages // 2]
                )  # extra layers go to the middle, not the embedding stage


def test_verify_strategies_pick_their_degrees():
    assert STRATEGIES["tp"].degrees(4) == (1, 4, 1)
    assert STRATEGIES["pp-1f1b"].degrees(4) == (1, 1, 4)
    assert STRATEGIES["dp-tp"].degrees(8) == (4, 2, 1)
    assert STRATEGIES["tp-pp"].degrees(8) == (1, 2, 4)
    assert STRATEGIES["dp-tp-pp"].degrees(8) == (2, 2, 2)

"""The dry run (loom.dryrun) against 4 real gloo processes training the same tiny job on a CPU.

Compared: each measured rank's parameter, gradient and optimizer bytes with what that rank of the real job
holds after its first step (the trainer's own count, mem_params/grads/optim, written by every rank through a
hook imported as a plug-in; rank 0's also in metrics.jsonl): equal to the byte. And the dry run's peak
with the real step's, measured on the second step (a steady one) by the same torch tracker on real tensors:
within 10 % (fp32: the CPU and the GPU code paths of the model are the same)."""

from __future__ import annotations

import json
import os
import sys

import loomrun
import pytest
from loomrun import loom_run

from loom.config import load_config
from loom.dryrun import blocks
from loom.dryrun.layout import Target, check_layout, pipeline_supported, ranks_to_measure, vocab_size
from loom.metrics import read_jsonl

LOOM = [sys.executable, "-m", "loom"]
TINY = [*loomrun.TINY, "--train.micro_batch_size=2", "--train.sample_tokens=0"]
LAYOUTS = {
    "fsdp4": ["--parallel.dp_impl=fsdp"],
    "tp2-dp2": ["--parallel.tp=2"],
    "pp2-dp2": ["--parallel.pp=2"],
}

# Every rank writes what the trainer counts after its first step, and the tracker's peak of its second step.
HOOK = """
import json, os

import loom.train.trainer as trainer

_report, _step = trainer.Trainer._model_state_report, trainer.Trainer.train_step
_out = {out!r}


def _write(name, value):
    with open(os.path.join(_out, name + os.environ.get("RANK", "0") + ".json"), "w") as f:
        json.dump(value, f)


def _reported(self):
    rec = _report(self)
    if rec and self.step == 1:
        _write("state", rec)
    return rec


def _tracked(self):
    if self.step != 1:
        return _step(self)
    from loom.dryrun import fake

    par = self.parallel
    tracker = fake.FSDPStepTracker(par.fsdp_roots, self.optimizer) if par.fsdp_roots else fake.StepTracker()
    if not par.fsdp_roots:
        tracker.track_external(par.model, self.optimizer)
    with tracker:
        rec = _step(self)
    _write("peak", fake.terms(tracker.get_tracker_snapshot("peak")))
    return rec


trainer.Trainer._model_state_report, trainer.Trainer.train_step = _reported, _tracked
"""


def measure_role(
    cfg, world: int, rank: int, vocab_size: int, precision: str, exact: bool = False
) -> blocks.RankMemory:
    """Rank `rank`'s memory (measure_roles for one rank)."""
    return blocks.measure_roles(cfg, world, [rank], vocab_size, precision, exact)[0]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=pytest.mark.skipif(
                n.startswith("pp") and not pipeline_supported(),
                reason="the dry run of pipeline layouts needs torch >= 2.13's pipelining",
            ),
        )
        for n in LAYOUTS
    ],
)
def test_dry_run_holds_what_four_real_processes_hold(tmp_path, char_data, name):
    out, hooks = tmp_path / "out", tmp_path / "hooks"
    out.mkdir()
    hooks.mkdir()
    (hooks / "loom_memory_hook.py").write_text(HOOK.format(out=str(out)))
    env = {  # every loom process imports the plug-ins LOOM_PLUGINS names, the ranks too
        **os.environ,
        "LOOM_PLUGINS": "loom_memory_hook",
        "PYTHONPATH": os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p),
    }
    args = [f"--data.path={char_data}", *TINY, *LAYOUTS[name]]
    r = loom_run(
        "train", "--nproc=4", f"--run.dir={tmp_path}", "--run.name=real", "--train.steps=2", *args, env=env
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    real = {k: json.loads((out / f"state{k}.json").read_text()) for k in range(4)}
    first = next(rec for rec in read_jsonl(tmp_path / "real" / "metrics.jsonl") if "mem_params" in rec)
    assert {k: first[k] for k in real[0]} == real[0]  # the hook reads what metrics.jsonl records

    cfg = load_config(None, args)
    dims = check_layout(cfg, Target(4))
    vocab = vocab_size(cfg)
    for rank, _ in ranks_to_measure(cfg, dims, vocab):
        dry = measure_role(cfg, 4, rank, vocab, "fp32")
        held = {"mem_params": dry.params, "mem_grads": dry.grads, "mem_optim": dry.optim}
        assert held == real[rank], (name, rank, held, real[rank])
        peak = json.loads((out / f"peak{rank}.json").read_text())["total"]
        assert abs(dry.peak - peak) <= 0.10 * peak, (name, rank, dry.peak, peak)

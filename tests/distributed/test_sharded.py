"""ZeRO-1, ZeRO-2 and FSDP (FSDP2) with real processes, compared with one process: loss curves, resharding
a checkpoint across implementations and world sizes, generation from an FSDP run, and the bytes of model
state each rank holds."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from loomrun import TINY, loom_here, loom_run

from loom.metrics import read_jsonl

LOOM = [sys.executable, "-m", "loom"]


def loom(*args, timeout=300):
    r = loom_run(*args, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def test_verify_sharded_strategies_and_hsdp(tmp_path, char_data):
    """ZeRO-1, ZeRO-2 and FSDP at 2 ranks, and HSDP (2 replicas x 2 shards, parallel.dp_replicate=2) at 4, in
    one `loom verify` (one reference run shared by all four) against one process."""
    loom(
        "verify",
        "--strategies",
        "zero1,zero2,fsdp,hsdp",
        "--steps",
        "30",
        "--out",
        str(tmp_path / "v"),
        "--data",
        str(char_data),
        "--json",
        str(tmp_path / "v.json"),
    )
    recs = json.loads((tmp_path / "v.json").read_text())
    assert [r["strategy"] for r in recs] == ["zero1", "zero2", "fsdp", "hsdp"]
    for r in recs:
        assert r["passed"] and r["max_abs_dloss"] <= 1e-5, r
    assert [r["world_size"] for r in recs] == [2, 2, 2, 4]
    assert recs[-1]["dp"] == 4
    log = (tmp_path / "v" / "hsdp.log").read_text()
    assert "replicate 2 x shard 2" in log  # the layout it ran, as the trainer describes it


def _losses(run, start=0):
    """(step, loss) of every record written (superseded ones too), from the start-th on."""
    recs = read_jsonl(run / "metrics.jsonl", superseded=True)
    return [(r["step"], r["loss"]) for r in recs if "loss" in r][start:]


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory, char_data):
    """One process's 8 steps (the reference curve), and the 8 steps of fsdp and zero1 at 2 ranks, each saving at
    step 4: made once, each resharding case continuing a copy of its saved run."""
    root = tmp_path_factory.mktemp("reshard")
    base = [
        f"--data.path={char_data}",
        f"--run.dir={root}",
        *TINY,
        "--train.steps=8",
        "--train.ckpt_every=4",
        "--train.keep_last=3",
    ]
    loom_here("train", "--run.name=ref", "--parallel.dp_impl=none", *base)
    for impl in ("fsdp", "zero1"):
        loom_here("train", "--nproc=2", f"--parallel.dp_impl={impl}", f"--run.name={impl}2", *base)
    return root, dict(_losses(root / "ref"))


@pytest.mark.parametrize(
    "saved,resumed",
    [(("fsdp", 2), ("fsdp", 4)), (("fsdp", 2), ("none", 1)), (("zero1", 2), ("ddp", 2))],
    ids=["fsdp2-to-fsdp4", "fsdp2-to-single", "zero1-to-ddp"],
)
def test_checkpoint_reshards(tmp_path, reshard_runs, saved, resumed):
    root, reference = reshard_runs
    run = tmp_path / "saved"
    shutil.copytree(root / f"{saved[0]}{saved[1]}", run)
    loom_here(
        "train",
        "--resume",
        str(run / "ckpt" / "step_000004"),
        f"--nproc={resumed[1]}",
        f"--parallel.dp_impl={resumed[0]}",
        "--train.device=cpu",
    )
    continued = _losses(run, start=8)
    assert [s for s, _ in continued] == [5, 6, 7, 8]
    for step, loss in continued:
        assert abs(loss - reference[step]) <= 1e-5, (step, loss, reference[step])


def test_generate_from_fsdp_run(tmp_path, char_data):
    loom(
        "train",
        "--nproc=2",
        "--parallel.dp_impl=fsdp",
        "--run.name=f",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        *TINY,
        "--train.steps=3",
        "--train.sample_every=3",
    )
    assert "=== step 3" in (tmp_path / "f" / "samples.txt").read_text()
    out = loom("generate", str(tmp_path / "f"), "--prompt", "The", "--max-new-tokens", "10").stdout
    assert out.startswith("The") and len(out) >= 10


@pytest.mark.parametrize("impl", ["fsdp"])  # zero2 samples through the same path (fsdp_roots)
def test_sampling_mid_run_gathers_once_and_leaves_training_as_it_was(tmp_path, char_data, impl):
    """The sample gathers the sharded weights once per call into a whole copy on rank 0
    (Parallelized.sampling_model) instead of running FSDP's sharded forward once per token, and leaves the
    training as it was: a run that samples at steps 2 and 4 of 6 has the losses of one that never samples."""
    base = [
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        *TINY,
        "--train.steps=6",
        "--nproc=2",
        f"--parallel.dp_impl={impl}",
        "--train.sample_tokens=40",
    ]
    loom("train", "--run.name=quiet", *base)
    # every process counts FSDP's all-gathers during each sample (a hook every loom process imports as a
    # plug-in, LOOM_PLUGINS)
    hooks, counts = tmp_path / "hooks", tmp_path / "counts"
    hooks.mkdir()
    counts.mkdir()
    (hooks / "loom_gather_hook.py").write_text(SAMPLE_GATHERS.format(out=str(counts)))
    env = {
        **os.environ,
        "LOOM_PLUGINS": "loom_gather_hook",
        "PYTHONPATH": os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p),
    }
    r = loom_run("train", "--run.name=sampling", *base, "--train.sample_every=2", env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert _losses(tmp_path / "sampling") == _losses(tmp_path / "quiet")
    samples = (tmp_path / "sampling" / "samples.txt").read_text()
    assert all(f"=== step {s}" in samples for s in (2, 4, 6))
    per_sample = [json.loads(f.read_text()) for f in sorted(counts.glob("rank*.json"))]
    assert len(per_sample) == 2 and all(len(c) == 3 for c in per_sample), per_sample
    # at most one FSDP gather per unit (2 blocks and the root) per sample, never one per unit per token (3 x 40)
    assert all(n <= 3 for c in per_sample for n in c), per_sample


SAMPLE_GATHERS = """
import json, os

import torch.distributed.fsdp._fully_shard._fsdp_param_group as group
import loom.generate as generate

_n, _per_sample, _gather, _sample = [0], [], group.foreach_all_gather, generate.Sampler.run

def _counted_gather(*a, **k):
    _n[0] += 1
    return _gather(*a, **k)

def _counted_sample(self, *a, **k):
    before = _n[0]
    try:
        return _sample(self, *a, **k)
    finally:
        _per_sample.append(_n[0] - before)  # written at once: the workers leave through os._exit
        with open(os.path.join({out!r}, "rank" + os.environ.get("RANK", "0") + ".json"), "w") as f:
            f.write(json.dumps(_per_sample))

group.foreach_all_gather, generate.Sampler.run = _counted_gather, _counted_sample
"""


def test_model_state_bytes_shrink_with_sharding(tmp_path, char_data):
    """dp=2: zero1 holds half of the optimizer state, zero2 also half of the gradients, fsdp also half of the
    parameters (a little more where a tensor's first dimension is odd), against one process's whole state
    (what every ddp rank holds). The exact bytes at dp=4, fsdp4 included, are the dry run's test
    (tests/distributed/test_dryrun_vs_processes.py)."""
    mem = {}
    for impl, nproc in (("none", 1), ("zero1", 2), ("zero2", 2), ("fsdp", 2)):
        loom_here(
            "train",
            f"--nproc={nproc}",
            f"--parallel.dp_impl={impl}",
            f"--run.name={impl}",
            f"--data.path={char_data}",
            f"--run.dir={tmp_path}",
            *TINY,
            "--train.steps=2",
        )
        rec = [r for r in read_jsonl(tmp_path / impl / "metrics.jsonl") if "mem_params" in r][-1]
        mem[impl] = {k: rec[f"mem_{k}"] for k in ("params", "grads", "optim")}
    full = mem["none"]
    assert min(full.values()) > 0

    def half(x, total):
        return 0.49 * total <= x <= 0.55 * total

    assert half(mem["zero1"]["optim"], full["optim"]) and mem["zero1"]["grads"] == full["grads"]
    assert half(mem["zero2"]["optim"], full["optim"]) and half(mem["zero2"]["grads"], full["grads"])
    for k in ("params", "grads", "optim"):
        assert half(mem["fsdp"][k], full[k]), (k, mem["fsdp"][k], full[k])
    shutil.rmtree(tmp_path / "none")

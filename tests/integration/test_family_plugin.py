"""A model family with a key of its own is one folder plus one registration: tests/plugins/loom_parallel_gpt
(GPT-J's parallel block; model.parallel_norms, its own key) is loaded with LOOM_PLUGINS and, with nothing in loom
naming it, trains, resumes exactly, passes `loom verify` for ddp, fsdp, tp and pp-1f1b (N processes = one
process), is planned and dry-run, and exports to safetensors. Compared against: the same family's
uninterrupted run, loom verify's single-process reference, and the trained model's parameter count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loomrun import loom_run
from tiny import tiny_args

from loom.metrics import read_jsonl

PLUGINS = Path(__file__).parents[1] / "plugins"
TINY = ["--model.family=parallel-gpt", *tiny_args({"optim.warmup_steps": 2})]


def loom(*args, plugins=True, ok=True, timeout=600):
    env = {**os.environ}
    if plugins:
        env["LOOM_PLUGINS"] = "loom_parallel_gpt"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGINS), env.get("PYTHONPATH")) if p)
    else:
        env.pop("LOOM_PLUGINS", None)
    r = loom_run(*args, env=env, timeout=timeout)
    if ok:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow  # loom verify runs four 2-process strategies
def test_plugin_family_with_its_own_key(tmp_path, char_data):
    """The family's own key at a non-default value (model.parallel_norms=2: GPT-NeoX's two norms) trains,
    resumes bit-identically, is saved in config.toml, passes loom verify (ddp, fsdp, tp, pp), is planned,
    dry-run and exported: the key reached the model each time (two norms a block in the export)."""
    own = [*TINY, "--model.parallel_norms=2"]
    base = [f"--data.path={char_data}", f"--run.dir={tmp_path}", *own, "--train.steps=6"]
    loom("train", "--run.name=whole", *base)
    loom("train", "--run.name=cut", *base, "--train.ckpt_every=3", "--train.steps=3")
    loom("train", "--resume", str(tmp_path / "cut"), "--train.steps=6")
    whole, cut = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert sorted(cut) == list(range(1, 7)) and cut == whole  # resumed bit-identically
    saved = (tmp_path / "whole" / "config.toml").read_text()
    assert "parallel_norms = 2" in saved and "n_experts" not in saved  # its keys, not another family's
    # the key is the family's: typed, bounded, checked by validate, refused for another family
    r = loom("train", "--run.name=bad", *base, "--model.parallel_norms=3", ok=False)
    assert r.returncode == 2 and "a parallel block has one norm or two" in r.stderr
    r = loom("train", "--run.name=bad", *base, "--model.family=llama", ok=False)
    assert r.returncode == 2 and "model.parallel_norms is for model.family=parallel-gpt" in r.stderr
    # export: the parallel block with its two norms is what trained (GPT-J's block has one)
    loom("export", str(tmp_path / "whole"), "--format", "safetensors", "--out", str(tmp_path / "st"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "st" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "blocks.0.ln_2.weight" in keys and "blocks.0.mlp.up_proj.weight" in keys
    # planned: its config.toml's shape (two norms: GPT's block count) is the model's parameter count
    vocab = json.loads((Path(char_data) / "meta.json").read_text())["vocab_size"]
    toml = tmp_path / "pgpt.toml"
    toml.write_text(saved.replace("vocab_size = 0", f"vocab_size = {vocab}"))
    plan = json.loads(loom("plan", "--model", str(toml), "--gpus", "2", "--gpu-mem", "80", "--json").stdout)
    assert plan["model"]["params"] == json.loads((tmp_path / "whole" / "run.json").read_text())["params"]
    # dry-run on 2 ranks (FSDP), and verified: N processes learn the one-process curve
    loom("train", "--dry-run", "--world", "2", "--parallel.dp_impl=fsdp", *base, "--train.batch_size=8")
    out = tmp_path / "v.json"
    loom(
        "verify",
        *("--strategies", "ddp,fsdp,tp,pp-1f1b", "--nproc", "2", "--steps", "3"),
        *("--out", str(tmp_path / "v"), "--data", str(char_data), "--json", str(out)),
        *own[:5],
        "--model.parallel_norms=2",
    )
    recs = json.loads(out.read_text())
    assert [r["strategy"] for r in recs] == ["ddp", "fsdp", "tp", "pp-1f1b"]
    for r in recs:
        assert r["passed"], r
    # without the plug-in the family is unknown, and the error says how to load it
    r = loom("train", "--run.name=nope", *base, plugins=False, ok=False)
    assert r.returncode == 2 and "parallel-gpt" in r.stderr and "LOOM_PLUGINS" in r.stderr


def test_the_family_lives_only_in_its_folder():
    """Nothing in loom names the plug-in family or its classes."""
    src = Path(__file__).parents[2] / "src" / "loom"
    for f in src.rglob("*.py"):
        text = f.read_text(encoding="utf-8")
        assert "parallel-gpt" not in text and "ParallelGPT" not in text, f


def test_plugin_evaluator_runs_on_its_own_cadence(char_data, tmp_path):
    """An evaluator is one module plus one registration (tests/plugins/loom_eval_plugin): loaded with
    LOOM_PLUGINS, the trainer runs it every 2 steps and at the end and records what it returns."""
    env = {
        **os.environ,
        "LOOM_PLUGINS": "loom_eval_plugin",
        "PYTHONPATH": os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH")) if p),
    }
    args = [f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=e", "--train.steps=5"]
    r = subprocess.run(
        [sys.executable, "-m", "loom", "train", *args, *TINY[1:]], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    top1 = [rec for rec in read_jsonl(tmp_path / "e" / "metrics.jsonl") if "top1" in rec]
    assert [rec["step"] for rec in top1] == [2, 4, 5] and all(0 <= rec["top1"] <= 1 for rec in top1)
    assert "step 4: top-1 next-token accuracy" in r.stdout + r.stderr

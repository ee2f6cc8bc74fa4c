"""What reads a sharded checkpoint besides training, on a run saved by 2 FSDP processes: generate, eval and
export read only model/ (shown by deleting optim/ first); `loom ckpt consolidate` writes one safetensors model
that generates the same text and exports to transformers with the same logits as the run itself; `loom ckpt
inspect` names a damaged checkpoint; a format-1 checkpoint (model.pt, optim.pt, extra.pt) still loads."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from loomrun import TINY, loom_run

from loom import checkpoint
from loom.cli import main


@pytest.fixture(scope="module")
def fsdp_run(char_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("ckpt_cli")
    r = loom_run(
        "train",
        "--nproc=2",
        "--parallel.dp_impl=fsdp",
        f"--data.path={char_data}",
        f"--run.dir={runs}",
        "--run.name=f",
        "--train.steps=4",
        *TINY,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return runs / "f"


def _generate(run, capsys) -> str:
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "The", "--max-new-tokens", "12", "--seed", "3"]) == 0
    return capsys.readouterr().out


def test_generate_and_eval_never_read_the_optimizer(fsdp_run, tmp_path, capsys):
    ref = _generate(fsdp_run, capsys)
    run = tmp_path / "f"
    shutil.copytree(fsdp_run, run)
    for step in (run / "ckpt").iterdir():
        shutil.rmtree(step / "optim")
    assert _generate(run, capsys) == ref
    assert main(["eval", str(run)]) == 0 and "val loss" in capsys.readouterr().out
    # training needs the optimizer: resuming is refused, naming what is missing
    assert main(["train", "--resume", str(run)]) == 2
    res = capsys.readouterr()
    assert "is missing optim/.metadata" in res.out and "no valid checkpoint" in res.err


def test_consolidate_generates_and_exports_the_same_model(fsdp_run, tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["ckpt", "consolidate", str(fsdp_run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        ".loom-output",  # loom's marker: --force may replace this folder later, and no run (issue 27 item 2)
        "config.toml",
        "model.safetensors",
        "run.json",
        "tokenizer",
    ]
    assert _generate(out, capsys) == _generate(fsdp_run, capsys)
    transformers = pytest.importorskip("transformers")
    assert main(["export", str(out), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    from loom.runs import load_run

    _, model, _, meta, _ = load_run(fsdp_run, torch.device("cpu"))
    x = torch.randint(0, meta["vocab_size"], (1, 16))
    with torch.no_grad():
        diff = (model(x)[0][..., : theirs.config.vocab_size] - theirs(x).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_inspect_names_valid_and_damaged_checkpoints(fsdp_run, tmp_path, capsys):
    run = tmp_path / "f"
    shutil.copytree(fsdp_run, run)
    shard = run / "ckpt" / "step_000004" / "model" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step 4, format 2, world size 2" in out and "dp_impl=fsdp" in out
    assert "INVALID" in out and "__1_0.distcp' has" in out and "model             3 file(s)" in out


def _write_format1(ckpt_dir: Path, step: int, tensors: dict, state: dict) -> Path:
    """A checkpoint as mains before the sharded writer (issue 16) wrote it, format 1: rank 0's whole tensors in
    model.pt, optim.pt and extra.pt, state.json, and a manifest of every file's size and SHA-256. loom reads
    this format and no longer writes it; this is its writer, kept with the tests that need one."""
    path = checkpoint.step_dir(ckpt_dir, step)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for name in checkpoint.TENSOR_FILES:
        torch.save(tensors.get(name.removesuffix(".pt"), {}), path / name)
    (path / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(path.iterdir())
    }
    (path / "manifest.json").write_text(json.dumps({"step": step, "files": files}), encoding="utf-8")
    return path


def test_format1_checkpoint_still_loads_for_generation(fsdp_run, tmp_path, capsys):
    run = tmp_path / "f"
    shutil.copytree(fsdp_run, run, ignore=shutil.ignore_patterns("ckpt"))
    whole, state = checkpoint.load(checkpoint.latest_valid(fsdp_run / "ckpt"))
    model = {**whole["model"], "lm_head.weight": whole["model"]["wte.weight"]}
    _write_format1(run / "ckpt", 4, {"model": model, "optim": {}, "extra": whole["extra"]}, state)
    assert (run / "ckpt" / "step_000004" / "model.pt").is_file()
    assert _generate(run, capsys) == _generate(fsdp_run, capsys)


def _as_format1(path: Path) -> None:
    """Rewrite the format-2 checkpoint `path` of a one-process run in format 1: its state read back by the
    trainer (the loader training uses), then written whole, as the previous writer did."""
    from loom.config import config_from_dict, load_toml, validate
    from loom.train.trainer import Trainer

    run = path.parent.parent
    cfg = config_from_dict(load_toml(run / "config.toml"))
    tr = Trainer(cfg, validate(cfg)[0], run, Path(cfg.data.path), torch.device("cpu"))
    tr.load(path)
    whole, state = checkpoint.load_extra(path)
    tensors = {
        "model": tr.parallel.model_state(),
        "optim": tr.optimizer.state_dict(),
        "extra": whole["extra"],
    }
    _write_format1(path.parent, state["step"], tensors, state)


def test_format1_checkpoint_resumes_bit_exact(char_data, tmp_path):
    """A run saved by the previous writer (whole tensors on rank 0: model.pt, optim.pt, extra.pt) resumes
    under the sharded code and continues the uninterrupted curve exactly."""
    from loom.metrics import read_jsonl

    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--train.steps=6",
        "--train.ckpt_every=3",
        "--train.keep_last=5",
        "--model.dropout=0.1",
        *TINY,
    ]
    assert main([*args, "--run.name=ref"]) == 0
    assert main([*args, "--run.name=old", "--train.steps=6"]) == 0
    step3 = tmp_path / "old" / "ckpt" / "step_000003"
    _as_format1(step3)
    assert (step3 / "optim.pt").is_file() and not checkpoint.is_sharded(step3)
    shutil.rmtree(tmp_path / "old" / "ckpt" / "step_000006")
    assert main(["train", "--resume", str(step3)]) == 0

    def curve(run):
        return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}

    assert curve(tmp_path / "old") == curve(tmp_path / "ref")
    assert checkpoint.is_sharded(tmp_path / "old" / "ckpt" / "step_000006")  # saved on in the new format

"""A fine-tuned run says what it was built from, and every reader checks it (issue 42's five faults, each
reproduced as a user met it on 5e0d824).

Compared against: the run's own metrics (`loom eval` of a chat run gives the val loss the run reported); the
same LoRA run evaluated before and after its base run trained on (equal: the base is pinned); and, for every
mismatch (a base gone or changed, another run's checkpoint, other finetune.* settings), one refusal that names
it. The dry run is compared with the model training builds (its shape, and LoRA's frozen base).
"""

from __future__ import annotations

import json
import re
import shutil

from sftkit import _sft_args

from loom.cli import main
from loom.config import config_from_dict, load_toml
from loom.metrics import read_jsonl


def _val_loss(capsys, run, *extra) -> float:
    capsys.readouterr()
    assert main(["eval", str(run), *extra]) == 0
    return float(re.search(r"val loss (\d+\.\d+)", capsys.readouterr().out).group(1))


def _refused(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err


def test_eval_of_a_chat_run_is_the_loss_the_run_reported(sft, capsys):
    """Fault 1: `loom eval` built the plain validation set (windows across conversations, every token scored):
    3.0395 against the run's 1.7259 after 150 steps, exit 0."""
    for name, extra in (("eval-full", ()), ("eval-lora", ("--finetune.lora_rank=2",))):
        run = sft / "runs" / name
        assert main([*_sft_args(sft, name, *extra), "--train.steps=4", "--train.eval_every=4"]) == 0
        reported = [r["val_loss"] for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r][-1]
        capsys.readouterr()
        assert main(["eval", str(run)]) == 0
        out = capsys.readouterr().out
        assert f"val loss {reported:.4f}" in out, (name, reported, out)
        assert "the assistant's tokens scored" in out


def test_a_lora_run_keeps_the_base_it_was_trained_on(sft, tmp_path, capsys):
    """Fault 2: the frozen base was read from model.init_from's newest checkpoint at every use, so the LoRA run
    changed (4.1368 -> 4.0929) when its base run trained on. Now the run pins the checkpoint it started from,
    by name and hash, and marks it so that the base run's train.keep_last keeps it: the base training on
    changes nothing; a base deleted by hand or re-saved is refused by name."""
    base = tmp_path / "runs" / "pbase"
    shutil.copytree(sft / "runs" / "base", base)
    args = _sft_args(sft, "pinned", "--finetune.lora_rank=2", f"--model.init_from=run:{base}")
    assert main([*args, f"--run.dir={tmp_path / 'runs'}", "--train.steps=2"]) == 0
    run = tmp_path / "runs" / "pinned"
    pinned = base / "ckpt" / "step_000003"
    assert config_from_dict(load_toml(run / "config.toml")).model.init_from == f"run:{pinned}"
    record = json.loads((run / "run.json").read_text())["base"]
    assert record["init_from"] == f"run:{pinned}" and len(record["sha256"]) == 64
    before = _val_loss(capsys, run)

    capsys.readouterr()
    again = ["train", "--resume", str(base), "--train.steps=6", "--train.keep_last=1", "--train.ckpt_every=1"]
    assert main(again) == 0
    # keep_last=1 keeps step 6 and the checkpoint the LoRA run depends on, which it names
    assert sorted(p.name for p in (base / "ckpt").iterdir() if p.is_dir()) == ["step_000003", "step_000006"]
    out = capsys.readouterr().out
    assert "is kept beyond train.keep_last: the LoRA run(s) " in out and str(run.resolve()) in out, out
    assert _val_loss(capsys, run) == before  # the base run's newer checkpoint is not this run's base

    shutil.rmtree(pinned)
    shutil.copytree(base / "ckpt" / "step_000006", pinned)  # other weights under the pinned name
    err = _refused(capsys, ["eval", str(run)])
    assert f"was trained on the base run:{pinned}" in err and "other weights" in err
    for argv in (
        ["chat", str(run), "--prompt", "x"],
        ["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")],
    ):
        assert "was trained on the base" in _refused(capsys, argv)
    resume = [*args, f"--run.dir={tmp_path / 'runs'}", "--train.steps=3", "--train.resume=auto"]
    assert "was trained on the base" in _refused(capsys, resume)

    shutil.rmtree(pinned)
    err = _refused(capsys, ["eval", str(run)])
    assert "the checkpoint this run was fine-tuned from is gone" in err


def test_a_checkpoint_of_another_run_is_refused(sft, capsys):
    """Fault 3: `--ckpt` took another run's checkpoint when the shapes matched (vocabularies 72 and 66, both
    padded to 128 rows): the base model evaluated, chatted with and exported under the chat run's name."""
    run = sft / "runs" / "own-ckpt"
    assert main([*_sft_args(sft, "own-ckpt"), "--train.steps=2"]) == 0
    other = sft / "runs" / "base" / "ckpt" / "step_000003"
    for argv in (
        ["eval", str(run), "--ckpt", str(other)],
        ["chat", str(run), "--ckpt", str(other), "--prompt", "x"],
        ["export", str(run), "--ckpt", str(other), "--format", "hf", "--out", str(sft / "wrong-hf")],
    ):
        err = _refused(capsys, argv)
        assert f"checkpoint '{other}' is not a checkpoint of the run" in err, argv
    assert not (sft / "wrong-hf").exists()
    _val_loss(capsys, run, "--ckpt", str(run / "ckpt" / "step_000002"))  # its own: fine


def test_finetune_settings_are_compared_with_the_checkpoint(sft, capsys):
    """Fault 5: a resume with finetune.lora_embeddings=false stopped saving the trained embedding and head,
    other lora_targets dropped trained adapters, an edited lora_alpha changed `loom eval`; all without a word."""
    args = _sft_args(sft, "ft-cmp", "--finetune.lora_rank=2")
    assert main([*args, "--train.steps=2"]) == 0
    run = sft / "runs" / "ft-cmp"
    resume = [*args, "--train.steps=3", "--train.resume=auto"]
    err = _refused(capsys, [*resume, "--finetune.lora_embeddings=false"])
    assert "other fine-tuning settings: finetune.lora_embeddings: 'auto' -> 'false'" in err
    err = _refused(capsys, [*resume, "--finetune.lora_targets=mlp"])
    assert "finetune.lora_targets: 'all-linear' -> 'mlp'" in err or "finetune.lora_targets" in err
    toml = run / "config.toml"
    toml.write_text(toml.read_text().replace("lora_alpha = 16.0", "lora_alpha = 8.0"))
    err = _refused(capsys, ["eval", str(run)])
    assert "finetune.lora_alpha: 8.0 in the run, 16.0 in the checkpoint" in err


def test_the_dry_run_builds_the_model_training_would(sft, tmp_path, capsys):
    """Fault 4: `loom train --dry-run --model.init_from=run:DIR` measured the default 4-layer gpt2 model, with
    or without LoRA. Now the run's model; with LoRA its frozen base takes no gradient and no optimizer state."""
    base, chat = sft / "runs" / "base", sft / "chat"
    dry = ["train", "--dry-run", "--world", "2", f"--model.init_from=run:{base}", f"--data.path={chat}"]
    records = {}
    for name, extra in (("full", []), ("lora", ["--finetune.lora_rank=2"])):
        out = tmp_path / f"{name}.json"
        assert main([*dry, *extra, "--json", str(out)]) == 0
        records[name] = json.loads(out.read_text())["ranks"][0]
    text = capsys.readouterr().out
    assert "model     gpt2 n_layer=2 n_embd=32 n_head=2" in text and f"from run:{base}" in text
    assert "LoRA rank 2" in text
    full, lora = records["full"], records["lora"]
    assert lora["params"] > full["params"]  # the adapters on top of the same model
    assert lora["grads"] < full["grads"] / 3 and lora["optim"] < full["optim"] / 3

"""eval, generate, export and consolidate build the model from the run's config.toml: when that file no
longer says what the checkpoint was trained with (one layer fewer, another rope_theta), each refuses,
naming the key and the checkpoint's value, instead of evaluating a truncated model or exporting another one.
Compared against: the checkpoint's own record of its model (state.json, a consolidated file's metadata);
the unedited run is accepted by every command, and dropout (off at evaluation) may differ."""

from __future__ import annotations

import shutil

import pytest
from tiny import tiny_args

from loom.cli import main

TINY = tiny_args(
    {
        "model.block_size": 16,
        "train.batch_size": 4,
        "train.eval_batches": 1,
        "optim.warmup_steps": 1,
        "train.steps": 1,
    }
)


def edit(run, old: str, new: str) -> None:
    toml = run / "config.toml"
    text = toml.read_text()
    assert old in text
    toml.write_text(text.replace(old, new))


def commands(run, out):
    return {
        "eval": ["eval", str(run), "--batches", "1", "--device", "cpu"],
        "generate": ["generate", str(run), "--max-new-tokens", "3", "--device", "cpu"],
        "export": ["export", str(run), "--format", "hf", "--out", str(out / "hf"), "--force"],
        "export-st": ["export", str(run), "--format", "safetensors", "--out", str(out / "st"), "--force"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, char_data):
    root = tmp_path_factory.mktemp("cfgck")
    assert main(["train", f"--data.path={char_data}", f"--run.dir={root}", "--run.name=gpt", *TINY]) == 0
    llama = ["--model.family=llama", "--model.rope_theta=500.0"]
    assert (
        main(["train", f"--data.path={char_data}", f"--run.dir={root}", "--run.name=llama", *TINY, *llama])
        == 0
    )
    return root


@pytest.mark.parametrize("command", ["eval", "generate", "export", "export-st"])
def test_a_layer_fewer_in_config_toml_is_refused(runs, tmp_path, command, capsys):
    run = tmp_path / "gpt"
    shutil.copytree(runs / "gpt", run)
    edit(run, "n_layer = 2", "n_layer = 1")
    assert main(commands(run, tmp_path)[command]) == 2
    err = capsys.readouterr().err
    assert "was trained with another model shape: model.n_layer: 1 in the run, 2 in the checkpoint" in err, (
        err
    )
    assert "config.toml" in err and "state.json" in err  # the remedy names the file and where the truth is
    edit(run, "n_layer = 1", "n_layer = 2")
    edit(run, "dropout = 0.0", "dropout = 0.1")  # off at evaluation: not a difference
    assert main(commands(run, tmp_path)[command]) == 0


@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_an_edited_rope_theta_is_refused(runs, tmp_path, command, capsys):
    run = tmp_path / "llama"
    shutil.copytree(runs / "llama", run)
    edit(run, "rope_theta = 500.0", "rope_theta = 10000.0")
    assert main(commands(run, tmp_path)[command]) == 2
    assert "model.rope_theta: 10000.0 in the run, 500.0 in the checkpoint" in capsys.readouterr().err


def test_consolidate_and_its_folder_are_checked(runs, tmp_path, capsys):
    run = tmp_path / "gpt"
    shutil.copytree(runs / "gpt", run)
    edit(run, "n_layer = 2", "n_layer = 1")
    assert main(["ckpt", "consolidate", str(run), "--out", str(tmp_path / "c1")]) == 2
    assert "model.n_layer: 1 in the run, 2 in the checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "c1" / "model.safetensors").exists()
    edit(run, "n_layer = 1", "n_layer = 2")
    assert main(["ckpt", "consolidate", str(run), "--out", str(tmp_path / "c2")]) == 0
    assert main(commands(tmp_path / "c2", tmp_path)["eval"]) == 0
    edit(tmp_path / "c2", "n_layer = 2", "n_layer = 1")  # the consolidated folder's own config.toml edited
    for command in ("eval", "export"):
        assert main(commands(tmp_path / "c2", tmp_path)[command]) == 2
        assert "model.n_layer: 1 in the run, 2 in the checkpoint" in capsys.readouterr().err


def test_export_names_the_architecture_it_wrote(runs, tmp_path, capsys):
    """A Llama export was announced as "a GPT-2 directory"."""
    for name, arch in (("llama", "LlamaForCausalLM"), ("gpt", "GPT2LMHeadModel")):
        assert main(["export", str(runs / name), "--format", "hf", "--out", str(tmp_path / name)]) == 0
        out = capsys.readouterr().out
        assert f"a {arch} directory" in out and (arch == "GPT2LMHeadModel" or "GPT-2" not in out), out

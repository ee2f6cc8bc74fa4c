"""A checkpoint written by an earlier main (tests/fixtures/ckpt_c343c9c: a 2-rank FSDP run of a 1-layer model,
stopped after its step-2 checkpoint) still resumes onto the same curve and still loads in generate, eval and
export. The fixture's expected.json holds what that main printed for generate and eval (generate's seeded sample
re-recorded once, when the engine's sampler changed: its note says so)."""

import json
import shutil
from pathlib import Path

import pytest
from loomrun import loom_run

from loom.cli import main
from loom.metrics import read_jsonl

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ckpt_c343c9c"


@pytest.fixture
def old_run(tmp_path, monkeypatch):
    """A copy of the fixture (the run is written into); the working directory is the copy, as the run's
    config names its data folder relative to where it was made."""
    shutil.copytree(FIXTURE, tmp_path / "old")
    monkeypatch.chdir(tmp_path / "old")
    return tmp_path / "old"


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def test_resumes_onto_the_curve_it_was_on(old_run):
    before = _losses(old_run / "fsdp2")  # the uninterrupted run's steps 1-4, by that main
    r = loom_run("train", "--resume", "fsdp2", "--nproc", "2", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from fsdp2/ckpt/step_000002" in r.stdout + r.stderr
    assert _losses(old_run / "fsdp2") == before  # steps 3 and 4 again, bit for bit


def test_generate_and_eval_print_what_they_printed(old_run, capsys):
    expected = json.loads((old_run / "expected.json").read_text())
    for command in ("generate", "eval"):
        capsys.readouterr()
        assert main([command, "fsdp2", *expected[command]["argv"]]) == 0
        assert capsys.readouterr().out == expected[command]["out"]


def test_exports_to_safetensors_and_transformers(old_run):
    safetensors = pytest.importorskip("safetensors.torch")
    assert main(["export", "fsdp2", "--format", "safetensors", "--out", "raw"]) == 0
    (file,) = Path("raw").glob("*.safetensors")
    assert safetensors.load_file(file)["wte.weight"].shape[1] == 16
    transformers = pytest.importorskip("transformers")
    assert main(["export", "fsdp2", "--format", "hf", "--out", "hf"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained("hf")
    assert theirs.config.n_layer == 1 and theirs.config.n_embd == 16

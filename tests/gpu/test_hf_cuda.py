"""A run trained on a CUDA GPU (bf16 autocast) exports to a transformers GPT-2 folder whose logits, on the
CPU in fp32, equal those of the run's own model loaded on the CPU. Compared against: transformers'
GPT2LMHeadModel (as tests/unit/test_hf.py on CPU). Skipped without CUDA or without the hf extra."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_args

from loom.cli import main
from loom.runs import load_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = tiny_args(
    {
        "train.batch_size": 4,
        "train.eval_batches": 1,
        "optim.warmup_steps": 1,
        "train.device": "cuda",
        "precision.dtype": "bf16",
    }
)


def test_export_of_a_cuda_trained_run(tmp_path, char_data):
    transformers = pytest.importorskip(
        "transformers", reason="needs transformers (the hf extra: pip install 'loom[hf]')"
    )
    assert (
        main(
            [
                "train",
                f"--data.path={char_data}",
                f"--run.dir={tmp_path}",
                "--run.name=r",
                "--train.steps=5",
                *TINY,
            ]
        )
        == 0
    )
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "r"), "--format", "hf", "--out", str(out)]) == 0
    _, model, tok, _, _ = load_run(tmp_path / "r", torch.device("cpu"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tok.encode("The one of them said")
    x = torch.tensor([[tok.eot_id, *ids]])
    with torch.no_grad():
        diff = (model(x)[..., : tok.vocab_size] - theirs(x).logits).abs().max().item()
    assert diff < 1e-5

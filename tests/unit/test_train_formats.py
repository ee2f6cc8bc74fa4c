"""Training directly from every foreign format (data.path pointing at the other project's files), compared
against training from loom's own shards of the same tokens (made by `loom data convert --to llmc`): the
first step's loss and gradient norm must be identical, which needs the same batch and the same vocabulary
(hence the same initial model)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from loom.config import Config, validate
from loom.data import formats as F
from loom.data.convert import data_convert_main
from loom.train.trainer import Trainer


def first_step(data_dir, run_dir) -> dict:
    cfg = Config()
    m, t = cfg.model, cfg.train
    m.n_layer, m.n_head, m.n_embd, m.block_size = 1, 2, 16, 8
    t.batch_size, t.eval_batches, t.device = 4, 1, "cpu"
    trainer = Trainer(cfg, validate(cfg)[0], run_dir, data_dir, torch.device("cpu"))
    rec = trainer.train_step()
    return {"loss": rec["loss"], "grad_norm": rec["grad_norm"], "vocab": trainer.model.cfg.vocab_size}


@pytest.mark.parametrize("fmt", list(F.TOKEN_FORMATS))
def test_first_step_loss_equals_loom_shards(tmp_path, fmt):
    from test_formats import write_reference  # the other projects' layouts, written without loom

    d = write_reference(fmt, tmp_path / fmt)
    loom_dir = tmp_path / "loom"
    assert data_convert_main(["--to", "llmc", str(d), str(loom_dir)]) == 0
    assert F.detect_dir(loom_dir) == "llmc" and (loom_dir / "meta.json").is_file()
    ours, theirs = first_step(loom_dir, tmp_path / "r1"), first_step(d, tmp_path / "r2")
    assert theirs == ours  # exact: same tokens, same vocabulary, same seed
    assert ours["vocab"] == 1000  # EOT=999 is the largest id


def test_nanogpt_with_meta_pkl(tmp_path):
    """nanoGPT's shakespeare_char layout: uint16 train.bin/val.bin and a pickled {vocab_size, itos, stoi}."""
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    d = tmp_path / "shakespeare_char"
    d.mkdir()
    ids[: len(ids) * 9 // 10].tofile(d / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    loom_dir = tmp_path / "loom"
    assert data_convert_main(["--to", "llmc", str(d), str(loom_dir)]) == 0
    ours, theirs = first_step(loom_dir, tmp_path / "r1"), first_step(d, tmp_path / "r2")
    assert theirs == ours and ours["vocab"] == len(chars) + 1  # + loom's end-of-text id

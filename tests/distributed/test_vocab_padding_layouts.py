"""Padding ids take no probability in any layout: with a vocabulary of 70 (padded to 128, so tensor parallel's
second rank holds ids 64..127, mostly padding), the loss of tensor parallel (vocabulary-parallel head under
loss_parallel), of a pipeline's last stage and of both together equals one process's cross-entropy over the
70 real logits only (compared against F.cross_entropy(logits[..., :70]) of a plain CPU model of the same
weights), and the vocabulary-parallel logits of the padding ids are the lowest value."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import parallelized, spawn_gloo

from loom.config import Config
from loom.train.trainer import build_model

SEED, VOCAB = 99, 70


def _cfg(**parallel) -> Config:
    cfg = Config()
    m = cfg.model
    m.n_layer, m.n_head, m.n_embd, m.block_size = 2, 2, 32, 16
    cfg.train.batch_size, cfg.run.seed = 4, SEED
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    xy = torch.randint(0, VOCAB, (4, 17), generator=g)
    return xy[:, :-1], xy[:, 1:]


def _worker(rank: int, world: int, parallel: dict, out: str) -> None:
    cfg = _cfg(**parallel)
    _, par = parallelized(cfg, world, rank, VOCAB, SEED)
    x, y = _batch()
    record = {}
    if par.pipeline is not None:
        loss = par.pipeline.step(x, y, contextlib.nullcontext)
        if par.pipeline.holds_last:
            record["loss"] = float(loss)
    else:
        with par.loss_context(), torch.no_grad():
            record["loss"] = float(par.forward(x, y))
            logits = par.model(x)
            record["pad"] = logits.full_tensor()[..., VOCAB:] if hasattr(logits, "full_tensor") else None
    if record:
        torch.save(record, f"{out}.{rank}")


LAYOUTS = {
    "tp": (2, {"tp": 2}),
    "pp": (2, {"pp": 2, "pp_microbatches": 2}),
    "tp-pp": (4, {"tp": 2, "pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_padding_ids_take_no_probability_in_any_layout(tmp_path, layout):
    world, parallel = LAYOUTS[layout]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "rec")
    spawn_gloo(_worker, world, tmp_path, parallel, out)
    records = [
        torch.load(f"{out}.{r}", weights_only=True) for r in range(world) if os.path.exists(f"{out}.{r}")
    ]
    assert records
    ref = build_model(_cfg(), VOCAB, "cpu")
    ref.reset_parameters(SEED)
    x, y = _batch()
    with torch.no_grad():
        want = F.cross_entropy(ref(x)[..., :VOCAB].flatten(0, 1), y.flatten()).item()  # the 70 real ids only
    for rec in records:
        assert rec["loss"] == pytest.approx(want, abs=1e-5)
        if rec.get("pad") is not None:  # vocabulary-parallel logits gathered: padding at the lowest value
            assert bool((rec["pad"] == torch.finfo(torch.float32).min).all())

"""Trainer.warm_up: the forward and backward a torchft group that comes into a running job throws away so that
torch.compile compiles before it joins (loom.distributed.ft.FtReplica.join). It must change nothing the next
step reads: compared against a fresh trainer's first step, bit for bit (loss, gradient norm, every weight and
buffer after it: dropout's random state kept, the loader rewound, a MoE layer's load counts forgotten)."""

from __future__ import annotations

import pytest
import torch

from loom.config import load_config, validate
from loom.train.trainer import Trainer

SMALL = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=16"]
FAMILIES = {
    "gpt": ["--model.dropout=0.1"],
    "moe": [
        "--model.family=moe",
        "--model.n_experts=4",
        "--model.moe_top_k=2",
        "--model.dropout=0.1",
        "--model.moe_bias_update_rate=0.001",
    ],
}


def _trainer(char_data, run_dir, family: str) -> Trainer:
    args = [
        *SMALL,
        *FAMILIES[family],
        f"--data.path={char_data}",
        "--train.batch_size=4",
        "--train.device=cpu",
    ]
    cfg = load_config(None, args)
    return Trainer(cfg, validate(cfg)[0], run_dir, char_data, torch.device("cpu"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_warm_up_changes_nothing_the_next_step_reads(char_data, tmp_path, family):
    warmed = _trainer(char_data, tmp_path / "a", family)  # one after the other: they share torch's generator
    assert warmed.warm_up() > 0
    counts = [m.load for m in warmed.model.modules() if hasattr(m, "forget_load")]
    assert len(counts) == (2 if family == "moe" else 0) and all(c is None for c in counts)  # forgotten
    a = warmed.train_step()
    fresh = _trainer(char_data, tmp_path / "b", family)
    b = fresh.train_step()
    assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    sa, sb = warmed.model.state_dict(), fresh.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    if family == "moe":  # the balance bias moved by the step's load alone
        assert any("expert_bias" in k and sa[k].abs().sum() > 0 for k in sa)

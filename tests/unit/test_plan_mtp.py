"""`loom plan` of a config with multi-token prediction (model.mtp_depth): the planner's training FLOPs per
token are the trainer's (its family's flops_per_token, what MFU divides by; tests/unit/test_mtp.py checks that
against torch's FLOP counter), the MTP modules' matrices and attention included, and its compute time per step
grows with them."""

from __future__ import annotations

import pytest

from loom.config import load_config
from loom.model.gpt.family import gpt_config
from loom.model.registry import get
from loom.plan import PRECISIONS
from loom.plan.estimate import Candidate, Cluster, Workload, evaluate
from loom.plan.shapes import shape_of_model

BASE = ["--model.n_layer=2", "--model.n_head=4", "--model.n_embd=64", "--model.block_size=32"]
FAMILIES = {
    "gpt2": [],
    "llama": ["--model.family=llama", "--model.n_kv_head=2"],
}


def _flops(family: str, depth: int, seq_len: int) -> tuple[int, float]:
    """(the planner's FLOPs per token, the trainer's) of the family's config with model.mtp_depth=depth."""
    cfg = load_config(None, [*BASE, *FAMILIES[family], f"--model.mtp_depth={depth}"])
    shape = shape_of_model(cfg.model, 300)
    trainer = get(cfg.model.family).flops_per_token(gpt_config(cfg, 300), seq_len)
    return 6 * shape.matmul_params() + shape.attn_flops(seq_len), trainer


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planner_counts_the_mtp_modules_as_the_trainer(family):
    for seq_len in (32, 16):
        planner, trainer = _flops(family, 2, seq_len)
        assert planner == trainer
        assert planner > _flops(family, 0, seq_len)[0]  # the modules count: D blocks, projections and heads


def test_the_planned_compute_time_grows_with_the_modules():
    """One GPU, no recomputation: compute time is FLOPs per token over the GPU's rate, so the MTP job's time
    over the plain one's is the ratio of the trainer's FLOPs per token."""
    cluster = Cluster(gpus=1, gpus_per_node=1, gpu_mem_gb=80)
    times = {}
    for depth in (0, 2):
        cfg = load_config(None, [*BASE, f"--model.mtp_depth={depth}"])
        wl = Workload(shape_of_model(cfg.model, 300), PRECISIONS["bf16-mixed"], 32, 32 * 8)
        c = evaluate(Candidate(1, 1, 1, 0, 8, "none", n_micro=1), cluster, wl)
        times[depth] = c.compute_s
    assert times[2] / times[0] == pytest.approx(
        _flops("gpt2", 2, 32)[1] / _flops("gpt2", 0, 32)[1], rel=1e-12
    )

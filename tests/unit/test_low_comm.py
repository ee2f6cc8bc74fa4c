"""Training over slow links, the parts that need no process: the rules of parallel.grad_compression and
parallel.diloco_* (one clear error each), the layout DiLoCo resolves to, the bytes PowerSGD's hook sends
(against torch's own rule), and DiLoCo's outer step (against torch.optim.SGD with Nesterov momentum)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from loom.config import load_config, validate
from loom.config.layout import ParallelDims
from loom.errors import LoomError
from loom.parallel.ddp import _powersgd_bytes
from loom.parallel.diloco import DiLoCo

BAD = {
    "diloco without a replicate dimension": (
        ["--parallel.diloco_inner_steps=10", "--parallel.dp_impl=ddp"],
        4,
        "needs a replicate dimension",
    ),
    "diloco with pipeline parallel": (
        ["--parallel.diloco_inner_steps=10", "--parallel.pp=2", "--parallel.dp_replicate=2"],
        4,
        "does not compose with tp/pp",
    ),
    "diloco with zero1": (
        ["--parallel.diloco_inner_steps=10", "--parallel.dp_impl=zero1", "--parallel.dp_replicate=2"],
        2,
        "does not compose with parallel.dp_impl=zero1",
    ),
    "diloco steps": (
        ["--parallel.diloco_inner_steps=7", "--parallel.dp_replicate=2"],
        2,
        "train.steps=100 is not a multiple",
    ),
    "diloco time budget": (
        ["--parallel.diloco_inner_steps=10", "--parallel.dp_replicate=2", "--train.time_budget_s=60"],
        2,
        "train.time_budget_s",
    ),
    "diloco on one process": (["--parallel.diloco_inner_steps=10"], 1, "on one process: DiLoCo averages"),
    "a diloco run on one process": (
        ["--parallel.diloco_inner_steps=10", "--parallel.dp_replicate=2"],
        1,
        r"one process is a single replica with nothing to average \(this run's parallel.dp_replicate=2 needs",
    ),
    "powersgd with fsdp": (
        ["--parallel.grad_compression=powersgd", "--parallel.dp_impl=fsdp"],
        2,
        "does not apply to dp_impl=fsdp",
    ),
    "bf16 with fsdp": (
        ["--parallel.grad_compression=bf16", "--parallel.dp_impl=fsdp"],
        2,
        "does not apply to dp_impl=fsdp",
    ),
    "compression with mpi": (
        ["--parallel.grad_compression=fp16", "--parallel.dp_impl=mpi"],
        2,
        "has none",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_low_communication_settings(case):
    args, world, message = BAD[case]
    cfg = load_config(None, ["--train.steps=100", *args])
    with pytest.raises(LoomError, match=message) as e:
        validate(cfg, world)
    if case == "bf16 with fsdp":
        assert "parallel.reduce_dtype=bf16" in e.value.hint


def test_diloco_layout_ddp_inside_replicas():
    cfg = load_config(None, ["--parallel.diloco_inner_steps=10", "--parallel.dp_replicate=2"])
    _, dims = validate(cfg, 4, rank=3)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_impl, dims.diloco) == (2, 2, "ddp", True)
    assert (dims.dp_replicate_rank, dims.dp_rank) == (1, 3)
    assert "ddp inside 2 DiLoCo replica(s) of 2" in dims.describe()
    cfg = load_config(
        None, ["--parallel.diloco_inner_steps=10", "--parallel.dp_replicate=2", "--parallel.dp_impl=fsdp"]
    )
    _, dims = validate(cfg, 4)
    assert dims.fsdp_enabled and not dims.hsdp_enabled  # FSDP within a replica, DiLoCo across


def test_powersgd_bytes_follow_torch_rule():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    state = SimpleNamespace(
        iter=0, start_powerSGD_iter=2, matrix_approximation_rank=4, min_compression_rate=2
    )
    grads = [torch.zeros(256, 64), torch.zeros(64), torch.zeros(8, 8), torch.zeros(16, 4, 4)]
    full = sum(g.numel() * 4 for g in grads)
    assert _powersgd_bytes(state, grads) == full  # the warm-up sends everything
    state.iter = 2
    want = 0
    for g in grads:
        m = g.view(g.shape[0], -1) if g.ndim > 1 else None
        ok, whole, small = _should_compress(*m.shape, min(*m.shape, 4), 2) if m is not None else (False, 0, 0)
        want += 4 * (small if ok else g.numel())
    assert _powersgd_bytes(state, grads) == want == 4 * ((256 + 64) * 4 + 64 + 64 + 16 * 16)


def test_outer_step_is_nesterov_sgd_on_the_change():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    lr, mu = 0.7, 0.9
    d = DiLoCo(model, ParallelDims(), None, 2, lr, mu, {})
    ref = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    sgd = torch.optim.SGD(ref, lr=lr, momentum=mu, nesterov=True)
    for _ in range(3):  # momentum builds up over outer steps
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))  # H inner steps' worth of change
        for r, p in zip(ref, model.parameters(), strict=True):
            r.grad = (r - p).detach()
        sgd.step()
        assert d.outer_step() == 0  # one replica: nothing sent
        for r, p in zip(ref, model.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=0, atol=1e-6)
    assert sorted(d.momentum_state()) == ["diloco.momentum.bias", "diloco.momentum.weight"]
    assert d.due(4) and not d.due(3)


def test_exposed_communication_of_a_step():
    from loom.metrics import StepTimer

    # 4 micro-batches: the last backward (DDP's all-reduce) took 0.3 s more than the others; 0.05 s of sync after
    assert StepTimer.comm_exposed({"b": [0.2, 0.2, 0.2, 0.5], "c": [0.05], "f": []}) == pytest.approx(0.35)
    assert StepTimer.comm_exposed({"b": [0.4], "c": [0.1], "f": []}) == pytest.approx(0.1)  # explicit only
    assert StepTimer.comm_exposed({"b": [], "c": [], "f": []}) == 0.0  # a pipeline schedule's step
    assert StepTimer.comm_exposed({"b": [0.3, 0.2], "c": [], "f": []}) == 0.0  # never below 0


def test_plan_says_when_compression_or_diloco_pays_off(capsys):
    from loom.plan.report import plan_main
    from loom.plan.shapes import resolve_model
    from loom.plan.slow_links import powersgd_factor

    args = ["--model", "7b", "--gpus", "32", "--gpus-per-node", "8", "--gpu-mem", "80", "--top", "1"]
    verdicts = {}
    for gbps in ("0.1", "10", "400"):
        assert plan_main([*args, "--inter-node-gbps", gbps]) == 0
        verdicts[gbps] = capsys.readouterr().out.splitlines()[-1]
    assert "DiLoCo H=500" in verdicts["0.1"]  # the only remedy that brings it under a tenth of the step
    assert "PowerSGD" in verdicts["10"]
    assert "fast enough" in verdicts["400"]
    assert 0 < powersgd_factor(resolve_model("7b", None)) < 1 / 20  # rank 4 of 4096-wide matrices
    with pytest.raises(LoomError, match="--inter-node-gbps must be positive"):
        plan_main([*args, "--inter-node-gbps", "0"])


def _resumed(saved: dict, *args: str) -> None:
    """check_saved_config of a checkpoint whose recorded parallel section is `saved`, resumed with `args`."""
    from loom.config import Config, check_saved_config

    cfg = load_config(None, list(args))
    record = Config().to_dict()
    record["parallel"].update(saved)
    check_saved_config(record, cfg, "checkpoint 'c'", "hint")


def test_resume_keeps_the_diloco_period_and_the_powersgd_rank():
    dl = {"diloco_inner_steps": 4, "dp_replicate": 2}
    _resumed(dl, "--parallel.diloco_inner_steps=4")
    _resumed(dl, "--parallel.diloco_inner_steps=0")  # continued as plain training: documented
    with pytest.raises(LoomError, match="trained with parallel.diloco_inner_steps=4, not 2") as e:
        _resumed(dl, "--parallel.diloco_inner_steps=2")
    assert "--parallel.diloco_inner_steps=4" in e.value.hint
    with pytest.raises(LoomError, match="a run without DiLoCo cannot become one on resume"):
        _resumed({}, "--parallel.diloco_inner_steps=4")
    ps = {"grad_compression": "powersgd", "powersgd_rank": 2}
    _resumed(ps, "--parallel.grad_compression=powersgd", "--parallel.powersgd_rank=2")
    _resumed(ps, "--parallel.grad_compression=none", "--parallel.powersgd_rank=8")
    # in words a user knows: the setting, both values, and why (not a tensor of another shape)
    with pytest.raises(
        LoomError, match=r"trained with parallel.powersgd_rank=2, not 3: the PowerSGD state"
    ) as e:
        _resumed(ps, "--parallel.grad_compression=powersgd", "--parallel.powersgd_rank=3")
    assert "--parallel.powersgd_rank=2" in e.value.hint


def test_a_powersgd_rank_at_a_matrix_width_is_said_or_refused(monkeypatch):
    """torch's rule sends a 32 x 32 matrix whole at rank >= 8 ((32 + 32) x 8 x 2 = 1024, not < 1024), a 32 x 256
    one from rank 15: named in a warning, and refused when no matrix is compressed."""
    from loom import log
    from loom.parallel.ddp import check_powersgd_rank, uncompressed_matrices

    model = nn.Sequential(
        nn.ModuleList([nn.Linear(32, 32) for _ in range(2)]), nn.Linear(256, 32), nn.LayerNorm(32)
    )
    state = SimpleNamespace(matrix_approximation_rank=4, min_compression_rate=2)
    assert uncompressed_matrices(state, model) == ({}, {"0.*.weight", "1.weight"})
    state.matrix_approximation_rank = 8
    assert uncompressed_matrices(state, model)[0] == {"0.*.weight": (32, 32)}
    warned = []
    monkeypatch.setattr(log, "warn", warned.append)
    check_powersgd_rank(state, model)
    assert len(warned) == 1 and "powersgd_rank=8: PowerSGD sends these matrices whole" in warned[0]
    assert "0.*.weight (32 x 32)" in warned[0] and "1.weight" not in warned[0]
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    state.matrix_approximation_rank = 32
    with pytest.raises(LoomError, match="powersgd_rank=32 compresses none of this model's matrices"):
        check_powersgd_rank(state, model)

"""train.ema: the average equals its formula written out here (step by step, from the recorded weights), is
swapped in and out of the weights bit for bit, resumes bit for bit from a checkpoint, and under DDP and FSDP at 2
ranks equals one process's (the checkpoint's `ema.*` tensors, FSDP's written as shards)."""

from __future__ import annotations

import shutil

import pytest
import torch
from loomrun import TINY, loom_here

from loom.metrics import read_jsonl
from loom.parallel import dcp_state
from loom.train.ema import EMA


class _Par:
    """What EMA asks of loom.parallel's Parallelized: the model, its tied aliases, the fp8 refresh."""

    def __init__(self, model):
        self.model, self.tied = model, {}

    def refresh_fp8_scales(self) -> None:
        pass


def test_ema_equals_the_formula_after_n_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[1].bias.requires_grad_(False)  # a frozen parameter is not averaged
    decay, steps = 0.9, 7
    ema = EMA(_Par(model), decay)
    assert set(ema.shadow) == {"0.weight", "0.bias", "1.weight"}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    history = [{k: v.detach().clone() for k, v in model.named_parameters()}]  # w_0 .. w_N
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        history.append({k: v.detach().clone() for k, v in model.named_parameters()})
    for name in ema.shadow:
        # ema_N = decay^N w_0 + sum_{t=1..N} (1 - decay) decay^(N-t) w_t
        want = decay**steps * history[0][name].double()
        for t in range(1, steps + 1):
            want += (1 - decay) * decay ** (steps - t) * history[t][name].double()
        torch.testing.assert_close(ema.shadow[name].double(), want, rtol=1e-6, atol=1e-6)
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    with ema.swapped():
        assert torch.equal(model[0].weight, ema.shadow["0.weight"])
    for k, v in model.named_parameters():
        assert torch.equal(v, weights[k]), k  # the weights back, bit for bit


def _ema_of(ckpt) -> dict[str, torch.Tensor]:
    sd = dcp_state.read_whole(ckpt / "optim")
    return {k: v for k, v in sd.items() if k.startswith("ema.")}


@pytest.fixture(scope="module")
def ema_runs(tmp_path_factory, char_data):
    """6 steps with train.ema=0.8 and a checkpoint at step 3: one process, DDP and FSDP at 2 ranks."""
    root = tmp_path_factory.mktemp("ema")
    base = [
        f"--data.path={char_data}",
        f"--run.dir={root}",
        *TINY,
        "--train.steps=6",
        "--train.ckpt_every=3",
        "--train.keep_last=3",
        "--train.eval_every=3",
        "--train.ema=0.8",
    ]
    loom_here("train", "--run.name=one", "--parallel.dp_impl=none", *base)
    for impl in ("ddp", "fsdp"):
        loom_here("train", "--nproc=2", f"--parallel.dp_impl={impl}", f"--run.name={impl}", *base)
    return root


def test_ema_evaluated_saved_and_equal_across_layouts(ema_runs):
    recs = read_jsonl(ema_runs / "one" / "metrics.jsonl")
    evals = [r for r in recs if "val_loss_ema" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(r["val_loss_ema"] != r["val_loss"] for r in recs if "val_loss_ema" in r and "val_loss" in r)
    ref = _ema_of(ema_runs / "one" / "ckpt" / "step_000006")
    assert "ema.wte.weight" in ref and not any("lm_head" in k for k in ref)  # tied: saved once
    for impl in ("ddp", "fsdp"):
        got = _ema_of(ema_runs / impl / "ckpt" / "step_000006")
        assert set(got) == set(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-5, msg=f"{impl} {k}")


@pytest.mark.parametrize("impl,nproc", [("none", 1), ("fsdp", 2)])
def test_ema_resumes_bit_for_bit(tmp_path, ema_runs, impl, nproc):
    name = "one" if impl == "none" else impl
    run = tmp_path / "r"
    shutil.copytree(ema_runs / name, run)
    shutil.rmtree(run / "ckpt" / "step_000006")
    loom_here(
        "train",
        "--resume",
        str(run / "ckpt" / "step_000003"),
        f"--nproc={nproc}",
        f"--parallel.dp_impl={impl}",
        "--train.device=cpu",
    )
    want, got = _ema_of(ema_runs / name / "ckpt" / "step_000006"), _ema_of(run / "ckpt" / "step_000006")
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k

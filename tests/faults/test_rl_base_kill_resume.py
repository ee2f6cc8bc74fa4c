"""kill -9 during `loom rl` from a base model (raw-text prompts, answers ended by rl.stop, a format plus a
correctness reward), then --resume: the rewards and losses that follow equal an uninterrupted run's, bit for bit
(CPU, fp32, one thread in every process: faultkit.ENV), as tests/faults/test_rl_kill_resume.py holds for a chat
model. With rl.updates_per_batch=2 a checkpoint may fall in the middle of a batch, which it then holds."""

from __future__ import annotations

from faultkit import Proc, records, run_inprocess, wait_for
from rlkit import rl_base_args

from loom import checkpoint


def _by_step(run) -> dict[int, tuple]:
    """step -> (loss, grad norm, reward mean or None): a step logged twice (replayed) keeps its last."""
    out = {}
    for r in records(run):
        if "loss" in r and "step" in r:
            out[r["step"]] = (r["loss"], r["grad_norm"], r.get("rl/reward_mean"))
    return out


def test_kill_9_during_base_model_rl_then_resume_equals_an_uninterrupted_run(rl_root, tmp_path):
    flat = ["--train.steps=10", "--train.ckpt_every=3", "--rl.updates_per_batch=2"]
    runs = rl_root / "runs"
    assert run_inprocess(rl_base_args(rl_root, "bk-whole", *flat)) == 0
    p = Proc(rl_base_args(rl_root, "bk-cut", *flat), tmp_path / "cut")
    wait_for(
        lambda: (
            checkpoint.latest_valid(runs / "bk-cut" / "ckpt") is not None
            and max(_by_step(runs / "bk-cut"), default=0) >= 5
        ),
        p,
        what="step 5 after a checkpoint",
    )
    p.kill_all()
    saved = checkpoint.latest_valid(runs / "bk-cut" / "ckpt")
    assert saved is not None and int(saved.name.split("_")[1]) < 10
    assert run_inprocess([*rl_base_args(rl_root, "bk-cut", *flat), "--resume"]) == 0
    whole, cut = _by_step(runs / "bk-whole"), _by_step(runs / "bk-cut")
    assert sorted(cut) == list(range(1, 11))
    assert whole == cut
    assert any(g > 0 for _, g, _ in whole.values())

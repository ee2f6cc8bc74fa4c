"""kill -9 during `loom rl`, then --resume: the rewards and losses that follow equal an uninterrupted run's, bit
for bit (CPU, fp32, one thread in every process: faultkit.ENV). Nothing of the sampler is saved but the count of
rollouts drawn: each answer's seed is a function of the run's seed, the rollout and the prompt's place
(loom.rl.rollout.sample_seed), so the resumed run samples what the uninterrupted one did. With
rl.updates_per_batch=2 a checkpoint may fall in the middle of a batch, which it then holds. The same holds for
RL from a base model (raw-text prompts, answers ended by rl.stop, a format plus a correctness reward).

SIGTERM while a reward hangs: the reward is interrupted, the rollout given up (its step not taken), the run
saves its stop checkpoint and exits EXIT_PREEMPTED; --resume draws that rollout again and continues the
uninterrupted run's rewards and losses bit for bit."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from faultkit import Proc, records, run_inprocess, wait_for
from rlkit import rl_args, rl_base_args

from loom import checkpoint
from loom.errors import EXIT_PREEMPTED

REGEX = ["--rl.reward=regex", "--rl.pattern=1"]


def _by_step(run) -> dict[int, tuple]:
    """step -> (loss, grad norm, reward mean or None): a step logged twice (replayed) keeps its last."""
    out = {}
    for r in records(run):
        if "loss" in r and "step" in r:
            out[r["step"]] = (r["loss"], r["grad_norm"], r.get("rl/reward_mean"))
    return out


@pytest.mark.parametrize("kind", ["chat", "base"])
def test_kill_9_during_rl_then_resume_equals_an_uninterrupted_run(rl_root, tmp_path, kind):
    flat = ["--train.steps=10", "--train.ckpt_every=3", "--rl.updates_per_batch=2"]

    def make(name: str, *a: str) -> list[str]:
        return rl_args(rl_root, name, *REGEX, *a) if kind == "chat" else rl_base_args(rl_root, name, *a)

    whole_name, cut_name = f"{kind}-whole", f"{kind}-cut"
    runs = rl_root / "runs"
    assert run_inprocess(make(whole_name, *flat)) == 0
    p = Proc(make(cut_name, *flat), tmp_path / "cut")
    wait_for(
        lambda: (
            checkpoint.latest_valid(runs / cut_name / "ckpt") is not None
            and max(_by_step(runs / cut_name), default=0) >= 5
        ),
        p,
        what="step 5 after a checkpoint",
    )
    p.kill_all()
    saved = checkpoint.latest_valid(runs / cut_name / "ckpt")
    assert saved is not None and int(saved.name.split("_")[1]) < 10
    assert run_inprocess([*make(cut_name, *flat), "--resume"]) == 0
    whole, cut = _by_step(runs / whole_name), _by_step(runs / cut_name)
    assert sorted(cut) == list(range(1, 11))
    assert whole == cut
    assert any(g > 0 for _, g, _ in whole.values())


HANGS = """
import time
from pathlib import Path

STATE = {"calls": 0, "hang_after": None, "marker": None}


def score(sample):
    \"\"\"regex's reward for a 1 in the answer; past STATE["hang_after"] calls it hangs for good.\"\"\"
    STATE["calls"] += 1
    if STATE["hang_after"] is not None and STATE["calls"] > STATE["hang_after"]:
        Path(STATE["marker"]).write_text("hung")
        while True:
            time.sleep(3600)
    return float("1" in sample.text)
"""


def test_sigterm_while_a_reward_hangs_stops_saves_and_resumes_exactly(rl_root, tmp_path, monkeypatch):
    """The reward hangs from the second rollout on (no rl.reward_timeout: nothing else would end it); a SIGTERM
    then stops the run at once with the stop checkpoint of step 1; --resume with the reward mended gives the
    uninterrupted run's steps 2-3."""
    (tmp_path / "hangs_reward.py").write_text(HANGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import hangs_reward

    flat = ["--rl.reward=hangs_reward:score", "--train.steps=3", "--train.ckpt_every=100"]
    runs, marker = rl_root / "runs", tmp_path / "hung"
    hangs_reward.STATE.update(calls=0, hang_after=None)
    assert run_inprocess(rl_args(rl_root, "t-whole", *flat)) == 0

    hangs_reward.STATE.update(calls=0, hang_after=8, marker=str(marker))  # 8 answers a rollout

    def terminate():
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # this process: the trainer's handler, chained by the reward's

    sender = threading.Thread(target=terminate, daemon=True)
    sender.start()
    t0 = time.monotonic()
    assert run_inprocess(rl_args(rl_root, "t-cut", *flat)) == EXIT_PREEMPTED
    sender.join(5)
    assert marker.exists() and time.monotonic() - t0 < 100  # stopped by the signal, not by the hang's end
    saved = checkpoint.latest_valid(runs / "t-cut" / "ckpt")
    assert saved is not None and int(saved.name.split("_")[1]) == 1  # the stop checkpoint
    assert max(_by_step(runs / "t-cut")) == 1  # step 2 was not taken

    hangs_reward.STATE.update(calls=0, hang_after=None)
    assert run_inprocess([*rl_args(rl_root, "t-cut", *flat), "--resume"]) == 0
    whole, cut = _by_step(runs / "t-whole"), _by_step(runs / "t-cut")
    assert sorted(cut) == [1, 2, 3] and whole == cut

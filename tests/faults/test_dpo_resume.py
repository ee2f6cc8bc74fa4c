"""Preference tuning (loom dpo, issue 46) killed with SIGKILL at a random step, then `--resume`: the losses and
the rewards that follow equal an uninterrupted run's, bit for bit (CPU, fp32, dropout on: the RNG comes back
too). The reference log-probabilities are computed once, before the first step, and travel in the
checkpoints: a resumed run that computed them again from its trained weights would start its losses elsewhere.
The step to kill at is drawn from LOOM_FAULT_SEED (printed, so a failure can be replayed)."""

from __future__ import annotations

import json
import os
import random
import time

from faultkit import CKPT, STEPS, Proc, alive, last_step, records, run_inprocess, train_args, wait_for

from loom.cli import main

SEED = int(os.environ.get("LOOM_FAULT_SEED", str(time.time_ns() % 100_000)))
BLOCK = ["--model.block_size=48"]
KEYS = ("loss", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/accuracy")


def _figures(run) -> dict[int, tuple]:
    return {r["step"]: tuple(r[k] for k in KEYS) for r in records(run) if "loss" in r}


def test_sigkill_during_dpo_then_resume_continues_bit_identical(tmp_path):
    rng = random.Random(1)
    words = "apple river stone cloud".split()
    with open(tmp_path / "pairs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(50):
            w = rng.sample(words, 2)
            f.write(json.dumps({"prompt": " ".join(w), "chosen": " ".join(w[::-1]), "rejected": w[0]}) + "\n")
    pref = tmp_path / "pref"
    args = ["data", "prepare", "--pairs", "--input", str(tmp_path / "pairs.jsonl"), "--out", str(pref)]
    assert main([*args, "--tokenizer", "char", "--block-size", "48"]) == 0
    assert run_inprocess(train_args(pref, tmp_path, "ref", STEPS, *CKPT, *BLOCK)) == 0
    ref = _figures(tmp_path / "ref")
    assert sorted(ref) == list(range(1, STEPS + 1))

    k = random.Random(SEED).randint(8, STEPS - 10)
    run = tmp_path / "r"
    p = Proc(train_args(pref, tmp_path, "r", STEPS, *CKPT, *BLOCK), tmp_path / "first")
    wait_for(lambda: last_step(run) >= k, p, what=f"step {k}")
    tree = p.tree()
    p.kill_all()
    killed_at = last_step(run)
    assert killed_at < STEPS and not alive(tree)
    r = Proc(["train", "--resume", str(run)], tmp_path / "resume")
    assert r.wait() == 0, r.stderr()[-3000:]
    assert "resumed from" in r.stdout()
    assert _figures(run) == ref  # the resumed steps replace the killed attempt's, equal to the reference
    print(f"\n[fault] SIGKILL loom dpo at step {killed_at} (seed {SEED}): resumed, {STEPS} steps equal")

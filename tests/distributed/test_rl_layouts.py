"""`loom rl` with real processes (gloo, loopback): `loom verify` on an RL config, ddp, zero2, fsdp and tp at 2 processes
against one process.

Each data-parallel rank samples for its own prompts (seeds from the rollout and the prompt's place, so the
answers are the ones one process samples), scores its own groups, and the loss divides by the global batch's
trained tokens. The engine samples with the model as it trains: under fsdp the two ranks' sharded forwards run
in lockstep (each samples different prompts), under tp both ranks run the same rows on their halves of every
layer (a KV cache of their own heads, the logits gathered over the vocabulary). The losses and parameters
after 10 steps must equal one process's to 1e-5 (fp32), the rewards exactly, and the sampler's
log-probabilities the trainer's bit for bit on every rank (rl/logprob_diff, the maximum over ranks, is 0) on every
layout. Layouts
that split an answer (pp, cp) are refused by validate (test_rl.py)."""

from __future__ import annotations

import json

from loomrun import verify_records
from rlkit import MODEL


def _rl_config(root, path) -> None:
    keys = dict(a.removeprefix("--").split("=", 1) for a in MODEL)
    lines = ["[model]", *(f"{k.split('.')[1]} = {v}" for k, v in keys.items())]
    lines += [
        f'init_from = "run:{root / "runs" / "sft"}"',
        "[train]",
        "batch_size = 8",
        "[optim]",
        "lr = 1e-3",
    ]
    lines += [
        "warmup_steps = 0",
        "[rl]",
        f'prompts = "{root / "arith" / "rl_train.jsonl"}"',
        "group_size = 4",
    ]
    lines += ["max_new_tokens = 4", 'reward = "regex"', 'pattern = "1"']
    path.write_text("\n".join(lines) + "\n")


def _by_step(run) -> list[dict]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r and "step" in r]


def test_verify_rl_on_ddp_zero2_fsdp_and_tp_against_one_process(rl_root, tmp_path):
    cfg = tmp_path / "rl.toml"
    _rl_config(rl_root, cfg)
    layouts = "ddp,zero2,fsdp,tp"
    recs = verify_records(
        tmp_path, rl_root / "chat", layouts, "--nproc", "2", "--tol-loss", "1e-5", str(cfg), steps=10
    )
    assert [r["world_size"] for r in recs] == [2, 2, 2, 2]
    ref = _by_step(tmp_path / "v" / "reference")
    assert sum(r["rl/trained_tokens"] for r in ref) > 0
    for name in layouts.split(","):
        run = _by_step(tmp_path / "v" / name)
        assert [r["rl/reward_mean"] for r in run] == [r["rl/reward_mean"] for r in ref], name
        assert [r["rl/trained_tokens"] for r in run] == [r["rl/trained_tokens"] for r in ref], name
        # batch-invariant forwards (rl.batch_invariant): the sampler's log-probabilities are the trainer's bit
        # for bit (under tp the engine's log-softmax is computed from the shards as loss_parallel computes it)
        assert [r["rl/logprob_diff"] for r in run] == [0.0] * len(run), name
    assert [r["rl/logprob_diff"] for r in ref] == [0.0] * len(ref)

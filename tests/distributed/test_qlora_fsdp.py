"""QLoRA (finetune.quantize_base=nf4) under FSDP2 with real processes (gloo, loopback), against one process.

The base's linears are torchao NF4Tensors made and quantized one module at a time before the layout
(loom.model.nf4.materialize_nf4); fully_shard then splits each NF4 weight by rows (torchao's NF4 split: whole
rows of 4-bit codes and whole blocks of scales) and gathers it through NF4Tensor's FSDP2 hooks
(fsdp_pre/post_all_gather), so every rank computes with the same 4-bit base as one process. `loom verify` on
chat data (the SFT loss) must give one process's losses and adapters within 1e-5 (fp32) for fsdp (ZeRO-3) and
zero2 at 2 processes; measured here: |dloss| 2.4e-7 and |dparam| 1.3e-8 (loss 3.37 -> 3.06 in 4 steps). `loom rl`
under FSDP with an NF4 base runs end to end (sampler and trainer agree exactly). The layouts NF4 cannot serve are refused
by validate (tests/unit/test_qlora.py).
"""

from __future__ import annotations

import json
import random
import re

from loomrun import verify_records

from loom.cli import main

# n_embd 256: every quantized weight (256 x 256, 256 x 1024, 1024 x 256) holds a multiple of 2 x 16,384 values
# and an even number of rows, so 2 ranks each hold whole NF4 scale blocks
QLORA = [
    "--model.n_layer=2",
    "--model.n_head=4",
    "--model.n_embd=256",
    "--model.block_size=64",
    "--finetune.lora_rank=4",
    "--finetune.lora_targets=all-linear",
    "--finetune.quantize_base=nf4",
]


def test_qlora_sft_under_fsdp_follows_one_process(tmp_path):
    rng = random.Random(0)
    words = "apple river stone cloud green house music paper".split()
    with open(tmp_path / "conv.jsonl", "w", encoding="utf-8") as f:
        for _ in range(120):
            w = rng.sample(words, rng.randint(2, 5))
            msgs = [{"role": "user", "content": "reverse: " + " ".join(w)}]
            msgs.append({"role": "assistant", "content": " ".join(reversed(w))})
            f.write(json.dumps({"messages": msgs}) + "\n")
    chat = tmp_path / "chat"
    prep = ["data", "prepare", "--chat", "--input", str(tmp_path / "conv.jsonl"), "--out", str(chat)]
    assert main([*prep, "--tokenizer", "char", "--block-size", "64"]) == 0
    recs = verify_records(tmp_path, chat, "fsdp,zero2", "--nproc", "2", *QLORA, steps=4)
    assert [(r["strategy"], r["world_size"]) for r in recs] == [("fsdp", 2), ("zero2", 2)]
    log = (tmp_path / "v" / "fsdp.log").read_text()
    assert "QLoRA: 12 base linears in NF4" in log, log[-2000:]
    losses = [float(x) for x in re.findall(r"^step \d+/4 .*\| loss ([0-9.]+)", log, re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1  # it learned: not two untouched models compared


def test_qlora_rl_under_fsdp_trains(tmp_path, monkeypatch):
    """`loom rl --nproc 2 --parallel.dp_impl=fsdp` with an NF4 base: the sampler's and the trainer's
    log-probabilities agree (the same NF4 model, gathered for sampling), the KL reference is built, and the
    adapters get gradients once a group's rewards differ."""
    import rlkit

    from loom.metrics import read_jsonl

    monkeypatch.setattr(rlkit, "MODEL", [*QLORA[:3], "--model.block_size=32"])
    root = rlkit.make_rl_root(tmp_path, sft_steps=2)
    args = rlkit.rl_args(root, "qrl", "--train.steps=2", "--train.sample_every=0", "--train.eval_every=0")
    args = [a for a in args if a != "--rl.reward=exact"] + ["--rl.reward=regex", "--rl.pattern=[0-4]"]
    args += [*QLORA[4:], "--rl.kl_coef=0.1", "--nproc", "2", "--parallel.dp_impl=fsdp"]
    assert main(args) == 0
    recs = [r for r in read_jsonl(root / "runs" / "qrl" / "metrics.jsonl") if "rl/logprob_diff" in r]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["rl/logprob_diff"] == 0 for r in recs) and any(r["grad_norm"] > 0 for r in recs), recs

"""Preference tuning (loom dpo, issue 46) with real processes (gloo, loopback): `loom verify` on preference
pairs, against one process.

Each layout computes its own reference log-probabilities before the first step (each data-parallel rank its
share of the pairs, then summed), and each step's loss is the mean over the global batch's pairs: a layout
that weighed pairs per rank or per micro-batch, mixed up which reference belongs to which pair, or lost a
vocabulary shard's part of a log-probability under tensor parallel would drift from one process. ddp, fsdp and
tp at 2 processes must match one process's losses and parameters to 1e-5 (fp32). The learning rate is 3e-4,
not verify's 1e-3: at the first steps the policy is the reference, so a pair's chosen and rejected gradients
nearly cancel, and AdamW, which divides each gradient by its own running scale, turns the rounding of a
near-zero gradient element into a step of the learning rate's size (at 1e-3 one weight of the tensor-parallel
run ends 1.0e-5 from one process's, with every loss within 2e-7).
"""

from __future__ import annotations

import json
import random

from loomrun import verify_records

from loom.cli import main


def test_verify_dpo_loss_on_data_parallel_and_tensor_layouts(tmp_path):
    rng = random.Random(0)
    words = "apple river stone cloud green house music paper".split()
    with open(tmp_path / "pairs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(60):
            w = rng.sample(words, rng.randint(2, 4))
            rec = {
                "prompt": "reverse: " + " ".join(w),
                "chosen": " ".join(reversed(w)),
                "rejected": " ".join(w),
            }
            f.write(json.dumps(rec) + "\n")
    pref = tmp_path / "pref"
    args = ["data", "prepare", "--pairs", "--input", str(tmp_path / "pairs.jsonl"), "--out", str(pref)]
    assert main([*args, "--tokenizer", "char", "--block-size", "64"]) == 0
    recs = verify_records(
        tmp_path, pref, "ddp,fsdp,tp", "--nproc", "2", "--model.block_size=64", "--optim.lr=3e-4"
    )
    assert [r["world_size"] for r in recs] == [2, 2, 2]

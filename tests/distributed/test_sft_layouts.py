"""Chat SFT with real processes (gloo, loopback), issue 34: `loom verify` on chat data, against one process.

The loss is the global batch's mean over the assistant's targets (loom.train.trainer's SFT scale): packed rows
hold different numbers of trained targets, so each micro-batch's share depends on the global count, and a
layout that normalised per rank or per micro-batch would drift from one process. ddp, fsdp and tp at 2
processes must match one process's losses and parameters to 1e-5 (fp32), with document masks on; and a 1F1B
pipeline of 2 stages, one conversation a row (document masks do not compose with pipeline parallel).
"""

from __future__ import annotations

import json
import random

from loomrun import verify_records

from loom.cli import main


def test_verify_sft_loss_on_every_data_parallel_and_tensor_layout(tmp_path):
    rng = random.Random(0)
    words = "apple river stone cloud green house music paper".split()
    with open(tmp_path / "conv.jsonl", "w", encoding="utf-8") as f:
        for i in range(200):
            w = rng.sample(words, rng.randint(2, 5))
            msgs = [{"role": "user", "content": "reverse: " + " ".join(w)}]
            msgs.append({"role": "assistant", "content": " ".join(reversed(w)) * (1 + i % 3)})
            f.write(json.dumps({"messages": msgs}) + "\n")
    chat = tmp_path / "chat"
    assert (
        main(
            [
                "data",
                "prepare",
                "--chat",
                "--input",
                str(tmp_path / "conv.jsonl"),
                "--out",
                str(chat),
                "--tokenizer",
                "char",
                "--block-size",
                "128",
            ]
        )
        == 0
    )
    recs = verify_records(
        tmp_path,
        chat,
        "ddp,fsdp,tp",
        "--nproc",
        "2",
        "--model.block_size=128",
        "--data.doc_mask=true",
        "--data.doc_positions=restart",
    )
    assert [r["world_size"] for r in recs] == [2, 2, 2]
    # pipeline parallel (no document masks there: one conversation a row, padded): the schedule's micro-batch
    # loss is the sum over its trained targets, weighted by the global count (loom.parallel.pipeline)
    (tmp_path / "v").rename(tmp_path / "v-dp")
    recs = verify_records(tmp_path, chat, "pp-1f1b", "--nproc", "2", "--model.block_size=128")
    assert recs[0]["pp"] == 2

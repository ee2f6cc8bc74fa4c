"""train.batch_schedule and train.seq_schedule across layouts: `loom verify` runs ddp and fsdp at 2 ranks
with both schedules (the batch 8 -> 16 sequences, rows of 8 -> 16 -> 32 tokens, each change inside the run) and
compares their losses and final parameters with one process's (within 1e-5, fp32): each rank's share of every
step's windows, and the accumulation count that follows the batch, add up to one process's step."""

from __future__ import annotations

from loomrun import verify_records


def test_verify_ddp_and_fsdp_with_both_schedules(tmp_path, char_data):
    recs = verify_records(
        tmp_path,
        char_data,
        "ddp,fsdp",
        "--train.batch_schedule=8@0,16@2",
        "--train.seq_schedule=8@0,16@3,32@4",
        steps=6,
    )
    assert len(recs) == 2


def test_verify_zero2_and_tp_with_a_batch_schedule(tmp_path, char_data):
    """The batch schedule under sharded optimizer states and gradients (zero2) and tensor parallel (whose ranks
    read the same rows: only the accumulation count changes); a length schedule is refused with tp."""
    recs = verify_records(tmp_path, char_data, "zero2,tp", "--train.batch_schedule=8@0,16@3", steps=6)
    assert len(recs) == 2

"""train.memory_snapshot on a CPU (issue 48, item 3): a simulated allocation failure (LOOM_FAULT_OOM_STEP) goes
the path a CUDA out-of-memory error takes: the snapshot file written, the message naming it and how to view
it, the exit code EXIT_OUT_OF_MEMORY; `steps` dumps after the chosen steps too. A CPU keeps no allocation
history: its file says so and holds the process's resident set. Compared against the documented names, the
exit code and the process's own memory figures; the CUDA pickle is tests/gpu/'s."""

from __future__ import annotations

import json

import torch
from faultkit import Proc, train_args

from loom.config import Config
from loom.errors import EXIT_OUT_OF_MEMORY
from loom.train.memory import MemorySnapshots


def test_simulated_oom_writes_the_snapshot_and_exits_with_its_code(char_data, tmp_path):
    args = [
        *train_args(char_data, tmp_path, "oom", 10),
        "--train.memory_snapshot=steps",
        "--train.memory_snapshot_steps=2",
    ]
    p = Proc(args, tmp_path / "out", env={"LOOM_FAULT_OOM_STEP": "4"})
    assert p.wait() == EXIT_OUT_OF_MEMORY == 71, p.stderr()[-3000:]
    folder = tmp_path / "oom" / "memory"
    assert sorted(f.name for f in folder.iterdir()) == ["oom_step4_rank0.json", "step2_rank0.json"]
    facts = json.loads((folder / "oom_step4_rank0.json").read_text())
    assert facts["step"] == 4 and "LOOM_FAULT_OOM_STEP=4" in facts["error"]
    assert facts["allocation_history"] is None and "CUDA devices only" in facts["why_no_history"]
    assert facts["rss_bytes"] > 10 * 2**20 and facts["peak_bytes"] >= facts["rss_bytes"]
    err = p.stderr()
    assert "rank 0 ran out of device memory in step 4" in err
    assert f"Memory snapshot: {folder / 'oom_step4_rank0.json'}" in err and "hint:" in err
    assert "Traceback" not in err


def test_off_names_the_key_and_writes_nothing(tmp_path):
    snaps = MemorySnapshots(Config(), 0, tmp_path, torch.device("cpu"))
    stop = snaps.out_of_memory(7, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert stop.code == EXIT_OUT_OF_MEMORY and "step 7" in stop.message
    assert "--train.memory_snapshot=on_oom" in stop.hint and not (tmp_path / "memory").exists()

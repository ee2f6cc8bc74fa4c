"""`train.memory_snapshot`: why did it run out of memory (issue 48, item 3).

on_oom (and steps) start recording the device's allocation history when the trainer is built, before the
model's weights exist. A step that raises torch.OutOfMemoryError then dumps the history into
RUN/memory/oom_step<S>_rank<R>.pickle and the run stops with `OutOfMemoryStop` (exit code
`loom.errors.EXIT_OUT_OF_MEMORY`, 71), whose message names the file and how to view it (drag it into
https://pytorch.org/memory_viz: the allocations over time, each with its stack trace). `steps` also dumps after
each step of train.memory_snapshot_steps (RUN/memory/step<S>_rank<R>.pickle).

Only CUDA keeps an allocation history (torch 2.13; loom.device.memory_history). On any other device the same
path writes RUN/memory/..._rank<R>.json instead, with what the process can honestly say: its resident set
now and at its peak (Linux /proc, getrusage), the step and the error; no allocation history (there is none
to give). LOOM_FAULT_OOM_STEP raises a simulated OutOfMemoryError in a forward, to exercise the path on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from loom import device as dev
from loom.config import Config
from loom.config.validate import step_list
from loom.errors import OutOfMemoryStop


def _rss_bytes() -> int | None:
    """This process's resident set now (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemorySnapshots:
    def __init__(self, cfg: Config, rank: int, run_dir: Path, device):
        t = cfg.train
        self.mode, self.rank, self.run_dir, self.device = t.memory_snapshot, rank, run_dir, device
        self.steps = set(step_list(t.memory_snapshot_steps, "")) if self.mode == "steps" else set()
        self.history = self.mode != "off" and dev.memory_history(device, True)

    def after_step(self, step: int) -> Path | None:
        """train.memory_snapshot=steps: the snapshot after each chosen step."""
        if step not in self.steps:
            return None
        from loom import log

        path = self.dump(f"step{step}", step, None)
        log.info(f"memory snapshot after step {step}: {path} ({self.how_to_view(path)})")
        return path

    def dump(self, tag: str, step: int, error: BaseException | None) -> Path:
        """The device's history (CUDA) as memory_viz's pickle, else the process's memory facts as JSON."""
        folder = self.run_dir / "memory"
        folder.mkdir(parents=True, exist_ok=True)
        if self.history:
            path = folder / f"{tag}_rank{self.rank}.pickle"
            dev.dump_memory_history(self.device, path)
            return path
        path = folder / f"{tag}_rank{self.rank}.json"
        facts = {
            "device": str(self.device),
            "step": step,
            "error": str(error) if error else None,
            "rss_bytes": _rss_bytes(),
            "peak_bytes": dev.peak_memory(self.device),  # a CPU: the process's peak resident set
            "allocation_history": None,
            "why_no_history": f"torch records allocation history on CUDA devices only, not on {self.device.type}",
        }
        path.write_text(json.dumps(facts, indent=1), encoding="utf-8")
        return path

    def how_to_view(self, path: Path) -> str:
        if path.suffix == ".pickle":
            return "drag it into https://pytorch.org/memory_viz to see every allocation and its stack"
        return "JSON: this device keeps no allocation history; rerun on a GPU for one"

    def out_of_memory(self, step: int, error: BaseException) -> OutOfMemoryStop:
        """The error that stops the run; with train.memory_snapshot on, after writing the snapshot."""
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        if self.mode == "off":
            return OutOfMemoryStop(
                f"rank {self.rank} ran out of device memory in step {step}: {first}",
                hint="rerun with --train.memory_snapshot=on_oom to get a snapshot of what held the memory; "
                "or lower train.micro_batch_size, turn on train.activation_checkpointing or "
                "train.activation_offload",
            )
        path = self.dump(f"oom_step{step}", step, error)
        return OutOfMemoryStop(
            f"rank {self.rank} ran out of device memory in step {step}: {first}. Memory snapshot: {path} "
            f"({self.how_to_view(path)})",
            hint="lower train.micro_batch_size, or turn on train.activation_checkpointing or "
            "train.activation_offload",
        )

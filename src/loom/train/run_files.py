"""The files a run folder holds beside its checkpoints, written by rank 0 when training starts (once nothing
can fail cheaply): the run marker, metrics.jsonl and the other metrics sinks, config.toml, the tokenizer and
run.json (exact versions, command and sizes, as modded-nanogpt writes into its run log)."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from loom import __version__
from loom.config import Config, to_toml
from loom.data.tokenizers import copy_tokenizer
from loom.metrics import Sinks, open_sinks
from loom.outputs import write_marker


def write_run_files(
    run_dir: Path,
    cfg: Config,
    data_dir: Path,
    meta: dict,
    *,
    device: torch.device,
    world_size: int,
    n_params: int,
    flops_per_token: float,
    active_params: int | None = None,
    origin: dict | None = None,
) -> Sinks:
    """Write the run folder's files and return its opened metrics sinks (the caller writes and closes them).
    `meta`: the data's meta (which tokenizer to copy); the keyword values are recorded in run.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_marker(run_dir, "run")  # so that --force may replace this folder later, and nothing else
    metrics = open_sinks(run_dir, cfg)  # metrics.jsonl, and TensorBoard / W&B if asked
    (run_dir / "config.toml").write_text(to_toml(cfg), encoding="utf-8")
    copy_tokenizer(data_dir, meta, run_dir / "tokenizer")
    info = {
        "loom_version": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": sys.argv,
        "device": str(device),
        "world_size": world_size,
        "data_dir": str(data_dir),
        "params": n_params,
        "active_params": n_params if active_params is None else active_params,  # a MoE's: k of E experts
        "flops_per_token": flops_per_token,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        **(origin or {}),  # run_id, and the base a fine-tuned run started from
    }
    (run_dir / "run.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    return metrics

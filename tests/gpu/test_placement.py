"""On a CUDA GPU the model, its optimizer state and every batch live on the GPU, and every collective of a
real training job goes to a backend that serves its tensor's device: ddp and fsdp applied on a 1-rank NCCL
group (2 ranks with 2+ GPUs), each collective checked by tests/distributed/hooks/sitecustomize.py against
the group's backend. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_args

from loom.config import Config, validate
from loom.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HOOKS = Path(__file__).parents[1] / "distributed" / "hooks"
TINY = tiny_args(
    {
        "optim.warmup_steps": 1,
        "train.eval_every": None,
        "train.device": "cuda",
        "precision.dtype": "bf16",
    }
)


def test_model_optimizer_and_batches_are_on_the_gpu(tmp_path, char_data):
    cfg = Config()
    m, t = cfg.model, cfg.train
    m.n_layer, m.n_head, m.n_embd, m.block_size = 2, 2, 64, 32
    t.batch_size, t.micro_batch_size, t.device, t.eval_batches = 8, 4, "cuda", 1
    trainer = Trainer(cfg, validate(cfg)[0], tmp_path / "run", char_data, torch.device("cuda", 0))
    x, y = trainer.batches.next_batch()
    assert x.device.type == y.device.type == "cuda"
    trainer.train_step()
    tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
    tensors += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    tensors += [
        v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    ]
    off = [tuple(t.shape) for t in tensors if t.device.type != "cuda"]
    assert not off, f"tensors left off the GPU: {off[:5]}"


@pytest.mark.parametrize("impl", ["ddp", "fsdp"])
def test_every_collective_of_a_gpu_job_fits_its_backend(tmp_path, char_data, impl):
    nproc = min(torch.cuda.device_count(), 2)
    out = tmp_path / "seen"
    out.mkdir()
    env = {
        **os.environ,
        "LOOM_CHECK_DEVICES_AS": "cuda",
        "LOOM_CHECK_OUT": str(out),
        "PYTHONPATH": os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p),
    }
    # an eval and a checkpoint: config agreement, the run plan, stop/skip flags, the checkpoint outcome,
    # gradient and loss collectives, the validation sums
    args = [
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--train.steps=3",
        "--train.eval_every=2",
        "--train.ckpt_every=2",
        f"--parallel.dp_impl={impl}",
        *TINY,
    ]
    if nproc > 1:
        args.append(f"--nproc={nproc}")
    else:  # one process as torchrun starts it, so that the hook knows its rank
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    r = subprocess.run(
        [sys.executable, "-m", "loom", "train", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(seen) == nproc
    for rank in seen:
        assert rank["checked"] > rank["cpu_tensors"] > 0, (
            "both the NCCL (gradients) and gloo (control) paths ran"
        )
        assert not rank["violations"], "\n".join(rank["violations"][:3])

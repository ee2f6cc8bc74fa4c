"""train.ema: an exponential moving average of the weights (Polyak averaging; modded-nanogpt's and OLMo-core's
weight averaging), updated after every optimizer step that updated the weights:

    ema <- decay * ema + (1 - decay) * weights        (torch.lerp(ema, weights, 1 - decay))

The average starts at the initial weights (step 0) and is kept in the parameters' own dtype and layout: each
rank averages exactly the pieces it holds (an FSDP shard, a tensor-parallel slice, a pipeline stage's
parameters, a whole replica under DDP), so it costs one copy of this rank's parameters and no communication.
It is evaluated beside the raw weights (`val_loss_ema`, EmaValEval: the average swapped into the parameters for
the evaluation and swapped back), and saved in the checkpoint's optim/ folder under `ema.<single-device name>`,
so that a resume continues it bit for bit, under any layout (DCP reshards it as it does the parameters).
Frozen parameters (a LoRA run's base) are not averaged: they never change.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from loom import log
from loom.eval.evaluator import EvalContext
from loom.eval.val_loss import ValLossEval

PREFIX = "ema."  # the keys of the average in a checkpoint's optim/ folder


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local piece; the same storage)."""
    from loom.parallel.tensor import plain

    t = plain(t)
    return t.to_local() if hasattr(t, "to_local") else t


class EMA:
    """The average of this rank's trained parameters (`parallel`: loom.parallel's Parallelized)."""

    def __init__(self, parallel, decay: float):
        from loom.parallel.init import canonical

        assert 0.0 < decay < 1.0, decay
        self.decay, self.parallel = decay, parallel
        seen: set[int] = set()
        self.params: dict[str, torch.Tensor] = {}  # single-device name -> this rank's piece of the weight
        for name, p in parallel.model.named_parameters():
            if p.requires_grad and id(p) not in seen:  # a tied weight once, under its canonical name
                seen.add(id(p))
                self.params[canonical(name, parallel.tied)] = p
        with torch.no_grad():
            self.shadow = {k: p.detach().clone() for k, p in self.params.items()}  # the average (same layout)
        self._pairs = [(_local(self.shadow[k]), _local(p)) for k, p in self.params.items()]

    @torch.no_grad()
    def update(self) -> None:
        """ema <- decay * ema + (1 - decay) * weights, for every piece this rank holds."""
        for avg, cur in self._pairs:  # one kernel each; the update is a small part of a step
            avg.lerp_(cur, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{ema.<name>: this rank's piece of the average} (DTensors stay sharded), for the optim/ folder."""
        return {PREFIX + k: v for k, v in self.shadow.items()}

    def load(self, optim_dir: Path | None, optim_sd: dict | None = None) -> None:
        """The average from a checkpoint: its optim/ DCP folder (format 2) or its whole optimizer state
        (format 1). A checkpoint saved without train.ema starts the average at the loaded weights (said)."""
        from loom.parallel import dcp_state

        want = self.state_dict()
        if optim_dir is not None:
            saved = dcp_state.saved_keys(optim_dir)
            if all(k in saved for k in want):  # the same answer on every rank: DCP's load is collective
                dcp_state.load_into(want, optim_dir, "optimizer")
                return
        elif optim_sd is not None and all(k in optim_sd for k in want):
            with torch.no_grad():
                for k, v in want.items():
                    _local(v).copy_(optim_sd[k].reshape(_local(v).shape).to(v.dtype))
            return
        log.warn(
            "train.ema: the checkpoint has no average of the weights; it starts again at the resumed weights"
        )
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """The average set to the current weights."""
        for avg, cur in self._pairs:
            avg.copy_(cur)

    @contextlib.contextmanager
    def swapped(self):
        """The average in the parameters for the block's duration, the weights back afterwards (bit for bit)."""
        with torch.no_grad():
            saved = [cur.clone() for _, cur in self._pairs]
            for avg, cur in self._pairs:
                cur.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, cur), w in zip(self._pairs, saved, strict=True):
                    cur.copy_(w)
            self.parallel.refresh_fp8_scales()


class EmaValEval(ValLossEval):
    """The validation loss of the averaged weights (`val_loss_ema`, `val_bpb_ema`), when val_loss is due."""

    name = "val_loss_ema"

    def __init__(self, ema: EMA, *args):
        super().__init__(*args)
        self.ema = ema

    def run(self, ctx: EvalContext) -> dict:
        with self.ema.swapped():
            self.ema.parallel.refresh_fp8_scales()
            found = super().run(ctx)
        return {f"{k}_ema": v for k, v in found.items()}

    def line(self, step: int, record: dict) -> str:
        bpb = f" | {record['val_bpb_ema']:.4f} bits/byte" if record.get("val_bpb_ema") else ""
        return f"step {step:>6} | val loss {record['val_loss_ema']:.4f}{bpb} (EMA weights, train.ema)"


class EmaModelOptimState:
    """loom.train.state.ModelOptimState with the average beside the optimizer state (optim/'s `ema.*`)."""

    def __init__(self, inner, ema: EMA):
        self.inner, self.ema = inner, ema

    def state_dict(self) -> dict:
        sd = self.inner.state_dict()
        sd["optim"] = {**sd["optim"], **self.ema.state_dict()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)
        optim = state_dict["optim"]
        if isinstance(optim, Path):
            self.ema.load(optim)
        else:
            self.ema.load(None, optim)

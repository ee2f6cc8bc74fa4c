"""Validation loss over a fixed set of windows, and loading a trained run for eval/generate."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from loom.data.loader import ValSet
from loom.eval.evaluator import EvalContext, Every


@torch.no_grad()
def val_loss(
    model: torch.nn.Module,
    valset: ValSet,
    micro_batch_size: int,
    device: torch.device,
    autocast=contextlib.nullcontext,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> float:
    """Mean token loss over the validation set's trained targets (every target of pretraining text; the
    assistant's of chat data); with several ranks each holds a share and sums are reduced (a padding batch,
    whose targets are all -1, runs its forward and counts nothing: ValSet.batches)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in valset.batches(micro_batch_size):
        n = int((y != -1).sum())  # the targets that count (SFT: the assistant's), read on the host
        x, y = x.to(device), y.to(device)
        with autocast():
            loss = model(x, y)
        if not n:  # a padding batch: its loss is 0/0
            continue
        total[0] += loss.double() * n
        total[1] += n
    total = all_reduce_sum(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


class ValLossEval(Every):
    """Validation loss (and bits per byte when the data has a tokenizer) every train.eval_every steps."""

    name = "val_loss"

    def __init__(self, valset: ValSet, micro_batch_size: int, every: int):
        super().__init__(every)
        self.valset, self.micro_batch_size = valset, micro_batch_size
        self.last: float | None = None  # the newest validation loss (the run's summary reports it)
        self._tokens_per_byte: float | None = None  # the windows' bytes, counted at the first evaluation

    def run(self, ctx: EvalContext) -> dict:
        par = ctx.parallel
        if par.pipeline is not None:
            loss = par.pipeline.val_loss(self.valset, self.micro_batch_size, ctx.autocast, par.all_reduce_sum)
        else:
            with par.loss_context():
                loss = val_loss(
                    par.eval_model(),
                    self.valset,
                    self.micro_batch_size,
                    ctx.device,
                    ctx.autocast,
                    par.all_reduce_sum,
                )
        self.last = loss
        if ctx.tokenizer is None or getattr(self.valset, "tokens_per_byte", True) is False:
            return {"val_loss": loss}
        if self._tokens_per_byte is None:
            self._tokens_per_byte = tokens_per_byte(
                self.valset, ctx.tokenizer, ctx.device, par.all_reduce_sum
            )
        return {"val_loss": loss, "val_bpb": bits_per_byte(loss, self._tokens_per_byte)}

    def line(self, step: int, record: dict) -> str:
        bpb = f" | {record['val_bpb']:.4f} bits/byte" if record.get("val_bpb") else ""
        return f"step {step:>6} | val loss {record['val_loss']:.4f}{bpb}"


class SourceValEval(ValLossEval):
    """data.mix: one source's validation loss and bits per byte, on its own val split, recorded as
    val_loss/NAME and val_bpb/NAME."""

    def __init__(self, source: str, valset: ValSet, micro_batch_size: int, every: int):
        super().__init__(valset, micro_batch_size, every)
        self.source = source
        self.name = f"val_loss/{source}"

    def run(self, ctx: EvalContext) -> dict:
        return {f"{k}/{self.source}": v for k, v in super().run(ctx).items()}

    def line(self, step: int, record: dict) -> str:
        bpb = record.get(f"val_bpb/{self.source}")
        bpb_text = f" | {bpb:.4f} bits/byte" if bpb else ""
        return f"step {step:>6} | val loss {record[f'val_loss/{self.source}']:.4f}{bpb_text} ({self.source})"


def tokens_per_byte(
    valset: ValSet,
    tokenizer,
    device: torch.device | str = "cpu",
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> float:
    """Target tokens per UTF-8 byte of the validation windows: each window's targets decoded to text and its
    bytes counted (a window cut inside a multi-byte character counts its replacement character; a few bytes
    in a set of thousands). A sum over the ranks' shares; a rank counted twice (tensor parallel holds the
    same windows on each tp rank) counts tokens and bytes alike, so the ratio holds."""
    tokens = n_bytes = 0
    for i in range(0, len(valset.ids), 64):
        for row in valset.windows.rows(valset.ids[i : i + 64])[:, 1:].tolist():
            tokens += len(row)
            n_bytes += len(tokenizer.decode(row).encode("utf-8"))
    total = all_reduce_sum(torch.tensor([tokens, n_bytes], dtype=torch.float64, device=device))
    return (total[0] / total[1]).item() if total[1] > 0 else math.nan


def bits_per_byte(loss: float, tokens_per_byte: float) -> float:
    """Validation loss in bits per byte of text: nats/token / ln 2 x tokens/byte. Independent of the
    tokenizer, so a char run and a BPE run on the same text compare (lower is better)."""
    return loss / math.log(2) * tokens_per_byte

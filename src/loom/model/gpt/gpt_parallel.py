"""How loom.parallel applies to the GPT: everything that names its modules lives here, beside the model.

loom.parallel is generic: it asks this file for the tensor-parallel plan, how to cut pipeline stages, which
modules are the transformer blocks (the units of FSDP, activation checkpointing and compile) and which
parameter names are one tied tensor. (torchtitan keeps the same split: models/*/parallelize.py.)
The model file itself (gpt.py) stays single-device.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loom.config import check_tp_heads
from loom.errors import LoomError
from loom.model.gpt.gpt import GPT, mask_padding_

# Names of one tensor in the single-device model (alias -> canonical): the head tied to the embedding.
TIED = {"lm_head.weight": "wte.weight"}


def tied(model: GPT) -> dict[str, str]:
    """TIED for a model whose head is its token embedding (GPT-2), {} for an untied one (Llama)."""
    return TIED if model.cfg.tie_embeddings else {}


def blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT or of a pipeline stage."""
    b = module.blocks
    return [m for m in (b.values() if isinstance(b, nn.ModuleDict) else b) if m is not None]


def tp_plan(model: GPT, tp: int, sp: bool, loss_parallel: bool) -> dict:
    """{module path: ParallelStyle}: Megatron's split (Shoeybi et al. 2019), applied in this order.

    q/k/v and the MLP up- (and SwiGLU gate) projections column-wise (each rank holds whole heads: H / tp query
    heads and the K / tp key/value heads they read, so tp divides both), the attention output and MLP
    down-projection row-wise (one all-reduce per sub-layer); QK-norm's gains replicated over the local heads
    (their gradients are partial sums over heads, reduced by align_grads); the token embedding vocabulary-parallel (row-wise)
    and the tied head column-wise over the vocabulary, so the cross-entropy runs under `loss_parallel()`
    without gathering the logits. Sequence parallel (Korthikanti et al. 2022) keeps the LayerNorms and
    dropouts on sequence shards: the all-reduces become all-gather + reduce-scatter pairs.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    cfg = model.cfg
    if cfg.padded_vocab % tp:
        raise LoomError(f"the padded vocabulary {cfg.padded_vocab} is not divisible by parallel.tp={tp}")
    check_tp_heads(cfg.n_head, cfg.kv_heads, tp)  # validate() made it already; a plan may be handed any tp
    seq = Shard(1) if sp else Replicate()
    # Embedding rows (the vocabulary) are split; ids outside a rank's range give zeros and the all-reduce of
    # the partial sums restores the lookup. Its output stays replicated so the position embedding can be added.
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    for i in range(cfg.n_layer):
        b = f"blocks.{i}"
        if sp and i == 0:  # the first block keeps only its own slice of the replicated embedding output
            plan[b] = PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Shard(1), None, None),
                use_local_output=True,
            )
        plan.update(
            {
                f"{b}.attn.q_proj": ColwiseParallel(),
                f"{b}.attn.k_proj": ColwiseParallel(),
                f"{b}.attn.v_proj": ColwiseParallel(),
                f"{b}.attn.o_proj": RowwiseParallel(output_layouts=seq),
                f"{b}.mlp.up_proj": ColwiseParallel(),
                f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=seq),
            }
        )
        if cfg.mlp == "swiglu":
            plan[f"{b}.mlp.gate_proj"] = ColwiseParallel()
        if cfg.qk_norm:  # input (B, T, H_local, D): a DTensor sharded over heads (dim 2) around the norm
            for n in ("q_norm", "k_norm"):
                plan[f"{b}.attn.{n}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if sp:  # LayerNorm on sequence shards; attention and MLP gather the sequence first
            plan.update(
                {
                    f"{b}.ln_1": SequenceParallel(),
                    f"{b}.ln_2": SequenceParallel(),
                    f"{b}.attn": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None),
                        desired_input_layouts=(Replicate(), None, None),
                        use_local_output=True,
                    ),
                    f"{b}.mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                    ),
                }
            )
    if sp:
        plan["ln_f"] = SequenceParallel()
    plan["lm_head"] = _vocab_parallel_head()(
        input_layouts=seq,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    return plan


def _vocab_parallel_head():
    """ColwiseParallel for the LMHead: each rank masks the padding ids of its own shard of the logits (the
    module's mask would index the whole vocabulary of a sharded DTensor), before any gather or loss_parallel
    reads them, so tensor parallel gives the single-device model's loss and samples."""
    from torch.distributed.tensor import DTensor

    from loom import compat

    def unmasked(module):
        module.mask_padding = False  # masked per shard below

    def mask_shard(mod, outputs, device_mesh):
        part = outputs.to_local()  # (B, T, V / tp): ids offset .. offset + V / tp - 1
        offset = device_mesh.get_local_rank() * part.size(-1)
        if offset + part.size(-1) > mod.vocab_size:  # this shard holds padding: masked on a copy (autograd)
            part = mask_padding_(part.clone(), mod.vocab_size, offset)
            outputs = DTensor.from_local(part, device_mesh, outputs.placements, run_check=False)
        return outputs

    return compat.colwise_style("VocabParallelHead", unmasked, mask_shard)


def retie(model: GPT) -> None:
    """Tie the head to the embedding again after tensor parallel (each is Shard(0) over the vocabulary) or
    materialization replaced them; a pipeline stage holding only one of them, or an untied model, has nothing
    to tie."""
    if model.cfg.tie_embeddings and model.wte is not None and model.lm_head is not None:
        model.lm_head.weight = model.wte.weight


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """Balanced contiguous layer ranges, the extra layers going to the middle stages (the first stage also
    runs the embeddings and the last the head, so they get the smaller share)."""
    base, extra = divmod(n_layer, n_stages)
    sizes = [base] * n_stages
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(s - (n_stages - 1) / 2)))
    for s in order[:extra]:
        sizes[s] += 1
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(starts[s], starts[s] + sizes[s]) for s in range(n_stages)]


class Stage(nn.Module):
    """A contiguous slice of the GPT. Submodule names equal the single-device model's (blocks keep their
    index), so a stage's parameter names are the full model's."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # the GPT's embedding (learned positions unless RoPE turns q and k instead)
            x = self.wte(x)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(x.size(1), device=x.device))
            x = self.drop(x)
        for name, block in self.blocks.items():
            x = block(x, None, int(name))
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def split_stages(model: GPT, stage_ids: list[int], n_stages: int) -> list[Stage]:
    """This rank's stages; the rest of the model is dropped from it (its names disappear from the module)."""
    ranges = stage_layers(model.cfg.n_layer, n_stages)
    stages = [Stage(model, ranges[s], s == 0, s == n_stages - 1) for s in stage_ids]
    keep = {i for s in stage_ids for i in ranges[s]}
    for i in range(model.cfg.n_layer):
        if i not in keep:
            model.blocks[i] = None  # the entry stays empty: later blocks keep their names (del renumbers)
    if 0 not in stage_ids:
        model.wte = model.wpe = model.drop = None  # a tied tensor stays reachable as lm_head.weight
    if n_stages - 1 not in stage_ids:
        model.ln_f = model.lm_head = None
    return stages

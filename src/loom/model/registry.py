"""Model families: `model.family` -> a ModelSpec, the one place the rest of loom asks about a model.

A family is a single-device model class plus what the layers above need to know about it: how to build it
from loom's config, its parallel plan (tensor-parallel styles, pipeline stages, the transformer blocks, tied
weights), FLOPs per token, an HF mapping if it has one, and what generation does past block_size. The
trainer, eval, checkpoint, generate and export code call `get(cfg.model.family)` and never name a class.
(torchtitan's TrainSpec plays this part.)

A new family is one module or folder that calls `register(ModelSpec(...))` when imported: the built-in ones
in model/gpt/ and model/moe/ (each folder's family.py), imported by the package's __init__; a family outside loom is loaded by naming its module in LOOM_PLUGINS (a comma list of
importable modules), or through the `loom.plugins` entry-point group of an installed package. Every process
of a job imports them at start (the variable is inherited), so `loom train --nproc N`, `loom verify` and
the launchers need nothing more.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.nn as nn

from loom.config import FAMILIES, FAMILY_SECTIONS, Config, FamilySection
from loom.errors import LoomError


class FamilyModel(Protocol):
    """What loom calls on a family's single-device model (loom's GPT has all of it; a family built on it too)."""

    cfg: Any  # the family's model config: block_size, vocab_size, padded_vocab, ...
    lm_head: nn.Module  # the output projection (parallel/fp8 keeps its padding mask)

    def forward(self, idx: Any, targets: Any = None, cache: Any = None) -> Any: ...

    # generation's and eval's cache: GPT's KVCache, or with rows=True a RowCache (loom.model.kv_cache: each
    # row at its own length, loom.engine's running batch)
    def kv_cache(self, batch: int, max_len: int, rows: bool = False) -> Any: ...

    def num_params(self) -> int: ...  # distinct parameters (a tied head counted once)


class ParallelPlan(Protocol):
    """How loom.parallel applies to a family (loom/model/gpt/gpt_parallel.py is GPT's)."""

    def tied(self, model: nn.Module) -> dict[str, str]: ...  # alias -> canonical name of one tensor

    def blocks(self, module: nn.Module) -> list[nn.Module]: ...  # units of FSDP, act. checkpointing, compile

    def tp_plan(self, model: nn.Module, tp: int, sp: bool, loss_parallel: bool) -> dict: ...

    def retie(self, model: nn.Module) -> None: ...

    def split_stages(self, model: nn.Module, stage_ids: list[int], n_stages: int) -> list[nn.Module]: ...


# The hooks' defaults: what a dense family without the extra has.
def no_experts(model: nn.Module) -> list[nn.Module]:
    return []


def nothing_after_step(model: nn.Module, sum_all: Callable[[Any], Any], update: bool) -> dict:
    return {}


def every_param_active(model: nn.Module) -> int:
    return model.num_params()


def no_position_table(model: nn.Module) -> nn.Module | None:
    return None


def no_shape_keys(model_cfg: Any) -> dict[str, Any]:
    return {}


def no_checks(cfg: Config) -> None:
    return None


@dataclass(frozen=True)
class ModelSpec:
    """A family: what it is called, how it is built, and every hook the layers above may ask of it. Each hook
    has a default (a dense GPT-like family needs none of them); nothing outside loom.model names a family."""

    name: str  # the value of model.family
    config: Callable[[Config, int], Any]  # (loom config, the data's vocabulary) -> the model's own config
    build: Callable[[Any], FamilyModel]  # model config -> the single-device model
    parallel: ParallelPlan
    flops_per_token: Callable[
        [Any, int | None], int
    ]  # (model config, sequence length) -> training FLOPs/token
    preset: dict[str, Any] = field(default_factory=dict)  # model.* keys the family sets unless given
    # the family's own config keys: a dataclass whose fields are accepted as model.<field> when model.family
    # is this family, with defaults, bounds and help text (loom.config's `_f`); None: none of its own
    keys: type | None = None
    # the family's own rules on a config, run by config.validate after every key's bounds (raise LoomError)
    check: Callable[[Config], None] = no_checks
    # model.mup applies: the family's config takes mup_base_width and its model scales init, lr groups, logits
    # and attention as loom.model.mup says (False: model.mup is refused before any work)
    mup: bool = False
    # model.mtp_depth applies: the family's model builds multi-token prediction modules (loom.model.mtp)
    mtp: bool = False
    hf: Any = None  # HF mapping (export_hf, load_hf_into) or None: no transformers export/import
    # export --format peft: {loom's linear: transformers' module} for n_layer blocks (None: no peft export)
    peft: Callable[[int], dict[str, str]] | None = None
    verify_model: dict[str, Any] = field(default_factory=dict)  # model.* keys of loom verify's tiny model
    # model.* keys loom verify sets when a strategy cuts sequences or pipeline stages (a MoE: no aux loss)
    verify_split: dict[str, Any] = field(default_factory=dict)
    # generation past block_size: True runs on with the cache (RoPE: what transformers does), False re-crops
    # the context to block_size and recomputes it every token (learned positions have block_size slots)
    extends_context: Callable[[Any], bool] = lambda model_cfg: False
    # parameters a token passes through (MFU counts these; a mixture of experts: k of its routed experts)
    active_params: Callable[[FamilyModel], int] = every_param_active
    # expert parallelism (parallel.ep): the modules whose `experts` are split over the ep ranks ([]: none,
    # parallel.ep is refused), and the work after each optimizer step (sum_all: a sum over the data ranks;
    # returns the figures for metrics.jsonl)
    expert_layers: Callable[[nn.Module], list[nn.Module]] = no_experts
    after_step: Callable[[nn.Module, Callable[[Any], Any], bool], dict] = nothing_after_step
    # context parallel: the learned-position table whose input is offset to this rank's chunk (None: RoPE,
    # positions computed in the attention); ring attention fills each block's `attn.context` (GPT's slot)
    position_table: Callable[[nn.Module], nn.Module | None] = no_position_table
    ring_attention: bool = False
    # loom plan: the model keys' share of the planner's shape beyond GPT's block (loom.plan.shapes.ModelShape
    # fields: a MoE's experts), and the reverse, the model.* keys of a planner shape's own fields
    plan_shape: Callable[[Any], dict[str, Any]] = no_shape_keys
    shape_keys: Callable[[Any], dict[str, Any]] = no_shape_keys
    # the dry run: why this family cannot be dry-run ("": it can)
    no_dry_run: str = ""

    @property
    def expert_parallel(self) -> bool:
        """The family has expert layers to split (parallel.ep, loom verify's ep strategies)."""
        return self.expert_layers is not no_experts

    def build_model(
        self, cfg: Config, vocab_size: int, device: Any = "meta", eot_id: int | None = None
    ) -> nn.Module:
        """The model for cfg.model, on the meta device by default (shapes only: loom.parallel materializes).
        eot_id: the data's end-of-text id, which data.doc_mask=true needs (loom.data.loader.doc_eot_id)."""
        import dataclasses

        import torch

        mcfg = self.config(cfg, vocab_size)
        if cfg.data.doc_mask:
            if not (
                dataclasses.is_dataclass(mcfg) and "eot_id" in {f.name for f in dataclasses.fields(mcfg)}
            ):
                raise LoomError(
                    f"data.doc_mask=true: the family '{self.name}' has no document-masked attention",
                    hint="use data.doc_mask=false, or a family built on loom's GPT (gpt2, llama)",
                )
            if eot_id is None:
                raise LoomError("data.doc_mask=true needs the data's end-of-text id (none was given)")
            mcfg = dataclasses.replace(mcfg, eot_id=eot_id)
        if mcfg.vocab_size < vocab_size:
            raise LoomError(
                f"model.vocab_size={mcfg.vocab_size} is smaller than the data's vocabulary {vocab_size}",
                hint="leave model.vocab_size=0 to take the data's",
            )
        with torch.device(device):
            return self.build(mcfg)


_SPECS: dict[str, ModelSpec] = {}
_loaded = False


def register(spec: ModelSpec) -> ModelSpec:
    """Make `spec` the family `spec.name`: its preset becomes what model.family=NAME sets, its own keys and
    checks the config's (loom.config's tables: the config layer never imports this package)."""
    _SPECS[spec.name] = spec
    FAMILIES[spec.name] = dict(spec.preset)
    FAMILY_SECTIONS[spec.name] = FamilySection(
        spec.preset, spec.keys, spec.check, spec.expert_parallel, spec.mup, spec.mtp
    )
    return spec


def expert_parallel_families() -> list[str]:
    """The families with expert layers to split (parallel.ep): loom verify's ep strategies choose among them."""
    load_plugins()
    return sorted(n for n, s in _SPECS.items() if s.expert_parallel)


def load_plugins() -> None:
    """Import the built-in families and every plug-in family (LOOM_PLUGINS, entry points), once."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # the built-in families registered when loom.model was imported (its __init__)
    names = [n.strip() for n in os.environ.get("LOOM_PLUGINS", "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise LoomError(
                f"LOOM_PLUGINS names '{name}', which cannot be imported: {e}",
                hint="put the plug-in's folder on PYTHONPATH, or remove it from LOOM_PLUGINS",
            ) from e
    from importlib.metadata import entry_points

    for ep in entry_points(group="loom.plugins"):
        ep.load()


def get(name: str) -> ModelSpec:
    """The family `name` (model.family), or an error listing the known ones."""
    load_plugins()
    if name not in _SPECS:
        raise LoomError(
            f"model.family='{name}' is not a known model family ({', '.join(sorted(_SPECS))})",
            hint="a plug-in family is loaded by naming its module in LOOM_PLUGINS=module[,module]",
        )
    return _SPECS[name]


def spec_of(cfg: Config) -> ModelSpec:
    return get(cfg.model.family)


def names() -> list[str]:
    load_plugins()
    return sorted(_SPECS)

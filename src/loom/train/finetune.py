"""Fine-tuning from a loom run: model.init_from=run:DIR takes DIR's model (its shape, and the weights of its newest
checkpoint, to which the run is pinned when it starts: loom.runs.pin_init_from).

The data may extend the run's tokenizer (chat data adds its chat tokens after the run's ids: loom.data.chat):
the embedding (and an untied head) then grow by those rows, each new row the mean of the run's trained rows
(a new token starts as the average token, as nanochat and HF's resize_token_embeddings(mean_resizing) do),
and every existing id keeps its row. Data with another tokenizer is refused by content, before any weight is
read.
"""

from __future__ import annotations

from pathlib import Path

from loom import log
from loom.config import Config, read_config
from loom.errors import LoomError
from loom.runs import is_run_init, run_dir_of


def resolve_init_from(cfg: Config, explicit: set[str]) -> None:
    """The model shape model.init_from names, set on cfg.model (before validate()): run:DIR's config.toml, or
    hf:DIR's config.json through the family's mapping. A key the user set to another value is an error.
    Training and its dry run both resolve it here, so both build the same model."""
    if not cfg.model.init_from:
        return
    if is_run_init(cfg):
        apply_run_init(cfg, explicit)
    else:
        from loom.model.hf import apply_init_from

        apply_init_from(cfg, explicit)


def apply_run_init(cfg: Config, explicit: set[str]) -> None:
    """Take the model's shape and options from the run's config.toml (a key set explicitly to another value is
    an error); block_size stays the user's when given."""
    d = run_dir_of(cfg)
    theirs = read_config(d / "config.toml").model
    for key, value in vars(theirs).items():
        if key in ("init_from", "dropout", "vocab_size"):
            continue
        if key == "block_size" and "model.block_size" in explicit:
            continue
        if getattr(cfg.model, key) != value:
            if f"model.{key}" in explicit:
                raise LoomError(
                    f"model.{key}={getattr(cfg.model, key)!r} conflicts with model.init_from, whose run has "
                    f"{key}={value!r}",
                    hint=f"drop --model.{key}; the run's config sets it",
                )
            setattr(cfg.model, key, value)


def lora_embeddings(cfg: Config, meta: dict) -> bool:
    """Whether a LoRA run trains the token embedding and the head too (finetune.lora_embeddings): auto when
    the data's vocabulary is larger than the base model's (chat data's tokens: their new rows all start as the
    mean row, so frozen they would be one token to the model)."""
    choice = cfg.finetune.lora_embeddings
    if choice != "auto":
        return choice == "true"
    base = (meta.get("chat") or {}).get("base_vocab_size")
    return isinstance(base, int) and base < meta["vocab_size"]


def warn_frozen_new_tokens(cfg: Config, meta: dict) -> None:
    """An explicit finetune.lora_embeddings=false on data that adds tokens is warned about, not refused: it
    has its uses (adapter-only checkpoints, a peft adapter that many-adapter servers load over one shared
    base), but every new row starts as the same mean row and stays frozen, so the model cannot tell the new
    tokens apart (LoRA SFT stalled that way at val 2.29 before lora_embeddings=auto existed)."""
    if not cfg.finetune.lora_rank or cfg.finetune.lora_embeddings != "false":
        return
    base = (meta.get("chat") or {}).get("base_vocab_size")
    if not isinstance(base, int) or base >= meta["vocab_size"]:
        return
    new = meta["vocab_size"] - base
    log.warn(
        f"finetune.lora_embeddings=false, but the data adds {new} token(s) to the base model's vocabulary of "
        f"{base:,} (chat tokens): their embedding and head rows all start as the same mean row and stay "
        "frozen, so the model sees them as one token and cannot learn to tell them apart. Set "
        "finetune.lora_embeddings=auto (or true) to train the embedding and head with the adapters"
    )


def apply_finetune(model, cfg: Config, meta: dict) -> list[str]:
    """finetune.* on a model just built, before the layout (tensor parallel and FSDP see the adapters): LoRA
    on the chosen linears, the base frozen, and the embedding and head trainable again when
    finetune.lora_embeddings says so. The names of the adapted linears ([] without LoRA)."""
    from loom.model.lora import apply_configured

    lora = apply_configured(model, cfg.finetune, cfg.run.seed)
    if lora and lora_embeddings(cfg, meta):
        for name, p in model.named_parameters():
            if name in ("wte.weight", "lm_head.weight"):
                p.requires_grad_(True)
    return lora


def finetune_model(model, cfg: Config, meta: dict) -> list[str]:
    """apply_finetune on the trainer's model, and the line that says what LoRA trains (its adapted linears;
    [] without LoRA)."""
    lora = apply_finetune(model, cfg, meta)
    if lora:
        from loom.model.lora import trainable_summary

        log.info(f"LoRA rank {cfg.finetune.lora_rank} on {len(lora)} linears: {trainable_summary(model)}")
    return lora


def training_flops_per_token(cfg: Config, meta: dict, model_cfg, full: float, lora: list[str]) -> float:
    """The training FLOPs per token of a model whose full training costs `full` (LoRA: fewer, see
    lora_flops_per_token)."""
    return lora_flops_per_token(cfg, meta, model_cfg, full) if lora else full


def lora_flops_per_token(cfg: Config, meta: dict, model_cfg, full: float) -> float:
    """Training FLOPs per token of the LoRA model whose full fine-tuning costs `full`: a frozen matrix gets no
    weight gradient (4 FLOPs a parameter, not 6), a trained one (the adapters; the head when it trains) 6.
    Counted on the whole model, built on the meta device (a pipeline stage holds only its blocks)."""
    import torch

    from loom.model.flops import matmul_params
    from loom.model.lora import lora_state_dict
    from loom.model.registry import spec_of

    with torch.device("meta"):
        whole = spec_of(cfg).build(model_cfg)
    apply_finetune(whole, cfg, meta)
    head = model_cfg.padded_vocab * model_cfg.n_embd if whole.lm_head.weight.requires_grad else 0
    adapters = sum(t.numel() for t in lora_state_dict(whole).values())
    return full - 2 * (matmul_params(model_cfg) - head) + 6 * adapters


def check_lora_targets(cfg: Config, shards: int = 1) -> None:
    """finetune.lora_targets that match no linear of the model, and a rank above an adapted linear's width,
    are refused before any process starts: the adapters are tried on the model built on the meta device
    (shapes only, no memory). QLoRA: every base linear NF4 can hold, split evenly over `shards` FSDP ranks."""
    if not cfg.finetune.lora_rank:
        return
    from loom.model.lora import apply_configured, check_rank
    from loom.model.registry import spec_of

    model = spec_of(cfg).build_model(cfg, max(cfg.model.vocab_size, 1), "meta", eot_id=0)
    apply_configured(model, cfg.finetune)
    check_rank(model)  # a rank above an adapted linear's width is no low-rank adapter
    if cfg.finetune.quantize_base == "nf4":
        from loom.model.nf4 import check_nf4, nf4_api

        nf4_api()  # torchao importable (validate found it; an old or broken install fails here)
        check_nf4(model, shards)  # every base linear's size a whole number of NF4 blocks (per rank)


def quantize_configured(model, cfg: Config, spec, device, init) -> list[str]:
    """finetune.quantize_base=nf4 (QLoRA) on a meta-built LoRA model, before the layout: the model made one
    module at a time (loom.model.nf4.materialize_nf4), each base linear given its model.init_from weights (or
    its seeded init) and quantized to NF4 at once, so no full-precision copy of the model is ever whole; FSDP's
    fully_shard then splits the NF4 weights (torchao's NF4Tensor serves its all-gather). `init(name, whole)`:
    the seeded init parallelize would use. Before the optimizer is built and before a resumed checkpoint's
    adapters are read (the checkpoint holds no base). The names quantized ([] when off: the model stays on
    the meta device for parallelize to materialize)."""
    if cfg.finetune.quantize_base != "nf4":
        return []
    from loom.model.nf4 import materialize_nf4, nf4_bytes
    from loom.runs import pretrained_state

    pretrained = pretrained_state(
        cfg, model
    )  # by the model's names; each base linear's dropped as it is used
    done = materialize_nf4(model, device, init, spec.parallel.tied(model), pretrained)
    del pretrained
    spec.parallel.retie(model)  # to_empty gave each module of a tied pair its own tensor
    n = sum(model.get_submodule(m).weight.numel() for m in done)
    log.info(
        f"QLoRA: {len(done)} base linears in NF4 ({n:,} weights, {nf4_bytes(n) / 2**20:,.1f} MiB against "
        f"{4 * n / 2**20:,.1f} MiB in fp32)"
    )
    return done


def check_data(cfg: Config, data_dir: Path, meta: dict, starting: bool) -> None:
    """What fine-tuning asks of the data before a run starts (`starting`: not resumed from a checkpoint): a
    run:DIR base pinned to its newest checkpoint, LoRA's frozen new tokens warned about, and the data's token
    ids meaning to the model what they meant to its run or its tokenizer. Nothing to ask of a pretraining run."""
    if not (cfg.model.init_from or cfg.finetune.lora_rank):
        return
    if starting:
        from loom.runs import pin_init_from

        pin_init_from(cfg)  # run:DIR -> its newest checkpoint, named from now on
    if cfg.finetune.lora_rank:
        warn_frozen_new_tokens(cfg, meta)
    if not starting:
        return
    if is_run_init(cfg):
        check_run_data(cfg, data_dir, meta)
    elif cfg.model.init_from:
        from loom.data.tokenizers import has_tokenizer, load_tokenizer
        from loom.model.hf import check_data_tokenizer

        # the data's ids must mean to the model what they meant to its tokenizer
        tok = load_tokenizer(data_dir, meta) if has_tokenizer(meta) else None
        check_data_tokenizer(cfg.model.init_from, data_dir, meta["vocab_size"], tok, cfg.model.vocab_size)


def check_run_data(cfg: Config, data_dir: Path, meta: dict) -> None:
    """The data's tokenizer must be the run's, or the run's with tokens appended (chat data): every id the run
    learned keeps its meaning."""
    from loom.data.loader import read_meta
    from loom.data.tokenizers import run_tokenizer_dir, tokenizer_hash

    d = run_dir_of(cfg)
    run_meta = read_meta(run_tokenizer_dir(d))
    base = (meta.get("chat") or {}).get("base_tokenizer_hash")
    same = tokenizer_hash(d / "tokenizer", run_meta) in (tokenizer_hash(data_dir, meta), base)
    if not same:
        raise LoomError(
            f"the data '{data_dir}' is not tokenized with the tokenizer of the run '{d}' (nor with it plus chat "
            "tokens): the run's ids would mean other text",
            hint=f"prepare the data with --tokenizer {d} (loom data prepare --chat takes a run directory)",
        )
    if meta["vocab_size"] < run_meta["vocab_size"]:
        raise LoomError(f"the data's vocabulary ({meta['vocab_size']}) is smaller than the run's")

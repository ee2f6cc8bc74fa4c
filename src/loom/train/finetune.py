"""Fine-tuning from a loom run: model.init_from=run:DIR takes DIR's model (its shape and newest weights).

The data may extend the run's tokenizer (chat data adds its chat tokens after the run's ids: loom.data.chat):
the embedding (and an untied head) then grow by those rows, each new row the mean of the run's trained rows
(a new token starts as the average token, as nanochat and HF's resize_token_embeddings(mean_resizing) do),
and every existing id keeps its row. Data with another tokenizer is refused by content, before any weight is
read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loom.config import Config, config_from_dict, load_toml
from loom.errors import LoomError

PREFIX = "run:"
# names of the vocabulary-sized weights of loom's families (rows = token ids)
_VOCAB_WEIGHTS = ("wte.weight", "lm_head.weight")


def is_run_init(cfg: Config) -> bool:
    return cfg.model.init_from.startswith(PREFIX)


def run_dir_of(cfg: Config) -> Path:
    d = Path(cfg.model.init_from[len(PREFIX) :]).expanduser()
    if not (d / "config.toml").is_file():
        raise LoomError(
            f"model.init_from={cfg.model.init_from}: '{d}' is not a loom run directory (no config.toml)",
            hint="give run:runs/<name>, a folder loom train wrote",
        )
    return d


def apply_run_init(cfg: Config, explicit: set[str]) -> None:
    """Take the model's shape and options from the run's config.toml (a key set explicitly to another value is
    an error); block_size stays the user's when given."""
    d = run_dir_of(cfg)
    theirs = config_from_dict(load_toml(d / "config.toml")).model
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


def check_chat_layout(cfg: Config, data_dir: Path) -> None:
    """SFT on chat data (loom.data.sft) runs on every layout but a pipeline's: the schedule computes each
    micro-batch's loss as the mean over its own targets, and SFT's is a sum over the global batch's trained
    ones divided by their count (loom.train.trainer's SFT scale)."""
    from loom.data.loader import read_meta
    from loom.data.sft import is_chat_data

    if cfg.parallel.pp > 1 and is_chat_data(read_meta(data_dir)):
        raise LoomError(
            f"SFT on chat data with parallel.pp={cfg.parallel.pp}: the pipeline schedule computes each "
            "micro-batch's loss as a mean over its own targets, and SFT's is a sum over the global batch's "
            "trained ones",
            hint="fine-tune with fsdp, ddp, tp or cp (parallel.pp=1)",
        )


def lora_embeddings(cfg: Config, meta: dict) -> bool:
    """Whether a LoRA run trains the token embedding and the head too (finetune.lora_embeddings): auto when
    the data's vocabulary is larger than the base model's (chat data's tokens: their new rows all start as the
    mean row, so frozen they would be one token to the model)."""
    choice = cfg.finetune.lora_embeddings
    if choice != "auto":
        return choice == "true"
    base = (meta.get("chat") or {}).get("base_vocab_size")
    return isinstance(base, int) and base < meta["vocab_size"]


def check_lora_targets(cfg: Config) -> None:
    """finetune.lora_targets that match no linear of the model are refused before any process starts: the
    adapters are tried on the model built on the meta device (shapes only, no memory)."""
    if not cfg.finetune.lora_rank:
        return
    from loom.model.lora import apply_configured
    from loom.model.registry import spec_of

    model = spec_of(cfg).build_model(cfg, max(cfg.model.vocab_size, 1), "meta", eot_id=0)
    apply_configured(model, cfg.finetune)


def check_run_data(cfg: Config, data_dir: Path, meta: dict) -> None:
    """The data's tokenizer must be the run's, or the run's with tokens appended (chat data): every id the run
    learned keeps its meaning."""
    from loom.data.loader import read_meta
    from loom.data.tokenizers import tokenizer_hash

    d = run_dir_of(cfg)
    run_meta = read_meta(d / "tokenizer")
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


def grow_rows(old: torch.Tensor, new_shape: torch.Size, old_vocab: int, new_vocab: int) -> torch.Tensor:
    """A vocabulary-sized weight (rows = ids) of `new_shape`: the old rows for the old ids, the mean of those
    for ids old_vocab .. new_vocab - 1, and the old padding rows (or zeros) above: the head masks those ids."""
    out = torch.zeros(new_shape, dtype=old.dtype)
    out[:old_vocab] = old[:old_vocab]
    out[old_vocab:new_vocab] = old[:old_vocab].mean(dim=0)
    keep = min(len(old), len(out))
    if keep > new_vocab:
        out[new_vocab:keep] = old[new_vocab:keep]
    return out


def run_init_state(cfg: Config, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The run's newest weights by loom's names for `model` (built for this run's vocabulary), on the host."""
    from loom.eval.val_loss import load_run

    d = run_dir_of(cfg)
    run_cfg, old, _, run_meta, path = load_run(d, torch.device("cpu"))
    state = {k: v.detach() for k, v in old.state_dict().items()}
    want = model.state_dict()
    old_vocab, new_vocab = run_meta["vocab_size"], model.cfg.vocab_size
    for name in _VOCAB_WEIGHTS:  # the chat tokens' new rows (the same rows when the vocabulary is the run's)
        if name in state and name in want:
            state[name] = grow_rows(state[name], want[name].shape, old_vocab, new_vocab)
    if getattr(model.cfg, "tie_embeddings", False) and "lm_head.weight" in state:
        state["lm_head.weight"] = state["wte.weight"]
    want = {
        k: v for k, v in want.items() if not k.endswith((".lora_A", ".lora_B"))
    }  # adapters keep their init
    mismatched = [k for k in want if k in state and state[k].shape != want[k].shape]
    if mismatched or set(state) != set(want):
        raise LoomError(
            f"the weights of '{path}' do not fit this model: "
            + ", ".join(f"{k} {tuple(state[k].shape)} vs {tuple(want[k].shape)}" for k in mismatched[:3])
            + (f" (keys differ: {sorted(set(state) ^ set(want))[:4]})" if set(state) != set(want) else ""),
            hint="keep the run's model.* keys (block_size with learned positions cannot grow)",
        )
    return state

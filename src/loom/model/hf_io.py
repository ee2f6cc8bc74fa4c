"""What loom's transformers mappings share (hf.py: GPT-2 and Llama; hf_moe.py: Qwen3-MoE): reading a local
directory's config.json and weights, writing an export folder and its tokenizer files, and model.init_from's
`hf:DIR` syntax. Nothing here knows an architecture's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loom.errors import LoomError
from loom.model.gpt import hf_llama

EOT = "<|endoftext|>"
# The architectures loom imports: config.json's model_type -> its transformers class.
SUPPORTED = {"gpt2": "GPT2LMHeadModel", **hf_llama.ARCHITECTURES, "qwen3_moe": "Qwen3MoeForCausalLM"}

# model.* keys that model.init_from sets from config.json (block_size and dropout stay the user's).
_SHAPE_KEYS = (
    "n_layer",
    "n_head",
    "n_embd",
    "vocab_size",
    "bias",
    "activation",
    "pos",
    "norm",
    "norm_eps",
    "mlp",
    "ffn_hidden",
    "n_kv_head",
    "qk_norm",
    "tie_embeddings",
)


def parse_init_from(spec: str) -> Path:
    """`hf:DIR` -> DIR (the only source loom imports from)."""
    if not spec.startswith("hf:") or len(spec) == 3:
        raise LoomError(
            f"model.init_from='{spec}' is not understood",
            hint="use model.init_from=hf:DIR with a local GPT-2 or Llama directory saved by transformers",
        )
    return Path(spec[3:]).expanduser()


def _prepare_out(out: Path, force: bool) -> None:
    from loom.outputs import replace_output, write_marker

    replace_output(out, "export", force)  # only an earlier export, never a run or a folder loom did not write
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "export")


# ------------------------------------------------------------------------------------------- tokenizer


def _char_tokenizer_json(chars: list[str], eot_id: int, specials: list[str] = ()) -> str:
    """A `tokenizers` pipeline equal to loom's CharTokenizer: BPE without merges, no pre-tokenizer (every
    character is a token), the end-of-text token (and chat data's tokens after it) as special tokens, decoding
    by concatenation."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOT] = eot_id
    vocab.update({t: eot_id + 1 + i for i, t in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (EOT, *specials)])
    return tok.to_str()


def _bpe_vocab_merges(spec: dict) -> tuple[dict, list[str]] | None:
    """vocab.json / merges.txt contents for a byte-level BPE tokenizer.json (GPT2Tokenizer's files)."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    kinds = [pre.get("type")] + [p.get("type") for p in pre.get("pretokenizers", [])]
    if model.get("type") != "BPE" or "ByteLevel" not in kinds:
        return None
    vocab = dict(model["vocab"])
    for t in spec.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return vocab, merges


def write_tokenizer(tokenizer, out: Path, block_size: int) -> list[str]:
    """tokenizer.json (+ vocab.json/merges.txt for byte-level BPE) and tokenizer_config.json."""
    if tokenizer is None:
        return ["no tokenizer files: the run was trained on token ids without a known tokenizer"]
    notes = []
    cls = "PreTrainedTokenizerFast"
    if tokenizer.kind == "sentencepiece":  # the model file itself, as Llama 2's folders hold it
        tokenizer.save(out)
        notes.append("tokenizer.model only (sentencepiece): no tokenizer.json is written for it")
        return notes + _tokenizer_config(out, "LlamaTokenizer", tokenizer.eot, block_size)
    if tokenizer.kind == "char":
        text = _char_tokenizer_json(tokenizer.chars, tokenizer.eot_id, getattr(tokenizer, "specials", ()))
    else:
        text = tokenizer.tok.to_str()
        files = _bpe_vocab_merges(json.loads(text))
        if files is None:
            notes.append("tokenizer.json only: it is not byte-level BPE, so no GPT-2 vocab.json/merges.txt")
        else:
            (out / "vocab.json").write_text(json.dumps(files[0], ensure_ascii=False), encoding="utf-8")
            (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(files[1]) + "\n", encoding="utf-8")
            cls = "GPT2TokenizerFast"
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    # the tokenizer's own end-of-text token (Llama's, GPT-2's)
    return notes + _tokenizer_config(out, cls, getattr(tokenizer, "eot", EOT), block_size)


def _tokenizer_config(out: Path, cls: str, eot: str, block_size: int) -> list[str]:
    """tokenizer_config.json and special_tokens_map.json: the class, the context, end of text as bos/eos/unk."""
    special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    config = {
        "tokenizer_class": cls,
        "model_max_length": block_size,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1), encoding="utf-8")
    return []


def check_same_config(have, want, directory) -> None:
    """A model to load a directory's weights into must have the directory's shape and options (dataclass
    configs, the run's own fields already copied into `want`): the fields that differ are named."""
    import dataclasses

    if want == have:
        return
    diff = [
        f"{f.name}={getattr(have, f.name)!r} (the directory: {getattr(want, f.name)!r})"
        for f in dataclasses.fields(want)
        if getattr(want, f.name) != getattr(have, f.name)
    ]
    raise LoomError(
        f"the model differs from '{directory}' in " + ", ".join(diff),
        hint="leave the model's shape and options to the imported config",
    )


def add_chat_template(out: Path, template: str, tokens: list[str], stop_ids: list[int]) -> None:
    """A chat model's export: its template in tokenizer_config.json (transformers' apply_chat_template renders
    conversations as loom's chat data did), its chat tokens as additional special tokens, and generation
    stopping at the end of the assistant's turn as at end-of-text."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(chat_template=template, additional_special_tokens=list(tokens))
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    gen = out / "generation_config.json"
    config = json.loads(gen.read_text(encoding="utf-8")) if gen.is_file() else {}
    config["eos_token_id"] = list(stop_ids)
    gen.write_text(json.dumps(config, indent=1), encoding="utf-8")


# ------------------------------------------------------------------------------------------- import


def read_config_json(directory: str | Path) -> dict:
    """config.json of a local directory saved by transformers, of an architecture loom imports (SUPPORTED),
    its tokenizer.json checked against its vocabulary; each architecture's own checks are its module's."""
    d = Path(directory)
    if not d.is_dir():
        raise LoomError(
            f"'{d}' is not a directory",
            hint="give a local folder saved by save_pretrained "
            "(download a hub model first, e.g. with `hf download gpt2 --local-dir DIR`)",
        )
    path = d / "config.json"
    if not path.is_file():
        raise LoomError(
            f"'{d}' has no config.json, so its model shape is unknown",
            hint="give a directory written by transformers' save_pretrained (config.json + weights)",
        )
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise LoomError(f"cannot read '{path}': {e}") from None
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        arch = ", ".join(hf.get("architectures") or []) or "an unnamed architecture"
        raise LoomError(
            f"'{path}' holds {arch} (model_type '{kind}'), which loom cannot import",
            hint="supported: " + ", ".join(f"{a} (model_type {t})" for t, a in SUPPORTED.items()),
        )
    _check_tokenizer_vocab(d, hf.get("vocab_size"))
    return hf


def _check_tokenizer_vocab(d: Path, vocab_size: int | None) -> None:
    """A tokenizer.json beside the weights whose ids reach past the model's vocabulary is refused."""
    path = d / "tokenizer.json"
    if vocab_size is None or not path.is_file():
        return
    from tokenizers import Tokenizer

    try:
        n = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises its own exception types for damaged files
        raise LoomError(f"cannot read '{path}': {e}") from None
    if n > vocab_size:
        raise LoomError(
            f"'{path}' has {n} tokens but the model's vocab_size is {vocab_size}: ids >= "
            f"{vocab_size} would have no embedding",
            hint="use the tokenizer the model was trained with, or resize the model's embeddings "
            "in transformers (resize_token_embeddings) and save it again",
        )


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a transformers directory: model.safetensors (single or sharded), else
    pytorch_model.bin."""
    d = Path(directory)
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    if (d / "model.safetensors.index.json").is_file():
        index = json.loads((d / "model.safetensors.index.json").read_text(encoding="utf-8"))
        return [d / f for f in sorted(set(index["weight_map"].values()))]
    if (d / "pytorch_model.bin").is_file():
        return [d / "pytorch_model.bin"]
    raise LoomError(
        f"'{d}' has no model.safetensors or pytorch_model.bin",
        hint="save the model with save_pretrained into that directory",
    )


FINGERPRINT_SPAN = 16 << 20  # bytes read from each end of a weight file larger than twice this


def fingerprint(directory: str | Path) -> str:
    """SHA-256 that identifies a transformers directory's weights: config.json, and each weight file's name,
    size and content (a file over 32 MiB: its first and last 16 MiB, which hold the safetensors header with
    every tensor's name, dtype, shape and offsets; a 70B model's 140 GB are not read at every use). Another
    model, or these weights re-saved after training, gives another value."""
    import hashlib

    d = Path(directory)
    h = hashlib.sha256((d / "config.json").read_bytes() if (d / "config.json").is_file() else b"")
    for f in weight_files(d):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= 2 * FINGERPRINT_SPAN:
                h.update(fh.read())
            else:
                h.update(fh.read(FINGERPRINT_SPAN))
                fh.seek(size - FINGERPRINT_SPAN)
                h.update(fh.read())
    return h.hexdigest()


def read_hf_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """GPT-2 tensors from model.safetensors (single or sharded) or pytorch_model.bin (weights only),
    with the 'transformer.' prefix removed (original GPT-2 checkpoints have none)."""
    from safetensors.torch import load_file

    sd = {}
    for f in weight_files(directory):
        try:
            part = (
                load_file(str(f))
                if f.suffix == ".safetensors"
                else torch.load(f, map_location="cpu", weights_only=True)
            )
        except Exception as e:  # safetensors and torch raise several types for damaged files
            raise LoomError(f"cannot read weights '{f}': {e}") from None
        sd.update(part)
    return {k.removeprefix("transformer."): v.float() for k, v in sd.items()}

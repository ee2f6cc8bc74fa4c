"""Interoperability with Hugging Face transformers: GPT2LMHeadModel here, LlamaForCausalLM in hf_llama.py
(Qwen3MoeForCausalLM, the moe family's, in hf_moe.py: its ModelSpec.hf).

Export writes the architecture the model's family has (GPT-2 for the default options, Llama for
model.family=llama); import reads either from a local directory (model.init_from=hf:DIR). The rest of this
docstring is GPT-2's mapping; hf_llama.py has Llama's.

loom's GPT is GPT-2's architecture (pre-LayerNorm, learned positions, tanh-GELU MLP of width 4C, tied
embeddings); only the parameter layout differs:

  loom                                   GPT2LMHeadModel (transformers)
  wte.weight (V_padded, C)               transformer.wte.weight (V, C)        rows [:V]
  blocks.i.attn.{q,k,v}_proj (C, C)      transformer.h.i.attn.c_attn (C, 3C)  Conv1D: y = x @ W + b, W = [q;k;v]^T
  blocks.i.attn.o_proj                   transformer.h.i.attn.c_proj          transposed
  blocks.i.mlp.up_proj / down_proj       transformer.h.i.mlp.c_fc / c_proj    transposed
  ln_1, ln_2, ln_f, wpe                  same names                           same

q/k/v stay separate in loom (tensor parallelism shards heads through them); they are fused only in the
exported file. A loom model without biases is exported with zero biases, which computes the same function.
Nothing here needs transformers: config.json is plain JSON and the weights are safetensors; the `hf`
extra (transformers) is only needed to load the export on the other side.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from loom import log
from loom.errors import LoomError
from loom.model.gpt import hf_llama
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.model.hf_io import (  # noqa: F401 (the names other modules read from hf)
    _SHAPE_KEYS,
    EOT,
    SUPPORTED,
    _prepare_out,
    check_same_config,
    parse_init_from,
    read_config_json,
    read_hf_weights,
    write_tokenizer,
)
from loom.model.moe import hf_moe

# GPTConfig fields with a GPT-2 equivalent; any other field must keep its default to be exportable.
_GPT2_FIELDS = {
    "vocab_size",
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "dropout",
    "bias",
    "activation",
    "rope_theta",
}  # rope_theta: unused with learned positions
# transformers' activation_function names for each of loom's model.activation values.
HF_ACTIVATIONS = {"gelu_tanh": ("gelu_new", "gelu_pytorch_tanh"), "gelu": ("gelu",)}


def _refuse(field: str, why: str, hint: str | None = None) -> LoomError:
    return LoomError(f"GPT-2 cannot represent this model: {field} {why}", hint=hint)


# ------------------------------------------------------------------------------------------- export


def check_exportable(cfg: GPTConfig) -> None:
    """Refuse, naming the field, a loom model shape that GPT2LMHeadModel has no setting for."""
    for f in dataclasses.fields(cfg):
        if f.name in _GPT2_FIELDS:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if getattr(cfg, f.name) != default:
            raise _refuse(
                f"model.{f.name}={getattr(cfg, f.name)!r}",
                "has no GPT-2 equivalent",
                hint=f"export a model trained with the default model.{f.name}={default!r}",
            )
    if cfg.n_embd % cfg.n_head:
        raise _refuse(f"model.n_embd={cfg.n_embd}", f"is not divisible by model.n_head={cfg.n_head}")


def gpt2_config(cfg: GPTConfig, eot_id: int | None = None) -> dict:
    """config.json of a GPT2LMHeadModel with loom's shape (vocabulary unpadded)."""
    check_exportable(cfg)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": HF_ACTIVATIONS[cfg.activation][0],
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": "float32",
    }


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """loom weights in GPT2LMHeadModel's names and layout (fp32, contiguous, vocabulary unpadded)."""
    cfg = model.cfg
    check_exportable(cfg)
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    with torch.device("meta"):  # the parameter names of a plain loom GPT of this shape, no memory
        expected = set(GPT(cfg).state_dict())
    extra = sorted(set(sd) - expected)
    if extra:
        raise _refuse(f"parameter '{extra[0]}'", "has no GPT-2 counterpart")
    C = cfg.n_embd

    def bias(name: str, n: int) -> torch.Tensor:  # a model without biases: zeros compute the same thing
        return sd.get(name, torch.zeros(n))

    out = {
        "transformer.wte.weight": sd["wte.weight"][: cfg.vocab_size],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
        "transformer.ln_f.bias": bias("ln_f.bias", C),
    }
    for i in range(cfg.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[h + f"{ln}.weight"] = sd[p + f"{ln}.weight"]
            out[h + f"{ln}.bias"] = bias(p + f"{ln}.bias", C)
        qkv = [sd[p + f"attn.{n}_proj.weight"] for n in "qkv"]  # each (C_out, C_in)
        out[h + "attn.c_attn.weight"] = torch.cat(qkv, dim=0).t()  # Conv1D: (C_in, 3C)
        out[h + "attn.c_attn.bias"] = torch.cat([bias(p + f"attn.{n}_proj.bias", C) for n in "qkv"])
        out[h + "attn.c_proj.weight"] = sd[p + "attn.o_proj.weight"].t()
        out[h + "attn.c_proj.bias"] = bias(p + "attn.o_proj.bias", C)
        out[h + "mlp.c_fc.weight"] = sd[p + "mlp.up_proj.weight"].t()
        out[h + "mlp.c_fc.bias"] = bias(p + "mlp.up_proj.bias", 4 * C)
        out[h + "mlp.c_proj.weight"] = sd[p + "mlp.down_proj.weight"].t()
        out[h + "mlp.c_proj.bias"] = bias(p + "mlp.down_proj.bias", C)
    return {k: v.contiguous() for k, v in out.items()}


def is_llama(cfg: GPTConfig) -> bool:
    """Exported as LlamaForCausalLM (any of the Llama parts), else as GPT2LMHeadModel."""
    return (cfg.pos, cfg.norm, cfg.mlp) != ("learned", "layernorm", "gelu")


def export_hf(model: GPT, out: str | Path, tokenizer=None, force: bool = False) -> list[str]:
    """Write a directory that `transformers.AutoModelForCausalLM.from_pretrained(out)` loads as GPT-2 or,
    for the llama family, as LlamaForCausalLM.

    `tokenizer` is loom's (char or BPE) or None; returns notes for the user (what could not be written)."""
    from safetensors.torch import save_file

    eot = getattr(tokenizer, "eot_id", None)
    if is_llama(model.cfg):  # refuses before anything is written
        config = hf_llama.llama_config(model.cfg, eot)
        state = hf_llama.llama_state_dict(
            {k: v.detach().float().cpu() for k, v in model.state_dict().items()}, model.cfg
        )
    else:
        config = gpt2_config(model.cfg, eot)
        state = gpt2_state_dict(model)
    out = Path(out)
    _prepare_out(out, force)
    (out / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eot, "eos_token_id": eot}, indent=1), encoding="utf-8"
    )
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return write_tokenizer(tokenizer, out, model.cfg.block_size)


def export_safetensors(model: GPT, out: str | Path, force: bool = False) -> Path:
    """loom's own state dict as out/model.safetensors; a tied lm_head is left out (it is wte), and the
    model shape is in the metadata under 'loom_model'."""
    from safetensors.torch import save_file

    out = Path(out)
    _prepare_out(out, force)
    tied = model.cfg.tie_embeddings
    state = {
        k: v.detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    meta = {"format": "pt", "loom_model": json.dumps(dataclasses.asdict(model.cfg))}
    if tied:
        meta["tied"] = "lm_head.weight=wte.weight"
    save_file(state, str(out / "model.safetensors"), metadata=meta)
    return out / "model.safetensors"


# ------------------------------------------------------------------------------------------- tokenizer


# ------------------------------------------------------------------------------------------- import


def read_hf_config(directory: str | Path) -> dict:
    """config.json of a local GPT-2, Llama or Qwen3-MoE directory, checked for what loom's model can represent."""
    hf = read_config_json(directory)
    kind, path = hf["model_type"], Path(directory) / "config.json"
    if kind in hf_llama.ARCHITECTURES:  # Llama, Qwen2, Qwen3
        hf_llama.check_config(hf, path)
        return hf
    if kind == "qwen3_moe":  # the moe family's mapping
        hf_moe.check_config(hf, path)
        return hf
    checks = [
        (
            "activation_function",
            _activation(hf) is not None,
            "loom's MLP has tanh-GELU (gelu_new) or exact GELU (gelu)",
        ),
        ("n_inner", hf.get("n_inner") in (None, 4 * hf.get("n_embd", 768)), "loom's MLP is 4 x n_embd wide"),
        ("tie_word_embeddings", hf.get("tie_word_embeddings", True), "loom ties lm_head to wte"),
        (
            "scale_attn_weights",
            hf.get("scale_attn_weights", True),
            "loom scales attention by 1/sqrt(head_dim)",
        ),
        (
            "scale_attn_by_inverse_layer_idx",
            not hf.get("scale_attn_by_inverse_layer_idx", False),
            "loom does not scale by layer",
        ),
        (
            "layer_norm_epsilon",
            abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) < 1e-12,
            "loom's LayerNorms use eps 1e-5",
        ),
        ("add_cross_attention", not hf.get("add_cross_attention", False), "loom's GPT is decoder-only"),
    ]
    for key, ok, why in checks:
        if not ok:
            raise LoomError(f"'{path}': {key}={hf.get(key)!r} cannot be imported: {why}")
    return hf


def check_data_tokenizer(
    init_from: str, data_dir: Path, data_vocab: int, data_tokenizer, vocab_size: int
) -> None:
    """Data to continue an imported model on must fit its embedding and, when the model came with a
    tokenizer.json, be tokenized by it (every token keeps its id; the data may add tokens within vocab_size).
    `data_tokenizer` is loom's tokenizer of the data (None: token ids only)."""
    d = parse_init_from(init_from)
    has_json = (d / "tokenizer.json").is_file()
    remedy = f"prepare the data with the model's tokenizer: loom data prepare ... --tokenizer {d / 'tokenizer.json'}"
    eot = getattr(data_tokenizer, "eot_id", None)
    if data_vocab > vocab_size and eot is not None and eot >= vocab_size:  # loom's separator has no row
        raise LoomError(
            f"the data '{data_dir}' separates documents with {EOT} (id {eot}), which loom's data "
            f"prepare added because the tokenizer has no such token, but the model imported from "
            f"'{d}' has only {vocab_size} embedding rows",
            hint=f"give the model a row for it in transformers (model.resize_token_embeddings({eot + 1}),"
            " then save_pretrained), or prepare data whose tokenizer already has that token",
        )
    if data_vocab > vocab_size:
        raise LoomError(
            f"the data '{data_dir}' has a vocabulary of {data_vocab} tokens but the model imported "
            f"from '{d}' has {vocab_size}: ids >= {vocab_size} have no embedding",
            hint=remedy if has_json else "use data prepared with the model's own tokenizer",
        )
    if not has_json or data_tokenizer is None:
        return
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)
    tok = getattr(data_tokenizer, "tok", None)
    if tok is not None:
        ours = tok.get_vocab(with_added_tokens=True)
    else:  # loom's char tokenizer: its characters, and the end-of-text token its export names (EOT)
        ours = {**getattr(data_tokenizer, "stoi", {}), EOT: eot}
    moved = [t for t, i in theirs.items() if ours.get(t) != i]
    if moved:
        raise LoomError(
            f"the data '{data_dir}' was tokenized with another tokenizer than '{d / 'tokenizer.json'}' "
            f"({len(moved)} of its {len(theirs)} tokens have another id or none, e.g. {moved[0]!r}): "
            "the model would read other text than the data holds",
            hint=remedy,
        )


def _activation(hf: dict) -> str | None:
    """loom's model.activation for a GPT-2 config.json's activation_function (None: none of loom's)."""
    name = hf.get("activation_function", "gelu_new")
    return next((a for a, names in HF_ACTIVATIONS.items() if name in names), None)


def gpt_config_from_hf(hf: dict, block_size: int | None = None, dropout: float = 0.0) -> GPTConfig:
    """loom's GPTConfig for a GPT-2 or Llama config.json; GPT-2's block_size may be cropped below n_positions."""
    if hf.get("model_type") in hf_llama.ARCHITECTURES:
        return hf_llama.gpt_config(hf, block_size, dropout)
    if hf.get("model_type") == "qwen3_moe":
        return hf_moe.moe_config(hf, block_size, dropout)
    n_pos = hf.get("n_positions", hf.get("n_ctx", 1024))
    if block_size is not None and block_size > n_pos:
        raise LoomError(
            f"model.block_size={block_size} exceeds the imported model's n_positions={n_pos}",
            hint=f"use model.block_size <= {n_pos}",
        )
    return GPTConfig(
        vocab_size=hf.get("vocab_size", 50257),
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        n_embd=hf.get("n_embd", 768),
        block_size=block_size or n_pos,
        dropout=dropout,
        bias=True,
        activation=_activation(hf),
    )


def loom_state_from_gpt2(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2 tensors -> loom's state dict for `cfg` (vocabulary padded, positions cropped to block_size).

    Padding rows are set to the mean of the real embedding rows (no id reads them, and the head masks their
    logits: LMHead), so the model is transformers' distribution over the V real ids."""
    C, V = cfg.n_embd, cfg.vocab_size

    def get(name: str, shape: tuple) -> torch.Tensor:
        return hf_llama.imported(sd, name, shape, "GPT2LMHeadModel")

    wte = get("wte.weight", (V, C))
    pad = wte.mean(dim=0, keepdim=True).expand(cfg.padded_vocab - V, C)
    out = {
        "wte.weight": torch.cat([wte, pad]),
        "wpe.weight": sd["wpe.weight"][: cfg.block_size],
        "ln_f.weight": get("ln_f.weight", (C,)),
        "ln_f.bias": get("ln_f.bias", (C,)),
    }
    for i in range(cfg.n_layer):
        p, h = f"blocks.{i}.", f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[p + f"{ln}.weight"] = get(h + f"{ln}.weight", (C,))
            out[p + f"{ln}.bias"] = get(h + f"{ln}.bias", (C,))
        w = get(h + "attn.c_attn.weight", (C, 3 * C)).t()  # (3C, C): rows q, k, v
        b = get(h + "attn.c_attn.bias", (3 * C,))
        for j, n in enumerate("qkv"):
            out[p + f"attn.{n}_proj.weight"] = w[j * C : (j + 1) * C]
            out[p + f"attn.{n}_proj.bias"] = b[j * C : (j + 1) * C]
        out[p + "attn.o_proj.weight"] = get(h + "attn.c_proj.weight", (C, C)).t()
        out[p + "attn.o_proj.bias"] = get(h + "attn.c_proj.bias", (C,))
        out[p + "mlp.up_proj.weight"] = get(h + "mlp.c_fc.weight", (C, 4 * C)).t()
        out[p + "mlp.up_proj.bias"] = get(h + "mlp.c_fc.bias", (4 * C,))
        out[p + "mlp.down_proj.weight"] = get(h + "mlp.c_proj.weight", (4 * C, C)).t()
        out[p + "mlp.down_proj.bias"] = get(h + "mlp.c_proj.bias", (C,))
    out["lm_head.weight"] = out["wte.weight"]  # tied
    return {k: v.contiguous() for k, v in out.items()}


@torch.no_grad()
def load_hf_into(model: GPT, directory: str | Path) -> None:
    """Copy GPT-2 or Llama weights from a local transformers directory into `model` (shapes must agree)."""
    hf = read_hf_config(directory)
    if hf["model_type"] == "qwen3_moe":
        return hf_moe.load_hf_into(model, directory)
    want = gpt_config_from_hf(hf, model.cfg.block_size, model.cfg.dropout)
    if hf["model_type"] == "gpt2":
        want = dataclasses.replace(want, rope_theta=model.cfg.rope_theta)  # unused by learned positions
    # document masking is how a run reads packed documents (data.doc_mask), not part of the weights
    c = model.cfg
    want = dataclasses.replace(want, doc_mask=c.doc_mask, eot_id=c.eot_id, doc_positions=c.doc_positions)
    check_same_config(model.cfg, want, directory)
    weights = read_hf_weights(directory)
    if hf["model_type"] in hf_llama.ARCHITECTURES:
        state = hf_llama.loom_state(weights, model.cfg)
    else:
        state = loom_state_from_gpt2(weights, model.cfg)
    model.load_state_dict(state)
    log.info(f"initialised from {SUPPORTED[hf['model_type']]} weights in {directory}")


load_gpt2_into = load_hf_into  # the name the trainer imports


def apply_init_from(cfg, explicit: set[str] = frozenset()) -> None:
    """With model.init_from=hf:DIR, take the model shape from DIR/config.json (before validate()).

    `cfg` is a loom.config.Config; a shape key the user set explicitly to another value is an error."""
    if not cfg.model.init_from:
        return
    m = cfg.model
    hf = read_hf_config(parse_init_from(m.init_from))
    if hf["model_type"] == "qwen3_moe":  # its keys include model.family=moe, which only it can hold
        values = hf_moe.model_keys(hf, m.block_size, m.dropout)
    else:
        g = gpt_config_from_hf(hf, m.block_size, m.dropout)
        keys = _SHAPE_KEYS + (("rope_theta",) if g.pos == "rope" else ())
        values = {key: getattr(g, key) for key in keys} | llama_keys(g, m)
        # what the imported model is, recorded in the run's config; an explicit built-in family of the other
        # kind conflicts (a plug-in family on GPT's keys may take either)
        imported, other = ("llama", "gpt2") if g.pos == "rope" else ("gpt2", "llama")
        if "model.family" not in explicit or m.family == other:
            values = {"family": imported, **values}
    grown = chat_vocab(cfg.data.path, values.get("vocab_size"))
    if grown:
        log.info(
            f"model.init_from: the embedding grows from {values['vocab_size']:,} to {grown:,} ids for the chat "
            "tokens (each new row the mean row)"
        )
        values["vocab_size"] = grown
    for key, value in values.items():
        if getattr(m, key) != value:
            if f"model.{key}" in explicit:
                raise LoomError(
                    f"model.{key}={getattr(m, key)!r} conflicts with model.init_from, which has "
                    f"{key}={value!r}",
                    hint=f"drop --model.{key}; the imported config sets it",
                )
            setattr(m, key, value)


def llama_keys(g: GPTConfig, m) -> dict:
    """The llama family's own keys (rope scaling, qkv_bias) an import sets: all of them where the model section
    has them, else those off their default (apply_init_from then names the conflict with the family)."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    return {k: getattr(g, k) for k in hf_llama.FAMILY_KEYS if getattr(g, k) != defaults[k] or hasattr(m, k)}


def chat_vocab(data_path: str, hf_vocab: int | None) -> int | None:
    """The vocabulary an imported model grows to for chat data prepared with its tokenizer plus loom's chat
    tokens, when those ids reach past its vocab_size (GPT-2's 50,257 rows leave no room): the data's, else
    None. loom.runs.pretrained_state grows the rows (each new one the mean row, loom.runs.grow_rows);
    check_data_tokenizer still checks that every token of the model's tokenizer keeps its id."""
    meta_path = Path(data_path) / "meta.json" if data_path else None
    if hf_vocab is None or meta_path is None or not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the data's own checks name what is wrong with it
    base, vocab = (meta.get("chat") or {}).get("base_vocab_size"), meta.get("vocab_size")
    if isinstance(base, int) and isinstance(vocab, int) and base <= hf_vocab < vocab:
        return vocab
    return None


def load_hf(directory: str | Path, block_size: int | None = None, dropout: float = 0.0) -> GPT:
    """A loom GPT holding the GPT-2, Llama or Qwen3-MoE model saved in `directory`."""
    hf = read_hf_config(directory)
    if hf["model_type"] == "qwen3_moe":
        return hf_moe.load_hf(directory, block_size, dropout)
    cfg = gpt_config_from_hf(hf, block_size, dropout)
    model = GPT(cfg)
    load_hf_into(model, directory)
    return model

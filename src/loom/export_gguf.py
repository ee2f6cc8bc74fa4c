"""`loom export --format gguf`: a run's model as one GGUF file that llama.cpp (and what is built on it: its
server, llama-cpp-python, Ollama) reads, written through the `gguf` package (llama.cpp's own writer).

What is written, following llama.cpp's converter (convert_hf_to_gguf.py) for the same architectures:
- the architecture: `gpt2` for loom's GPT-2-shaped models (learned positions, LayerNorm, tanh-GELU MLP), `llama`
  for the llama family's shape (RoPE, RMSNorm, SwiGLU, grouped-query attention). Anything else (the moe family,
  a plug-in family's model, QK-norm, q/k/v biases, YaRN) is refused, naming it, before the checkpoint is read.
- its hyper-parameters: `{arch}.context_length` (model.block_size), `embedding_length`, `block_count`,
  `feed_forward_length`, `attention.head_count`(`_kv`), the norm's epsilon; for llama `rope.freq_base`,
  `rope.dimension_count` (the head width) and, for scaled RoPE (linear, llama3), llama.cpp's `rope_freqs.weight`:
  each rotation speed's divisor, theta^(-2i/D) / loom's scaled speed, so any of loom's frequency rules is exact.
- the tensors by llama.cpp's names (`token_embd`, `blk.N.attn_q`, ..., `output_norm`, `output`), in numpy's
  orientation of loom's nn.Linear weights (out, in), which GGUF stores as dims (in, out). Only the real
  vocabulary's rows: loom pads the embedding to a multiple of 64. GPT-2's q, k and v are fused into `attn_qkv`
  (rows q, k, v) and its biases written as zeros when the model has none (the same function). A tied head is
  left out: llama.cpp's gpt2 and llama read token_embd in its place.
- llama's q and k rows permuted per head: loom's RoPE turns channel i with i + D/2 (transformers' layout), while
  llama.cpp's `llama` turns neighbours 2i and 2i+1 (Meta's layout): the converter permutes transformers' q_proj
  and k_proj the same way.
- the matrices in the type asked (f16, bf16, or q8_0: blocks of 32 int8 with an fp16 scale; a matrix whose rows
  are not a whole number of blocks stays f16, as the converter does); norms, biases and rope_freqs in f32.
- the tokenizer as llama.cpp's `gpt2` (byte-level BPE) model: `tokenizer.ggml.tokens` (by id; ids the model has
  and the tokenizer lacks are unused `[PADn]` tokens), `token_type` (special tokens are control tokens),
  `merges`, `pre` (llama.cpp's name for the split pattern: gpt-2, or llama-bpe for cl100k's), bos = eos = the
  end-of-text id, no token added in front. loom's char tokenizer is written the same way: each character as its
  byte-level text and, for characters of several UTF-8 bytes, the merges that join their bytes back (llama.cpp
  needs a merges list: a char vocabulary of single bytes gets one merge that can never apply). A chat run's
  template goes along as `tokenizer.chat_template`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from loom.errors import LoomError

GGUF_TYPES = ("f16", "bf16", "q8_0")
# what to do instead for a model or tokenizer llama.cpp has no reader for here
_HINT = (
    "export it with --format hf and convert that directory with llama.cpp's convert_hf_to_gguf.py, or train "
    "a model of the gpt2 or llama family"
)
# the split patterns llama.cpp knows by name (tokenizer.ggml.pre), by the regex of a tokenizer.json
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise LoomError(
            "--format gguf needs the gguf package", hint="pip install 'loom[hf]' (or pip install gguf)"
        ) from None
    return gguf


# ------------------------------------------------------------------------------------------- the checks


def architecture(mcfg) -> str:
    """llama.cpp's architecture for loom's model config (`gpt2` or `llama`), or a LoomError naming what it cannot
    represent."""
    from loom.model import hf
    from loom.model.gpt import hf_llama
    from loom.model.gpt.gpt import GPTConfig

    if not isinstance(mcfg, GPTConfig):
        raise LoomError(f"--format gguf writes loom's GPT, not a {type(mcfg).__name__} model", hint=_HINT)
    cfg = dataclasses.replace(mcfg, doc_mask=False, eot_id=-1, doc_positions="continue")  # not in the weights
    if not hf.is_llama(cfg):
        hf.check_exportable(cfg)  # every field at GPT-2's setting, named otherwise
        if cfg.activation != "gelu_tanh":
            raise LoomError(
                f"llama.cpp's gpt2 computes GELU with the tanh approximation, not model.activation="
                f"{cfg.activation!r}",
                hint="export a model trained with model.activation=gelu_tanh (GPT-2's)",
            )
        return "gpt2"
    hf_llama.check_exportable(cfg)  # RoPE, RMSNorm, SwiGLU, named otherwise
    for key, what in (
        ("qk_norm", "RMSNorm of each query and key head (llama.cpp's qwen3 architecture)"),
        ("qkv_bias", "q/k/v biases (llama.cpp's qwen2 architecture)"),
        ("bias", "biases"),
    ):
        if getattr(cfg, key):
            raise LoomError(
                f"--format gguf writes llama.cpp's llama architecture, which has no {what}: model.{key}=true",
                hint=_HINT,
            )
    if cfg.rope_type == "yarn":
        raise LoomError(
            "--format gguf: model.rope_type='yarn' (its scaled cos and sin) is not written for llama.cpp",
            hint=_HINT,
        )
    return "llama"


def check_run(run_dir: str | Path) -> None:
    """Everything --format gguf refuses, from the run's config and tokenizer alone: before a weight is read."""
    from loom.config import config_from_dict, load_toml
    from loom.data.loader import read_meta
    from loom.data.tokenizers import has_tokenizer, load_tokenizer, run_tokenizer_dir
    from loom.model.gpt.gpt import GPT
    from loom.model.registry import spec_of

    _gguf()
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise LoomError(
            f"'{run_dir}' is not a loom run directory (no config.toml)", hint="give a runs/<name> folder"
        )
    cfg = config_from_dict(load_toml(run_dir / "config.toml"))
    meta = read_meta(run_tokenizer_dir(run_dir))
    spec = spec_of(cfg)
    mcfg = spec.config(cfg, meta["vocab_size"])
    if spec.build is not GPT:  # a family with a model of its own (moe, plug-ins)
        raise LoomError(
            f"--format gguf writes llama.cpp's gpt2 and llama architectures; model.family="
            f"{cfg.model.family} builds {getattr(spec.build, '__name__', 'another model')}, which it has no "
            "mapping for",
            hint=_HINT,
        )
    architecture(mcfg)
    tok = load_tokenizer(run_dir / "tokenizer", meta) if has_tokenizer(meta) else None
    vocab_of(tok, mcfg.vocab_size)


# ------------------------------------------------------------------------------------------- the tokenizer


@dataclasses.dataclass
class Vocab:
    """What tokenizer.ggml.* holds: tokens and their types by id, merges, llama.cpp's split pattern's name."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    eot_id: int


def vocab_of(tok, n_vocab: int) -> Vocab:
    """The tokenizer as llama.cpp's byte-level BPE (`gpt2`) vocabulary of n_vocab ids (the model's rows)."""
    if tok is None:
        raise LoomError(
            "--format gguf: the run has no tokenizer (it was trained on token ids only), and llama.cpp reads "
            "its tokenizer from the file",
            hint="train on data prepared with a tokenizer (loom data prepare --tokenizer bpe)",
        )
    if tok.kind == "char":
        vocab = _char_vocab(tok)
    elif tok.kind == "bpe":
        vocab = _bpe_vocab(tok)
    else:
        raise LoomError(
            f"--format gguf writes byte-level BPE tokenizers; this run's is {tok.kind}",
            hint=_HINT,
        )
    if len(vocab.tokens) > n_vocab:
        raise LoomError(
            f"the tokenizer has {len(vocab.tokens)} ids but the model only {n_vocab} embedding rows",
            hint="export a run whose model.vocab_size holds its tokenizer",
        )
    gguf = _gguf()
    for i in range(len(vocab.tokens), n_vocab):  # rows the model has beyond the tokenizer (model.vocab_size)
        vocab.tokens.append(f"[PAD{i}]")
        vocab.types.append(int(gguf.TokenType.UNUSED))
    return vocab


def _byte_text(text: str) -> str:
    """text as gpt2's byte-level alphabet writes it (a space is 'Ġ', a newline 'Ċ')."""
    from loom.data.encode import byte_decoder

    enc = {b: c for c, b in byte_decoder().items()}
    return "".join(enc[b] for b in text.encode("utf-8"))


def _char_vocab(tok) -> Vocab:
    """loom's char tokenizer as a byte-level BPE: every character a token (its bytes' text) and the merges
    that build each several-byte character from its bytes (llama.cpp splits the byte text into characters
    and merges by rank); end-of-text and the chat tokens as control tokens."""
    gguf = _gguf()
    from loom.data.tokenizers import EOT

    tokens = [_byte_text(c) for c in tok.chars] + [EOT, *tok.specials]
    types = [int(gguf.TokenType.NORMAL)] * len(tok.chars)
    types += [int(gguf.TokenType.CONTROL)] * (1 + len(tok.specials))
    merges = []
    for t in tokens[: len(tok.chars)]:  # a lead byte then its continuation bytes: they meet nowhere else
        merges += [f"{t[:k]} {t[k]}" for k in range(1, len(t))]
    if not merges:  # llama.cpp refuses a gpt2 vocabulary without merges; pieces of two tokens never meet
        merges = [f"{EOT} {EOT}"]
    return Vocab(tokens, types, list(dict.fromkeys(merges)), "gpt-2", tok.eot_id)


def _bpe_vocab(tok) -> Vocab:
    """A `tokenizers` byte-level BPE (loom's trained BPE, GPT-2's, Llama 3's) by id, or a LoomError naming what
    llama.cpp's gpt2 model cannot represent."""
    from loom.data.encode import GPT2_PATTERN, GPT4_PATTERN

    gguf = _gguf()
    spec = json.loads(tok.tok.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if model.get("type") != "BPE" or "ByteLevel" not in kinds or spec.get("normalizer"):
        raise LoomError(
            f"--format gguf writes byte-level BPE tokenizers; this run's tokenizer.json is "
            f"{model.get('type')} with pre-tokenizers {kinds} and normalizer "
            f"{(spec.get('normalizer') or {}).get('type')}",
            hint=_HINT,
        )
    if any(s.get("type") == "ByteLevel" and s.get("add_prefix_space") for s in steps):
        raise LoomError(
            "--format gguf: the tokenizer puts a space before the text (ByteLevel add_prefix_space), which "
            "llama.cpp's gpt2 tokenizer does not",
            hint=_HINT,
        )
    names = {GPT2_PATTERN: "gpt-2", GPT4_PATTERN: "llama-bpe", _LLAMA3_PATTERN: "llama-bpe"}
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        pre_name = "gpt-2"  # the ByteLevel pre-tokenizer's own split is GPT-2's pattern
    elif kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        pre_name = names.get(pattern)
        if pre_name is None:
            raise LoomError(
                f"--format gguf: the tokenizer splits text by {pattern!r}, which is none of the patterns loom "
                "names for llama.cpp (GPT-2's, cl100k's, Llama 3's)",
                hint=_HINT,
            )
    else:
        raise LoomError(f"--format gguf: the tokenizer's pre-tokenizers {kinds} are not written", hint=_HINT)
    by_id = {i: t for t, i in model["vocab"].items()}
    control = {}
    for t in spec.get("added_tokens", []):
        by_id[t["id"]] = t["content"]
        control[t["id"]] = gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED
    n = max(by_id) + 1
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = [
        int(control.get(i, gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED)) for i in range(n)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        raise LoomError("--format gguf: the BPE tokenizer has no merges, which llama.cpp needs", hint=_HINT)
    return Vocab(tokens, types, merges, pre_name, tok.eot_id)


# ------------------------------------------------------------------------------------------- the weights


def _permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows (heads * D, C) from loom's pairing (i, i + D/2) to llama.cpp's (2i, 2i + 1) in each head."""
    D = w.shape[0] // heads
    return w.reshape(heads, 2, D // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(model, arch: str) -> dict[str, torch.Tensor]:
    """The model's weights by llama.cpp's names, fp32 on the host, vocabulary unpadded."""
    cfg = model.cfg
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    V, C = cfg.vocab_size, cfg.n_embd
    out = {"token_embd.weight": sd["wte.weight"][:V]}

    def bias(name: str, n: int) -> torch.Tensor:  # GPT-2 without biases: zeros compute the same thing
        return sd.get(name, torch.zeros(n))

    for i in range(cfg.n_layer):
        p, b = f"blocks.{i}.", f"blk.{i}."
        if arch == "gpt2":
            out[b + "attn_norm.weight"], out[b + "attn_norm.bias"] = (
                sd[p + "ln_1.weight"],
                bias(p + "ln_1.bias", C),
            )
            out[b + "attn_qkv.weight"] = torch.cat([sd[p + f"attn.{n}_proj.weight"] for n in "qkv"])
            out[b + "attn_qkv.bias"] = torch.cat([bias(p + f"attn.{n}_proj.bias", C) for n in "qkv"])
            out[b + "attn_output.weight"] = sd[p + "attn.o_proj.weight"]
            out[b + "attn_output.bias"] = bias(p + "attn.o_proj.bias", C)
            out[b + "ffn_norm.weight"], out[b + "ffn_norm.bias"] = (
                sd[p + "ln_2.weight"],
                bias(p + "ln_2.bias", C),
            )
            out[b + "ffn_up.weight"] = sd[p + "mlp.up_proj.weight"]
            out[b + "ffn_up.bias"] = bias(p + "mlp.up_proj.bias", cfg.ffn_width)
            out[b + "ffn_down.weight"] = sd[p + "mlp.down_proj.weight"]
            out[b + "ffn_down.bias"] = bias(p + "mlp.down_proj.bias", C)
        else:
            out[b + "attn_norm.weight"] = sd[p + "ln_1.weight"]
            out[b + "attn_q.weight"] = _permute_rope(sd[p + "attn.q_proj.weight"], cfg.n_head)
            out[b + "attn_k.weight"] = _permute_rope(sd[p + "attn.k_proj.weight"], cfg.kv_heads)
            out[b + "attn_v.weight"] = sd[p + "attn.v_proj.weight"]
            out[b + "attn_output.weight"] = sd[p + "attn.o_proj.weight"]
            out[b + "ffn_norm.weight"] = sd[p + "ln_2.weight"]
            for n in ("gate", "up", "down"):
                out[b + f"ffn_{n}.weight"] = sd[p + f"mlp.{n}_proj.weight"]
    if arch == "gpt2":
        out["position_embd.weight"] = sd["wpe.weight"]
        out["output_norm.bias"] = bias("ln_f.bias", C)
    out["output_norm.weight"] = sd["ln_f.weight"]
    if not cfg.tie_embeddings:  # a tied head is left out: llama.cpp reads token_embd in its place
        out["output.weight"] = sd["lm_head.weight"][:V]
    if arch == "llama" and cfg.rope_type != "default":
        from loom.model.gpt.gpt import Rope, rope_inv_freq

        plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
        out["rope_freqs.weight"] = plain / rope_inv_freq(cfg.head_dim, Rope.of(cfg))
    return {k: v.contiguous() for k, v in out.items()}


def _encoded(gguf, name: str, t: torch.Tensor, gguf_type: str):
    """(array, raw type) of one tensor as written: matrices in gguf_type, the rest f32."""
    Q = gguf.GGMLQuantizationType
    a = t.numpy().astype(np.float32)
    if a.ndim < 2 or name == "rope_freqs.weight":
        return a, Q.F32
    if gguf_type == "q8_0" and a.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        return gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0
    if gguf_type == "bf16":
        return gguf.quants.quantize(a, Q.BF16), Q.BF16
    return a.astype(np.float16), Q.F16  # f16, and q8_0's fallback for rows not a whole number of blocks


# ------------------------------------------------------------------------------------------- the file


def write_gguf(
    model, tok, meta: dict, path: Path, gguf_type: str = "f16", name: str = "loom"
) -> dict[str, str]:
    """Write the GGUF file `path` for loom's model and tokenizer (module docstring); returns {tensor name:
    its type}."""
    gguf = _gguf()
    if gguf_type not in GGUF_TYPES:
        raise LoomError(f"--gguf-type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    cfg = model.cfg
    arch = architecture(cfg)
    vocab = vocab_of(tok, cfg.vocab_size)
    tensors = gguf_tensors(model, arch)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_file_type(int(file_type.get(gguf_type, gguf.LlamaFileType.MOSTLY_Q8_0)))
    if gguf_type == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.block_size)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.ffn_width)
    w.add_head_count(cfg.n_head)
    if arch == "gpt2":
        w.add_layer_norm_eps(cfg.norm_eps)
    else:
        w.add_head_count_kv(cfg.kv_heads)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.eot_id)
    w.add_eos_token_id(vocab.eot_id)
    w.add_add_bos_token(False)  # loom starts a prompt with its text (a document's start is end-of-text)
    w.add_add_eos_token(False)
    if isinstance(meta.get("chat"), dict):
        from loom.data.chat import chat_template_of

        w.add_chat_template(chat_template_of(tok, meta).jinja())
    types = {}
    for key, t in tensors.items():
        data, raw = _encoded(gguf, key, t, gguf_type)
        w.add_tensor(key, data, raw_dtype=raw)
        types[key] = raw.name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def export_gguf(run_dir: str | Path, out: Path, ckpt=None, gguf_type: str = "f16", force: bool = False):
    """`loom export RUN --format gguf --out OUT`: OUT/model-<type>.gguf, written beside OUT and renamed into
    place when whole; every refusal comes before the checkpoint is read. Returns the notes for the user."""
    from loom.outputs import staged_output, write_marker
    from loom.runs import load_run

    if gguf_type not in GGUF_TYPES:
        raise LoomError(f"--gguf-type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    check_run(run_dir)
    cfg, model, tok, meta, path = load_run(run_dir, torch.device("cpu"), ckpt)
    if cfg.model.mup:  # llama.cpp's architectures have no μP multipliers
        raise LoomError(
            "model.mup: llama.cpp's gpt2 and llama architectures have no μP output and attention multipliers",
            hint="export it with --format safetensors",
        )
    name = f"model-{gguf_type}.gguf"
    with staged_output(out, "export", force) as tmp:
        tmp.mkdir()
        write_marker(tmp, "export")  # OUT is loom's export, which --force may replace
        types = write_gguf(model, tok, meta, tmp / name, gguf_type, Path(run_dir).resolve().name)
    kinds = sorted(set(types.values()))
    notes = [
        f"wrote {out / name} from {path}: llama.cpp's {architecture(model.cfg)} architecture, "
        f"{len(types)} tensors ({', '.join(kinds)})"
    ]
    if cfg.data.doc_mask:
        notes.append(
            "data.doc_mask: llama.cpp attends over the whole sequence, which equals loom's on one document"
        )
    return notes

"""`loom export --format gguf`: the file read back with the gguf package's own reader (gguf.GGUFReader), compared
against the run it came from: every tensor's name and shape, the metadata, the tokenizer's tokens and merges,
each weight dequantized against loom's (f16 and bf16 to their rounding, q8_0 within its block's step), and a
forward written here from llama.cpp's conventions (neighbouring RoPE pairs, GGUF's names) over the file's tensors
against loom's logits. llama.cpp itself is compared in benchmarks/gguf_llamacpp.py (it compiles llama.cpp).
Bad input: each refusal is a LoomError naming the cause, raised before the checkpoint is read."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import gguf  # the hf extra (make setup installs it)
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import TINY

from loom.cli import main
from loom.errors import LoomError
from loom.export_gguf import _byte_text, architecture, check_run, vocab_of
from loom.model.gpt.gpt import GPTConfig
from loom.runs import load_run

LLAMA = ["--model.family=llama", "--model.n_kv_head=1"]  # grouped-query: k permuted with its own head count


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny gpt2 and llama runs on byte-level BPE data, and a gpt2 run on characters."""
    import random

    from loom.data.prepare import prepare

    root = tmp_path_factory.mktemp("gguf")
    (root / "docs").mkdir()
    words = "the of and to in is that it for as with was on be by at this from one said what them café naïve"
    for i in range(4):
        rng = random.Random(i)
        text = " ".join(rng.choice(words.split()) for _ in range(1200))
        (root / "docs" / f"d{i}.txt").write_text(text.capitalize() + ".\n")
    prepare([root / "docs"], root / "data-bpe", tokenizer="bpe", vocab_size=300, val_fraction=0.25, seed=0)
    prepare([root / "docs"], root / "data-char", tokenizer="char", val_fraction=0.25, seed=0)
    made = {}
    for name, data, extra in (("gpt2", "bpe", []), ("llama", "bpe", LLAMA), ("char", "char", [])):
        args = [
            f"--data.path={root / ('data-' + data)}",
            f"--run.dir={root}",
            f"--run.name={name}",
            "--train.steps=3",
        ]
        assert main(["train", *args, *TINY, *extra]) == 0
        made[name] = root / name
    return made


def _export(run, out, kind: str) -> gguf.GGUFReader:
    assert main(["export", str(run), "--format", "gguf", "--gguf-type", kind, "--out", str(out)]) == 0
    return gguf.GGUFReader(out / f"model-{kind}.gguf")


def _value(reader, key: str):
    return reader.fields[key].contents()


def _weights(reader) -> dict[str, torch.Tensor]:
    """Every tensor of the file dequantized to fp32 in numpy's (rows, columns) orientation."""
    return {
        t.name: torch.from_numpy(
            gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape)))
        )
        for t in reader.tensors
    }


def _expected_names(arch: str, n_layer: int, tied: bool) -> set[str]:
    per = {
        "gpt2": [
            f"{n}.{w}"
            for n in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
            for w in ("weight", "bias")
        ],
        "llama": [
            f"{n}.weight"
            for n in (
                "attn_norm",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_norm",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            )
        ],
    }[arch]
    names = {f"blk.{i}.{p}" for i in range(n_layer) for p in per} | {
        "token_embd.weight",
        "output_norm.weight",
    }
    names |= {"position_embd.weight", "output_norm.bias"} if arch == "gpt2" else set()
    return names | (set() if tied else {"output.weight"})


def _rope_pairs(x: torch.Tensor, pos: torch.Tensor, theta: float, factors=None) -> torch.Tensor:
    """llama.cpp's `llama` RoPE: channels 2i and 2i + 1 of each head (B, T, H, D) turn together, by
    theta^(-2i/D) divided by rope_freqs[i] when the file has it."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float) / D)
    inv = inv if factors is None else inv / factors
    ang = pos[:, None].float() * inv  # (T, D/2)
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def _forward(w: dict, meta: dict, arch: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) of the GGUF tensors `w` as llama.cpp's gpt2 / llama graphs compute them."""
    n_layer, C = meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"]
    H = meta[f"{arch}.attention.head_count"]
    K = meta.get(f"{arch}.attention.head_count_kv", H)
    T, D = len(ids), meta.get(f"{arch}.rope.dimension_count", C // H)
    x = w["token_embd.weight"][ids]
    if arch == "gpt2":
        x = x + w["position_embd.weight"][:T]
        eps = meta["gpt2.attention.layer_norm_epsilon"]

        def norm(x, n):
            return F.layer_norm(x, (C,), w[n + ".weight"], w[n + ".bias"], eps)
    else:
        eps = meta["llama.attention.layer_norm_rms_epsilon"]

        def norm(x, n):
            return F.rms_norm(x, (C,), w[n + ".weight"], eps)

    def lin(x, n):
        return x @ w[n + ".weight"].T + (w[n + ".bias"] if n + ".bias" in w else 0)

    for i in range(n_layer):
        b = f"blk.{i}."
        h = norm(x, b + "attn_norm")
        if arch == "gpt2":
            q, k, v = lin(h, b + "attn_qkv").split(C, dim=-1)
        else:
            q, k, v = lin(h, b + "attn_q"), lin(h, b + "attn_k"), lin(h, b + "attn_v")
        q, k, v = q.view(1, T, H, D), k.view(1, T, K, D), v.view(1, T, K, D)
        if arch == "llama":
            pos, theta = torch.arange(T), meta["llama.rope.freq_base"]
            factors = w.get("rope_freqs.weight")
            q, k = _rope_pairs(q, pos, theta, factors), _rope_pairs(k, pos, theta, factors)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(T, H * D)
        x = x + lin(y, b + "attn_output")
        h = norm(x, b + "ffn_norm")
        if arch == "gpt2":
            h = F.gelu(lin(h, b + "ffn_up"), approximate="tanh")
        else:
            h = F.silu(lin(h, b + "ffn_gate")) * lin(h, b + "ffn_up")
        x = x + lin(h, b + "ffn_down")
    x = norm(x, "output_norm")
    return x @ w.get("output.weight", w["token_embd.weight"]).T


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0"])
def test_the_file_reads_back_as_the_run(runs, tmp_path, name, kind):
    reader = _export(runs[name], tmp_path / "out", kind)
    _, model, tok, _, _ = load_run(runs[name], torch.device("cpu"))
    cfg, V = model.cfg, tok.vocab_size
    assert cfg.vocab_size == V < cfg.padded_vocab  # the padding rows are left out
    meta = {k: _value(reader, k) for k in reader.fields if not k.startswith("GGUF.")}
    arch = meta["general.architecture"]
    assert arch == name
    want = {
        f"{arch}.context_length": 32,
        f"{arch}.embedding_length": 32,
        f"{arch}.block_count": 2,
        f"{arch}.feed_forward_length": cfg.ffn_width,
        f"{arch}.attention.head_count": 2,
        "general.file_type": {"f16": 1, "bf16": 32, "q8_0": 7}[kind],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": tok.eot_id,
        "tokenizer.ggml.eos_token_id": tok.eot_id,
        "tokenizer.ggml.add_bos_token": False,
    }
    if arch == "llama":
        want |= {
            "llama.attention.head_count_kv": 1,
            "llama.rope.dimension_count": 16,
            "llama.rope.freq_base": 10000.0,
        }
    assert {k: meta.get(k) for k in want} == want
    eps_key = (
        "gpt2.attention.layer_norm_epsilon" if arch == "gpt2" else "llama.attention.layer_norm_rms_epsilon"
    )
    assert meta[eps_key] == pytest.approx(cfg.norm_eps)
    # the tokenizer: tokenizer.json's tokens by id, its merges in rank order, end-of-text a control token
    spec = json.loads(tok.tok.to_str())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()} | {
        t["id"]: t["content"] for t in spec["added_tokens"]
    }
    assert meta["tokenizer.ggml.tokens"] == [by_id[i] for i in range(V)]
    assert meta["tokenizer.ggml.merges"] == [
        m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]
    ]
    types = meta["tokenizer.ggml.token_type"]
    assert types[tok.eot_id] == gguf.TokenType.CONTROL and types.count(gguf.TokenType.NORMAL) == V - 1

    # every tensor's name and shape (GGUF's dims are numpy's reversed), then its values
    w = _weights(reader)
    assert set(w) == _expected_names(arch, 2, cfg.tie_embeddings)
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes["token_embd.weight"] == (32, V)
    if arch == "gpt2":
        assert shapes["blk.0.attn_qkv.weight"] == (32, 96) and shapes["position_embd.weight"] == (32, 32)
    else:
        assert shapes["blk.1.attn_k.weight"] == (32, 16) and shapes["output.weight"] == (32, V)
        assert shapes["blk.0.ffn_gate.weight"] == (32, cfg.ffn_width)
    matrix = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[kind]
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {kinds[n] for n in w if w[n].dim() == 2} == {matrix}
    assert {kinds[n] for n in w if w[n].dim() == 1} == {"F32"}

    ours = model.state_dict()
    pairs = {
        "token_embd.weight": ours["wte.weight"][:V],
        "blk.1.ffn_down.weight": ours["blocks.1.mlp.down_proj.weight"],
    }
    if (
        arch == "llama"
    ):  # llama.cpp pairs channels 2i, 2i+1: row 2i of a head is loom's row i, 2i+1 is i + D/2
        q = ours["blocks.0.attn.q_proj.weight"].view(2, 2, 8, 32)
        pairs["blk.0.attn_q.weight"] = q.transpose(1, 2).reshape(32, 32)
        pairs["output.weight"] = ours["lm_head.weight"][:V]
    else:
        pairs["blk.0.attn_qkv.weight"] = torch.cat([ours[f"blocks.0.attn.{n}_proj.weight"] for n in "qkv"])
    for n, theirs in pairs.items():
        got = w[n]
        if kind == "f16":
            assert torch.equal(got, theirs.half().float()), n
        elif kind == "bf16":
            assert torch.equal(got, theirs.bfloat16().float()), n
        else:  # q8_0: each block of 32 in steps of its largest |value| / 127 (the scale itself in fp16)
            blocks = theirs.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            assert ((got.reshape(-1, 32) - blocks).abs() <= 0.51 * step + 1e-3 * step * 127).all(), n


LLAMA_SHAPE = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "tie_embeddings": False, "n_kv_head": 2}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        LLAMA_SHAPE,
        LLAMA_SHAPE | {"tie_embeddings": True, "head_size": 24, "rope_theta": 500.0},
        LLAMA_SHAPE | {"rope_type": "llama3", "rope_factor": 8.0, "rope_original_context": 16},
        LLAMA_SHAPE | {"rope_type": "linear", "rope_factor": 4.0},
    ],
    ids=["gpt2", "llama-gqa", "llama-tied-head24", "llama3-rope", "linear-rope"],
)
def test_llama_cpp_conventions_over_the_file_give_loom_logits(runs, tmp_path, changes):
    """A random model with sharp attention (q and k scaled up, so a q or k row out of place moves the logits)
    written by write_gguf, then run from the file as llama.cpp's graph runs it (neighbouring RoPE pairs, each
    speed divided by rope_freqs), equals loom's forward to fp16 rounding."""
    from loom.export_gguf import write_gguf
    from loom.model.gpt.gpt import GPT

    _, _, tok, _, _ = load_run(runs["gpt2"], torch.device("cpu"))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=4, n_embd=64, block_size=32, **changes)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(6)
    types = write_gguf(model, tok, {}, tmp_path / "m.gguf", "f16")
    assert ("rope_freqs.weight" in types) == (cfg.rope_type != "default")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    meta = {k: _value(reader, k) for k in reader.fields if not k.startswith("GGUF.")}
    ids = torch.tensor(tok.encode("The one of them said what they were on about")[:24])
    with torch.no_grad():
        theirs = _forward(_weights(reader), meta, meta["general.architecture"], ids)
        ours = model(ids[None])[0, :, : tok.vocab_size].float()
        wrong = dict(_weights(reader))  # the same file with llama's k rows left in loom's order: far off
    err = (theirs - ours).abs().max().item()
    assert err < 0.03, err
    if cfg.pos == "rope":
        from loom.export_gguf import _permute_rope

        for i in range(2):  # undo the permutation: loom's pairing read as llama.cpp's
            k = wrong[f"blk.{i}.attn_k.weight"]
            wrong[f"blk.{i}.attn_k.weight"] = k.view(2, -1, 2, 64).transpose(1, 2).reshape(k.shape)
            assert torch.equal(_permute_rope(wrong[f"blk.{i}.attn_k.weight"], 2), k)
        off = (_forward(wrong, meta, "llama", ids) - ours).abs().max().item()
        assert off > 20 * err, (off, err)


def test_a_char_tokenizer_is_written_as_byte_level_bpe(runs, tmp_path):
    """Every character a token by its byte-level text; a character of several bytes joined by merges of its
    bytes (é: 'Ã' + '©'), end-of-text a control token after them."""
    reader = _export(runs["char"], tmp_path / "out", "f16")
    _, _, tok, _, _ = load_run(runs["char"], torch.device("cpu"))
    tokens = _value(reader, "tokenizer.ggml.tokens")
    assert tokens[: len(tok.chars)] == [_byte_text(c) for c in tok.chars]
    assert tokens[tok.eot_id] == "<|endoftext|>" and _byte_text(" ") == "Ġ" and _byte_text("\n") == "Ċ"
    assert "é" in tok.chars and "Ã ©" in _value(reader, "tokenizer.ggml.merges")
    assert len(tokens) == tok.vocab_size


def test_a_chat_run_carries_its_template_and_its_tokens_as_control_tokens(sft, tmp_path, capsys):
    """An SFT run on chat data (document-masked, positions restarting in each document): the chat template goes
    along as tokenizer.chat_template, the chat tokens are control tokens, and the export says that llama.cpp
    attends over the whole sequence."""
    from sftkit import _sft_args

    from loom.data.chat import chat_template_of

    assert main([*_sft_args(sft, "sft-gguf"), "--train.steps=2"]) == 0
    run = sft / "runs" / "sft-gguf"
    capsys.readouterr()
    reader = _export(run, tmp_path / "out", "q8_0")
    assert "data.doc_mask: llama.cpp attends over the whole sequence" in capsys.readouterr().out
    _, _, tok, meta, _ = load_run(run, torch.device("cpu"))
    assert _value(reader, "tokenizer.chat_template") == chat_template_of(tok, meta).jinja()
    tokens, types = _value(reader, "tokenizer.ggml.tokens"), _value(reader, "tokenizer.ggml.token_type")
    assert tok.specials and all(types[tokens.index(t)] == gguf.TokenType.CONTROL for t in tok.specials)


# ------------------------------------------------------------------------------------------ bad input


def test_a_family_llama_cpp_has_no_mapping_for_is_refused_before_reading_weights(runs, tmp_path):
    """A moe run (its config, no checkpoint at all): the family is named, not the missing checkpoint."""
    from loom.config import load_config, to_toml

    run = tmp_path / "moe"
    run.mkdir()
    shutil.copytree(runs["gpt2"] / "tokenizer", run / "tokenizer")
    cfg = load_config(None, ["--model.family=moe", "--model.n_experts=4", "--model.moe_top_k=1"])
    (run / "config.toml").write_text(to_toml(cfg))
    with pytest.raises(LoomError, match="model.family=moe builds"):
        check_run(run)
    assert main(["export", str(run), "--format", "gguf", "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True}, "model.qk_norm=true"),
        ({"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qkv_bias": True}, "model.qkv_bias=true"),
        ({"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "rope_type": "yarn"}, "rope_type='yarn'"),
        ({"activation": "gelu"}, "model.activation='gelu'"),
        ({"pos": "rope"}, "model.norm='layernorm'"),  # half llama: no architecture of llama.cpp's
        ({"ffn_hidden": 96}, "model.ffn_hidden=96"),
    ],
)
def test_a_model_shape_llama_cpp_cannot_read_is_named(changes, named):
    with pytest.raises(LoomError, match=named.replace("(", r"\(").replace(")", r"\)")):
        architecture(GPTConfig(vocab_size=10, **changes))


def test_tokenizers_llama_cpp_cannot_read_are_named(text_maker):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from loom.data.tokenizers import HFTokenizer

    with pytest.raises(LoomError, match="no tokenizer"):
        vocab_of(None, 10)
    with pytest.raises(LoomError, match="byte-level BPE tokenizers; this run's is sentencepiece"):
        vocab_of(SimpleNamespace(kind="sentencepiece"), 10)
    word = Tokenizer(models.WordLevel({"a": 0, "<|endoftext|>": 1}, unk_token="a"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(LoomError, match="byte-level BPE.*WordLevel"):
        vocab_of(HFTokenizer(word), 10)
    bpe = HFTokenizer.train([text_maker(5000)], 300)
    vocab = vocab_of(bpe, 320)  # rows past the tokenizer: unused placeholders
    assert vocab.tokens[300:] == [f"[PAD{i}]" for i in range(300, 320)] and vocab.pre == "gpt-2"
    assert set(vocab.types[300:]) == {gguf.TokenType.UNUSED}
    with pytest.raises(LoomError, match="300 ids but the model only 299"):
        vocab_of(bpe, 299)
    spaced = Tokenizer.from_str(bpe.tok.to_str())
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    with pytest.raises(LoomError, match="add_prefix_space"):
        vocab_of(HFTokenizer(spaced), 320)
    other = bpe.tok
    other.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\w+|\s"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    with pytest.raises(LoomError, match=r"splits text by '\\\\w\+\|\\\\s'"):
        vocab_of(HFTokenizer(other), 320)


def test_gguf_type_belongs_to_format_gguf(runs, tmp_path, capsys):
    out = tmp_path / "o"
    assert (
        main(["export", str(runs["gpt2"]), "--format", "hf", "--gguf-type", "q8_0", "--out", str(out)]) == 2
    )
    assert "--gguf-type is an option of --format gguf" in capsys.readouterr().err
    assert not out.exists()

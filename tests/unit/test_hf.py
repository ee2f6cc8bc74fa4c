"""GPT-2 export and import, compared against transformers' own GPT2LMHeadModel on CPU: logits of the same
weights must agree to float32 rounding, and transformers' tokenizer loaded from the export must give
loom's token ids."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_args

from loom.cli import main
from loom.config import Config
from loom.errors import LoomError
from loom.metrics import read_jsonl
from loom.model import hf
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.runs import load_run

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'loom[hf]'")

TOL = 1e-5  # float32: both sides compute the same ops in a different grouping
TINY = tiny_args({"train.batch_size": 4, "train.eval_batches": 1, "optim.warmup_steps": 1})


def load_gpt2(directory: str | Path, block_size: int | None = None, dropout: float = 0.0) -> GPT:
    """A loom GPT holding the GPT-2 model saved in `directory` (another architecture is refused)."""
    kind = hf.read_hf_config(directory).get("model_type")
    if kind != "gpt2":
        raise LoomError(
            f"'{directory}' describes a '{kind}' model; load_gpt2 reads GPT-2 only",
            hint="use loom.model.hf.load_hf for every supported architecture",
        )
    return hf.load_hf(directory, block_size, dropout)


def tiny_gpt(bias: bool, vocab: int = 100, activation: str = "gelu_tanh") -> GPT:
    torch.manual_seed(0)
    m = GPT(
        GPTConfig(
            vocab_size=vocab, n_layer=2, n_head=2, n_embd=32, block_size=16, bias=bias, activation=activation
        )
    ).eval()
    with torch.no_grad():  # non-zero biases and LayerNorm affines, so a mix-up would show
        for name, p in m.named_parameters():
            if name.endswith("bias") or ".ln_" in name or name.startswith("ln_f"):
                p.add_(torch.randn_like(p) * 0.3)
    return m


def random_gpt2(tmp_path, vocab=64, n_positions=48, n_embd=48, n_head=3, activation_function="gelu_new"):
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=2,
        n_head=n_head,
        bos_token_id=0,
        eos_token_id=0,
        activation_function=activation_function,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # the default init has zero biases; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    d = tmp_path / "gpt2"
    model.save_pretrained(d)
    return model, d


@pytest.mark.parametrize("bias,activation", [(False, "gelu_tanh"), (True, "gelu_tanh"), (False, "gelu")])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, bias, activation):
    m = tiny_gpt(bias, activation=activation)
    assert hf.export_hf(m, tmp_path / "out") == [
        "no tokenizer files: the run was trained on token ids without a known tokenizer"
    ]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == "GPT2LMHeadModel" and theirs.config.vocab_size == 100  # unpadded
    assert theirs.config.activation_function == {"gelu_tanh": "gelu_new", "gelu": "gelu"}[activation]
    x = torch.randint(0, 100, (3, 16))
    with torch.no_grad():
        ours, ref = m(x), theirs(x).logits
    assert ours.shape[-1] == 128 and ref.shape[-1] == 100
    diff = (ours[..., :100] - ref).abs().max().item()
    print(f"export max abs logits diff (bias={bias}): {diff:.3g}")
    assert diff < TOL


def test_import_matches_transformers_logits(tmp_path):
    ref, d = random_gpt2(tmp_path, vocab=90)
    ours = load_gpt2(d).eval()
    assert ours.cfg == GPTConfig(vocab_size=90, n_layer=2, n_head=3, n_embd=48, block_size=48, bias=True)
    x = torch.randint(0, 90, (2, 48))
    with torch.no_grad():
        a, b = ours(x), ref(x).logits
    diff = (a[..., :90] - b).abs().max().item()
    print(f"import max abs logits diff: {diff:.3g}")
    assert diff < TOL
    # Padding rows (90 -> 128) are the mean real row: each padding id gets at most 1/V of the probability
    p_pad = F.softmax(a, -1)[..., 90:]
    assert (p_pad <= 1 / 90 + 1e-6).all()
    # Exported again, the model is the one transformers saved
    hf.export_hf(ours, tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert (again(x).logits - b).abs().max().item() < TOL


def test_import_exact_gelu_model(tmp_path):
    ref, d = random_gpt2(tmp_path, activation_function="gelu")
    ours = load_gpt2(d).eval()
    assert ours.cfg.activation == "gelu"
    x = torch.randint(0, 64, (2, 48))
    with torch.no_grad():
        assert (ours(x)[..., :64] - ref(x).logits).abs().max().item() < TOL


def test_import_crops_positions_to_block_size(tmp_path):
    ref, d = random_gpt2(tmp_path)
    ours = load_gpt2(d, block_size=16).eval()
    assert ours.wpe.weight.shape == (16, 48)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert (ours(x) - ref(x).logits).abs().max().item() < TOL
    with pytest.raises(LoomError, match="model.block_size=64 exceeds .* n_positions=48"):
        load_gpt2(d, block_size=64)


def test_safetensors_checkpoint_is_read_the_same_way_as_a_bin(tmp_path):
    ref, d = random_gpt2(tmp_path)
    sd = hf.read_hf_weights(d)
    torch.save({"transformer." + k: v for k, v in sd.items()}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    other = hf.read_hf_weights(tmp_path)
    assert set(other) == set(sd) and all(torch.equal(other[k], sd[k]) for k in sd)


def test_init_from_trains_from_the_imported_weights(tmp_path, char_data):
    """`loom train --model.init_from=hf:DIR`: the first step's loss is transformers' loss on that batch."""
    from loom.data.loader import ShardLoader

    ref, d = random_gpt2(tmp_path, vocab=64)  # 64 = padded vocab: no padding, so losses are comparable
    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=ft",
        "--train.steps=2",
        f"--model.init_from=hf:{d}",
        *[a for a in TINY if "n_" not in a],
    ]  # the shape comes from d
    assert main(args) == 0
    cfg, model, _, _, _ = load_run(tmp_path / "ft", torch.device("cpu"))
    assert (cfg.model.n_embd, cfg.model.n_head, cfg.model.bias, cfg.model.vocab_size) == (48, 3, True, 64)
    first = next(r for r in read_jsonl(tmp_path / "ft" / "metrics.jsonl") if "loss" in r)
    x, y = ShardLoader(char_data, 4, 32, seed=cfg.run.seed).next_batch()
    with torch.no_grad():
        want = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).item()
    assert first["loss"] == pytest.approx(want, abs=1e-5)
    assert main([*args, "--force", "--model.n_layer=3"]) == 2  # an explicit conflicting shape is refused


def test_export_cli_with_tokenizer(tmp_path, char_data, capsys):
    assert (
        main(
            [
                "train",
                f"--data.path={char_data}",
                f"--run.dir={tmp_path}",
                "--run.name=r",
                "--train.steps=2",
                *TINY,
            ]
        )
        == 0
    )
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "r"), "--format", "hf", "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    _, model, tok, _, _ = load_run(tmp_path / "r", torch.device("cpu"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    their_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "The one of them said"
    ids = their_tok.encode(text)
    assert ids == tok.encode(text) and their_tok.decode(ids) == text
    assert their_tok.eos_token_id == tok.eot_id == theirs.config.eos_token_id
    x = torch.tensor([[tok.eot_id, *ids]])
    with torch.no_grad():
        diff = (model(x)[..., : tok.vocab_size] - theirs(x).logits).abs().max().item()
    with capsys.disabled():
        print(f"export CLI max abs logits diff: {diff:.3g}")
    assert diff < TOL
    # raw safetensors: loom's names, the tied head left out, the shape in the metadata
    from safetensors import safe_open

    assert (
        main(["export", str(tmp_path / "r"), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
    )
    with safe_open(str(tmp_path / "st" / "model.safetensors"), "pt") as f:
        assert "blocks.0.attn.q_proj.weight" in f.keys() and "lm_head.weight" not in f.keys()
        assert json.loads(f.metadata()["loom_model"])["n_embd"] == 32
        assert torch.equal(f.get_tensor("wte.weight"), model.wte.weight)
    assert main(["export", str(tmp_path / "r"), "--format", "hf", "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_byte_level_bpe_exports_gpt2_vocab_and_merges(tmp_path, text_maker):
    make_text = text_maker
    from loom.data.tokenizers import HFTokenizer

    tok = HFTokenizer.train([make_text(20000)], 400)
    assert hf.write_tokenizer(tok, tmp_path, 64) == []
    (tmp_path / "tokenizer.json").unlink()  # only GPT-2's classic files left
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = make_text(400, seed=3) + "<|endoftext|> And then."
    ours = tok.encode(make_text(400, seed=3)) + [tok.eot_id] + tok.encode(" And then.")
    assert theirs.encode(text) == ours and theirs.decode(ours) == text


# ------------------------------------------------------------------------------------------ bad input


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(LoomError, match="has no config.json"):
        load_gpt2(tmp_path)
    cfg = Config()
    cfg.model.init_from = f"hf:{tmp_path}"
    with pytest.raises(LoomError, match="has no config.json"):
        hf.apply_init_from(cfg)
    with pytest.raises(LoomError, match="is not a directory"):
        hf.read_hf_config(tmp_path / "missing")
    cfg.model.init_from = str(tmp_path)
    with pytest.raises(LoomError, match="hf:DIR"):
        hf.apply_init_from(cfg)


@pytest.mark.parametrize(
    "key,value",
    [
        ("activation_function", "relu"),
        ("tie_word_embeddings", False),
        ("n_inner", 100),
        ("scale_attn_by_inverse_layer_idx", True),
        ("model_type", "llama"),
    ],
)
def test_configs_loom_cannot_represent_are_named(tmp_path, key, value):
    _, d = random_gpt2(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoomError, match=key if key != "model_type" else "GPT-2 only"):
        load_gpt2(d)


def test_export_refuses_a_field_gpt2_has_no_setting_for():
    @dataclasses.dataclass
    class RotaryConfig(GPTConfig):
        rope: bool = False

    hf.check_exportable(RotaryConfig(vocab_size=10))  # at the default: representable
    with pytest.raises(LoomError, match="model.rope=True has no GPT-2 equivalent"):
        hf.check_exportable(RotaryConfig(vocab_size=10, rope=True))


def test_explicit_shape_conflicting_with_init_from(tmp_path):
    _, d = random_gpt2(tmp_path)
    cfg = Config()
    cfg.model.init_from = f"hf:{d}"
    cfg.model.n_layer, cfg.model.block_size = 5, 32
    with pytest.raises(LoomError, match="model.n_layer=5 conflicts with model.init_from"):
        hf.apply_init_from(cfg, {"model.n_layer"})
    hf.apply_init_from(cfg, set())  # not set by the user: taken from config.json
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.bias) == (2, 48, True)

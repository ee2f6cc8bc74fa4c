"""A vocabulary that is not a multiple of 64 (66, padded to 128): the padding ids take no probability, so a
model imported from transformers, exported to it, and imported again gives transformers' own cross-entropy
(compared against GPT2LMHeadModel and LlamaForCausalLM built here with random weights, to float32
rounding), training from it starts at transformers' loss, and sampling never draws a padding id."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.cli import main
from loom.metrics import read_jsonl
from loom.model import hf
from loom.model.gpt.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'loom[hf]'")

VOCAB, TOL = 66, 1e-5


def random_hf(tmp_path, kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.1,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(cfg)
    d = tmp_path / kind
    model.eval().save_pretrained(d)
    return model, d


def hf_loss(model, x, y) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_import_export_round_trip_give_transformers_loss(tmp_path, kind):
    theirs, d = random_hf(tmp_path, kind)
    xy = torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(1))
    x, y = xy[:, :-1], xy[:, 1:]
    want = hf_loss(theirs, x, y)
    ours = hf.load_hf(d).eval()
    assert ours.cfg.padded_vocab == 128
    with torch.no_grad():
        got = ours(x, y).item()
        probs = ours(x).softmax(-1)
    print(f"{kind} vocab {VOCAB}: loom {got:.4f} transformers {want:.4f}")
    assert got == pytest.approx(want, abs=TOL)  # import
    assert bool((probs[..., VOCAB:] == 0).all())  # no mass on the padding ids
    hf.export_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf_loss(back, x, y) == pytest.approx(want, abs=TOL)  # export
    again = hf.load_hf(tmp_path / "out").eval()
    with torch.no_grad():
        assert again(x, y).item() == pytest.approx(want, abs=TOL)  # round trip


def test_init_from_trains_from_transformers_loss_with_an_unpadded_vocabulary(tmp_path, char_data):
    """`loom train --model.init_from=hf:DIR` with vocabulary 66: the first step's loss is transformers'."""
    from loom.data.loader import ShardLoader

    theirs, d = random_hf(tmp_path, "gpt2")
    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=ft",
        "--train.steps=1",
        f"--model.init_from=hf:{d}",
        "--model.block_size=32",
        "--train.batch_size=4",
        "--train.eval_batches=1",
        "--train.sample_every=0",
        "--train.eval_every=0",
        "--optim.warmup_steps=1",
        "--train.log_every=1",
        "--train.device=cpu",
    ]
    assert main(args) == 0
    first = next(r for r in read_jsonl(tmp_path / "ft" / "metrics.jsonl") if "loss" in r)
    x, y = ShardLoader(char_data, 4, 32, seed=1337).next_batch()
    assert first["loss"] == pytest.approx(hf_loss(theirs, x, y), abs=TOL)


def test_bf16_logits_and_sampling_never_reach_padding():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=32, block_size=16)).eval()
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(x)
    assert bool((logits[..., VOCAB:] == torch.finfo(logits.dtype).min).all())
    assert bool((logits.float().softmax(-1)[..., VOCAB:] == 0).all())
    from loom.generate import sample_next

    # sampling from the raw (uncropped) logits at a high temperature still never draws a padding id
    draws = sample_next(
        m(x)[:, -1].repeat(500, 1), temperature=5.0, generator=torch.Generator().manual_seed(0)
    )
    assert int(draws.max()) < VOCAB


def test_char_export_imports_again_on_its_own_data(tmp_path, char_data):
    """train(char) -> export -> init_from=hf:EXPORT on the same data: the export's tokenizer.json is the
    data's char tokenizer (it was refused: "66 of its 66 tokens have another id"), and training starts from
    the exported model (loss of the first step = the exported model's loss in transformers)."""
    from loom.data.loader import ShardLoader

    common = [
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--train.steps=1",
        "--model.n_layer=1",
        "--model.n_head=2",
        "--model.n_embd=32",
        "--model.block_size=32",
        "--train.batch_size=4",
        "--train.eval_batches=1",
        "--train.sample_every=0",
        "--train.eval_every=0",
        "--optim.warmup_steps=1",
        "--train.log_every=1",
        "--train.device=cpu",
        "--precision.dtype=fp32",  # compared with transformers' fp32 loss (auto is bf16 on a bf16 CPU)
    ]
    assert main(["train", "--run.name=a", *common]) == 0
    assert main(["export", str(tmp_path / "a"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    rest = [a for a in common if not a.startswith("--model.n_")]
    assert main(["train", "--run.name=b", f"--model.init_from=hf:{tmp_path / 'hf'}", *rest]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    first = next(r for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "loss" in r)
    x, y = ShardLoader(char_data, 4, 32, seed=1337).next_batch()
    assert first["loss"] == pytest.approx(hf_loss(theirs, x, y), abs=TOL)

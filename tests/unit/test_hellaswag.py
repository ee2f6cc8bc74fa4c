"""HellaSwag scoring, compared against (1) a GPT built by hand so that the right answer is known, and
(2) a direct per-example computation through loom's own loss (model(x, targets) with the context's
targets masked by -1), on synthetic JSONL in the official layout (ctx, endings, label)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from loom.cli import main
from loom.data.tokenizers import CharTokenizer
from loom.errors import LoomError
from loom.eval import hellaswag as hs
from loom.model.gpt.gpt import GPT, GPTConfig

TOK = CharTokenizer(sorted(set("abcdefgh xyz.")))


@torch.no_grad()
def ending_losses(model: torch.nn.Module, rows: list[list[int]], n_ctx: list[int], device) -> tuple:
    """The oracle loom's scoring is checked against: (sum, mean) cross-entropy of each row's ending tokens given what precedes them, shape (4,) each."""
    T = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T - 1)
    for i, (r, c) in enumerate(zip(rows, n_ctx, strict=True)):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, c - 1 : len(r) - 1] = 1.0  # target position t predicts token t + 1: the ending's tokens
    tokens, mask = tokens.to(device), mask.to(device)
    logits = model(tokens[:, :-1]).float()  # (4, T - 1, V)
    loss = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")  # (4, T - 1)
    total = (loss * mask).sum(1)
    return total, total / mask.sum(1)


def write_jsonl(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples), encoding="utf-8")
    return path


def favours(token: int, alpha: float = 10.0, block_size: int = 32) -> GPT:
    """A GPT whose every prediction is `token` with logit alpha (all other logits 0): the blocks add nothing
    (zero output projections), ln_f maps any input to its bias b, and only wte[token] is aligned with b."""
    cfg = GPTConfig(
        vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=block_size, bias=True
    )
    m = GPT(cfg).eval()
    with torch.no_grad():
        for name in ("attn.o_proj", "mlp.down_proj"):
            layer = m.blocks[0].get_submodule(name)
            layer.weight.zero_()
            layer.bias.zero_()
        b = torch.randn(16)
        m.ln_f.weight.zero_()
        m.ln_f.bias.copy_(b)
        m.wte.weight.zero_()
        m.wte.weight[token] = alpha * b / b.dot(b)
    return m


def test_hand_built_model_knows_the_answer():
    a, b = TOK.stoi["a"], TOK.stoi["b"]
    m = favours(a)
    rows, n_ctx = hs.encode_example({"ctx": "xyz.", "endings": ["a"] * 4, "label": 0}, TOK, 32)
    assert rows[0] == [TOK.eot_id, *TOK.encode("xyz. a")] and n_ctx == [5] * 4
    total, mean = ending_losses(m, [TOK.encode(" aab")], [1], "cpu")
    others = [0.0] * (TOK.vocab_size - 1)  # the padding ids (up to 64) take no probability
    high, low = (
        torch.logsumexp(torch.tensor([10.0] + others), 0).item(),
        -torch.log_softmax(torch.tensor([10.0] + others), 0)[0].item(),
    )  # loss of any other token, and of `a`
    assert m.cfg.padded_vocab == 64 and b != a
    assert total.item() == pytest.approx(2 * low + high, rel=1e-5)  # " " is context; a, a, b are scored
    assert mean.item() == pytest.approx(total.item() / 3)

    # "aaaaaaaaab" has the lowest mean loss; "b" (2 tokens: " b") the lowest total loss.
    endings = ["bbb", "aaaaaaaaab", "b", "bb"]
    rng = random.Random(0)
    examples = [
        {"ctx": "".join(rng.choice("xyz ") for _ in range(rng.randint(0, 9))), "endings": endings, "label": 1}
        for _ in range(6)
    ]
    assert hs.evaluate(m, TOK, examples, "cpu") == {"n": 6, "acc": 0.0, "acc_norm": 1.0}
    examples[0]["label"] = examples[1]["label"] = 2
    assert hs.evaluate(m, TOK, examples, "cpu") == {"n": 6, "acc": 2 / 6, "acc_norm": 4 / 6}
    same_length = [{"ctx": "x", "endings": ["abc", "bbb", "aaa", "aba"], "label": 2}]
    assert hs.evaluate(m, TOK, same_length, "cpu") == {"n": 1, "acc": 1.0, "acc_norm": 1.0}


def test_losses_equal_a_direct_computation_through_the_models_own_loss(tmp_path):
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=24)).eval()
    rng = random.Random(1)

    def words(n: int) -> str:
        return " ".join("".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 5))) for _ in range(n))

    examples = [
        {
            "ctx": words(rng.randint(0, 6)),
            "endings": [words(rng.randint(1, 6)) for _ in range(4)],
            "label": rng.randrange(4),
        }
        for _ in range(12)
    ]
    path = write_jsonl(tmp_path / "hs.jsonl", examples)
    assert hs.read_examples(path) == examples
    correct, correct_norm = 0, 0
    for ex in examples:
        sums, means = [], []
        for ending in ex["endings"]:
            ctx, end = [TOK.eot_id, *TOK.encode(ex["ctx"])], TOK.encode(" " + ending)[:24]
            full = (ctx + end)[-25:]  # block_size + 1 tokens at most, context cut from the left
            n_end = len(end)
            x = torch.tensor([full[:-1]])
            y = torch.tensor([[-1] * (len(full) - 1 - n_end) + full[-n_end:]])
            with torch.no_grad():
                mean = m(x, y).item()  # mean over the non-ignored targets: the ending's tokens
            sums.append(mean * n_end)
            means.append(mean)
        total, mean = ending_losses(m, *hs.encode_example(ex, TOK, 24), "cpu")
        assert total.tolist() == pytest.approx(sums, rel=1e-5) and mean.tolist() == pytest.approx(
            means, rel=1e-5
        )
        correct += min(range(4), key=sums.__getitem__) == ex["label"]
        correct_norm += min(range(4), key=means.__getitem__) == ex["label"]
    r = hs.evaluate(m, TOK, examples, "cpu")
    assert r == {"n": 12, "acc": correct / 12, "acc_norm": correct_norm / 12}
    # Ranks take interleaved examples; summed counts equal the single-process figures.
    parts = [hs.evaluate(m, TOK, examples, "cpu", rank, 3) for rank in range(3)]
    assert sum(p["n"] for p in parts) == 12
    assert sum(p["acc"] * p["n"] for p in parts) == pytest.approx(correct)


def test_long_endings_keep_their_start_and_one_context_token():
    ex = {"ctx": "xyz " * 10, "endings": ["a" * 40, "b", "ab", "c"], "label": 0}
    rows, n_ctx = hs.encode_example(ex, TOK, 16)
    assert len(rows[0]) == 17 and n_ctx[0] == 1 and rows[0][1:] == TOK.encode(" " + "a" * 40)[:16]
    assert all(len(r) <= 17 for r in rows) and rows[1][-2:] == TOK.encode(" b")


@pytest.mark.parametrize(
    "line,match",
    [
        ('{"ctx": "x", "endings": ["a", "b", "c"], "label": 0}', "4 non-empty texts"),
        ('{"endings": ["a", "b", "c", "d"], "label": 0}', "needs 'ctx'"),
        ('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 4}', "label 4"),
        ('{"ctx": "x", "endings": ["a", "b", "c", "d"]}', "label None"),
        ("not json", "is not JSON"),
        ("[1, 2]", "needs 'ctx'"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, match):
    good = '{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": "2"}'  # the official file has "2"
    (tmp_path / "hs.jsonl").write_text(good + "\n" + line + "\n")
    with pytest.raises(LoomError, match=f"hs.jsonl:2 .*{match}|hs.jsonl:2 {match}"):
        hs.read_examples(tmp_path / "hs.jsonl")
    assert hs.read_examples(tmp_path / "hs.jsonl", limit=1)[0]["label"] == 2
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(LoomError, match="holds no examples"):
        hs.read_examples(tmp_path / "empty.jsonl")


def test_cli_on_a_trained_run(tmp_path, char_data, capsys):
    from loom.data.tokenizers import load_tokenizer
    from loom.runs import load_run

    assert (
        main(
            [
                "train",
                f"--data.path={char_data}",
                f"--run.dir={tmp_path}",
                "--run.name=r",
                "--train.steps=2",
                "--model.n_layer=1",
                "--model.n_head=2",
                "--model.n_embd=16",
                "--model.block_size=32",
                "--train.batch_size=4",
                "--train.eval_batches=1",
                "--train.sample_every=0",
                "--train.sample_tokens=4",
                "--train.device=cpu",
            ]
        )
        == 0
    )
    tok = load_tokenizer(
        tmp_path / "r" / "tokenizer", json.loads((tmp_path / "r/tokenizer/meta.json").read_text())
    )
    words = "the of and to in is that it for as with was on be by at this from".split()
    rng = random.Random(2)
    examples = [
        {
            "ctx": " ".join(rng.choices(words, k=8)).capitalize(),
            "endings": [" ".join(rng.choices(words, k=rng.randint(2, 6))) + "." for _ in range(4)],
            "label": rng.randrange(4),
        }
        for _ in range(10)
    ]
    path = write_jsonl(tmp_path / "hs.jsonl", examples)
    capsys.readouterr()
    assert (
        main(["eval", str(tmp_path / "r"), "--task", "hellaswag", "--data", str(path), "--device", "cpu"])
        == 0
    )
    out = capsys.readouterr().out
    _, model, _, _, _ = load_run(tmp_path / "r", torch.device("cpu"))
    r = hs.evaluate(model, tok, examples, "cpu")
    assert "10 examples" in out and f"acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f}" in out
    assert main(["eval", str(tmp_path / "r"), "--task", "hellaswag"]) == 2
    assert "needs --data" in capsys.readouterr().err


def test_an_example_the_tokenizer_cannot_encode_is_refused_at_start_with_its_line(
    tmp_path, char_data, capsys
):
    """A character outside a char run's vocabulary failed only at the first evaluation (after training had
    started), without the line; now at start, naming the file and line, in training and in `loom eval`."""
    good = {"ctx": "the cat", "endings": ["sat", "ran", "ate", "hid"], "label": 0}
    path = write_jsonl(
        tmp_path / "hs.jsonl", [good, good, {**good, "endings": ["sat", "ran", "caf\u00e9", "hid"]}]
    )
    tok = CharTokenizer(sorted(set("the cat sran hid caf")))
    with pytest.raises(LoomError, match=r"hs.jsonl:3: the ending 2 cannot be encoded: character '\u00e9'"):
        hs.read_examples(path, tokenizer=tok)
    assert len(hs.read_examples(path, limit=2, tokenizer=tok)) == 2
    run = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--model.n_layer=1",
        "--model.n_head=2",
        "--model.n_embd=16",
        "--model.block_size=32",
        "--train.batch_size=4",
        "--train.eval_batches=1",
        "--train.sample_every=0",
        "--train.device=cpu",
        "--train.steps=2",
    ]
    assert main([*run, "--run.name=bad", "--train.hellaswag_every=1", f"--train.hellaswag_data={path}"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3: the ending 2 cannot be encoded" in err and err.count("loom: error:") == 1, err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()  # refused before the first step
    assert main([*run, "--run.name=ok"]) == 0
    capsys.readouterr()
    assert (
        main(["eval", str(tmp_path / "ok"), "--task", "hellaswag", "--data", str(path), "--device", "cpu"])
        == 2
    )
    assert f"{path}:3: the ending 2 cannot be encoded" in capsys.readouterr().err

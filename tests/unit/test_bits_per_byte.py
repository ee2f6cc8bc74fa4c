"""Bits per byte (loom.eval.val_loss): against bytes counted by hand from the validation windows' text, a char
and a BPE tokenization of the same text giving the same bits for the same per-byte probability, and a run
recording val_bpb in metrics.jsonl, printing it in `loom eval` and drawing it in `loom plot`."""

from __future__ import annotations

import json
import math

import pytest

from loom.data.loader import ValSet, read_meta
from loom.data.prepare import prepare
from loom.data.tokenizers import load_tokenizer
from loom.eval.val_loss import bits_per_byte, tokens_per_byte


def _valset(data, block=16):
    return ValSet(data, block, 1000), load_tokenizer(data, read_meta(data))


def test_tokens_per_byte_counts_the_decoded_targets(char_data):
    vs, tok = _valset(char_data)
    rows = vs.windows.rows(vs.ids)[:, 1:].tolist()
    by_hand = sum(map(len, rows)) / sum(len(tok.decode(r).encode("utf-8")) for r in rows)
    assert tokens_per_byte(vs, tok) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(1.0)  # ASCII text, one character a token
    assert bits_per_byte(math.log(2), 1.0) == pytest.approx(1.0)


def test_bpe_and_char_agree_on_bits_per_byte(tmp_path):
    """A model that spends b bits per byte spends b x bytes/token bits per token: bpb undoes the tokenizer."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("the cat sat on the mat. é naïve café.\n" * 400, encoding="utf-8")
    ratios = {}
    for kind in ("char", "bpe"):
        prepare(
            [docs],
            tmp_path / kind,
            tokenizer=kind,
            vocab_size=300,
            val_fraction=0.5,
            split_mode="tail",
            seed=0,
        )
        ratios[kind] = tokens_per_byte(*_valset(tmp_path / kind, block=32))
    assert ratios["bpe"] < ratios["char"] < 1.0  # é and ï: two bytes, one character
    for kind, tpb in ratios.items():  # 1.5 bits per byte, expressed per token and back
        assert bits_per_byte(1.5 * math.log(2) / tpb, tpb) == pytest.approx(1.5), kind


def test_run_records_bpb_and_eval_and_plot_show_it(char_data, tmp_path, capsys):
    from loom.cli import main

    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=r",
        "--train.steps=2",
        "--model.n_layer=1",
        "--model.n_head=2",
        "--model.n_embd=16",
        "--model.block_size=16",
        "--train.batch_size=4",
        "--train.eval_batches=2",
        "--train.sample_every=0",
        "--train.device=cpu",
    ]
    assert main(args) == 0
    recs = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in recs if "val_loss" in r][-1]
    assert val["val_bpb"] == pytest.approx(val["val_loss"] / math.log(2), rel=1e-6)  # ASCII char data
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "r"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"bits per byte {val['val_bpb']:.4f}" in out
    assert main(["plot", str(tmp_path / "r"), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0

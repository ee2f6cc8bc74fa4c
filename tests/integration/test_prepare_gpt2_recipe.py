"""configs/gpt2_124m.toml from Parquet shards prepared with GPT-2-style vocabulary files (issue 19).

Compared against: build-nanogpt's arithmetic (524,288 tokens per step = 512 sequences; accumulation
512 / (micro-batch 64 x processes) = 524,288 / (64 x 1024 x processes)) printed at start, and the tokenizers
library's own ids for the encoder.json + vocab.bpe pair.
"""

from __future__ import annotations

import json

from loom.cli import main
from loom.data.encode import byte_decoder
from loom.data.tokenizers import HFTokenizer, load_given_tokenizer
from loom.metrics import read_jsonl

TEXTS = [
    f"The {i}th document of the web says: numbers {i * 37} and words, words, words.\n" * 3 for i in range(300)
]


def gpt2_files(folder, tok: HFTokenizer) -> None:
    """OpenAI's GPT-2 file layout (encoder.json + vocab.bpe) for a byte-level BPE."""
    raw = json.loads(tok.tok.to_str())["model"]
    folder.mkdir()
    (folder / "encoder.json").write_text(json.dumps(raw["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["merges"]]
    (folder / "vocab.bpe").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    assert len(byte_decoder()) == 256


def test_gpt2_recipe_from_parquet_tiny_shapes(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "fineweb"
    src.mkdir()
    for i in range(2):  # two parquet files, several row groups each
        pq.write_table(
            pa.table({"text": TEXTS[i::2], "id": list(range(150))}), src / f"00{i}.parquet", row_group_size=40
        )
    gpt2 = tmp_path / "gpt2"
    gpt2_files(gpt2, HFTokenizer.train(TEXTS, 400, "gpt2", "tokenizers"))
    given = load_given_tokenizer(gpt2)
    assert given.encode(TEXTS[3]) == HFTokenizer.train(TEXTS, 400, "gpt2", "tokenizers").encode(TEXTS[3])
    data = tmp_path / "fineweb10B"
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(src),
                "--glob",
                "*.parquet",
                "--out",
                str(data),
                "--tokenizer",
                str(gpt2),
                "--val-fraction",
                "0.05",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    meta = json.loads((data / "meta.json").read_text())
    assert meta["documents"] == 300 and meta["tokenizer"]["kind"] == "tokenizer.json"
    capsys.readouterr()
    # tiny shapes (the vocabulary from the data, fp32): the batch arithmetic of the recipe stays as it is
    tiny = [
        "--model.vocab_size=0",
        "--precision.dtype=fp32",
        "--model.n_layer=1",
        "--model.n_head=1",
        "--model.n_embd=16",
        "--model.block_size=8",
        "--train.compile=false",
        "--train.steps=2",
        "--train.eval_every=0",
        "--train.eval_batches=1",
        "--train.sample_every=0",
        "--train.sample_tokens=2",
        "--train.log_every=1",
        "--train.device=cpu",
    ]
    hellaswag = tmp_path / "hellaswag_val.jsonl"  # the recipe scores HellaSwag in the loop (every 250 steps)
    hellaswag.write_text(
        "".join(
            json.dumps({"ctx": t[:40], "endings": [t[40:60], t[60:70], "x", t[:5]], "label": 0}) + "\n"
            for t in TEXTS[:5]
        )
    )
    assert (
        main(
            [
                "train",
                "configs/gpt2_124m.toml",
                f"--data.path={data}",
                f"--run.dir={tmp_path}",
                "--run.name=r",
                f"--train.hellaswag_data={hellaswag}",
                *tiny,
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    accum = 524_288 // (64 * 1024 * 1)
    assert f"grad accum {accum} |" in out.out + out.err
    recs = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss" in r] == [1, 2]
    assert [(r["step"], 0 <= r["hellaswag_acc"] <= 1) for r in recs if "hellaswag_acc" in r] == [(2, True)]

"""The chat SFT tests' shared setup: a tiny char-level base run and conversations prepared with its tokenizer
(test_sft.py, test_sft_lineage.py)."""

from __future__ import annotations

import json
import random

from loom.cli import main

WORDS = "apple river stone cloud green house music paper light table".split()
MODEL = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64"]
# fp32, not the default auto (bf16 on a CPU with bf16 units): the tests compare losses exactly
QUIET = [
    "--train.eval_every=0",
    "--train.sample_every=0",
    "--train.eval_batches=1",
    "--train.device=cpu",
    "--precision.dtype=fp32",
]


def _conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        w = rng.sample(WORDS, rng.randint(2, 4))
        msgs = [{"role": "user", "content": "reverse: " + " ".join(w)}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "be brief"})
        msgs.append({"role": "assistant", "content": " ".join(reversed(w))})
        if i % 4 == 0:  # a second turn
            msgs += [{"role": "user", "content": "again"}, {"role": "assistant", "content": w[0]}]
        out.append({"messages": msgs})
    return out


def make_char_base(root, text: str, model: list[str], *train: str) -> None:
    """`text` as root/base.txt, prepared with a char tokenizer into root/text, and a base run root/runs/base of
    `model` trained on it (`train`: its steps and the like)."""
    (root / "base.txt").write_text(text)
    prepare = ["data", "prepare", "--input", str(root / "base.txt"), "--out", str(root / "text")]
    assert main([*prepare, "--tokenizer", "char"]) == 0
    base = [f"--data.path={root / 'text'}", f"--run.dir={root / 'runs'}", "--run.name=base", *model, *QUIET]
    assert main(["train", *base, *train]) == 0


def make_sft_root(root):
    """A tiny base run (char tokenizer) and chat data prepared with its tokenizer, under `root`."""
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(4000)) + " reverse: again\n"
    make_char_base(root, text, MODEL, "--train.steps=3")
    with open(root / "conv.jsonl", "w", encoding="utf-8") as f:
        for c in _conversations(120, seed=1):
            f.write(json.dumps(c) + "\n")
    assert (
        main(
            [
                "data",
                "prepare",
                "--chat",
                "--input",
                str(root / "conv.jsonl"),
                "--out",
                str(root / "chat"),
                "--tokenizer",
                str(root / "runs" / "base"),
                "--block-size",
                "64",
            ]
        )
        == 0
    )
    return root


def _sft_args(root, name: str, *extra: str) -> list[str]:
    return [
        "train",
        f"--data.path={root / 'chat'}",
        f"--model.init_from=run:{root / 'runs' / 'base'}",
        f"--run.dir={root / 'runs'}",
        f"--run.name={name}",
        "--data.doc_mask=true",
        "--data.doc_positions=restart",
        *QUIET,
        *extra,
    ]

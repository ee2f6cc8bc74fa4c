"""loom's lm-evaluation-harness adapter against the harness's own `hf` backend, on the same model: a
GPT-2-124M-shaped loom run (12 layers, 12 heads, 768 wide, 1024 positions, 50,257-token vocabulary; one
training step from random weights) exported to transformers, scoring the same HellaSwag-format task (4
endings per context, acc and acc_norm) made here. Both in this process, one after the other, with the same
threads and batch size; the ratio is loom's time over hf's (the goal: <= 1.0). The accuracies must be equal.

    PYTHONPATH=src python benchmarks/lm_eval_speed.py --examples 1000 --out benchmarks/results/...json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = (
    "the of and to in is that it for as with was on be by at this from have or an they which one you were her "
    "all she there would their we him been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any my now such like man over also"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_task(root: Path, n: int) -> Path:
    rng = random.Random(0)
    rows = [
        {
            "ctx": sentence(rng, rng.randint(30, 50)).capitalize() + ".",
            "endings": [sentence(rng, rng.randint(10, 20)) + "." for _ in range(4)],
            "label": rng.randrange(4),
        }
        for _ in range(n)
    ]
    d = root / "tasks"
    d.mkdir()
    (d / "hs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "hs.yaml").write_text(
        f"task: hellaswag_format\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'hs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{ctx}}'\ndoc_to_choice: '{{endings}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return d


def make_run(root: Path) -> Path:
    rng = random.Random(1)
    docs = root / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"d{i}.txt").write_text(". ".join(sentence(rng, 12) for _ in range(3000)))
    loom = [sys.executable, "-m", "loom"]
    subprocess.run(
        [
            *loom,
            "data",
            "prepare",
            "--input",
            str(docs),
            "--out",
            str(root / "data"),
            "--tokenizer",
            "bpe",
            "--vocab-size",
            "4096",
        ],
        check=True,
    )
    subprocess.run(
        [
            *loom,
            "train",
            f"--data.path={root / 'data'}",
            f"--run.dir={root}",
            "--run.name=gpt2",
            "--model.n_layer=12",
            "--model.n_head=12",
            "--model.n_embd=768",
            "--model.block_size=1024",
            "--model.vocab_size=50257",
            "--train.steps=1",
            "--train.batch_size=1",
            "--train.eval_batches=1",
            "--train.sample_every=0",
            "--train.device=cpu",
        ],
        check=True,
    )
    subprocess.run(
        [*loom, "export", str(root / "gpt2"), "--format", "hf", "--out", str(root / "hf")], check=True
    )
    return root / "gpt2"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16, help="both backends (default 16)")
    p.add_argument("--out", help="write the figures to this JSON file")
    args = p.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM

    from loom.eval import harness
    from loom.runs import load_run

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tasks, run = make_task(root, args.examples), make_run(root)
        figures = {
            "examples": args.examples,
            "batch_size": args.batch_size,
            "threads": torch.get_num_threads(),
        }
        _, model, tok, _, _ = load_run(run, torch.device("cpu"))
        lm = harness.make_lm(model, tok, torch.device("cpu"), batch_size=args.batch_size)
        hf = HFLM(pretrained=str(root / "hf"), device="cpu", batch_size=args.batch_size, dtype="float32")
        results = {}
        for name, backend in (("loom", lm), ("hf", hf)):
            loaded = harness.load_tasks("hellaswag_format", str(tasks))
            t0 = time.perf_counter()
            r = harness.scores(harness.evaluate(backend, loaded, bootstrap_iters=0))
            figures[f"{name}_s"] = round(time.perf_counter() - t0, 2)
            results[name] = r
            print(f"{name}: {figures[f'{name}_s']} s  {r}", flush=True)
        figures["loom_over_hf"] = round(figures["loom_s"] / figures["hf_s"], 3)
        figures["same_accuracies"] = results["loom"] == results["hf"]
        figures["acc"] = results["loom"]["hellaswag_format/acc"]
        figures["acc_norm"] = results["loom"]["hellaswag_format/acc_norm"]
        figures["params"] = sum(p.numel() for p in model.parameters())
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Preference tuning moves a behaviour the SFT model shows about half the time (issue 46): a format.

1. data: lists of 2 to 4 words from 16, prompt "list: w1 w2 w3". The SFT conversations answer with the words
   joined by ", " or by " ", each half of the time at random: the SFT model learns both formats, and which one
   its greedy answer takes depends on the prompt. The preference pairs (other word lists) choose the comma
   format over the space one, same words. 200 held-out word lists are in neither.
2. SFT: `loom data prepare --chat --tokenizer char`, then `loom train` on that chat data (the data chooses the
   SFT stage; the model starts from scratch: a copy task needs no pretrained base).
3. pairs: `loom data prepare --pairs --tokenizer RUNS/sft` (the SFT model's tokenizer, chat tokens included).
4. DPO: `loom dpo --model.init_from=run:RUNS/sft` (the reference: the SFT model).
5. score: greedy answers (loom.chat's ChatSession, as `loom chat --prompt`) to the held-out prompts before and
   after DPO: the share in the comma format (the preferred behaviour), and the share whose words are the
   prompt's (DPO must not break the content).

Run it with both CPU slots for the timings: HEAVY_SLOTS=2 /work/heavy python benchmarks/dpo_preference.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = "red sun cat map box owl pen cup jar fox bee ink sky egg toy hat".split()
MODEL = ["--model.n_layer=2", "--model.n_head=4", "--model.n_embd=64", "--model.block_size=64"]


def word_lists(n: int, seed: int, exclude: set = frozenset()) -> list[tuple[str, ...]]:
    """n distinct lists of 2 to 4 words, none in `exclude`."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        w = tuple(rng.sample(WORDS, rng.randint(2, 4)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def prompt(w: tuple[str, ...]) -> str:
    return "list: " + " ".join(w)


def comma(w: tuple[str, ...]) -> str:
    return ", ".join(w)


def plain(w: tuple[str, ...]) -> str:
    return " ".join(w)


def make_data(out: Path, n_sft: int, n_pairs: int) -> list[tuple[str, ...]]:
    """The SFT conversations and the preference pairs as JSONL in `out`; returns the held-out word lists."""
    held = word_lists(200, seed=9)
    sft = word_lists(n_sft, seed=1, exclude=set(held))
    pairs = word_lists(n_pairs, seed=2, exclude=set(held))
    coin = random.Random(3)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sft.jsonl", "w", encoding="utf-8") as f:
        for w in sft:
            answer = comma(w) if coin.random() < 0.5 else plain(w)
            msgs = [{"role": "user", "content": prompt(w)}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(out / "pairs.jsonl", "w", encoding="utf-8") as f:
        for w in pairs:
            f.write(json.dumps({"prompt": prompt(w), "chosen": comma(w), "rejected": plain(w)}) + "\n")
    return held


def loom(*args: str) -> float:
    """`loom ARGS` in a process of its own; its seconds."""
    print("$ loom " + " ".join(args), flush=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "loom", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return round(time.time() - t0, 1)


def greedy_answers(run: Path, prompts: list[str]) -> list[str]:
    """The run's greedy answer to each prompt, each a conversation of its own (as `loom chat --prompt`)."""
    import torch

    from loom.chat import ChatSession, Sampling, chat_template
    from loom.data.loader import read_meta
    from loom.env import detect_env
    from loom.runs import open_run

    meta = read_meta(run / "tokenizer")
    with open_run(run, torch.device("cpu"), detect_env()) as r:
        session = ChatSession(
            r.model, chat_template(r.tok, meta, run), r.tok, r.device, Sampling(0.0, None, None, 40)
        )
        out = []
        for p in prompts:
            session.reset()
            out.append(session.reply(p))
    return out


def scores(answers: list[str], held: list[tuple[str, ...]]) -> dict:
    """The share of answers in the comma format, and the share whose words are the prompt's."""
    fmt = sum(bool(re.fullmatch(r"\w+(, \w+)+", a.strip())) for a in answers)
    words = sum(re.split(r",? ", a.strip()) == list(w) for a, w in zip(answers, held, strict=True))
    return {"comma_format": fmt / len(held), "right_words": words / len(held)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--dpo-steps", type=int, default=30)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--dpo-lr", type=float, default=1e-4)
    p.add_argument("--runs", type=Path, default=Path("/tmp/loom-dpo-preference"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu-2core-2026-11-28")
    p.add_argument("--reuse", action="store_true", help="keep the SFT run if --runs has one")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    runs = args.runs
    held = make_data(runs / "data", n_sft=3000, n_pairs=1000)
    common = [
        f"--run.dir={runs}",
        "--train.sample_every=0",
        "--train.ckpt_every=0",
        "--force",
        "--train.device=cpu",
    ]
    seconds = {}
    if not (args.reuse and (runs / "sft" / "ckpt").is_dir()):
        chat = [
            "data",
            "prepare",
            "--chat",
            "--input",
            str(runs / "data/sft.jsonl"),
            "--out",
            str(runs / "chat"),
        ]
        loom(*chat, "--tokenizer", "char", "--block-size", "64", "--force")
        seconds["sft"] = loom(
            "train",
            f"--data.path={runs / 'chat'}",
            "--run.name=sft",
            *MODEL,
            "--data.doc_mask=true",
            "--data.doc_positions=restart",
            f"--train.steps={args.sft_steps}",
            "--train.batch_size=16",
            "--train.eval_every=100",
            "--train.eval_batches=2",
            "--optim.lr=2e-3",
            "--optim.warmup_steps=20",
            *common,
        )
    prepare = [
        "data",
        "prepare",
        "--pairs",
        "--input",
        str(runs / "data/pairs.jsonl"),
        "--out",
        str(runs / "pref"),
    ]
    loom(*prepare, "--tokenizer", str(runs / "sft"), "--force")
    seconds["dpo"] = loom(
        "dpo",
        f"--data.path={runs / 'pref'}",
        f"--model.init_from=run:{runs / 'sft'}",
        "--run.name=dpo",
        f"--train.steps={args.dpo_steps}",
        "--train.batch_size=32",
        f"--optim.lr={args.dpo_lr}",
        "--optim.warmup_steps=5",
        f"--dpo.beta={args.beta}",
        "--train.eval_every=0",
        "--train.log_every=1",
        *common,
    )
    prompts = [prompt(w) for w in held]
    answers = {name: greedy_answers(runs / name, prompts) for name in ("sft", "dpo")}
    metrics = [json.loads(line) for line in (runs / "dpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "dpo/margin" in m]
    report = {
        "task": "answer a list of 2-4 words in the comma format (the SFT data: half comma, half space)",
        "held_out": len(held),
        "sft_steps": args.sft_steps,
        "dpo_steps": args.dpo_steps,
        "beta": args.beta,
        "dpo_lr": args.dpo_lr,
        "before_dpo": scores(answers["sft"], held),
        "after_dpo": scores(answers["dpo"], held),
        "dpo_first_last": {k: (steps[0][k], steps[-1][k]) for k in ("loss", "dpo/margin", "dpo/accuracy")},
        "seconds": seconds,
        "examples": [
            {"prompt": prompts[i], "sft": answers["sft"][i], "dpo": answers["dpo"][i]} for i in range(8)
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dpo_preference.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

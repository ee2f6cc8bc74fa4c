"""A capability a base model visibly learns by chat SFT, on this CPU (issue 34): reversing a list of words.

    python benchmarks/sft_capability.py [--base-steps 800] [--sft-steps 800] [--out DIR] [--runs DIR]

1. base: `loom train` on the built-in corpus (the Python standard library, BPE 4096): loom's default GPT (4
   layers, 192 wide, 4 heads, block 128), --base-steps steps. It has never seen the task.
2. data: conversations made here from a fixed list of common words: the user asks "reverse: w1 w2 ... wn"
   (3 to 6 words), the assistant answers "wn ... w2 w1". --train-convs for training; 200 held-out prompts whose
   word lists are in no training conversation. `loom data prepare --chat --tokenizer RUN` renders them with the
   base run's tokenizer plus loom's chat tokens.
3. SFT, twice from the same base (model.init_from=run:base; conversations packed with document masks and
   restarted positions): full fine-tuning (lr 1e-3), and LoRA (finetune.lora_rank, lr 3e-3) on every linear of
   the blocks, the embedding and head training too (finetune.lora_embeddings=auto: the chat tokens are new).
4. score: exact-match accuracy of greedy answers on the 200 held-out prompts through `loom chat RUN --prompt`
   (loom's CLI, in this process), before SFT (the base with its embedding grown by the chat tokens, the
   starting point of both runs) and after each. The full fine-tune is exported (`loom export --format hf`) and
   transformers (apply_chat_template, then greedy generate) answers the same prompts: its answers are compared
   with loom's one by one; so is the LoRA run's export (adapters merged). Checkpoint sizes on disk are reported
   (a LoRA run's holds what it trains: the adapters, and here the embedding and head).
Writes sft_capability.json into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "apple river stone cloud green house music paper light table water night garden yellow window "
    "summer winter silver planet forest bridge market castle dragon mirror pocket rabbit rocket shadow "
    "candle engine flower guitar island jacket ladder monkey orange pencil pillow school spider sugar "
    "ticket tiger violin wallet basket button camera cotton doctor finger hammer kitten lemon marble "
    "number pepper puzzle ribbon saddle singer tunnel turtle velvet wizard anchor barrel cactus dinner"
).split()


def conversations(n: int, seed: int, exclude: set[tuple[str, ...]] = frozenset()) -> list[tuple[str, ...]]:
    """n distinct word lists of 3 to 6 words, none in `exclude`."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        words = tuple(rng.sample(WORDS, rng.randint(3, 6)))
        if words not in seen:
            seen.add(words)
            out.append(words)
    return out


def prompt(words: tuple[str, ...]) -> str:
    return "reverse: " + " ".join(words)


def answer(words: tuple[str, ...]) -> str:
    return " ".join(reversed(words))


def loom(*args: str, threads: int = 2) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "loom", *args]
    print("$ loom " + " ".join(args), flush=True)
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def loom_chat(run: Path, text: str) -> str:
    """`loom chat RUN --prompt TEXT` in this process: its printed answer."""
    from loom.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["chat", str(run), "--prompt", text, "--max-new-tokens", "40", "--device", "cpu"])
    if rc:
        raise SystemExit(f"loom chat {run} exited {rc}")
    return out.getvalue().rstrip("\n")


def score(answers: list[str], held: list[tuple[str, ...]]) -> float:
    return sum(a.strip() == answer(w) for a, w in zip(answers, held, strict=True)) / len(held)


def before_answers(sft_run: Path, held: list[tuple[str, ...]]) -> list[str]:
    """The starting point of SFT: the base run's weights in the SFT model (embedding grown by the chat tokens,
    loom.train.finetune), answering through the same ChatSession as loom chat."""
    import torch

    from loom.chat import ChatSession, chat_template
    from loom.config import config_from_dict, load_toml
    from loom.data.loader import read_meta
    from loom.data.tokenizers import load_tokenizer
    from loom.model.registry import spec_of
    from loom.runs import run_init_state

    cfg = config_from_dict(load_toml(sft_run / "config.toml"))
    meta = read_meta(sft_run / "tokenizer")
    tok = load_tokenizer(sft_run / "tokenizer", meta)
    model = spec_of(cfg).build_model(cfg, meta["vocab_size"], "cpu", tok.eot_id)
    model.load_state_dict(run_init_state(cfg, model))
    session = ChatSession(model.eval(), chat_template(tok, meta, sft_run), tok, torch.device("cpu"))
    session.sampling.max_new_tokens = 40
    out = []
    for w in held:
        session.reset()
        out.append(session.reply(prompt(w)))
    return out


def hf_answers(export: Path, held: list[tuple[str, ...]]) -> list[str]:
    """transformers' greedy answers from the export: its tokenizer's chat template, then generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    end = tok.convert_tokens_to_ids("<|assistant_end|>")
    out = []
    for w in held:
        msgs = [{"role": "user", "content": prompt(w)}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(
                x, max_new_tokens=40, do_sample=False, eos_token_id=[end, tok.eos_token_id], pad_token_id=end
            )
        new = [t for t in y[0, len(ids) :].tolist() if t not in (end, tok.eos_token_id)]
        out.append(tok.decode(new))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-steps", type=int, default=800)
    p.add_argument("--sft-steps", type=int, default=800)
    p.add_argument("--train-convs", type=int, default=4000)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu-2core-2026-11-27")
    p.add_argument("--runs", type=Path, default=Path("/tmp/loom-sft-capability"))
    p.add_argument("--reuse", action="store_true", help="keep a stage whose output exists in --runs")
    args = p.parse_args()
    runs = args.runs
    runs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    common = [f"--run.dir={runs}", "--train.sample_every=0", "--train.ckpt_every=0", "--force"]
    base = runs / "base"
    if not (args.reuse and (base / "ckpt").is_dir()):
        loom("train", "--run.name=base", f"--train.steps={args.base_steps}", "--train.eval_every=0", *common)

    train = conversations(args.train_convs, seed=1)
    held = conversations(200, seed=2, exclude=set(train))
    data = runs / "data"
    data.mkdir(exist_ok=True)
    with open(data / "train.jsonl", "w", encoding="utf-8") as f:
        for w in train:
            msgs = [{"role": "user", "content": prompt(w)}, {"role": "assistant", "content": answer(w)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    chat = runs / "chat"
    loom(
        "data",
        "prepare",
        "--chat",
        "--input",
        str(data / "train.jsonl"),
        "--out",
        str(chat),
        "--tokenizer",
        str(base),
        "--block-size",
        "128",
        "--val-fraction",
        "0.05",
        "--force",
    )
    sft = [
        f"--data.path={chat}",
        f"--model.init_from=run:{base}",
        "--data.doc_mask=true",
        "--data.doc_positions=restart",
        f"--train.steps={args.sft_steps}",
        "--train.eval_every=100",
        "--train.eval_batches=4",
        "--optim.warmup_steps=20",
        *common,
    ]
    timings = {}
    for name, extra in (
        ("sft-full", ["--optim.lr=1e-3", "--optim.min_lr=1e-4"]),
        (
            "sft-lora",
            [
                f"--finetune.lora_rank={args.lora_rank}",
                f"--finetune.lora_alpha={2 * args.lora_rank}",
                "--finetune.lora_targets=all-linear",
                "--optim.lr=3e-3",
                "--optim.min_lr=3e-4",
            ],
        ),
    ):
        s = time.time()
        loom("train", f"--run.name={name}", *sft, *extra)
        timings[name] = round(time.time() - s, 1)

    results = {"before": before_answers(runs / "sft-full", held)}
    for name in ("sft-full", "sft-lora"):
        results[name] = [loom_chat(runs / name, prompt(w)) for w in held]
    theirs, same = {}, {}
    for name in ("sft-full", "sft-lora"):  # the LoRA run's export has its adapters merged into the weights
        export = runs / f"hf-{name}"
        loom("export", str(runs / name), "--format", "hf", "--out", str(export), "--force")
        theirs[name] = hf_answers(export, held)
        same[name] = sum(a == b for a, b in zip(theirs[name], results[name], strict=True))
    sizes = {
        name: sum(f.stat().st_size for f in (runs / name / "ckpt").rglob("*") if f.is_file())
        for name in ("base", "sft-full", "sft-lora")
    }
    report = {
        "task": "reverse 3-6 words from a list of 75",
        "train_conversations": len(train),
        "held_out": len(held),
        "base_steps": args.base_steps,
        "sft_steps": args.sft_steps,
        "lora_rank": args.lora_rank,
        "accuracy": {k: score(v, held) for k, v in results.items()},
        "transformers_same_answers": same,
        "transformers_accuracy": {k: score(v, held) for k, v in theirs.items()},
        "checkpoint_bytes": sizes,
        "sft_seconds": timings,
        "seconds": round(time.time() - t0, 1),
        "examples": [
            {
                "prompt": prompt(w),
                **{k: v[i] for k, v in results.items()},
                "transformers": theirs["sft-full"][i],
            }
            for i, w in enumerate(held[:5])
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sft_capability.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    keys = ("accuracy", "transformers_same_answers", "sft_seconds", "checkpoint_bytes")
    print(json.dumps({k: report[k] for k in keys}, indent=1))


if __name__ == "__main__":
    main()

"""The RL tests' shared setup: the arithmetic task (scripts/make_arith.py), a tiny char-level base run on its
sums, chat data prepared with its tokenizer and a short SFT run (test_rl.py, test_rl_resume.py, the layouts
test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# QUIET pins fp32: the RL tests compare the sampler's and the trainer's log-probabilities and runs bit for bit
from sftkit import QUIET

from loom.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32"]


def run_script(name: str, out: Path, *args: str) -> None:
    """scripts/NAME.py's main(--out OUT ARGS), in this process (the task writers: make_arith, make_calc)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(out), *args]) == 0


def make_arith(out: Path, *args: str) -> None:
    run_script("make_arith", out, *args)


def make_rl_root(root: Path, sft_steps: int = 20) -> Path:
    """Under root: arith/ (the task), text/ and runs/base (a base run on the sums), chat/ (the SFT
    conversations with the base's tokenizer and chat tokens) and runs/sft (SFT from the base)."""
    make_arith(root / "arith", "--digits", "1", "--n-train", "80", "--n-heldout", "16", "--n-sft", "60")
    text = (root / "arith" / "base.txt").read_text() * 5  # enough for a validation split of 32-token rows
    (root / "base.txt").write_text(text)
    prep = ["data", "prepare", "--input", str(root / "base.txt"), "--out", str(root / "text")]
    assert main([*prep, "--tokenizer", "char"]) == 0
    runs = root / "runs"
    base = [f"--data.path={root / 'text'}", f"--run.dir={runs}", "--run.name=base", *MODEL, *QUIET]
    assert main(["train", *base, "--train.steps=3", "--train.batch_size=8"]) == 0
    chat = [
        "data",
        "prepare",
        "--chat",
        "--input",
        str(root / "arith" / "sft.jsonl"),
        "--out",
        str(root / "chat"),
    ]
    assert main([*chat, "--tokenizer", str(runs / "base"), "--block-size", "32"]) == 0
    sft = [f"--data.path={root / 'chat'}", f"--model.init_from=run:{runs / 'base'}", f"--run.dir={runs}"]
    assert (
        main(["sft", *sft, "--run.name=sft", *QUIET, f"--train.steps={sft_steps}", "--train.batch_size=8"])
        == 0
    )
    return root


def rl_args(root: Path, name: str, *extra: str) -> list[str]:
    """`loom rl` of the SFT run on the arithmetic prompts: 2 prompts x 4 answers a step, answers of <= 4 tokens."""
    return [
        "rl",
        f"--data.path={root / 'chat'}",
        f"--model.init_from=run:{root / 'runs' / 'sft'}",
        f"--run.dir={root / 'runs'}",
        f"--run.name={name}",
        f"--rl.prompts={root / 'arith' / 'rl_train.jsonl'}",
        "--rl.group_size=4",
        "--rl.max_new_tokens=4",
        "--rl.reward=exact",
        "--train.batch_size=8",
        "--optim.lr=1e-3",
        "--optim.warmup_steps=0",
        "--train.log_every=1",
        *QUIET,
        *extra,
    ]


def rl_base_args(root: Path, name: str, *extra: str) -> list[str]:
    """`loom rl` of the base run itself (no SFT, R1-Zero style) on the arithmetic prompts as raw text: answers end
    at a newline (rl.stop), a format reward (digits only) plus the correctness reward."""
    return [
        "rl",
        f"--data.path={root / 'text'}",
        f"--model.init_from=run:{root / 'runs' / 'base'}",
        f"--run.dir={root / 'runs'}",
        f"--run.name={name}",
        f"--rl.prompts={root / 'arith' / 'rl_train.jsonl'}",
        "--rl.group_size=4",
        "--rl.max_new_tokens=4",
        "--rl.reward=0.2*regex+exact",
        "--rl.pattern=^\\d+$",
        "--rl.stop=\\n",
        "--train.batch_size=8",
        "--optim.lr=1e-3",
        "--optim.warmup_steps=0",
        "--train.log_every=1",
        *QUIET,
        *extra,
    ]

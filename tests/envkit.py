"""The multi-turn RL tests' shared setup (rl.env): the calculator task (scripts/make_calc.py, 2-digit x 1-digit
products), a tiny char-level base run on its text, chat data of tool-using conversations prepared with the base's
tokenizer (the tool role: its results masked) and a short SFT run; and `loom rl` arguments with the calculator."""

from __future__ import annotations

from pathlib import Path

from rlkit import run_script
from sftkit import QUIET, make_char_base

from loom.cli import main

MODEL = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64"]


def make_calc(out: Path, *args: str) -> None:
    run_script("make_calc", out, *args)


def make_calc_root(root: Path, sft_steps: int = 20) -> Path:
    """Under root: calc/ (the task), text/ and runs/base (a base run), chat/ (the tool conversations) and
    runs/sft (SFT from the base on them)."""
    make_calc(root / "calc", "--a-digits", "2", "--b-digits", "1", "--n-train", "80", "--n-heldout", "8")
    make_char_base(root, (root / "calc" / "base.txt").read_text() * 3, MODEL, "--train.steps=3")
    runs = root / "runs"
    conv = str(root / "calc" / "sft_tool.jsonl")
    prep = ["data", "prepare", "--chat", "--input", conv, "--out", str(root / "chat")]
    assert main([*prep, "--tokenizer", str(runs / "base"), "--block-size", "64"]) == 0
    sft = [f"--data.path={root / 'chat'}", f"--model.init_from=run:{runs / 'base'}", f"--run.dir={runs}"]
    args = [*sft, "--run.name=sft", *QUIET, f"--train.steps={sft_steps}", "--train.batch_size=8"]
    assert main(["sft", *args, "--optim.lr=3e-3"]) == 0
    return root


def env_args(root: Path, name: str, *extra: str) -> list[str]:
    """`loom rl` of the SFT run with the calculator: 2 prompts x 4 episodes a step, up to 3 turns."""
    return [
        "rl",
        f"--data.path={root / 'chat'}",
        f"--model.init_from=run:{root / 'runs' / 'sft'}",
        f"--run.dir={root / 'runs'}",
        f"--run.name={name}",
        f"--rl.prompts={root / 'calc' / 'rl_train.jsonl'}",
        "--rl.env=loom.rl.envs:Calculator",
        "--rl.max_turns=3",
        "--rl.max_new_tokens=12",
        "--rl.group_size=4",
        "--train.batch_size=8",
        "--optim.lr=1e-3",
        "--optim.warmup_steps=0",
        "--train.log_every=1",
        "--rl.max_dropped_steps=0",
        *QUIET,
        *extra,
    ]


# Environments for the tests (rl.env=envkit:NAME): each gives the same episodes whatever the tiny model writes.
OBS = "1"  # short: three turns and two observations fit the 64-token block


class Turns:
    """Two observations whatever the model writes, then done with a reward from the answer's length (groups'
    rewards differ): every episode has three model turns and two observations."""

    def reset(self, row: dict) -> str:
        self.n, self.row = 0, row
        return ""

    def step(self, text: str):
        self.n += 1
        if self.n < 3:
            return OBS, 0.0, False
        return None, float(len(text) % 2), True


def _even(row: dict) -> bool:
    return int(row["answer"]) % 2 == 0


class RaisesOnEven(Turns):
    """Raises in step for rows with an even answer (their episodes are dropped), Turns otherwise."""

    def step(self, text: str):
        if _even(self.row):
            raise RuntimeError("the environment broke")
        return super().step(text)


class HangsOnEven(Turns):
    """Hangs (60 s) in step for rows with an even answer, Turns otherwise."""

    def step(self, text: str):
        if _even(self.row):
            import time

            time.sleep(60)
        return super().step(text)


class NonString(Turns):
    """An observation that is a number, not text."""

    def step(self, text: str):
        return 7, 0.0, False


class NeverEnds(Turns):
    """Never done: every episode reaches rl.max_turns."""

    def step(self, text: str):
        return OBS, 0.0, False


class MalformedCall(Turns):
    """The calculator answering a malformed call first (its error observation, counted), then done."""

    def reset(self, row: dict) -> str:
        from loom.rl.envs import Calculator

        self.calc = Calculator()
        self.calc.reset(row)
        return super().reset(row)

    @property
    def tool_errors(self) -> int:
        return self.calc.tool_errors

    def step(self, text: str):
        self.n += 1
        if self.n == 1:
            obs, _, _ = self.calc.step("<calc>12*</calc>")
            return obs, 0.0, False
        return None, float(len(text) % 2), True

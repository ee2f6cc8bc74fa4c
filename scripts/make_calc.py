"""Write a task that needs a calculator for `loom rl --rl.env=loom.rl.envs:Calculator`: products "a*b=" of an
A-digit and a B-digit number with their answer, as RL prompts (train and held-out, disjoint), as SFT
conversations in two formats, and as a base run's text.

    python scripts/make_calc.py --out data/calc --a-digits 3 --b-digits 2 --n-train 2000 --n-heldout 200 --n-sft 400

Writes OUT/rl_train.jsonl and OUT/rl_heldout.jsonl ({"prompt": "123*45=", "answer": "5535"}); OUT/sft_tool.jsonl,
conversations that use the tool through the chat template's tool role (user "123*45=", assistant
"<calc>123*45</calc>", tool "<result>5535</result>", assistant "5535": SFT trains on the assistant's turns only,
the tool's result is masked), and OUT/sft_plain.jsonl, the same problems answered directly (assistant "5535");
both from the train prompts. OUT/base.txt holds the products as plain lines and as calculator transcripts (so a
char tokenizer made from it writes every character both formats use, the calculator's error answer included).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problems(a_digits: int, b_digits: int, n: int, seed: int) -> list[tuple[str, str]]:
    """n distinct a*b with a of exactly a_digits digits and b of exactly b_digits, drawn by seed."""
    lo_a, lo_b = 10 ** (a_digits - 1) if a_digits > 1 else 0, 10 ** (b_digits - 1) if b_digits > 1 else 0
    total = (10**a_digits - lo_a) * (10**b_digits - lo_b)
    if n > total:
        raise SystemExit(f"{a_digits}-digit x {b_digits}-digit products give only {total} problems")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < n:
        a, b = rng.randrange(lo_a, 10**a_digits), rng.randrange(lo_b, 10**b_digits)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append((f"{a}*{b}=", str(a * b)))
    return out


def tool_messages(q: str, ans: str) -> list[dict]:
    expr = q.rstrip("=")
    return [
        {"role": "user", "content": q},
        {"role": "assistant", "content": f"<calc>{expr}</calc>"},
        {"role": "tool", "content": f"<result>{ans}</result>"},
        {"role": "assistant", "content": ans},
    ]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--a-digits", type=int, default=3)
    p.add_argument("--b-digits", type=int, default=2)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-heldout", type=int, default=200)
    p.add_argument(
        "--n-sft", type=int, default=400, help="SFT conversations (each format), from the train prompts"
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    all_ = problems(a.a_digits, a.b_digits, a.n_train + a.n_heldout, a.seed)
    held, train = all_[: a.n_heldout], all_[a.n_heldout :]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "rl_train.jsonl", [{"prompt": q, "answer": ans} for q, ans in train])
    write_jsonl(out / "rl_heldout.jsonl", [{"prompt": q, "answer": ans} for q, ans in held])
    sft = train[: a.n_sft]
    write_jsonl(out / "sft_tool.jsonl", [{"messages": tool_messages(q, ans)} for q, ans in sft])
    plain = [[{"role": "user", "content": q}, {"role": "assistant", "content": ans}] for q, ans in sft]
    write_jsonl(out / "sft_plain.jsonl", [{"messages": m} for m in plain])
    lines = [f"{q}{ans}\n<calc>{q[:-1]}</calc><result>{ans}</result>\n" for q, ans in train]
    (out / "base.txt").write_text("".join(lines) + "<result>error</result>\n", encoding="utf-8")
    print(f"wrote {len(train)} train and {len(held)} held-out prompts, {len(sft)} SFT conversations to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

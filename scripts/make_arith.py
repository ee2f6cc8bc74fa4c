"""Write an arithmetic task for `loom rl`: prompts "a+b=" with their answer, as RL prompts (train and held-out,
disjoint) and as conversations for SFT (the answer as the assistant's turn) and for a base run's text.

    python scripts/make_arith.py --out data/arith --digits 2 --n-train 2000 --n-heldout 200 --n-sft 500

Writes OUT/rl_train.jsonl and OUT/rl_heldout.jsonl ({"prompt": "12+34=", "answer": "46"}), OUT/sft.jsonl
({"messages": [user, assistant]}) drawn from the train prompts, and OUT/base.txt (the sums as plain lines).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problems(digits: int, seed: int) -> list[tuple[str, str]]:
    """Every a+b with a, b of up to `digits` digits, shuffled by seed."""
    top = 10**digits
    out = [(f"{a}+{b}=", str(a + b)) for a in range(top) for b in range(top)]
    random.Random(seed).shuffle(out)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-heldout", type=int, default=200)
    p.add_argument("--n-sft", type=int, default=500, help="conversations for SFT, from the train prompts")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    all_ = problems(a.digits, a.seed)
    if a.n_train + a.n_heldout > len(all_):
        p.error(f"{a.digits}-digit sums give only {len(all_)} problems")
    held, train = all_[: a.n_heldout], all_[a.n_heldout : a.n_heldout + a.n_train]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "rl_train.jsonl", [{"prompt": q, "answer": ans} for q, ans in train])
    write_jsonl(out / "rl_heldout.jsonl", [{"prompt": q, "answer": ans} for q, ans in held])
    sft = train[: a.n_sft]
    write_jsonl(
        out / "sft.jsonl",
        [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]}
            for q, ans in sft
        ],
    )
    (out / "base.txt").write_text("".join(f"{q}{ans}\n" for q, ans in train), encoding="utf-8")
    print(f"wrote {len(train)} train and {len(held)} held-out prompts, {len(sft)} SFT conversations to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

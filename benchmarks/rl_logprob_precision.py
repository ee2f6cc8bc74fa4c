"""The sampler's log-probabilities against the trainer's under fp32 and bf16 (issue 46: "in bf16 the measured
difference is reported"): `loom rl` for 10 steps of the tests' arithmetic setup (tests/rlkit.py: a 2-layer,
32-wide char model after 60 SFT steps; 2 prompts x 8 answers of <= 8 tokens a step, every group trained:
rl.dynamic_sampling=false) in fp32 with and without batch-invariant forwards (rl.batch_invariant) and in bf16,
and each step's rl/logprob_diff (the largest |sampler - trainer| over the trained tokens).

    python benchmarks/rl_logprob_precision.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    import torch
    from rlkit import make_rl_root, rl_args

    from loom.cli import main as loom
    from loom.metrics import read_jsonl

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("rl_logprob_precision"))
    args = p.parse_args()
    torch.set_num_threads(1)
    root = make_rl_root(args.out, sft_steps=60)
    diffs = {}
    settings = {
        "fp32": ["--precision.dtype=fp32"],
        "fp32-not-invariant": ["--precision.dtype=fp32", "--rl.batch_invariant=false"],
        "bf16": ["--precision.dtype=bf16"],
    }
    for name, flags in settings.items():
        extra = [
            "--train.steps=10",
            "--rl.dynamic_sampling=false",
            "--rl.group_size=8",
            "--rl.max_new_tokens=8",
        ]
        assert loom([*rl_args(root, f"rl_{name}", *extra, *flags)]) == 0
        recs = read_jsonl(root / "runs" / f"rl_{name}" / "metrics.jsonl")
        diffs[name] = [r["rl/logprob_diff"] for r in recs if "rl/logprob_diff" in r]
    for dtype, d in diffs.items():
        print(
            f"{dtype}: rl/logprob_diff max {max(d):.3g}, median {sorted(d)[len(d) // 2]:.3g} over {len(d)} steps"
        )
    print(json.dumps(diffs))


if __name__ == "__main__":
    main()

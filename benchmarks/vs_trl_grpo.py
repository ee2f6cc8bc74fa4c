"""loom rl side by side with TRL's GRPOTrainer: the same SFT model (loom's export), prompts, reward, group size,
steps, max new tokens, temperature, learning rate and prompts per step; held-out greedy pass@1 of the SFT model,
loom's result and TRL's by ONE evaluator (transformers generate on each exported folder), and seconds per step.

    python benchmarks/vs_trl_grpo.py --out /tmp/vs_trl --trl-python /work/trl-venv/bin/python --steps 20

--base: the base-model recipe instead (R1-Zero style, no SFT): both start from the README's base run (loom's
export), take the raw {"prompt"} rows as plain text, end an answer at a newline (loom: rl.stop; TRL: the newline
is the tokenizer's end-of-sequence, so its generation stops and its loss mask ends there, as loom's does) and
score it with the same loom reward (--reward, e.g. 0.2*regex+exact with --pattern).

TRL runs in its own interpreter (it is not a dependency of loom): that venv needs trl, transformers, torch and
loom importable (PYTHONPATH=src). Writes OUT/vs_trl_grpo.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run by --trl-python: GRPOTrainer on the exported SFT folder with loom's own `exact` reward.
TRL_SCRIPT = r"""
import json, sys, time
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from loom.rl.rewards import load_reward

a = json.loads(sys.argv[1])
rows = [json.loads(line) for line in open(a["prompts"])]
scorer = load_reward(a["reward"], "answer", a["pattern"])
if a["base"]:  # plain text the model continues (TRL's standard format), as loom's base-model RL
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
else:
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])

def reward(prompts, completions, answer, **kw):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    # the text before the first newline: what loom's rl.stop='\n' leaves for its reward
    return [scorer.score({"answer": x}, t.split("\n")[0] if a["base"] else t)[0] or 0.0
            for t, x in zip(texts, answer)]

class Times(TrainerCallback):
    def __init__(self):
        self.times, self.t = [], None
    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t)

g, p = a["group_size"], a["prompts_per_step"]
cfg = GRPOConfig(
    output_dir=a["out"], max_steps=a["steps"], num_generations=g, per_device_train_batch_size=g * p,
    gradient_accumulation_steps=1, max_completion_length=a["max_new_tokens"], temperature=a["temperature"],
    learning_rate=a["lr"], lr_scheduler_type="constant", warmup_steps=0, beta=0.0, loss_type="dapo",
    num_iterations=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
    bf16=False, fp16=False, dataloader_num_workers=0,
)
model = AutoModelForCausalLM.from_pretrained(a["model"])
tok = AutoTokenizer.from_pretrained(a["model"])
if a["base"]:  # a newline ends an answer: TRL's generation stops at eos and masks the loss after it
    nl = tok.encode("\n", add_special_tokens=False)
    assert len(nl) == 1, nl
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.eos_token = tok.convert_ids_to_tokens(nl[0])
    model.generation_config.eos_token_id = nl[0]
times = Times()
tr = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                 callbacks=[times])
t0 = time.perf_counter()
tr.train()
total = time.perf_counter() - t0
tr.save_model(a["out"] + "/final")
tok.save_pretrained(a["out"] + "/final")
json.dump({"step_s": times.times, "total_s": total, "log": tr.state.log_history}, open(a["out"] + "/trl.json", "w"))
"""


def loom(*args: str, cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run([sys.executable, "-m", "loom", *args], cwd=cwd, env=env, check=True)


def sft_model(out: Path, a) -> Path:
    """The arithmetic task and a small base -> SFT run (the README's recipe, fewer steps); reused when present."""
    if not (out / "arith").exists():
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts/make_arith.py"),
                "--out",
                str(out / "arith"),
                "--digits",
                "2",
                "--n-train",
                str(a.n_train),
                "--n-heldout",
                str(a.heldout),
                "--n-sft",
                "600",
            ],
            check=True,
        )
    if not (out / "runs/base").exists():
        loom("data", "prepare", "--input", "arith/base.txt", "--out", "text", "--tokenizer", "char", cwd=out)
        loom(
            "train",
            "--data.path=text",
            "--run.name=base",
            "--model.n_layer=4",
            "--model.n_head=4",
            "--model.n_embd=128",
            "--model.block_size=32",
            f"--train.steps={a.base_steps}",
            "--train.batch_size=32",
            "--optim.lr=1e-3",
            "--optim.warmup_steps=20",
            cwd=out,
        )
    if a.base:
        if not (out / "base_hf").exists():
            loom("export", "runs/base", "--format", "hf", "--out", "base_hf", cwd=out)
        return out / "base_hf"
    if not (out / "runs/sft").exists():
        loom(
            "data",
            "prepare",
            "--chat",
            "--input",
            "arith/sft.jsonl",
            "--out",
            "chat",
            "--tokenizer",
            "runs/base",
            "--block-size",
            "32",
            cwd=out,
        )
        loom(
            "sft",
            "--data.path=chat",
            "--model.init_from=run:runs/base",
            "--run.name=sft",
            f"--train.steps={a.sft_steps}",
            "--train.batch_size=32",
            "--optim.lr=1e-3",
            "--optim.warmup_steps=10",
            *([f"--train.ckpt_every={a.sft_ckpt}"] if a.sft_ckpt else []),
            cwd=out,
        )
    if not (out / "sft_hf").exists():
        loom("export", "runs/sft", "--format", "hf", "--out", "sft_hf", *sft_ckpt(a), cwd=out)
    return out / "sft_hf"


def sft_ckpt(a) -> list[str]:
    """--ckpt of the SFT checkpoint both start from (--sft-ckpt STEP: the README recipe's half-trained model)."""
    return ["--ckpt", f"runs/sft/ckpt/step_{a.sft_ckpt:06d}"] if a.sft_ckpt else []


def init_from(a) -> str:
    if a.base:
        return "run:runs/base"
    return f"run:runs/sft/ckpt/step_{a.sft_ckpt:06d}" if a.sft_ckpt else "run:runs/sft"


def run_loom(out: Path, a) -> dict:
    import shutil

    for old in ("runs/rl", "rl_hf", "trl"):  # a run left from before would resume, not start again
        shutil.rmtree(out / old, ignore_errors=True)
    t0 = time.perf_counter()
    base = ["--data.path=text", "--rl.stop=\\n"] if a.base else ["--data.path=chat"]
    loom(
        "rl",
        "--train.log_every=1",  # every step's dt (the median is over them all)
        *base,
        f"--model.init_from={init_from(a)}",
        "--run.name=rl",
        "--rl.prompts=arith/rl_train.jsonl",
        f"--rl.group_size={a.group_size}",
        f"--train.batch_size={a.group_size * a.prompts_per_step}",
        f"--rl.max_new_tokens={a.max_new_tokens}",
        f"--rl.reward={a.reward}",
        f"--rl.pattern={a.pattern}",
        f"--precision.dtype={a.dtype}",  # TRL's run is fp32 (bf16=False)
        f"--train.steps={a.steps}",
        f"--optim.lr={a.lr}",
        "--optim.warmup_steps=0",
        # TRL's GRPOConfig defaults, so both take the same optimizer steps: AdamW betas (0.9, 0.999), no
        # weight decay, clip 1.0 (loom's too), a constant rate (wsd without decay), and groups whose rewards
        # are all equal kept at advantage 0 (their tokens count in DAPO's normalisation, as in TRL)
        "--optim.beta2=0.999",
        "--optim.weight_decay=0",
        "--optim.schedule=wsd",
        "--optim.decay_frac=0",
        f"--rl.dynamic_sampling={str(a.dynamic_sampling).lower()}",
        cwd=out,
    )
    total = time.perf_counter() - t0
    loom("export", "runs/rl", "--format", "hf", "--out", "rl_hf", "--force", cwd=out)
    recs = [json.loads(x) for x in open(out / "runs/rl/metrics.jsonl") if '"dt"' in x]
    return {"step_s": [r["dt"] for r in recs], "total_s": total}


def run_trl(out: Path, a) -> dict:
    args = {
        "prompts": str(out / "arith/rl_train.jsonl"),
        "model": str(out / ("base_hf" if a.base else "sft_hf")),
        "out": str(out / "trl"),
        "base": a.base,
        "reward": a.reward,
        "pattern": a.pattern,
        "steps": a.steps,
        "group_size": a.group_size,
        "prompts_per_step": a.prompts_per_step,
        "max_new_tokens": a.max_new_tokens,
        "temperature": a.temperature,
        "lr": a.lr,
    }
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run([a.trl_python, "-c", TRL_SCRIPT, json.dumps(args)], cwd=out, env=env, check=True)
    return json.loads((out / "trl/trl.json").read_text())


def greedy_answers(folder: Path, rows: list[dict], a) -> list[str]:
    """Each row's greedy answer by transformers generate on an exported folder: the one evaluator for all three
    models. --base: the prompt's raw text, the answer cut before its first newline (loom's rl.stop='\\n')."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    kw = {"eos_token_id": tok.encode("\n", add_special_tokens=False)[0]} if a.base else {}
    out = []
    for r in rows:
        if a.base:
            ids = torch.tensor([tok.encode(r["prompt"], add_special_tokens=False)])
        else:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=False,
            )
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False, **kw)
        text = tok.decode(got[0, ids.shape[1] :], skip_special_tokens=True)
        out.append(text.split("\n")[0] if a.base else text)
    return out


def pass_at_1(folder: Path, prompts: Path, a) -> float:
    """Greedy held-out pass@1, correct as loom's held-out scoring counts it (every term of the reward > 0)."""
    from loom.rl.rewards import load_reward

    reward = load_reward(a.reward, "answer", a.pattern)
    rows = [json.loads(line) for line in open(prompts)]
    texts = greedy_answers(folder, rows, a)
    return sum(reward.correct(r, t) for r, t in zip(rows, texts, strict=True)) / len(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--trl-python", default="/work/trl-venv/bin/python")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0, help="TRL's; loom rl samples at 1")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--n-train", type=int, default=3000, help="train prompts (and the base run's sums)")
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--sft-steps", type=int, default=1200)
    p.add_argument("--sft-ckpt", type=int, default=0, help="start from the SFT run's checkpoint at this step")
    p.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="loom drops groups whose rewards are all equal (its default; TRL keeps them at advantage 0)",
    )
    p.add_argument("--base", action="store_true", help="the base-model recipe: RL from the base run, no SFT")
    p.add_argument("--reward", default="exact", help="loom's rl.reward, for both (e.g. 0.2*regex+exact)")
    p.add_argument("--pattern", default="", help="rl.pattern of a regex term (e.g. '^\\d+$')")
    p.add_argument("--dtype", default="fp32", help="loom's precision.dtype (TRL's run is fp32)")
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sft_model(out, a)
    lo, tr = run_loom(out, a), run_trl(out, a)
    held = out / "arith/rl_heldout.jsonl"
    start = "base" if a.base else "sft"
    res = {
        "settings": vars(a),
        f"pass1_{start}": pass_at_1(out / f"{start}_hf", held, a),
        "loom": {
            "pass1": pass_at_1(out / "rl_hf", held, a),
            "median_step_s": statistics.median(lo["step_s"]),
            "total_s": lo["total_s"],
        },
        "trl": {
            "pass1": pass_at_1(out / "trl/final", held, a),
            "median_step_s": statistics.median(tr["step_s"]),
            "total_s": tr["total_s"],
        },
        "total_s": time.perf_counter() - t0,
    }
    (out / "vs_trl_grpo.json").write_text(json.dumps(res, indent=1))
    print(f"held-out pass@1: {start} {res[f'pass1_{start}']:.3f}")
    for k in ("loom", "trl"):
        r = res[k]
        print(
            f"{k:5s} pass@1 {r['pass1']:.3f}  median s/step {r['median_step_s']:.3f}  total {r['total_s']:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

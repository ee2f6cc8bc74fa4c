"""loom rl side by side with TRL's GRPOTrainer: the same SFT model (loom's export), prompts, reward, group size,
steps, max new tokens, temperature, learning rate and prompts per step; held-out greedy pass@1 of the SFT model,
loom's result and TRL's by ONE evaluator (transformers generate on each exported folder), and seconds per step.

    python benchmarks/vs_trl_grpo.py --out /tmp/vs_trl --trl-python /work/trl-venv/bin/python --steps 20

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
from loom.rl.rewards import Sample, exact

a = json.loads(sys.argv[1])
rows = [json.loads(line) for line in open(a["prompts"])]
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])

def reward(prompts, completions, answer, **kw):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [exact(Sample(row={}, text=t, answer=x)) for t, x in zip(texts, answer)]

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
                "3000",
                "--n-heldout",
                str(a.heldout),
                "--n-sft",
                "600",
            ],
            check=True,
        )
    if not (out / "runs/sft").exists():
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
    return f"run:runs/sft/ckpt/step_{a.sft_ckpt:06d}" if a.sft_ckpt else "run:runs/sft"


def run_loom(out: Path, a) -> dict:
    import shutil

    for old in ("runs/rl", "rl_hf", "trl"):  # a run left from before would resume, not start again
        shutil.rmtree(out / old, ignore_errors=True)
    t0 = time.perf_counter()
    loom(
        "rl",
        "--train.log_every=1",  # every step's dt (the median is over them all)
        "--data.path=chat",
        f"--model.init_from={init_from(a)}",
        "--run.name=rl",
        "--rl.prompts=arith/rl_train.jsonl",
        f"--rl.group_size={a.group_size}",
        f"--train.batch_size={a.group_size * a.prompts_per_step}",
        f"--rl.max_new_tokens={a.max_new_tokens}",
        "--rl.reward=exact",
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
        "model": str(out / "sft_hf"),
        "out": str(out / "trl"),
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


def pass_at_1(folder: Path, prompts: Path, max_new_tokens: int) -> float:
    """Greedy pass@1 by transformers generate on an exported folder: the one evaluator for all three models."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loom.rl.rewards import Sample, exact

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in open(prompts)]
    good = 0
    for r in rows:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=False,
        )
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        text = tok.decode(got[0, ids.shape[1] :], skip_special_tokens=True)
        good += exact(Sample(row=r, text=text, answer=r["answer"])) > 0
    return good / len(rows)


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
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--sft-steps", type=int, default=1200)
    p.add_argument("--sft-ckpt", type=int, default=0, help="start from the SFT run's checkpoint at this step")
    p.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="loom drops groups whose rewards are all equal (its default; TRL keeps them at advantage 0)",
    )
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sft_model(out, a)
    lo, tr = run_loom(out, a), run_trl(out, a)
    held = out / "arith/rl_heldout.jsonl"
    res = {
        "settings": vars(a),
        "pass1_sft": pass_at_1(out / "sft_hf", held, a.max_new_tokens),
        "loom": {
            "pass1": pass_at_1(out / "rl_hf", held, a.max_new_tokens),
            "median_step_s": statistics.median(lo["step_s"]),
            "total_s": lo["total_s"],
        },
        "trl": {
            "pass1": pass_at_1(out / "trl/final", held, a.max_new_tokens),
            "median_step_s": statistics.median(tr["step_s"]),
            "total_s": tr["total_s"],
        },
        "total_s": time.perf_counter() - t0,
    }
    (out / "vs_trl_grpo.json").write_text(json.dumps(res, indent=1))
    print(f"held-out pass@1: SFT {res['pass1_sft']:.3f}")
    for k in ("loom", "trl"):
        r = res[k]
        print(
            f"{k:5s} pass@1 {r['pass1']:.3f}  median s/step {r['median_step_s']:.3f}  total {r['total_s']:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

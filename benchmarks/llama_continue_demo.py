"""Continue training a transformers Llama with loom and hand it back (issue 20's round trip), end to end:

    python benchmarks/llama_continue_demo.py [--steps 50] [--nproc 2] [--work DIR] [--json OUT]

1. transformers builds a small random LlamaForCausalLM (grouped-query attention, untied head) and saves it with
   a byte-level BPE tokenizer.json trained here on a few standard-library files (512 tokens, <|endoftext|>
   included, a multiple of 64 so loom pads nothing);
2. `loom data prepare --tokenizer DIR/tokenizer.json` tokenizes other standard-library files with it;
3. `loom train --model.init_from=hf:DIR --nproc 2 --parallel.dp_impl=fsdp` continues training for --steps;
4. `loom export RUN --format hf` writes a LlamaForCausalLM directory;
5. transformers loads the export and computes its mean token loss on the held-out windows loom's eval uses
   (loom.data.loader.ValSet of the val split), which must equal `loom eval` on the run to 1e-4.
Writes the figures as JSON (stdout and --json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LOOM = [sys.executable, "-m", "loom"]
EOT = "<|endoftext|>"


def sh(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*LOOM, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"loom {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def make_llama(d: Path, texts: list[str]) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    assert tok.get_vocab_size() == 512, tok.get_vocab_size()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(EOT),
        eos_token_id=tok.token_to_id(EOT),
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))


def _valset(run: Path):
    from loom.config import config_from_dict, load_toml
    from loom.data.loader import ValSet
    from loom.runs import run_data_dir

    cfg = config_from_dict(load_toml(run / "config.toml"))
    return cfg, ValSet(
        run_data_dir(run, cfg), cfg.model.block_size, cfg.train.eval_batches * cfg.train.batch_size
    )


def loom_eval(run: Path) -> float:
    """`loom eval RUN` (loom.cli's steps) at full precision."""
    from loom.eval.val_loss import val_loss
    from loom.runs import load_run

    cfg, model, *_ = load_run(run, torch.device("cpu"))
    _, val = _valset(run)
    return val_loss(model, val, cfg.train.micro_batch_size or cfg.train.batch_size, torch.device("cpu"))


@torch.no_grad()
def transformers_loss(export: Path, run: Path) -> tuple[float, int]:
    """transformers' mean token loss on the run's validation windows (the same rows `loom eval` reads)."""
    import transformers

    cfg, val = _valset(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    total, n = 0.0, 0
    for x, y in val.batches(cfg.train.batch_size):
        logits = model(x).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        n += y.numel()
    return total / n, n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="loom-llama-demo-"))
    from loom.data.corpus import python_stdlib_files

    files = sorted(python_stdlib_files(), key=str)
    t0 = time.time()
    hf_dir, data, runs, export = work / "hf-llama", work / "data", work / "runs", work / "export"
    make_llama(hf_dir, [Path(f).read_text(errors="replace") for f in files[:20]])
    sh(
        "data",
        "prepare",
        "--input",
        *map(str, files[20:60]),
        "--out",
        str(data),
        "--tokenizer",
        str(hf_dir / "tokenizer.json"),
        "--force",
    )
    sh(
        "train",
        f"--data.path={data}",
        f"--model.init_from=hf:{hf_dir}",
        f"--nproc={args.nproc}",
        "--parallel.dp_impl=fsdp",
        f"--train.steps={args.steps}",
        "--model.block_size=64",
        "--train.batch_size=8",
        "--train.eval_every=0",
        "--train.eval_batches=8",
        "--train.sample_every=0",
        "--train.log_every=10",
        "--optim.lr=3e-3",
        "--optim.warmup_steps=5",
        "--precision.dtype=fp32",
        "--train.device=cpu",
        f"--run.dir={runs}",
        "--run.name=continued",
        "--force",
    )
    run = runs / "continued"
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    sh("export", str(run), "--format", "hf", "--out", str(export), "--force")
    printed = float(re.search(r"val loss (\d+\.\d+)", sh("eval", str(run), "--device", "cpu")).group(1))
    loom_loss = loom_eval(run)  # what `loom eval` computes, unrounded
    assert abs(loom_loss - printed) <= 5e-5
    theirs, tokens = transformers_loss(export, run)
    result = {
        "steps": args.steps,
        "nproc": args.nproc,
        "dp_impl": "fsdp",
        "first_logged_train_loss": first,
        "loom_eval_printed": printed,
        "loom_eval_val_loss": loom_loss,
        "transformers_val_loss": theirs,
        "abs_diff": abs(theirs - loom_loss),
        "val_tokens": tokens,
        "pass_1e-4": abs(theirs - loom_loss) <= 1e-4,
        "wall_s": round(time.time() - t0, 1),
        "work": str(work),
        "note": "2-core CPU shared with other jobs",
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["pass_1e-4"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""`loom export --format gguf` read by llama.cpp itself (llama-cpp-python), against loom (issue 63).

    python benchmarks/gguf_llamacpp.py --llama-python VENV/bin/python [--steps 300] [--new-tokens 24] [--out DIR] [--work DIR]

llama-cpp-python compiles llama.cpp (5-15 min of CPU), so it lives in a virtualenv of its own, never loom's:

    python3 -m venv /tmp/llamacpp-venv
    CMAKE_BUILD_PARALLEL_LEVEL=1 /tmp/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36

loom runs in this interpreter, llama.cpp in the other, and the two meet through files (a JSON job, a JSON
answer). Four tiny runs are trained on the built-in corpus (the Python standard library) with `loom train`:
  gpt2-bpe     GPT-2's shape, byte-level BPE of 1,024 tokens with GPT-2's split pattern (tokenizer.ggml.pre gpt-2)
  llama-bpe4   the llama family, 2 key/value heads for 4 query heads, BPE with cl100k's pattern (pre llama-bpe)
  llama-char   the llama family on loom's char tokenizer (written as byte-level BPE without merges)
  llama3-rope  the llama family with Llama 3.1's RoPE scaling (model.rope_type=llama3: llama.cpp's rope_freqs)
Each is exported as f16, bf16 and q8_0. For each file and prompt:
  - llama.cpp's tokenizer on the prompt's text against loom's ids (tokenize(text, add_bos=False));
  - the logits at the prompt's last position: max |llama.cpp - loom| over the vocabulary (loom in fp32);
  - greedy tokens: --new-tokens steps of argmax from llama.cpp's logits (its own KV cache) against loom's
    greedy tokens (loom.generate.generate with temperature 0: what `loom generate --temperature 0` draws); where
    they part, loom's logit of its pick minus that of llama.cpp's pick at that step (a near tie or not).
For a char run one more prompt holds a character of several UTF-8 bytes (joined by the merges the export writes).
Writes gguf_llamacpp.json (every figure) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "def main(",
    "import os\nimport sys\n\n",
    "class Parser:\n    def __init__(self",
    "    return",
    "# Copyright",
]
RUNS = {
    "gpt2-bpe": ("bpe", ["--model.n_head=4", "--model.n_embd=128"]),
    "llama-bpe4": (
        "bpe4",
        ["--model.family=llama", "--model.n_head=4", "--model.n_kv_head=2", "--model.n_embd=128"],
    ),
    "llama-char": ("char", ["--model.family=llama", "--model.n_head=4", "--model.n_embd=128"]),
    "llama3-rope": (
        "bpe",
        [
            "--model.family=llama",
            "--model.n_head=4",
            "--model.n_embd=128",
            "--model.rope_type=llama3",
            "--model.rope_factor=8",
            "--model.rope_original_context=32",
        ],
    ),
}
DATA = {
    "bpe": ["--tokenizer", "bpe", "--vocab-size", "1024"],
    "bpe4": ["--tokenizer", "bpe", "--vocab-size", "1024", "--split-pattern", "gpt4"],
    "char": ["--tokenizer", "char"],
}
TYPES = ("f16", "bf16", "q8_0")

# what runs in llama-cpp-python's interpreter: reads the job, answers with tokens and logits
CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

job = json.load(open(sys.argv[1]))
out = []
for f in job["files"]:
    llm = Llama(model_path=f["path"], n_ctx=job["n_ctx"], n_threads=1, logits_all=True, verbose=False)
    rows = []
    for p in job["prompts"]:
        ids = llm.tokenize(p["text"].encode("utf-8"), add_bos=False, special=False)
        llm.reset()
        llm.eval(p["ids"])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32).tolist()
        greedy = []
        for _ in range(job["new_tokens"]):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            greedy.append(t)
            llm.eval([t])
        rows.append({"ids": ids, "logits": last, "greedy": greedy})
    out.append({"name": f["name"], "n_vocab": llm.n_vocab(), "prompts": rows})
    del llm
json.dump(out, open(sys.argv[2], "w"))
"""


def sh(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def loom_side(run: Path, prompts: list[str], new_tokens: int) -> list[dict]:
    """loom's ids, last-position logits (fp32) and greedy tokens for each prompt."""
    import torch

    from loom.generate import generate
    from loom.runs import load_run

    _, model, tok, _, _ = load_run(run, torch.device("cpu"))
    wide = next((c for c in getattr(tok, "chars", []) if len(c.encode("utf-8")) > 1), None)
    rows = []
    for text in prompts + ([f"x = '{wide}'"] if wide else []):  # a char of several bytes: merges join it
        ids = tok.encode(text)
        idx = torch.tensor([ids])
        with torch.no_grad():
            logits = model(idx)[0, -1, : tok.vocab_size].float()
            out = generate(model, idx, new_tokens, temperature=0.0, vocab_size=tok.vocab_size)
            # loom's logits at each generated position: how close a pick was where the two part
            steps = model(out)[0, len(ids) - 1 : -1, : tok.vocab_size].float()
        greedy = out[0, len(ids) :].tolist()
        rows.append({"text": text, "ids": ids, "logits": logits.tolist(), "greedy": greedy, "steps": steps})
    return rows


def margin(ours: dict, their_greedy: list[int], step: int) -> float:
    """loom's logit of its greedy pick minus its logit of llama.cpp's pick, at the step where they part."""
    row = ours["steps"][step]
    return float(row[ours["greedy"][step]] - row[their_greedy[step]])


TRAIN = [  # every run's shape and schedule; RUNS adds its family's flags
    "--model.n_layer=2",
    "--model.block_size=64",
    "--train.batch_size=16",
    "--train.eval_every=0",
    "--train.sample_every=0",
    "--optim.lr=3e-3",
    "--precision.dtype=fp32",
    "--train.device=cpu",
    "--force",
]


def compare(ours: list[dict], theirs: dict) -> list[dict]:
    """One file's figures, prompt by prompt: loom's rows (loom_side) against llama.cpp's answer for the file."""
    rows = []
    for o, t in zip(ours, theirs["prompts"], strict=True):
        pairs = zip(o["greedy"], t["greedy"], strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        rows.append(
            {
                "prompt": o["text"],
                "tokenizer_same": t["ids"] == o["ids"],
                "max_abs_logit_diff": max(abs(a - b) for a, b in zip(o["logits"], t["logits"], strict=True)),
                "logit_range": max(o["logits"]) - min(o["logits"]),
                "greedy_same": same is None,
                "first_divergence": same,
                # loom's logit of its pick minus that of llama.cpp's, where they part (a near tie?)
                "loom_margin_there": None if same is None else margin(o, t["greedy"], same),
                "loom_greedy": o["greedy"],
                "llamacpp_greedy": t["greedy"],
            }
        )
    return rows


def table(results: dict) -> str:
    """The Markdown table of gguf.md: a row per run and type."""
    lines = [
        "| run | type | tokenizer same | greedy same | max abs logit diff (last prompt position) "
        "| where greedy parts: step (loom's margin there) |",
        "|---|---|---|---|---|---|",
    ]
    for run, r in results.items():
        for kind, f in r["types"].items():
            rows, n = f["prompts"], len(f["prompts"])
            spans = [x["logit_range"] for x in rows]
            parts = [
                f"{x['first_divergence']} ({x['loom_margin_there']:.1e})"
                for x in rows
                if not x["greedy_same"]
            ]
            lines.append(
                f"| {run} | {kind} | {sum(x['tokenizer_same'] for x in rows)}/{n} "
                f"| {sum(x['greedy_same'] for x in rows)}/{n} "
                f"| {max(x['max_abs_logit_diff'] for x in rows):.2e} (logits span {min(spans):.1f}-{max(spans):.1f}) "
                f"| {', '.join(parts) or '-'} |"
            )
    return "\n".join(lines)


def run_llamacpp(python: str, work: Path, files: list[dict], ours: list[dict], new_tokens: int) -> list[dict]:
    """llama.cpp's answer (CHILD, in llama-cpp-python's interpreter) for the GGUF files and loom's prompts."""
    job = {
        "files": files,
        "n_ctx": 64,
        "new_tokens": new_tokens,
        "prompts": [{"text": r["text"], "ids": r["ids"]} for r in ours],
    }
    (work / "job.json").write_text(json.dumps(job))
    (work / "child.py").write_text(CHILD)
    cmd = [python, str(work / "child.py"), str(work / "job.json"), str(work / "answer.json")]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((work / "answer.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", required=True, help="the python of a virtualenv with llama-cpp-python")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gguf"))
    p.add_argument("--work", default=None, help="runs, data and GGUF files (default: OUT/work)")
    args = p.parse_args()
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    loom = [sys.executable, "-m", "loom"]
    for name, flags in DATA.items():
        if not (work / f"data-{name}" / "meta.json").is_file():
            sh(
                [
                    *loom,
                    "data",
                    "prepare",
                    "--corpus",
                    "python-stdlib",
                    "--out",
                    str(work / f"data-{name}"),
                    *flags,
                ]
            )
    results = {}
    for run, (data, flags) in RUNS.items():
        t0 = time.time()
        where = [f"--data.path={work / f'data-{data}'}", f"--run.dir={work}", f"--run.name={run}"]
        steps = [f"--train.steps={args.steps}", f"--train.log_every={args.steps}"]
        sh([*loom, "train", *where, *TRAIN, *steps, *flags])
        files = []
        for kind in TYPES:
            dest = work / f"{run}-{kind}"
            gguf = ["--format", "gguf", "--gguf-type", kind, "--out", str(dest), "--force"]
            sh([*loom, "export", str(work / run), *gguf])
            files.append({"name": kind, "path": str(dest / f"model-{kind}.gguf")})
        ours = loom_side(work / run, PROMPTS, args.new_tokens)
        theirs = run_llamacpp(args.llama_python, work, files, ours, args.new_tokens)
        per = {f["name"]: {"n_vocab": f["n_vocab"], "prompts": compare(ours, f)} for f in theirs}
        results[run] = {"seconds": round(time.time() - t0, 1), "types": per}
    (out / "gguf_llamacpp.json").write_text(json.dumps(results, indent=1))
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU acceptance kit: one command that says what works on this GPU, in a few minutes.

    make gpu-check                        # on a CUDA machine (whole kit <= 8 minutes on one H100/H200)
    make gpu-check ARGS=--cpu             # the same checks with tiny shapes on the CPU (CI tests the kit)
    python benchmarks/gpu_check.py [--cpu] [--out DIR] [--nanogpt PATH] [--only a,b] [--fail-check NAME]

Each check is a subprocess with a time limit; its output is kept in OUT/<check>.log. The kit writes
OUT/gpu-report.json and OUT/gpu-report.md (check, status, seconds, key figures) and exits 1 if any check
failed. Statuses: pass, fail, skipped (with the reason; "gpu only: would run <command>" under --cpu).
Checks, in order:
  tests-gpu            pytest tests/gpu -rs; on CUDA a skipped test is a failure (they exist to run there)
  prepare-data         a small char-level data set for the training checks (loom data prepare)
  train-<impl>         a few dozen steps with --parallel.dp_impl=ddp|zero1|zero2|fsdp in one process: the
                       wrapper is applied on a 1-rank NCCL group (gloo under --cpu), so its code path runs
  train-tp-pp          tensor, pipeline (1f1b) and context parallel (Ulysses) at degree 1 on 1-rank meshes
                       with fsdp (parallel.degree1_meshes): every model-parallel code path on one GPU
  train-cp-ring        the same with ring attention for the context-parallel dimension
  prepare-chat         conversations asking to reverse words, in train-ddp's tokenizer plus the chat tokens
  sft-lora             `loom sft` with LoRA on every block linear from the train-ddp run: losses, tokens/s
  chat                 `loom chat RUN --prompt` on that run: its greedy answer
  verify               with 2+ GPUs: loom verify over them (ddp, zero1, zero2, fsdp, tp, pp-1f1b)
  bench-optim          loom bench optim --params 124M: torch-fused, torch-foreach, triton; ms/step and the
                       share of the datasheet memory bandwidth (and of the copy bandwidth measured there)
  bench-train-eager    GPT-2 124M (vocab 50304, T=1024, bf16) through loom bench train: tokens/s, MFU, peak
                       memory, at the largest micro-batch of --micro-batches that fits (tried largest first)
  bench-train-compile  the same with train.compile=true at that micro-batch
  bench-long-flash     long context: one sequence of T = 32k a step (GPT-2 124M's width, bf16), causal flash
                       attention (SDPA): tokens/s, ms/step, peak memory
  bench-long-doc-mask  the same with data.doc_mask=true (FlexAttention's block mask, documents of ~2048
                       tokens): the same figures and its speed over the flash run's
  nanogpt              nanoGPT's own train.py on the same shape (compile on), with --nanogpt PATH
  bench-train-fp8-gpt2 GPT-2 124M at T=2048, compiled: bf16 against fp8 tensorwise and rowwise (loom bench train
                       --fp8, interleaved rounds, one micro-batch): tokens/s, speed over bf16, peak memory
  bench-train-fp8-1b   the same for a 1.0B Llama (20 layers, 2048 wide, 32k vocabulary) at T=2048
                       The two fp8 checks need torchao and take minutes of compilation each: past the kit's
                       default budget, run them with --only bench-train-fp8-gpt2,bench-train-fp8-1b
On a bare GPU machine (an interpreter that already has torch with CUDA and loom's dependencies, no package
index) `make gpu-check` runs this file from the working tree with that interpreter: `--probe` says whether it
can (exit 0) and lists what it misses. A missing optional package skips only the checks that need it: pytest
(tests-gpu), triton (bench-optim's triton kernel), transformers (the HF tests inside tests-gpu).
--fail-check NAME makes that check fail on purpose (its command is replaced by one that exits 1): how the
kit's own test proves that a failure reaches the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PY = sys.executable
LOOM = [PY, "-m", "loom"]
# loom's own dependencies (pyproject.toml) as import names; without one of them nothing runs
REQUIRED = ("torch", "numpy", "tokenizers", "rich", "safetensors", "matplotlib")
# optional packages and the checks they serve: a missing one skips only those
OPTIONAL = {
    "pytest": "tests-gpu",
    "triton": "bench-optim's triton kernel",
    "transformers": "the HF import/export tests in tests-gpu",
    "torchao": "the fp8 benchmarks (bench-train-fp8-*)",
}
BUDGET_S = 480.0  # the whole kit on a GPU: 8 minutes, under the device machine's 10 minutes per command

# Datasheet memory bandwidth in GB/s, matched as substrings of torch.cuda.get_device_name (first match wins).
GPU_BANDWIDTH_GBPS = {
    "H200": 4800.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,  # SXM
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,  # 40 GB
}

# GPT-2 124M as nanoGPT trains it: vocab padded to 50304, T=1024, no bias, no dropout.
GPT2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304}
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 50304}  # the same vocabulary
# issue 31's fp8 shapes (T = 2048) and micro-batches; --cpu: TINY
FP8_SHAPES = {
    "gpt2": ({**GPT2, "block_size": 2048}, 8),
    "1b": (
        {
            "family": "llama",
            "n_layer": 20,
            "n_head": 32,
            "n_kv_head": 8,
            "n_embd": 2048,
            "block_size": 2048,
            "vocab_size": 32768,
        },
        2,
    ),
}
DP_IMPLS = ("ddp", "zero1", "zero2", "fsdp")
VERIFY_STRATEGIES = "ddp,zero1,zero2,fsdp,tp,pp-1f1b"
NANO_STEP = re.compile(r"^iter (\d+): loss ([-\d.naif]+), time ([\d.]+)ms")


def datasheet_bandwidth(name: str) -> float | None:
    """The GPU's memory bandwidth in GB/s from its name, or None for an unknown device."""
    return next((bw for key, bw in GPU_BANDWIDTH_GBPS.items() if key in name), None)


@dataclass
class Check:
    name: str
    # candidate commands, tried in order until one does not run out of memory (usually just one)
    argvs: Callable[[dict], list[list[str]]] | None
    timeout_s: float
    figures: Callable[[str, dict], dict] = lambda out, ctx: {}  # key figures from the output
    why_not: str | None = None  # set: the check is not run, and this is the reason
    gpu_only: bool = False
    strict_skips: bool = False  # pytest: a skipped test fails the check
    cwd: Path = ROOT


# ------------------------------------------------------------------------------------------- the interpreter
def missing(names) -> list[str]:
    """The packages among `names` that this interpreter cannot import (found without importing them)."""
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def child_env() -> dict[str, str]:
    """The environment of every check: loom's sources first on PYTHONPATH, so the kit runs from the working
    tree on an interpreter where loom is not installed (a bare GPU machine), and from the same tree in .venv."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def probe(cpu: bool) -> int:
    """--probe: can this interpreter run the kit as it is, with no virtualenv and no pip? 0 if so, else 1.
    It can when it imports loom's dependencies and (unless --cpu) its torch sees a CUDA device; then
    installing anything would only replace the machine's own CUDA torch."""
    lacking = missing(REQUIRED)
    if lacking:
        print(
            f"gpu_check --probe: {PY} lacks loom's dependencies {', '.join(lacking)}: use a virtualenv (make setup)"
        )
        return 1
    import torch

    if not cpu and not torch.cuda.is_available():
        print(f"gpu_check --probe: torch {torch.__version__} in {PY} sees no CUDA device")
        return 1
    opt = missing(OPTIONAL)
    print(
        f"gpu_check --probe: {PY} has torch {torch.__version__} (CUDA {torch.version.cuda}) and loom's "
        "dependencies: running from the working tree, no virtualenv, no pip"
        + "".join(f"\n  missing optional package {n}: skips {OPTIONAL[n]}" for n in opt)
    )
    return 0


def versions(cuda: bool) -> dict[str, Any]:
    """What a figure depends on: interpreter, torch, CUDA, cuDNN, driver, the GPUs, triton, loom's commit."""
    import platform

    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": PY,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }
    for name in ("triton", "transformers", "numpy"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        info["loom_commit"] = sha.stdout.strip() or None
    except OSError:
        info["loom_commit"] = None
    if cuda:
        info["cudnn"] = torch.backends.cudnn.version()
        info["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(torch.cuda.device_count())
        ]
        info["driver"] = nvidia_driver()
    return info


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None where it cannot be asked."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


# ------------------------------------------------------------------------------------------- the checks
def build_checks(args, cuda: bool, n_gpus: int, out: Path) -> list[Check]:
    """Every check of the kit, in order; those that cannot run here carry the reason and the command."""
    data, shape = out / "data", (GPT2 if cuda else TINY)
    device = "cuda" if cuda else "cpu"
    lacking = set(missing(OPTIONAL))
    checks = [
        Check(
            "tests-gpu",
            lambda ctx: [[PY, "-m", "pytest", "tests/gpu", "-rs", "-q", "-p", "no:cacheprovider"]],
            240,
            pytest_figures,
            strict_skips=cuda,
            why_not="needs pytest, which this interpreter lacks" if "pytest" in lacking else None,
        ),
        Check(
            "prepare-data",
            lambda ctx: [
                [
                    *LOOM,
                    "data",
                    "prepare",
                    "--input",
                    str(write_text(out)),
                    "--out",
                    str(data),
                    "--tokenizer",
                    "char",
                    "--val-fraction",
                    "0.1",
                ]
            ],
            120,
        ),
    ]
    steps = 30 if cuda else 5
    small = (
        [
            "--model.n_layer=4",
            "--model.n_head=4",
            "--model.n_embd=128",
            "--model.block_size=128",
            "--train.batch_size=16",
        ]
        if cuda
        else [
            "--model.n_layer=2",
            "--model.n_head=2",
            "--model.n_embd=32",
            "--model.block_size=32",
            "--train.batch_size=8",
        ]
    )
    common = [
        f"--data.path={data}",
        f"--run.dir={out / 'runs'}",
        f"--train.device={device}",
        "--train.log_every=1",
        f"--train.steps={steps}",
        "--train.eval_every=0",
        "--train.sample_every=0",
        "--train.eval_batches=1",
        f"--precision.dtype={'bf16' if cuda else 'fp32'}",
        *small,
    ]
    for impl in DP_IMPLS:
        run = out / "runs" / f"train-{impl}"
        checks.append(
            Check(
                f"train-{impl}",
                lambda ctx, impl=impl: [
                    [*LOOM, "train", *common, f"--run.name=train-{impl}", f"--parallel.dp_impl={impl}"]
                ],
                120,
                lambda o, ctx, run=run: train_figures(run),
            )
        )
    run = out / "runs" / "train-tp-pp"
    checks.append(
        Check(
            "train-tp-pp",
            lambda ctx: [
                [
                    *LOOM,
                    "train",
                    *common,
                    "--run.name=train-tp-pp",
                    "--parallel.degree1_meshes=true",
                    "--parallel.dp_impl=fsdp",
                ]
            ],
            120,
            lambda o, ctx, run=run: train_figures(run),
        )
    )
    run = out / "runs" / "train-cp-ring"
    checks.append(
        Check(
            "train-cp-ring",
            lambda ctx: [
                [
                    *LOOM,
                    "train",
                    *common,
                    "--run.name=train-cp-ring",
                    "--parallel.degree1_meshes=true",
                    "--parallel.dp_impl=fsdp",
                    "--parallel.cp_impl=ring",
                    "--model.dropout=0.0",
                ]
            ],
            120,
            lambda o, ctx, run=run: train_figures(run),
        )
    )
    # chat SFT with LoRA (issue 34) from the train-ddp run: conversations in that run's tokenizer (its chat
    # tokens added, the embedding grown), adapters on every block linear, then loom chat's greedy answer
    base, sft_run = out / "runs" / f"train-{DP_IMPLS[0]}", out / "runs" / "sft-lora"
    chat, block = out / "chat", next(a for a in small if a.startswith("--model.block_size=")).split("=")[1]
    prepare_chat = [*LOOM, "data", "prepare", "--chat", "--input", str(out / "conversations.jsonl"), "--out",
                    str(chat), "--tokenizer", str(base), "--block-size", block, "--force"]  # fmt: skip
    sft = [*LOOM, "sft", *common, f"--data.path={chat}", "--run.name=sft-lora", f"--model.init_from=run:{base}",
           "--finetune.lora_rank=8", "--finetune.lora_targets=all-linear", "--data.doc_mask=true",
           "--data.doc_positions=restart"]  # fmt: skip
    ask = [
        *LOOM,
        "chat",
        str(sft_run),
        "--prompt",
        "reverse. of the",
        "--max-new-tokens",
        "16",
        "--device",
        device,
    ]
    checks += [
        Check("prepare-chat", lambda ctx: [write_conversations(out, 5 if cuda else 2, prepare_chat)], 120),
        Check("sft-lora", lambda ctx: [sft], 240, lambda o, ctx: train_figures(sft_run)),
        Check("chat", lambda ctx: [ask], 60, lambda o, ctx: {"answer": (o.strip().splitlines() or [""])[-1]}),
    ]
    verify = [
        *LOOM,
        "verify",
        "--strategies",
        VERIFY_STRATEGIES,
        f"--nproc={max(n_gpus, 2)}",
        "--steps=10",
        "--out",
        str(out / "verify"),
        "--train.device=cuda",
    ]
    no_verify = f"gpu only (needs 2+ GPUs, {n_gpus} here): would run {cmd(verify)}"
    checks.append(
        Check("verify", lambda ctx: [verify], 300, gpu_only=True, why_not=None if n_gpus >= 2 else no_verify)
    )
    optim = out / "bench-optim.json"
    sizes = (
        ["--params", "124M", "--device", "cuda"]
        if cuda
        else ["--params", "1M", "--device", "cpu", "--iters", "3", "--warmup", "1", "--copy-mb", "16"]
    )
    impls = ["--impls", "torch-fused,torch-foreach" + ("" if "triton" in lacking else ",triton")]
    checks.append(
        Check(
            "bench-optim",
            lambda ctx: [[*LOOM, "bench", "optim", *impls, *sizes, "--json", str(optim)]],
            180,
            lambda o, ctx: optim_figures(optim, cuda),
        )
    )
    mbs = args.micro_batches if cuda else [2]

    def bench_base(model: dict, dtype: str) -> list[str]:
        """loom bench train on synthetic data: a few timed steps of `model` (no dropout, no biases)."""
        return [
            *LOOM,
            "bench",
            "train",
            "--synthetic",
            f"--steps={10 if cuda else 2}",
            f"--warmup={3 if cuda else 1}",
            *[f"--model.{k}={v}" for k, v in model.items()],
            "--model.dropout=0.0",
            "--model.bias=false",
            f"--train.device={device}",
            f"--precision.dtype={dtype}",
        ]

    bench = bench_base(shape, "bf16" if cuda else "fp32")

    def bench_argvs(compile_: bool):
        def argvs(ctx: dict) -> list[list[str]]:
            found = ctx.get("bench-train-eager", {}).get("figures", {}).get("micro_batch")
            sizes = [found] if compile_ and found else mbs
            return [
                [
                    *bench,
                    f"--train.compile={str(compile_).lower()}",
                    f"--train.batch_size={mb}",
                    f"--train.micro_batch_size={mb}",
                    "--json",
                    str(out / f"bench-train-{mb}-{compile_}.json"),
                ]
                for mb in sizes
            ]

        return argvs

    checks.append(Check("bench-train-eager", bench_argvs(False), 240, bench_train_figures))
    checks.append(Check("bench-train-compile", bench_argvs(True), 300, bench_train_figures))
    if not cuda:
        checks[-1].why_not = (
            "--cpu leaves torch.compile out (minutes of C++ compilation on a CPU): would run "
            + cmd(bench_argvs(True)({})[0])
        )
    # Long context: one sequence of T = 32k (256 on --cpu) a step, causal flash attention (SDPA) against
    # document-masked attention (FlexAttention's block mask on the GPU; documents of ~2048 tokens)
    long_t = 32768 if cuda else 256
    for name, extra in (("flash", []), ("doc-mask", ["--data.doc_mask=true"])):
        long_json = out / f"bench-long-{name}.json"
        long_argv = [
            *LOOM,
            "bench",
            "train",
            "--synthetic",
            f"--steps={5 if cuda else 2}",
            "--warmup=1",
            *[f"--model.{k}={v}" for k, v in {**shape, "block_size": long_t}.items()],
            "--model.dropout=0.0",
            "--model.bias=false",
            "--train.batch_size=1",
            "--train.micro_batch_size=1",
            f"--train.device={device}",
            f"--precision.dtype={'bf16' if cuda else 'fp32'}",
            *extra,
            "--json",
            str(long_json),
        ]
        checks.append(
            Check(
                f"bench-long-{name}",
                lambda ctx, argv=long_argv: [argv],
                240,
                lambda o, ctx, name=name: long_context_figures(o, ctx, name),
            )
        )
    # Mixture of experts (issue 32): the same MoE (8 SwiGLU experts as wide as the dense MLP, top-2, in every
    # layer) with its experts as one grouped GEMM (torch._grouped_mm) and as a loop of matmuls, one expert each
    moe_json = out / "bench-train-moe.json"
    moe_argv = [
        *bench,
        "--model.family=moe",
        "--model.n_experts=8",
        "--model.moe_top_k=2",
        f"--train.batch_size={4 if cuda else 2}",
        f"--train.micro_batch_size={4 if cuda else 2}",
        "--moe-gemm",
        "grouped,loop",
        "--json",
        str(moe_json),
    ]
    checks.append(Check("bench-train-moe", lambda ctx: [moe_argv], 300, lambda o, ctx: moe_figures(moe_json)))
    checks.append(
        Check(
            "nanogpt",
            lambda ctx: [nanogpt_argv(args.nanogpt, out, shape, ctx, mbs, cuda)],
            300,
            nanogpt_figures,
            cwd=Path(args.nanogpt or ROOT).resolve(),
        )
    )
    if args.nanogpt is None:
        checks[
            -1
        ].why_not = "needs --nanogpt PATH (a nanoGPT checkout): would run PATH/train.py on the same shape"
    for name, (fp8_shape, fp8_mb) in FP8_SHAPES.items():
        fp8_json = out / f"bench-train-fp8-{name}.json"
        fp8_argv = [
            *bench_base(fp8_shape if cuda else TINY, "bf16"),
            f"--train.batch_size={fp8_mb if cuda else 2}",
            f"--train.micro_batch_size={fp8_mb if cuda else 2}",
            f"--train.compile={'true' if cuda else 'false'}",
            # on a GPU torchao's size rule picks the linears; the CPU's tiny model has none that big
            *([] if cuda else ["--precision.fp8_filter=all"]),
            "--fp8",
            "off,tensorwise,rowwise" if cuda else "off,tensorwise",
            "--json",
            str(fp8_json),
        ]
        why_not = (
            "needs torchao (the loom[fp8] extra), which this interpreter lacks"
            if "torchao" in lacking
            else None
        )
        if not cuda and name != "gpt2":  # --cpu: both shapes are TINY; the first check runs it
            why_not = f"gpu only (--cpu runs bench-train-fp8-gpt2's tiny shape): would run {cmd(fp8_argv)}"
        checks.append(
            Check(
                f"bench-train-fp8-{name}",
                lambda ctx, argv=fp8_argv: [argv],
                420,
                lambda o, ctx, path=fp8_json: fp8_figures(path),
                why_not=why_not,
            )
        )
    return checks


def write_text(out: Path) -> Path:
    """Deterministic pseudo-English (about 200k characters) for the training checks."""
    import random

    words = (
        "the of and to in is that it for as with was on be by at this from have or an they which one you "
        "were her all she there would their we him been has when who will more no if out so"
    ).split()
    rng, lines, size = random.Random(0), [], 0
    while size < 200_000:
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + ".")
        size += len(lines[-1]) + 1
    path = out / "text.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def write_conversations(out: Path, most_words: int, argv: list[str]) -> list[str]:
    """Write OUT/conversations.jsonl, 800 conversations asking to reverse 2 to most_words of write_text's
    words (its characters only); returns argv, the command that prepares them."""
    import random

    words = "the of and to in is that it for as with was on be by at this from have or".split()
    rng, lines = random.Random(1), []
    for _ in range(800):
        w = rng.sample(words, rng.randint(2, most_words))
        msgs = [{"role": "user", "content": "reverse. " + " ".join(w)}]
        lines.append(json.dumps({"messages": [*msgs, {"role": "assistant", "content": " ".join(w[::-1])}]}))
    (out / "conversations.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return argv


def nanogpt_argv(nanogpt: Path, out: Path, shape: dict, ctx: dict, mbs: list[int], cuda: bool) -> list[str]:
    """nanoGPT's train.py on loom's bench shape, run in its checkout (it reads configurator.py and data/ from
    there), on random tokens written in its own format to PATH/data/gpu_check/{train,val}.bin."""
    import numpy as np

    mb = ctx.get("bench-train-compile", {}).get("figures", {}).get("micro_batch") or mbs[-1]
    data = Path(nanogpt) / "data" / "gpu_check"
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):  # no meta.pkl: nanoGPT then uses GPT-2's vocabulary padded to 50304
        rng.integers(0, shape["vocab_size"], 64 * (shape["block_size"] + 1), dtype=np.uint16).tofile(
            data / f"{split}.bin"
        )
    return [
        PY,
        "train.py",
        "--dataset=gpu_check",
        f"--out_dir={out / 'nanogpt'}",
        f"--n_layer={shape['n_layer']}",
        f"--n_head={shape['n_head']}",
        f"--n_embd={shape['n_embd']}",
        f"--block_size={shape['block_size']}",
        f"--batch_size={mb}",
        "--gradient_accumulation_steps=1",
        f"--max_iters={20 if cuda else 3}",
        "--eval_interval=100000",
        "--eval_iters=1",
        "--log_interval=1",
        "--dropout=0.0",
        "--bias=False",
        "--always_save_checkpoint=False",
        "--wandb_log=False",
        f"--compile={cuda}",
        f"--device={'cuda' if cuda else 'cpu'}",
        f"--dtype={'bfloat16' if cuda else 'float32'}",
    ]


# ------------------------------------------------------------------------------------------- key figures
def pytest_figures(output: str, ctx: dict) -> dict:
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)\b", output)}
    skips = re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", output, re.M)
    reasons = sorted({r for _, r in skips})
    lacking = missing(OPTIONAL)  # tests skipped for a package this interpreter lacks: reported, not failed
    excused = sum(int(n) for n, r in skips if any(p in r for p in lacking))
    return {
        **counts,
        **({"skip_reasons": reasons} if reasons else {}),
        **({"skipped_missing_package": excused} if excused else {}),
    }


def train_figures(run: Path) -> dict:
    from loom.metrics import read_jsonl

    recs = read_jsonl(run / "metrics.jsonl")
    losses = [r["loss"] for r in recs if "loss" in r]
    summary = next((r["summary"] for r in recs if "summary" in r), {})
    return {
        "steps": len(losses),
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
        "tokens_per_s": round(summary.get("tokens_per_s") or 0),
    }


def optim_figures(path: Path, cuda: bool) -> dict:
    recs = json.loads(path.read_text())
    name = recs[0]["device_name"]
    sheet = datasheet_bandwidth(name) if cuda else None
    figs: dict[str, Any] = {
        "device_name": name,
        "n_params": recs[0]["n_params"],
        "datasheet_gbps": sheet,
        "copy_gbps": round(recs[0]["copy_bandwidth_gbps"], 1),
    }
    for r in recs:
        if "skipped" in r:
            figs[r["impl"]] = f"skipped: {r['skipped']}"
            continue
        figs[r["impl"]] = {
            "ms": round(r["time_ms"], 3),
            "gbps": round(r["bandwidth_gbps"], 1),
            "of_copy": round(r["fraction_of_copy"], 3),
            "of_datasheet": round(r["bandwidth_gbps"] / sheet, 3) if sheet else "n/a",
        }
    return figs


def bench_train_figures(output: str, ctx: dict) -> dict:
    path = Path(ctx["argv"][ctx["argv"].index("--json") + 1])
    r = json.loads(path.read_text())[0]
    return {
        "micro_batch": r["micro_batch_size"],
        "micro_batch_note": ctx["mb_note"],
        "tokens_per_s": round(r["tokens_per_s"]),
        "mfu": round(r["mfu"], 4) if r["mfu"] is not None else "n/a",
        "peak_mem_gib": round(r["peak_mem_bytes"] / 2**30, 2),
        "compile_s": r["compile_s"],
        "ms_per_step": round(r["ms_per_step"], 1),
    }


def fp8_figures(path: Path) -> dict:
    """Per recipe: tokens/s, speed over bf16 (the first mode, timed in the same rounds), peak memory."""
    figs = {}
    for r in json.loads(path.read_text()):
        figs[f"{r['mode']}_tokens_per_s"] = round(r["tokens_per_s"])
        figs[f"{r['mode']}_vs_bf16"] = round(r["speed_vs_first"], 3)
        figs[f"{r['mode']}_peak_mem_gib"] = round(r["peak_mem_bytes"] / 2**30, 2)
    return figs


def moe_figures(path: Path) -> dict:
    """The MoE's tokens/s, MFU (on active parameters) and peak memory with each expert GEMM (timed in the same
    interleaved rounds), and the grouped GEMM's speed over the loop's."""
    figs: dict[str, Any] = {}
    for r in json.loads(path.read_text()):
        figs[f"{r['mode']}_tokens_per_s"] = round(r["tokens_per_s"])
        figs[f"{r['mode']}_mfu"] = round(r["mfu"], 4) if r["mfu"] is not None else "n/a"
        figs[f"{r['mode']}_peak_mem_gib"] = round(r["peak_mem_bytes"] / 2**30, 2)
    figs["grouped_vs_loop"] = round(figs["grouped_tokens_per_s"] / figs["loop_tokens_per_s"], 3)
    return figs


def long_context_figures(output: str, ctx: dict, name: str) -> dict:
    """tokens/s, ms/step and peak memory at one long sequence a step; the doc-masked run adds its speed as a
    share of the flash run's."""
    path = Path(ctx["argv"][ctx["argv"].index("--json") + 1])
    r = json.loads(path.read_text())[0]
    figs = {
        "block_size": int(next(a for a in ctx["argv"] if a.startswith("--model.block_size=")).split("=")[1]),
        "tokens_per_s": round(r["tokens_per_s"]),
        "ms_per_step": round(r["ms_per_step"], 1),
        "peak_mem_gib": round(r["peak_mem_bytes"] / 2**30, 2),
    }
    flash = ctx.get("bench-long-flash", {}).get("figures", {}).get("tokens_per_s")
    if name == "doc-mask" and flash:
        figs["over_flash"] = round(r["tokens_per_s"] / flash, 3)
    return figs


def nanogpt_figures(output: str, ctx: dict) -> dict:
    times = [float(m.group(3)) for line in output.splitlines() if (m := NANO_STEP.match(line.strip()))]
    mb = int(
        ctx["argv"][next(i for i, a in enumerate(ctx["argv"]) if a.startswith("--batch_size="))].split("=")[1]
    )
    block = int(next(a for a in ctx["argv"] if a.startswith("--block_size=")).split("=")[1])
    steady = times[3:] or times[1:] or times  # iteration 0 includes compilation and the first evaluation
    tps = mb * block / (statistics.median(steady) / 1e3) if steady else 0.0
    figs = {"micro_batch": mb, "steps": len(times), "tokens_per_s": round(tps)}
    loom_tps = ctx.get("bench-train-compile", {}).get("figures", {}).get("tokens_per_s") or ctx.get(
        "bench-train-eager", {}
    ).get("figures", {}).get("tokens_per_s")
    if loom_tps and tps:
        figs["loom_over_nanogpt"] = round(loom_tps / tps, 3)
    return figs


# ------------------------------------------------------------------------------------------- running
def cmd(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv).replace(PY, "python")


def out_of_memory(output: str) -> bool:
    return "out of memory" in output.lower() or "OutOfMemoryError" in output


def run_check(c: Check, ctx: dict, out: Path, deadline: float, fail: str | None) -> dict:
    """Run one check (each candidate command until one fits in memory); its result as a report row."""
    t0 = time.perf_counter()
    argvs = c.argvs(ctx)
    if c.name == fail:
        argvs = [[PY, "-c", f"raise SystemExit('deliberate failure of {c.name} (--fail-check)')"]]
    log_path, tried, output, rc = out / f"{c.name}.log", [], "", 0
    with log_path.open("w", encoding="utf-8") as log:
        for argv in argvs:
            limit = min(c.timeout_s, deadline - time.monotonic())
            if limit <= 0:
                return {
                    "status": "fail",
                    "reason": "the kit's time budget (--budget-s) was spent before it ran",
                    "seconds": 0.0,
                    "command": cmd(argv),
                }
            log.write(f"$ {cmd(argv)}\n")
            log.flush()
            # a session of its own, so that a timeout ends the check's whole process tree (loom's workers too)
            proc = subprocess.Popen(
                argv,
                cwd=c.cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=child_env(),
                start_new_session=True,
            )
            try:
                output, _ = proc.communicate(timeout=limit)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                log.write(output)
                return {
                    "status": "fail",
                    "reason": f"timed out after {limit:.0f} s",
                    "command": cmd(argv),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            log.write(output + f"\n[exit {rc}]\n")
            tried.append(argv)
            if rc == 0 or not out_of_memory(output) or argv is argvs[-1]:
                break
    row: dict[str, Any] = {"command": cmd(argv), "seconds": round(time.perf_counter() - t0, 1), "rc": rc}
    sizes = [a.split("=")[1] for v in argvs for a in v if a.startswith("--train.micro_batch_size=")]
    note = f"largest of {'/'.join(sizes)} that fits ({len(tried) - 1} ran out of memory)"
    ctx_one = {**ctx, "argv": argv, "mb_note": note}
    if rc != 0:
        tail = [ln for ln in output.strip().splitlines() if ln.strip()][-3:]
        row.update(status="fail", reason=f"exit {rc}: " + " | ".join(tail)[-300:])
        return row
    try:
        row["figures"] = c.figures(output, ctx_one)
    except Exception as e:  # a check that ran but whose output lacks its figures has failed
        row.update(status="fail", reason=f"no figures in its output: {type(e).__name__}: {e}")
        return row
    skipped = row["figures"].get("skipped", 0) if isinstance(row["figures"], dict) else 0
    skipped -= row["figures"].get("skipped_missing_package", 0) if isinstance(row["figures"], dict) else 0
    if c.strict_skips and skipped > 0:
        row.update(status="fail", reason=f"{skipped} test(s) skipped on a CUDA machine")
    elif (
        ctx["_cuda"]
        and c.name == "bench-optim"
        and any(str(v).startswith("skipped") for v in row["figures"].values())
    ):
        row.update(status="fail", reason="an implementation was skipped on CUDA (triton missing?)")
    else:
        row["status"] = "pass"
    return row


def fmt_figures(figs: dict) -> str:
    parts = []
    for k, v in figs.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a} {b}" for a, b in v.items())
            parts.append(f"{k}: {v}")
        elif isinstance(v, list):
            parts.append(f"{k}: " + "; ".join(map(str, v)))
        else:
            parts.append(f"{k} {v}")
    return "; ".join(parts).replace("|", "/")


def write_report(out: Path, header: dict, rows: list[dict]) -> None:
    (out / "gpu-report.json").write_text(json.dumps({**header, "checks": rows}, indent=1) + "\n")
    lines = [
        f"# loom GPU check: {header['device_name']}",
        "",
        f"{header['mode']} | torch {header['torch']} | {header['n_gpus']} GPU(s) | {header['date']} | "
        f"{header['seconds']:.0f} s | {'all passed' if header['ok'] else 'FAILED'}",
        "",
        "versions: " + ", ".join(f"{k} {v}" for k, v in header["versions"].items() if k != "gpus"),
        "",
        *[
            f"GPU {i}: {g['name']}, sm {g['capability']}, {g['memory_gib']} GiB"
            for i, g in enumerate(header["versions"].get("gpus", []))
        ],
        "",
        "| check | status | seconds | key figures |",
        "|---|---|---:|---|",
    ]
    for r in rows:
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(
            f"| {r['check']} | {status.replace('|', '/')} | {r.get('seconds', 0):.1f} | "
            f"{fmt_figures(r.get('figures', {}))} |"
        )
    (out / "gpu-report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu", action="store_true", help="tiny shapes on the CPU (GPU-only checks listed, not run)"
    )
    p.add_argument("--out", type=Path, help="report folder (default runs/gpu-check-<time>)")
    p.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout: also run its train.py on the same shape")
    p.add_argument(
        "--micro-batches",
        default="32,16,8",
        help="GPT-2 124M micro-batches to try, largest first (default 32,16,8)",
    )
    p.add_argument("--only", help="comma list of checks to run (the others are reported as not selected)")
    p.add_argument("--fail-check", metavar="NAME", help="make this check fail on purpose (tests the kit)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="time for the whole kit (default 480)")
    p.add_argument(
        "--probe",
        action="store_true",
        help="only say whether this interpreter runs the kit as it is (exit 0) or needs a virtualenv",
    )
    args = p.parse_args(argv)
    if args.probe:
        return probe(args.cpu)
    args.micro_batches = [int(x) for x in args.micro_batches.split(",")]
    if str(SRC) not in sys.path:  # the figures read loom's records in this process: the tree's loom
        sys.path.insert(0, str(SRC))
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print(
            "gpu_check: no CUDA device here; run with --cpu (tiny shapes, GPU-only checks listed)",
            file=sys.stderr,
        )
        return 2
    n_gpus = torch.cuda.device_count() if cuda else 0
    out = args.out or ROOT / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    checks = build_checks(args, cuda, n_gpus, out)
    names = [c.name for c in checks]
    only = set(args.only.split(",")) if args.only else None
    for n in [*(only or []), *([args.fail_check] if args.fail_check else [])]:
        if n not in names:
            print(f"gpu_check: unknown check '{n}'; the checks are {', '.join(names)}", file=sys.stderr)
            return 2
    t0, deadline = time.perf_counter(), time.monotonic() + args.budget_s
    ctx: dict[str, Any] = {"_cuda": cuda}
    env = versions(cuda)
    print(
        "gpu_check: "
        + ", ".join(f"{k} {v}" for k, v in env.items() if k != "gpus" and v is not None)
        + "".join(
            f"\n  GPU {i}: {g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)"
            for i, g in enumerate(env.get("gpus", []))
        ),
        flush=True,
    )
    for n in missing(OPTIONAL):
        print(f"gpu_check: optional package {n} is missing here: skips {OPTIONAL[n]}", flush=True)
    rows = []
    for i, c in enumerate(checks, 1):
        row: dict[str, Any] = {"check": c.name}
        if only is not None and c.name not in only:
            row.update(status="skipped", reason="not selected (--only)")
        elif c.gpu_only and not cuda:
            row.update(status="skipped", reason=c.why_not or f"gpu only: would run {cmd(c.argvs({})[0])}")
        elif c.why_not:
            row.update(status="skipped", reason=c.why_not)
        elif c.name.startswith("train-") and ctx.get("prepare-data", {}).get("status") != "pass":
            row.update(status="fail", reason="prepare-data failed")
        else:
            print(f"[{i}/{len(checks)}] {c.name} ...", flush=True)
            row.update(run_check(c, ctx, out, deadline, args.fail_check))
        ctx[c.name] = row
        rows.append(row)
        extra = f" ({row['reason']})" if row.get("reason") else ""
        print(f"[{i}/{len(checks)}] {c.name}: {row['status']}{extra}", flush=True)
    ok = all(r["status"] != "fail" for r in rows)
    header = {
        "mode": "cuda" if cuda else "cpu (--cpu: tiny shapes)",
        "ok": ok,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
        "n_gpus": n_gpus,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": time.perf_counter() - t0,
        "versions": env,
        "missing_optional": missing(OPTIONAL),
    }
    write_report(out, header, rows)
    print((out / "gpu-report.md").read_text())
    print(f"report: {out / 'gpu-report.md'} and gpu-report.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

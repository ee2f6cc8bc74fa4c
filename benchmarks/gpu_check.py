"""The GPU acceptance kit: one command that says what works on this GPU, the figures that matter first.

    make gpu-check ARGS="--plan first --export DIR"   # on a CUDA machine: the open questions, ~5 minutes
    make gpu-check ARGS="--cpu"                       # every line with tiny shapes on the CPU (CI tests the kit)
    python benchmarks/gpu_check.py [--cpu] [--plan first|second|rest|all | --only a,b] [--out DIR]
                                   [--export DIR] [--budget-s S] [--times TOML] [--nanogpt PATH]
                                   [--fail-check NAME] [--hang-check NAME]

Each line is a process of its own with a time limit (a `loom` line a fork of loom's preloaded fork server,
loom.train.spawn.start_loom), its output streamed to OUT/<line>.log. Lines run by priority, not
in a fixed order: `--plan first` (<= 5 minutes on one H100) answers the open questions: GPT-2 124M bf16
tokens/s and MFU eager and compiled, the Triton fused AdamW against torch's fused, DDP over NCCL at one GPU,
long-context flash attention; `second` the fp8 1B comparison and the benchmarks the first leaves; `rest` the
correctness lines; `all` (the default) all of them in that order. `--only a,b` runs those lines in the order
given. A line runs after the lines it needs (prepare-data before a training), added to the plan if missing.
Each line's estimated seconds are in benchmarks/gpu_check_times.toml, beside this file (--times: another).

The report, OUT/gpu-report.json and OUT/gpu-report.md (line, status, seconds, key figures), is rewritten after
every line, and each line's figures are on its console status line, so a kit stopped by a time limit (SIGTERM,
SIGINT: the running line is stopped and reported) or killed leaves what it did. Statuses: pass, fail, skipped
(with the reason; "gpu only: would run <command>" under --cpu), cut (the kit's time budget, --budget-s, ran
out before or during the line, or the kit was stopped: not a failure), pending (not reached yet). Exit code:
1 if a line failed, 128 + the signal's number if the kit was stopped, else 0.
`--export DIR` (a device command's $OUT) writes at most 4 flat files there, refreshed after every line:
gpu-report.md, gpu-report.json, gpu-check-console.log and gpu-check-files.tar.gz (every line's log, the
benchmarks' JSON, the runs' metrics.jsonl and run.json).

The lines, by priority (plan first, then second, then rest):
  bench-train-eager    GPT-2 124M (vocab 50304, T=1024, bf16) through loom bench train: tokens/s, MFU, peak
                       memory, at the largest micro-batch of --micro-batches that fits (tried largest first)
  bench-optim          loom bench optim --params 124M: torch-fused, torch-foreach, triton; ms/step and the
                       share of the datasheet memory bandwidth (and of the copy bandwidth measured there)
  bench-long-flash     long context: one sequence of T = 32k a step (GPT-2 124M's width, bf16), causal flash
                       attention (SDPA): tokens/s, ms/step, peak memory
  prepare-data         a small char-level data set for the training lines (loom data prepare)
  train-ddp            a few dozen steps with --parallel.dp_impl=ddp in one process: the wrapper is applied on
                       a 1-rank NCCL group (gloo under --cpu), so its code path runs; losses, tokens/s
  bench-train-compile  bench-train-eager with train.compile=true at the micro-batch it found; compile_s counts
                       the forward's and the backward's compilation (the first step, timed whole)
  bench-train-fp8-1b   a 1.0B Llama (20 layers, 2048 wide, 32k vocabulary) at T=2048, compiled: bf16 against
                       fp8 tensorwise and rowwise (loom bench train --fp8, interleaved rounds, one micro-batch):
                       tokens/s, speed over bf16, peak memory, and per mode how many linears train in float8
                       (torchao's size rule: the projections too small to gain stay bf16)
  speedrun-gpt2        configs/speedrun_gpt2_124m.toml as it is (GPT-2 124M's shape, Muon, bf16, compiled) on the
                       built-in corpus to its fixed token budget: val loss at the end, tokens/s, MFU (--cpu: a
                       tiny shape on prepare-data's set, 4 steps)
  bench-decode         generation: GPT-2 124M bf16 through loom bench generate at batch 1 and 64 (prompt 128,
                       128 new tokens, greedy): loom's decode tokens/s, transformers' generate on loom's export
                       beside it, and decoding's memory-bandwidth use (weights and KV cache read per step)
  bench-decode-int8    bench-decode's model and shapes (no transformers side) with int8 weight-only linears
                       (torchao, loom bench generate --quantize int8) beside bf16: decode tokens/s of each, ratio
  bench-long-doc-mask  bench-long-flash with data.doc_mask=true (FlexAttention's block mask, compiled on CUDA,
                       documents of ~2048 tokens): the same figures and its speed over the flash run's
  bench-train-fp8-gpt2 the same fp8 comparison for GPT-2 124M at T=2048 with precision.fp8_filter=all (the size
                       rule would leave its linears, all 768 wide, in bf16)
                       The fp8 lines need torchao (a wheel with no dependencies: README, "GPU check")
  bench-train-moe      a mixture of experts (8 experts, top-2) with its expert GEMMs grouped and looped
  nanogpt              nanoGPT's own train.py on GPT-2 124M (compile on), with --nanogpt PATH
  tests-gpu            pytest tests/gpu -rs; on CUDA a skipped test is a failure (they exist to run there)
  train-<impl>         train-ddp's run with dp_impl=zero1, zero2, fsdp
  train-tp-pp          tensor, pipeline (1f1b) and context parallel (Ulysses) at degree 1 on 1-rank meshes
                       with fsdp (parallel.degree1_meshes): every model-parallel code path on one GPU
  train-cp-ring        the same with ring attention for the context-parallel dimension
  prepare-chat         conversations asking to reverse words, in train-ddp's tokenizer plus the chat tokens
  sft-lora             `loom sft` with LoRA on every block linear from the train-ddp run: losses, tokens/s
  chat                 `loom chat RUN --prompt` on that run: its greedy answer
  verify               with 2+ GPUs: loom verify over them (ddp, zero1, zero2, fsdp, tp, pp-1f1b)
On a bare GPU machine (an interpreter that already has torch with CUDA and loom's dependencies, no package
index) `make gpu-check` runs this file from the working tree with that interpreter: `--probe` says whether it
can (exit 0) and lists what it misses. A missing optional package skips only the lines that need it: pytest
(tests-gpu), triton (bench-optim's triton kernel), transformers (the HF tests inside tests-gpu), torchao (fp8).
--fail-check NAME makes that line fail on purpose (its command is replaced by one that exits 1): how the
kit's own test proves that a failure reaches the exit code. --hang-check NAME makes that line sleep for a minute:
how it proves that the budget stops a running line (a real line may finish inside any short budget).
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
import tarfile
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
# --cpu: the tiny shapes on a shared CI machine; the budget is there to stop a hang, not to plan the time
CPU_BUDGET_S = 1800.0
TIMES = Path(__file__).with_name("gpu_check_times.toml")

# Each line's priority is its place here: plans run in this order, `all` runs first, second, rest.
PLANS = {
    # the open questions, cheapest first and the compile (the longest, the likeliest to hang) last
    "first": (
        "bench-train-eager",
        "bench-optim",
        "bench-long-flash",
        "prepare-data",
        "train-ddp",
        "bench-train-compile",
    ),
    # the fp8 1B comparison, then the benchmarks the first plan leaves
    "second": (
        "bench-train-fp8-1b",
        "speedrun-gpt2",
        "bench-decode",
        "bench-decode-int8",
        "bench-long-doc-mask",
        "bench-train-fp8-gpt2",
        "bench-train-moe",
        "nanogpt",
    ),
    # the correctness lines (train-ddp's run is their base: it is added where it has not run)
    "rest": (
        "tests-gpu",
        "train-zero1",
        "train-zero2",
        "train-fsdp",
        "train-tp-pp",
        "train-cp-ring",
        "prepare-chat",
        "sft-lora",
        "chat",
        "rl-tis",
        "verify",
    ),
}
PLANS["all"] = tuple(n for plan in ("first", "second", "rest") for n in PLANS[plan])
# what a line reads from another: it runs after it, and a plan without it gets it added
NEEDS = {
    **{f"train-{x}": ("prepare-data",) for x in ("ddp", "zero1", "zero2", "fsdp", "tp-pp", "cp-ring")},
    "prepare-chat": ("train-ddp",),
    "sft-lora": ("prepare-chat",),
    "chat": ("sft-lora",),
    "rl-tis": ("train-ddp",),
    "speedrun-gpt2": ("prepare-data",),  # --cpu trains on its set (the GPU on the built-in corpus)
}
EXPORT_FILES = ("gpu-report.md", "gpu-report.json", "gpu-check-console.log", "gpu-check-files.tar.gz")
ARCHIVED = {
    ".log",
    ".json",
    ".jsonl",
    ".md",
}  # what the export's archive keeps of OUT (not data, not weights)
ARCHIVE_MAX_FILE = 4 * 2**20

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


def line_times(cuda: bool, path: Path = TIMES) -> dict[str, float]:
    """Each line's estimated seconds on this kind of machine (gpu_check_times.toml's [cuda] or [cpu] table),
    and "overhead", the kit's own (its interpreter, the versions, the report and the export)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: loom's dependency tomli
        import tomli as tomllib

    table = tomllib.loads(path.read_text(encoding="utf-8"))["cuda" if cuda else "cpu"]
    return {k: float(v) for k, v in table.items() if isinstance(v, (int, float))}


def resolve_plan(names: list[str] | tuple[str, ...]) -> list[str]:
    """The lines in the order given, each preceded by the lines it needs (NEEDS) unless they come earlier."""
    plan: list[str] = []

    def add(name: str) -> None:
        if name not in plan:
            for need in NEEDS.get(name, ()):
                add(need)
            plan.append(name)

    for name in names:
        add(name)
    return plan


def plan_estimate(
    names: list[str], cuda: bool = True, skipped: frozenset[str] = frozenset(), path: Path = TIMES
) -> float:
    """The estimated seconds of a plan's lines but those `skipped` here, the kit's overhead included (a line
    without an estimate counts as a minute)."""
    times = line_times(cuda, path)
    lines = [n for n in resolve_plan(names) if n not in skipped]
    return times.get("overhead", 0.0) + sum(times.get(n, 60.0) for n in lines)


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
    """Every line of the kit (PLANS orders them); those that cannot run here carry the reason and the command."""
    lacking = set(missing(OPTIONAL))
    small, common = train_args(cuda, out)
    return [
        *training_checks(cuda, out, lacking, common),
        *chat_checks(cuda, out, small, common),
        verify_check(n_gpus, out),
        *bench_checks(args, cuda, out, lacking),
        *long_context_checks(cuda, out),
        decode_check(cuda, out, lacking),
        int8_decode_check(cuda, out, lacking),
        *moe_and_nanogpt_checks(args, cuda, out),
        *fp8_checks(cuda, out, lacking),
        speedrun_check(cuda, out),
    ]


def train_args(cuda: bool, out: Path) -> tuple[list[str], list[str]]:
    """The training lines' small model, and every option they share (the small model's among them)."""
    data, device = out / "data", "cuda" if cuda else "cpu"
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
    return small, common


def training_checks(cuda: bool, out: Path, lacking: set[str], common: list[str]) -> list[Check]:
    """tests/gpu, the data set, and a few dozen steps with each data-parallel wrapper and model-parallel layout."""
    data = out / "data"
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
                [*LOOM, "data", "prepare", "--input", str(write_text(out)), "--out", str(data)]
                + ["--tokenizer", "char", "--val-fraction", "0.1"]
            ],
            120,
        ),
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
    return checks


def chat_checks(cuda: bool, out: Path, small: list[str], common: list[str]) -> list[Check]:
    device = "cuda" if cuda else "cpu"
    # chat SFT with LoRA (issue 34) from the train-ddp run: conversations in that run's tokenizer (its chat
    # tokens added, the embedding grown), adapters on every block linear, then loom chat's greedy answer
    base, sft_run = out / "runs" / f"train-{DP_IMPLS[0]}", out / "runs" / "sft-lora"
    chat, block = out / "chat", next(a for a in small if a.startswith("--model.block_size=")).split("=")[1]
    prepare_chat = [
        *LOOM,
        "data",
        "prepare",
        "--chat",
        "--input",
        str(out / "conversations.jsonl"),
        "--out",
        str(chat),
        "--tokenizer",
        str(base),
        "--block-size",
        block,
        "--force",
    ]
    sft = [
        *LOOM,
        "sft",
        *common,
        f"--data.path={chat}",
        "--run.name=sft-lora",
        f"--model.init_from=run:{base}",
        "--finetune.lora_rank=8",
        "--finetune.lora_targets=all-linear",
        "--data.doc_mask=true",
        "--data.doc_positions=restart",
    ]
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
    # loom rl from the train-ddp base (raw-text prompts), batch-invariance off: the sampler's and the trainer's
    # log-probabilities differ (bf16 on CUDA) and rl.is_cap's truncated importance weights correct for it
    rl_run = out / "runs" / "rl-tis"
    rl = [
        *LOOM,
        "rl",
        *common,
        "--run.name=rl-tis",
        f"--model.init_from=run:{base}",
        f"--rl.prompts={out / 'rl_prompts.jsonl'}",
        "--rl.reward=regex",
        "--rl.pattern=e",
        "--rl.stop=.",
        "--rl.group_size=4",
        "--rl.max_new_tokens=16",
        "--rl.batch_invariant=false",
        "--rl.updates_per_batch=2",
    ]
    return [
        Check("prepare-chat", lambda ctx: [write_conversations(out, 5 if cuda else 2, prepare_chat)], 120),
        Check("sft-lora", lambda ctx: [sft], 240, lambda o, ctx: train_figures(sft_run)),
        Check("chat", lambda ctx: [ask], 60, lambda o, ctx: {"answer": (o.strip().splitlines() or [""])[-1]}),
        Check("rl-tis", lambda ctx: [write_rl_prompts(out, rl)], 180, lambda o, ctx: rl_figures(rl_run)),
    ]


def verify_check(n_gpus: int, out: Path) -> Check:
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
    return Check(
        "verify", lambda ctx: [verify], 300, gpu_only=True, why_not=None if n_gpus >= 2 else no_verify
    )


def bench_checks(args, cuda: bool, out: Path, lacking: set[str]) -> list[Check]:
    """loom bench optim, and GPT-2 124M through loom bench train eager and compiled."""
    checks = []
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

    bench = bench_base(GPT2 if cuda else TINY, "bf16" if cuda else "fp32", cuda)

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
    return checks


def long_context_checks(cuda: bool, out: Path) -> list[Check]:
    shape, device, checks = (GPT2 if cuda else TINY), "cuda" if cuda else "cpu", []
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
    return checks


def decode_argv(cuda: bool, path: Path, *extra: str) -> list[str]:
    """`loom bench generate` at bench-decode's shape: GPT-2 124M at batch 1 and 64 in bf16 (--cpu: the tiny shape,
    batch 1 and 4, fp32), its records written to `path`; `extra`: the line's own options."""
    shape = GPT2 if cuda else TINY
    return [
        *LOOM,
        "bench",
        "generate",
        *extra,
        "--batch",
        "1,64" if cuda else "1,4",
        "--prompt-len",
        "128" if cuda else "8",
        "--new-tokens",
        "128" if cuda else "8",
        "--rounds",
        "3" if cuda else "1",
        "--dtype",
        "bf16" if cuda else "fp32",
        "--device",
        "cuda" if cuda else "cpu",
        *[f"--model.{k}={v}" for k, v in shape.items()],
        "--json",
        str(path),
    ]


def decode_check(cuda: bool, out: Path, lacking: set[str]) -> Check:
    """Generation speed (issue 45): loom.engine at batch 1 and 64 beside transformers' generate on the same
    weights, and the decode's bandwidth use; --cpu: the tiny shape, batch 1 and 4."""
    decode_json = out / "bench-decode.json"
    argv = decode_argv(cuda, decode_json, *(["--no-hf"] if "transformers" in lacking else []))
    return Check("bench-decode", lambda ctx: [argv], 240, lambda o, ctx: decode_figures(decode_json))


def decode_figures(path: Path) -> dict:
    """Per batch: loom's decode tokens/s, transformers' and the ratio, the bandwidth use (CUDA)."""
    figs: dict[str, Any] = {}
    for r in json.loads(path.read_text()):
        b = r["batch"]
        figs[f"b{b}_decode_tok_s"] = round(r["loom"]["decode_tok_s"])
        if "hf" in r:
            figs[f"b{b}_hf_decode_tok_s"] = round(r["hf"]["decode_tok_s"])
            figs[f"b{b}_vs_hf"] = round(r["decode_vs_hf"], 2)
            figs[f"b{b}_same_tokens"] = r["same_tokens"]
        if "bandwidth" in r:
            figs[f"b{b}_bandwidth_util"] = round(r["bandwidth"]["utilisation"], 3)
    return figs


def int8_decode_check(cuda: bool, out: Path, lacking: set[str]) -> Check:
    """Decoding with int8 weight-only linears (issue 62): bench-decode's model at batch 1 and 64 (--cpu: the tiny
    shape, batch 1 and 4), bf16 and int8 timed in one process (fp32 on the CPU)."""
    path = out / "bench-decode-int8.json"
    argv = decode_argv(cuda, path, "--quantize", "int8", "--no-hf")
    why_not = (
        "needs torchao (the loom[fp8] extra), which this interpreter lacks" if "torchao" in lacking else None
    )
    return Check(
        "bench-decode-int8", lambda ctx: [argv], 240, lambda o, ctx: int8_figures(path), why_not=why_not
    )


def int8_figures(path: Path) -> dict:
    """Per batch: decode tokens/s with the weights as they are (bf16 on a GPU) and int8, and their ratio."""
    figs: dict[str, Any] = {}
    for r in json.loads(path.read_text()):
        for b, v in r["speed"].items():
            figs[f"b{b}_base_decode_tok_s"] = round(v["base"]["decode_tok_s"])
            figs[f"b{b}_int8_decode_tok_s"] = round(v["int8"]["decode_tok_s"])
            figs[f"b{b}_int8_vs_base"] = round(v["decode_speedup"], 2)
    return figs


def moe_and_nanogpt_checks(args, cuda: bool, out: Path) -> list[Check]:
    shape, mbs, checks = (GPT2 if cuda else TINY), (args.micro_batches if cuda else [2]), []
    # Mixture of experts (issue 32): the same MoE (8 SwiGLU experts as wide as the dense MLP, top-2, in every
    # layer) with its experts as one grouped GEMM (torch._grouped_mm) and as a loop of matmuls, one expert each
    bench = bench_base(GPT2 if cuda else TINY, "bf16" if cuda else "fp32", cuda)
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
    return checks


def fp8_checks(cuda: bool, out: Path, lacking: set[str]) -> list[Check]:
    checks = []
    for name, (fp8_shape, fp8_mb) in FP8_SHAPES.items():
        fp8_json = out / f"bench-train-fp8-{name}.json"
        fp8_argv = [
            *bench_base(fp8_shape if cuda else TINY, "bf16", cuda),
            f"--train.batch_size={fp8_mb if cuda else 2}",
            f"--train.micro_batch_size={fp8_mb if cuda else 2}",
            f"--train.compile={'true' if cuda else 'false'}",
            # the 1B: torchao's size rule picks the linears big enough to gain; GPT-2 124M has none that big
            # (768 wide: the rule leaves every one in bf16 with rowwise, all but the MLP's up-projections with
            # tensorwise), nor has the CPU's tiny model, so there every linear is converted
            *([] if cuda and name == "1b" else ["--precision.fp8_filter=all"]),
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
                lambda o, ctx, path=fp8_json: fp8_figures(path, o),
                why_not=why_not,
            )
        )
    return checks


def speedrun_check(cuda: bool, out: Path) -> Check:
    """The GPT-2 124M speedrun recipe (issue 61) trained to its token budget (train.steps x batch_size x
    block_size, fixed by the config) with the config's own options; --cpu: its options on a tiny shape, 4 steps
    on prepare-data's set, fp32 and eager (a CPU compile takes minutes)."""
    run = out / "runs" / "speedrun-gpt2"
    argv = [
        *LOOM,
        "train",
        str(ROOT / "configs" / "speedrun_gpt2_124m.toml"),
        f"--run.dir={out / 'runs'}",
        "--run.name=speedrun-gpt2",
        f"--train.device={'cuda' if cuda else 'cpu'}",
        "--train.log_every=1",
    ]
    if not cuda:
        tiny = {**TINY, "vocab_size": 0}  # the char set's vocabulary
        argv += [f"--model.{k}={v}" for k, v in tiny.items()] + [f"--data.path={out / 'data'}"]
        argv += ["--train.steps=4", "--train.batch_size=2", "--train.micro_batch_size=2"]
        argv += ["--train.compile=false", "--precision.dtype=fp32", "--train.eval_batches=1"]
        argv += ["--optim.warmup_steps=1"]
    return Check(
        "speedrun-gpt2", lambda ctx: [argv], 480 if cuda else 120, lambda o, ctx: speedrun_figures(run)
    )


def speedrun_figures(run: Path) -> dict:
    """The speedrun line's: tokens trained, the val loss at the end, tokens/s and MFU (the trainer's summary)."""
    from loom.metrics import read_jsonl

    recs = read_jsonl(run / "metrics.jsonl")
    summary = next((r["summary"] for r in recs if "summary" in r), {})
    return {
        "steps": summary.get("step"),
        "tokens": max((r["tokens"] for r in recs if "tokens" in r), default=None),
        "val_loss": round(summary["val_loss"], 4) if summary.get("val_loss") is not None else None,
        "tokens_per_s": round(summary.get("tokens_per_s") or 0),
        "mfu": round(summary["mfu"], 4) if summary.get("mfu") is not None else None,
    }


def bench_base(model: dict, dtype: str, cuda: bool) -> list[str]:
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
        f"--train.device={'cuda' if cuda else 'cpu'}",
        f"--precision.dtype={dtype}",
    ]


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


def write_rl_prompts(out: Path, argv: list[str]) -> list[str]:
    """Write OUT/rl_prompts.jsonl, 200 raw-text prompts of write_text's words (its characters only) for the
    rl-tis line; returns argv, the command that trains on them."""
    import random

    words = "the of and to in is that it for as with was on be by at this from have or".split()
    rng = random.Random(2)
    rows = [json.dumps({"prompt": " ".join(rng.sample(words, 3)) + " "}) for _ in range(200)]
    (out / "rl_prompts.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
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


def rl_figures(run: Path) -> dict:
    """The rl-tis line's: the largest sampler-vs-trainer log-probability difference over the steps, and the
    truncated importance weights' statistics (their mean and largest raw value, the share truncated)."""
    from loom.metrics import read_jsonl

    recs = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r and "rl/trained_tokens" in r]
    fresh = [r for r in recs if "rl/logprob_diff" in r]  # a batch's first step: a rollout was drawn for it
    weights = [r for r in recs if "rl/is_weight_mean" in r]
    return {
        "steps": len(recs),
        "logprob_diff_max": max((r["rl/logprob_diff"] for r in fresh), default=None),
        "is_weight_mean": round(sum(r["rl/is_weight_mean"] for r in weights) / max(len(weights), 1), 6),
        "is_weight_max": max((r["rl/is_weight_max"] for r in weights), default=None),
        "is_truncated_frac": max((r["rl/is_truncated_frac"] for r in weights), default=None),
        "reward_first_last": [recs[0].get("rl/reward_mean"), recs[-1].get("rl/reward_mean")]
        if recs
        else None,
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


FP8_LOG = re.compile(r"fp8: (\d+) of (\d+) linear layers in float8 \(precision\.fp8=(\w+)")


def fp8_figures(path: Path, output: str = "") -> dict:
    """Per recipe: tokens/s, speed over bf16 (the first mode, timed in the same rounds), peak memory, and how
    many linears trained in float8 ("N/M"): from the record, else from the line fp8.convert logs, else absent."""
    logged = {m.group(3): f"{m.group(1)}/{m.group(2)}" for m in FP8_LOG.finditer(output)}
    figs = {}
    for r in json.loads(path.read_text()):
        mode = r["mode"]
        figs[f"{mode}_tokens_per_s"] = round(r["tokens_per_s"])
        figs[f"{mode}_vs_bf16"] = round(r["speed_vs_first"], 3)
        figs[f"{mode}_peak_mem_gib"] = round(r["peak_mem_bytes"] / 2**30, 2)
        if mode != "off":
            counted = f"{r['fp8_linears']}/{r['linears']}" if "fp8_linears" in r else logged.get(mode)
            if counted:
                figs[f"{mode}_fp8_linears"] = counted
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


class Stopped(Exception):
    """A signal asked the kit to stop (SIGTERM from `timeout` or a device's time limit, SIGINT): the running
    line is ended and cut, the report written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


def run_argv(argv: list[str], cwd: Path, log_path: Path, limit: float) -> tuple[int | None, str]:
    """Run one command with its output appended to log_path as it comes (a killed kit leaves it there): its
    exit code (None: still running after `limit` seconds, then ended) and its output."""
    with log_path.open("ab") as log:
        log.write(f"$ {cmd(argv)}\n".encode())
        log.flush()
        start = log.tell()
        # a session of its own, so that a timeout or a stopped kit ends the line's whole process tree
        proc = start_line(argv, cwd, log.fileno())
        try:
            rc: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # past its limit, or the kit stopped by a signal while it ran
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    output = log_path.read_bytes()[start:].decode("utf-8", "replace")
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"\n[exit {'killed at the time limit' if rc is None else rc}]\n")
    return rc, output


def kill_tree(pid: int) -> None:
    """SIGKILL a line's session (its process and what it started); a forked line stopped before its first
    statement (os.setsid) has no session yet: then the process alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Forked:
    """A `python -m loom ...` line started as a fork of loom's preloaded fork server (loom.train.spawn.start_loom:
    torch imported once for the kit, not once a line: ~4 s of CPU and 15-30 s of a GPU machine's time over
    the kit), with Popen's wait and poll."""

    def __init__(self, argv: list[str], cwd: Path, fd: int):
        from loom.train.spawn import start_loom

        self.p = start_loom(argv[len(LOOM) :], child_env(), str(cwd), fd, fd, session=True, server=True)
        self.pid = self.p.pid

    def poll(self) -> int | None:
        return self.p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.p.join(timeout)
        if self.p.exitcode is None:
            raise subprocess.TimeoutExpired("loom", timeout)
        return self.p.exitcode


def start_line(argv: list[str], cwd: Path, fd: int):
    """One line's process, its output to fd: a loom command forked warm (Forked), anything else a subprocess."""
    if argv[: len(LOOM)] == LOOM:
        return Forked(argv, cwd, fd)
    return subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=fd,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_env(),
        start_new_session=True,
    )


def run_check(c: Check, ctx: dict, out: Path, deadline: float, args: argparse.Namespace) -> dict:
    """Run one line (each candidate command until one fits in memory); its result as a report row."""
    t0 = time.perf_counter()
    argvs = c.argvs(ctx)
    if c.name == args.fail_check:
        argvs = [[PY, "-c", f"raise SystemExit('deliberate failure of {c.name} (--fail-check)')"]]
    if c.name == args.hang_check:
        argvs = [[PY, "-c", "import time; time.sleep(60)"]]
    log_path, tried, output, rc = out / f"{c.name}.log", [], "", 0
    log_path.write_bytes(b"")
    for argv in argvs:
        left = deadline - time.monotonic()
        limit = min(c.timeout_s, left)
        if limit <= 0:
            return {
                "status": "cut",
                "reason": "the kit's time budget ran out before it started",
                "seconds": 0.0,
            }
        rc, output = run_argv(argv, c.cwd, log_path, limit)
        seconds = round(time.perf_counter() - t0, 1)
        if rc is None and left < c.timeout_s:  # the budget, not the line's own limit, ended it
            why = f"stopped after {seconds:.0f} s: the kit's time budget (--budget-s) ran out"
            return {"status": "cut", "reason": why, "command": cmd(argv), "seconds": seconds}
        if rc is None:
            why = f"timed out after {limit:.0f} s"
            return {"status": "fail", "reason": why, "command": cmd(argv), "seconds": seconds}
        tried.append(argv)
        if rc == 0 or not out_of_memory(output) or argv is argvs[-1]:
            break
    row: dict[str, Any] = {"command": cmd(argv), "seconds": round(time.perf_counter() - t0, 1), "rc": rc}
    sizes = [a.split("=")[1] for v in argvs for a in v if a.startswith("--train.micro_batch_size=")]
    note = f"largest of {'/'.join(sizes)} that fits ({len(tried) - 1} ran out of memory)"
    return judge(c, row, output, {**ctx, "argv": argv, "mb_note": note})


def judge(c: Check, row: dict, output: str, ctx: dict) -> dict:
    """A line that ran: its figures, and pass or fail (a non-zero exit, no figures, a skipped GPU test, a
    bench-optim implementation skipped on CUDA)."""
    rc = row["rc"]
    if rc != 0:
        tail = [ln for ln in output.strip().splitlines() if ln.strip()][-3:]
        row.update(status="fail", reason=f"exit {rc}: " + " | ".join(tail)[-300:])
        return row
    try:
        row["figures"] = c.figures(output, ctx)
    except Exception as e:  # a line that ran but whose output lacks its figures has failed
        row.update(status="fail", reason=f"no figures in its output: {type(e).__name__}: {e}")
        return row
    figs = row["figures"] if isinstance(row["figures"], dict) else {}
    skipped = figs.get("skipped", 0) - figs.get("skipped_missing_package", 0)
    if c.strict_skips and skipped > 0:
        row.update(status="fail", reason=f"{skipped} test(s) skipped on a CUDA machine")
    elif (
        ctx["_cuda"] and c.name == "bench-optim" and any(str(v).startswith("skipped") for v in figs.values())
    ):
        row.update(status="fail", reason="an implementation was skipped on CUDA (triton missing?)")
    else:
        row["status"] = "pass"
    return row


def before_run(c: Check, ctx: dict, cuda: bool, left: float, estimate: float | None) -> dict | None:
    """The row of a line that is not to run (GPU only, a missing package, a needed line that did not pass, an
    estimate over the budget left), or None: run it."""
    if c.gpu_only and not cuda:
        return {"status": "skipped", "reason": c.why_not or f"gpu only: would run {cmd(c.argvs({})[0])}"}
    if c.why_not:
        return {"status": "skipped", "reason": c.why_not}
    for need in NEEDS.get(c.name, ()):
        got = ctx.get(need, {}).get("status", "not run")
        if got != "pass":  # a cut need cuts its line too; a failed one has failed the kit already
            return {"status": "cut" if got == "cut" else "skipped", "reason": f"needs {need}, which is {got}"}
    if estimate is not None and estimate > left:  # its time goes to the shorter lines after it
        why = f"not started: ~{estimate:.0f} s estimated, {max(left, 0):.0f} s of the time budget left"
        return {"status": "cut", "reason": why}
    return None


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


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write path through a temporary beside it: a kit killed mid-write leaves the previous version whole."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)


def verdict(header: dict, rows: list[dict]) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "cut", "pending", "running")}
    if header["state"] == "running":
        done = len(rows) - counts["pending"] - counts["running"]
        return f"RUNNING ({done} of {len(rows)} lines reported)"
    word = "FAILED" if counts["fail"] else header["state"] if header["state"] != "done" else "all passed"
    return word + (f", {counts['cut']} cut" if counts["cut"] else "")


def report_md(header: dict, rows: list[dict]) -> str:
    lines = [
        f"# loom GPU check: {header['device_name']}",
        "",
        f"{header['mode']} | plan {header['plan']} | torch {header['torch']} | {header['n_gpus']} GPU(s) | "
        f"{header['date']} | {header['seconds']:.0f} s of ~{header['estimate_s']:.0f} s estimated, budget "
        f"{header['budget_s']:.0f} s | {verdict(header, rows)}",
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
    return "\n".join(lines) + "\n"


class Kit:
    """A run's report and console, kept on disk as the run goes: gpu-report.{md,json} in OUT (and the export
    folder) rewritten at the start and end of every line, the console appended line by line, the export's
    archive refreshed after every line; whatever stops the kit, they hold what it did."""

    def __init__(self, out: Path, export: Path | None, header: dict, rows: dict[str, dict], budget_s: float):
        self.out, self.export, self.header, self.rows = out, export, header, rows
        self.deadline = time.monotonic() + budget_s
        self.t0 = time.perf_counter()
        self.consoles = [out / "gpu-check-console.log"] + (
            [export / "gpu-check-console.log"] if export else []
        )
        for path in self.consoles:
            path.write_text("", encoding="utf-8")

    def say(self, text: str) -> None:
        print(text, flush=True)
        for path in self.consoles:
            with path.open("a", encoding="utf-8") as f:
                f.write(text + "\n")

    def write(self, archive: bool = True) -> None:
        self.header["seconds"] = time.perf_counter() - self.t0
        self.header["ok"] = all(r["status"] != "fail" for r in self.rows.values())
        rows = list(self.rows.values())
        doc = json.dumps({**self.header, "checks": rows}, indent=1) + "\n"
        md = report_md(self.header, rows)
        for folder in (self.out, self.export):
            if folder is not None:
                write_atomic(folder / "gpu-report.json", doc)
                write_atomic(folder / "gpu-report.md", md)
        if archive and self.export is not None:
            write_archive(self.out, self.export / "gpu-check-files.tar.gz")


def write_archive(out: Path, dest: Path) -> None:
    """OUT's logs and JSON (every line's log, the benchmarks' records, the runs' metrics.jsonl and run.json)
    in one gzipped tar: one file to bring back from a device, whatever the lines wrote and however deep."""
    files = sorted(
        p
        for p in out.rglob("*")
        if p.is_file()
        and p.suffix in ARCHIVED
        and not p.name.endswith(".part")
        and p.name != "conversations.jsonl"  # the chat line's input, written by the kit itself
        and p.stat().st_size <= ARCHIVE_MAX_FILE
    )
    tmp = dest.with_name(dest.name + ".part")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(out)))
    os.replace(tmp, dest)


def status_line(tag: str, row: dict) -> str:
    """A line's status on the console, with its figures: what a truncated run still shows."""
    extra = f" ({row['reason']})" if row.get("reason") else ""
    took = f" {row['seconds']:.1f} s" if "seconds" in row else ""
    figs = fmt_figures(row.get("figures", {}))
    return f"{tag}: {row['status']}{extra}{took}" + (f" | {figs}" if figs else "")


def run_plan(kit: Kit, checks: dict[str, Check], plan: list[str], args, cuda: bool) -> int | None:
    """Run the plan's lines in order, the report rewritten around each; the number of the signal that stopped
    the kit, or None when every line was reached."""
    ctx: dict[str, Any] = {"_cuda": cuda}
    times, started = line_times(cuda, args.times), time.perf_counter()
    try:
        for i, name in enumerate(plan, 1):
            c, row, tag = checks[name], kit.rows[name], f"[{i}/{len(plan)}] {name}"
            left = kit.deadline - time.monotonic()
            result = before_run(c, ctx, cuda, left, times.get(name))
            if result is None:
                row["status"], started = "running", time.perf_counter()
                kit.say(
                    f"{tag} ... (~{times.get(name, 60):.0f} s estimated, {left:.0f} s of the budget left)"
                )
                kit.write(archive=False)
                result = run_check(c, ctx, kit.out, kit.deadline, args)
            row.update(result)
            ctx[name] = row
            kit.say(status_line(tag, row))
            kit.write()
    except Stopped as e:
        for sig in (signal.SIGTERM, signal.SIGINT):  # one stop is enough: the report is written next
            signal.signal(sig, signal.SIG_IGN)
        for name in plan:
            row = kit.rows[name]
            if row["status"] == "running":
                took = time.perf_counter() - started
                row.update(status="cut", reason=f"stopped by {e} after {took:.0f} s", seconds=round(took, 1))
            elif row["status"] == "pending":
                row.update(status="cut", reason=f"not started: the kit was stopped by {e}")
        kit.header["state"] = f"stopped by {e}"
        kit.say(f"gpu_check: stopped by {e}; the report holds the lines done")
        return e.signum
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu", action="store_true", help="tiny shapes on the CPU (GPU-only lines listed, not run)"
    )
    p.add_argument("--out", type=Path, help="report folder (default runs/gpu-check-<time>)")
    p.add_argument(
        "--export",
        type=Path,
        metavar="DIR",
        help="also write the report, the console and one archive of OUT's logs and JSON to DIR: 4 flat files",
    )
    p.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout: also run its train.py on the same shape")
    p.add_argument(
        "--micro-batches",
        default="32,16,8",
        help="GPT-2 124M micro-batches to try, largest first (default 32,16,8)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--plan", choices=list(PLANS), default="all", help="which lines, by priority (default all)"
    )
    which.add_argument("--only", help="comma list of lines to run, in that order (and the lines they need)")
    p.add_argument("--fail-check", metavar="NAME", help="make this line fail on purpose (tests the kit)")
    p.add_argument(
        "--hang-check", metavar="NAME", help="make this line sleep for a minute (tests the budget)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help=f"time for the whole kit (default {BUDGET_S:.0f}; {CPU_BUDGET_S:.0f} with --cpu): the lines it "
        "leaves are cut, which fails nothing",
    )
    p.add_argument(
        "--times",
        type=Path,
        default=TIMES,
        help="each line's estimated seconds (default benchmarks/gpu_check_times.toml, its format)",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="only say whether this interpreter runs the kit as it is (exit 0) or needs a virtualenv",
    )
    return p.parse_args(argv)


def start(args, checks: dict[str, Check], cuda: bool, n_gpus: int, plan: list[str], selected: str) -> Kit:
    """The kit's report before its first line: every line, those of the plan pending, the others skipped."""
    import torch

    out = args.out
    skipped = frozenset(n for n, c in checks.items() if c.why_not or (c.gpu_only and not cuda))
    env = versions(cuda)
    reason = "not selected (--only)" if args.only else f"not in plan {args.plan}"
    rows = {n: {"check": n, "status": "pending"} for n in plan}
    rows.update(
        {n: {"check": n, "status": "skipped", "reason": reason} for n in PLANS["all"] if n not in rows}
    )
    header = {
        "mode": "cuda" if cuda else "cpu (--cpu: tiny shapes)",
        "state": "running",
        "plan": selected,
        "estimate_s": round(plan_estimate(plan, cuda, skipped, args.times)),
        "budget_s": args.budget_s,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
        "n_gpus": n_gpus,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "versions": env,
        "missing_optional": missing(OPTIONAL),
    }
    if args.export:
        args.export.mkdir(parents=True, exist_ok=True)
    from loom.train.spawn import start_server

    start_server()  # the fork server of the loom lines (Forked), ready before the budget's clock starts
    kit = Kit(out, args.export.resolve() if args.export else None, header, rows, args.budget_s)
    kit.say(
        "gpu_check: "
        + ", ".join(f"{k} {v}" for k, v in env.items() if k != "gpus" and v is not None)
        + "".join(
            f"\n  GPU {i}: {g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)"
            for i, g in enumerate(env.get("gpus", []))
        )
    )
    for n in missing(OPTIONAL):
        kit.say(f"gpu_check: optional package {n} is missing here: skips {OPTIONAL[n]}")
    kit.say(
        f"gpu_check: plan {selected}: {', '.join(plan)} (~{header['estimate_s']} s estimated, budget "
        f"{args.budget_s:.0f} s)"
    )
    return kit


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        return probe(args.cpu)
    args.micro_batches = [int(x) for x in args.micro_batches.split(",")]
    if str(SRC) not in sys.path:  # the figures read loom's records in this process: the tree's loom
        sys.path.insert(0, str(SRC))
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print(
            "gpu_check: no CUDA device here; run with --cpu (tiny shapes, GPU-only lines listed)",
            file=sys.stderr,
        )
        return 2
    if args.budget_s is None:
        args.budget_s = BUDGET_S if cuda else CPU_BUDGET_S
    n_gpus = torch.cuda.device_count() if cuda else 0
    out = args.out = (args.out or ROOT / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    checks = {c.name: c for c in build_checks(args, cuda, n_gpus, out)}
    assert sorted(checks) == sorted(PLANS["all"]), "every line has its place in PLANS"
    only = args.only.split(",") if args.only else None
    for n in [*(only or []), *(n for n in (args.fail_check, args.hang_check) if n)]:
        if n not in checks:
            print(f"gpu_check: unknown line '{n}'; the lines are {', '.join(PLANS['all'])}", file=sys.stderr)
            return 2
    plan = resolve_plan(only or PLANS[args.plan])
    kit = start(args, checks, cuda, n_gpus, plan, "--only " + args.only if only else args.plan)
    kit.write()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, raise_stopped)
    stopped = run_plan(kit, checks, plan, args, cuda)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the last report is written whole, whatever comes now
        signal.signal(sig, signal.SIG_IGN)
    if stopped is None:
        kit.header["state"] = "done"
    kit.write()
    kit.say(report_md(kit.header, list(kit.rows.values())))
    kit.say(
        f"report: {out / 'gpu-report.md'} and gpu-report.json"
        + (f"; exported to {kit.export}" if kit.export else "")
    )
    if stopped is not None:
        return 128 + stopped
    return 0 if kit.header["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

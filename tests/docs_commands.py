"""The commands README.md and docs/*.md show, read out of their fenced shell blocks, and the rule that says which
of them a test runs (tests/unit/test_docs_commands.py, tests/integration/test_docs_commands_run.py).

A block is a fence opened with ```bash, ```sh, ```shell or ```console. Its lines are joined at a trailing
backslash, split into words as the shell would (quotes kept together, `# ...` comments dropped), and cut into
commands at `;` and `&&`. A word `...` stands for "your options" and is dropped: what remains must still be a
whole command.

The rule for each command, in this order (the first that matches):
- `make TARGET ...`: TARGET must be a rule of the Makefile. Not run (make builds a virtualenv).
- `python ... benchmarks/X.py`: the script must exist. Not run (benchmarks take minutes, some need a GPU).
- a `loom` command, also after a launcher (`srun ... loom`, `torchrun ... -m loom`, `mpiexec -n 4 loom`) or
  inside `loom launch -- loom ...`: it must parse (the verb exists, its options are accepted, every
  `--section.key=value` is a config key with a value it takes, and the config passes `validate` over the
  processes it names). Then it RUNS and must exit 0: a help text and `loom plan` without `--check` in the
  unit test (tests/unit/test_docs_commands.py), `loom doctor` in a process of its own, every other one in its
  page's folder, in the page's order, scaled down by THE SCALE RULE below (tests/integration/
  test_docs_commands_run*.py) -- unless NOT_RUN lists it with its reason (a GPU, a cluster, a download, a
  server, more than 2 processes, minutes).
- `python scripts/X.py` (a page's way to make its input): runs with the page's commands (NOT_RUN: the
  network-namespace scripts).
- anything else (`source`, `pip`, `kill`, `tar`, benchmarks ...) is the reader's shell, not loom's: listed, not
  checked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

TOP = Path(__file__).resolve().parents[1]
SHELL_FENCES = ("bash", "sh", "shell", "console")
LAUNCHERS = ("srun", "pbsdsh", "mpiexec", "mpirun", "torchrun", "timeout")


@dataclass(frozen=True)
class Command:
    page: str  # e.g. docs/data.md
    line: int  # the line the command starts on
    words: tuple[str, ...]
    elided: bool = False  # the page wrote `...` in it (the reader's other options): a fragment

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{' '.join(self.words)[:60]}"


def pages() -> list[Path]:
    return [TOP / "README.md", *sorted((TOP / "docs").glob("*.md"))]


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of every fenced shell block, continuation lines joined."""
    out, fence, pending, start = [], None, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence not in SHELL_FENCES:
            continue
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def commands(path: Path) -> list[Command]:
    page = str(path.relative_to(TOP))
    found = []
    for n, line in shell_lines(path.read_text(encoding="utf-8")):
        words: list[str] = []
        dots = False
        for w in shlex.split(line, comments=True) + [";"]:
            if w in (";", "&&") or w.endswith(";"):
                if w.endswith(";") and w != ";":
                    words.append(w[:-1])
                if words:
                    found.append(Command(page, n, tuple(words), dots))
                words, dots = [], False
            elif w != "...":
                words.append(w)
            else:
                dots = True
    return found


def all_commands() -> list[Command]:
    return [c for p in pages() for c in commands(p)]


def loom_argv(words: tuple[str, ...]) -> list[str] | None:
    """The arguments after `loom` (or `-m loom`), past environment assignments and launchers; None if none."""
    for i, w in enumerate(words):
        if w == "loom" or (w == "-m" and i + 1 < len(words) and words[i + 1] == "loom"):
            return list(words[i + 1 + (w == "-m") :])
        if not (re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w) or i > 0 or w in LAUNCHERS):
            return None
    return None


def launched(words: tuple[str, ...]) -> bool:
    return words[0] in LAUNCHERS or any(re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w) for w in words[:1])


def inner_command(argv: list[str]) -> list[str] | None:
    """`loom launch [opts] -- loom train ...`: the arguments of the loom command it launches."""
    if argv[:1] == ["launch"] and "--" in argv:
        rest = tuple(argv[argv.index("--") + 1 :])
        return loom_argv(rest)
    return None


def is_help(argv: list[str]) -> bool:
    return not argv or any(a in ("-h", "--help", "--help-config") for a in argv)


def runs_here(cmd: Command) -> bool:
    """Quick here, in this process: help texts and `loom plan` estimates (the doctor: see `runs_as_process`)."""
    argv = loom_argv(cmd.words)
    if argv is None or launched(cmd.words):
        return False
    return is_help(argv) or (argv[0] == "plan" and "--check" not in argv)


def runs_as_process(cmd: Command) -> bool:
    """`loom doctor` (not `--nodes`, which needs hosts): quick, but its probes start processes."""
    argv = loom_argv(cmd.words)
    return argv is not None and not launched(cmd.words) and argv[:1] == ["doctor"] and "--nodes" not in argv


# ---------------------------------------------------------------------------------------------------------------
# Running the pages' commands (tests/integration/test_docs_commands_run*.py)
#
# Each page's commands run in the page's order in one working folder of its own, as a reader who starts on that
# page would type them: the inputs the page tells the reader to bring are made first (`reader_inputs`: notes/,
# tinyshakespeare.txt, conversations.jsonl, pairs.jsonl, ...; configs/, scripts/ and tests/ of this checkout),
# then what the page assumes was done before it (PAGE_SETUP: a run under runs/<name>, a prepared folder), then
# the commands. A command the test does not run is in NOT_RUN with its reason; every other loom command (and
# `python scripts/...`) runs and must exit 0.
#
# THE SCALE RULE (one rule, fewer steps; model sizes, batches and data as the page gives them):
#   a command that trains (train, sft, dpo, rl) runs STEPS optimizer steps: --train.steps=N becomes
#   min(N, STEPS) (a page's k-th `--resume`: min(N, (k + 1) x STEPS), STEPS more than the run it resumes),
#   and that cap is added where the page gives none; with it the work that is sized by the run's length: train.ckpt_every <= STEPS (a checkpoint
#   `ckpt/step_N` a later command reads is then step_STEPS), the evaluation 1 batch (train.eval_batches=1),
#   the samples 8 tokens (train.sample_tokens=8), no time budget (train.time_budget_s dropped);
#   a benchmark times 1 repetition after none untimed (bench train: --steps 1 --warmup 0 --rounds 1; bench
#   optim/comm: --iters 1 --warmup 0; bench generate: --rounds 1 --requests 1, --new-tokens <= 8; bench peak:
#   --seconds 0.1); `loom generate --max-new-tokens` <= 8.
# A command the rule changed is "scaled"; `scale` returns it and the test names it in its id.
# ---------------------------------------------------------------------------------------------------------------

STEPS = 2
TRAINING_VERBS = ("train", "sft", "dpo", "rl")


def _set(argv: list[str], key: str, value: str) -> list[str]:
    """argv with `--key=value` replacing any `--key=...` (or `--key ...`), or added."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == key and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            skip = True
            continue
        if a == key or a.startswith(key + "="):
            continue
        out.append(a)
    return [*out, f"{key}={value}"]


def _value(argv: list[str], key: str) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(key + "="):
            return a.split("=", 1)[1]
        if a == key and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _training(argv: list[str], resumes: int) -> list[str]:
    steps = _value(argv, "--train.steps")
    cap = STEPS * (1 + resumes)  # the n-th resume of a page trains STEPS more than the run before it
    argv = _set(argv, "--train.steps", str(min(int(steps), cap) if steps else cap))
    every = _value(argv, "--train.ckpt_every")
    if every is not None:
        argv = _set(argv, "--train.ckpt_every", str(min(int(every), STEPS)))
    argv = [re.sub(r"ckpt/step_\d+", f"ckpt/step_{STEPS:06d}", a) for a in argv]
    argv = [a for a in argv if not a.startswith("--train.time_budget_s")]
    return [*argv, "--train.eval_batches=1", "--train.sample_tokens=8"]


def resumes(argv: list[str]) -> bool:
    return "--resume" in argv or "--train.resume=auto" in argv


def scale(argv: list[str], resumes_so_far: int = 0) -> list[str]:
    """The loom command's arguments under THE SCALE RULE (unchanged if it does not train, measure or generate);
    resumes_so_far: the resuming commands of its page up to it, itself included."""
    if is_help(argv):
        return argv
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--") + 2
        return [*argv[:cut], *scale(argv[cut:], resumes_so_far)]
    if argv[:1] and argv[0] in TRAINING_VERBS:
        return _training(argv, resumes_so_far)
    if argv[:2] == ["bench", "train"]:
        return [*argv, "--steps", "1", "--warmup", "0", "--rounds", "1"]
    if argv[:2] in (["bench", "optim"], ["bench", "comm"]):
        return [*argv, "--iters", "1", "--warmup", "0"]
    if argv[:2] == ["bench", "generate"]:
        new = min(int(_value(argv, "--new-tokens") or 8), 8)
        out = _set(_set(argv, "--new-tokens", str(new)), "--rounds", "1")
        return _set(out, "--requests", "1") if "--requests" in argv else out
    if argv[:2] == ["bench", "peak"]:
        return [*argv, "--seconds", "0.1"]
    if argv[:1] == ["generate"] and _value(argv, "--max-new-tokens"):
        return _set(argv, "--max-new-tokens", str(min(int(_value(argv, "--max-new-tokens")), 8)))
    return argv


def key(cmd: Command) -> str:
    """How NOT_RUN names a command: its page and its words as the page prints them (no line number)."""
    return f"{cmd.page}: {' '.join(cmd.words)}"


# Made for every page's folder: what the pages tell the reader to bring (their own text, conversations, ...).
def reader_inputs(root: Path) -> None:
    import json
    import random

    rng = random.Random(0)
    words = "the river stone cloud green house music paper light table apple def return class if else".split()

    def text(n: int) -> str:
        return "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(n // 60)) + "\n"

    (root / "notes").mkdir()
    for i in range(3):
        (root / "notes" / f"note{i}.md").write_text(f"# Note {i}\n\n" + text(6000), encoding="utf-8")
    with open(root / "papers.jsonl", "w", encoding="utf-8") as f:
        for _ in range(20):
            f.write(json.dumps({"text": text(600)}) + "\n")
    (root / "tinyshakespeare.txt").write_text(text(40000), encoding="utf-8")
    reverse = "apple river stone cloud green house music paper light table".split()
    with (
        open(root / "conversations.jsonl", "w", encoding="utf-8") as f,
        open(root / "pairs.jsonl", "w", encoding="utf-8") as g,
    ):
        for _ in range(120):
            w = rng.sample(reverse, 3)
            ask = "reverse: " + " ".join(w)
            msgs = [{"role": "user", "content": ask}, {"role": "assistant", "content": " ".join(reversed(w))}]
            f.write(json.dumps({"messages": msgs}) + "\n")
            g.write(
                json.dumps({"prompt": ask, "chosen": " ".join(reversed(w)), "rejected": " ".join(w)}) + "\n"
            )
    # the base text of the post-training pages' char model: every character their chats and sums use
    (root / "base.txt").write_text(
        text(20000) + "reverse: again 0123456789 + = user assistant system be brief\n", encoding="utf-8"
    )
    for name in ("configs", "scripts", "tests"):
        (root / name).symlink_to(TOP / name)


def complete(cmd: Command, page_cmds: list[Command]) -> list[str]:
    """The loom arguments to run: an elided command (`loom dpo ... --dpo.loss=ipo`) is the last whole command
    of its verb in its block with these options added (under its own run name, else `NAME-lineN`), as the
    reader reads it."""
    argv = loom_argv(cmd.words) or []
    if not cmd.elided or not argv:
        return argv
    before = [
        c
        for c in page_cmds
        if c.line < cmd.line and not c.elided and (loom_argv(c.words) or [])[:1] == argv[:1]
    ]
    lines = (TOP / cmd.page).read_text(encoding="utf-8").splitlines()
    if not before or any(x.startswith("```") for x in lines[before[-1].line - 1 : cmd.line]):
        return argv  # none above it in its block: `...` is the reader's own options, the rest a whole command
    base = loom_argv(before[-1].words) or []
    name = _value(argv, "--run.name") or f"{_value(base, '--run.name') or argv[0]}-line{cmd.line}"
    return _set([*base, *argv[1:]], "--run.name", name)


# What each page assumes the reader did before it (run in the page's folder before its commands): a run of the
# tiny char model under the names the page reads, a prepared folder. `base` is the post-training pages' char
# model (base.txt holds every character their chats and sums use).
_TINY_RUN = (
    "loom train --data.path=data/base --model.n_layer=2 --model.n_head=2 --model.n_embd=32 --model.block_size=128 "
    "--train.batch_size=8 --train.steps=2 --train.eval_batches=1 --train.sample_tokens=8 --optim.warmup_steps=1 "
    "--run.name="
)
_BASE = "loom data prepare --input base.txt --out data/base --tokenizer char"
_SHAKESPEARE = "loom data prepare --input tinyshakespeare.txt --out data/shakespeare_char --tokenizer char"
PAGE_SETUP: dict[str, list[str]] = {
    "docs/evaluation.md": [_BASE, _TINY_RUN + "<name>", _TINY_RUN + "a", _TINY_RUN + "b"],
    "docs/models.md": [_BASE, _TINY_RUN + "<name>"],
    "docs/operations.md": [_BASE, _TINY_RUN + "<name>", _SHAKESPEARE],
    # the PEFT export needs the llama family, QLoRA's NF4 blocks widths that are multiples of 128
    "docs/post-training.md": [
        _BASE,
        _TINY_RUN.replace("n_embd=32", "n_embd=128") + "base --model.family=llama",
    ],
    "docs/serving.md": [_BASE, _TINY_RUN + "mine"],
    "docs/training.md": [_SHAKESPEARE],
    "docs/data.md": [  # a mixture's sources share one tokenizer; the chat data's base run and the sft run
        "loom data prepare --input tinyshakespeare.txt --tokenizer char --out data/web",
        "loom data prepare --input tinyshakespeare.txt --tokenizer char --out data/code",
        "loom data prepare --input tinyshakespeare.txt --tokenizer char --out data/math",
        _BASE,
        _TINY_RUN + "base",
        "loom data prepare --chat --input conversations.jsonl --out data/setup-chat --tokenizer runs/base",
        "loom sft --data.path=data/setup-chat --model.init_from=run:runs/base --run.name=sft --train.steps=2 "
        "--train.eval_batches=1 --train.sample_every=0",
    ],
}

_GPU = "needs a GPU (CUDA, Triton or FP8 matmuls): tests/gpu and `make gpu-check`"
_CLUSTER = "a launcher or a cluster (Slurm, PBS, several nodes): tests/integration/test_launch*.py"
_MANY = "more than 2 processes on 2 cores (minutes); the same layouts run with 2 in tests/distributed"
_VERIFY = "every strategy of the list trains apart in its processes (minutes): tests/distributed runs them"
_SERVER = "a server that runs until stopped: tests/integration/test_serve.py runs it with a real client"
_HF = "HF weights or a tokenizer file the reader downloads (none can be fetched here)"
_NETNS = "network namespaces need root and `ip netns`: tests/netns runs them where it may"
_EVAL_DL = "an lm-evaluation-harness task or the CORE bundle, which the reader downloads"

# Every loom command (and `python scripts/...` line) of the pages that the test does not run, and why: the rest
# run and must exit 0. Keyed by `key(cmd)`, the page and the command's words (tests/unit/test_docs_commands.py
# checks that each still names a command of its page).
NOT_RUN: dict[str, str] = {
    "docs/operations.md: loom ckpt average runs/<name> --last 2 --out averaged": (
        "the page's run keeps one checkpoint; tests/integration/test_ckpt_average.py runs it on one that kept 3"
    ),
    "README.md: loom serve runs/mine --port 8000": _SERVER,
    "docs/data.md: loom data prepare --input notes/ --out data/sp --tokenizer llama2/tokenizer.model": _HF,
    "docs/data.md: loom data prepare --input notes/ --out data/tt --tokenizer cl100k_base.tiktoken": _HF,
    "docs/data.md: loom data tokenizer convert cl100k_base.tiktoken --to hf tok-hf": _HF,
    "docs/data.md: loom data tokenizer convert tok-hf --to tiktoken tok-tt": _HF
    + " (reads tok-hf, made from one)",
    "docs/data.md: loom data tokenizer convert gpt2-dir --to gpt2 tok-gpt2": _HF,
    "docs/data.md: loom data tokenizer convert llama2/tokenizer.model --to hf tok-sp": _HF,
    "docs/evaluation.md: torchrun --nproc-per-node 8 -m loom eval runs/<name> --shard": _CLUSTER,
    "docs/evaluation.md: loom eval runs/<name> --tasks hellaswag,arc_easy,piqa --num-fewshot 0 --limit 500": _EVAL_DL,
    "docs/evaluation.md: loom eval runs/<name> --tasks my_task --include-path my_tasks/": (
        "the reader's own lm-evaluation-harness task folder"
    ),
    "docs/evaluation.md: loom eval runs/<name> --suite core --bundle eval_bundle/": _EVAL_DL,
    "docs/evaluation.md: loom eval --runs runs/s1 runs/s2 runs/s3 --suite core --bundle eval_bundle/": _EVAL_DL,
    "docs/evaluation.md: torchrun --nproc-per-node 8 -m loom eval runs/<name> --tasks hellaswag": _CLUSTER,
    "docs/evaluation.md: torchrun --nproc-per-node 8 -m loom eval runs/<name> --tasks hellaswag --shard": _CLUSTER,
    "docs/evaluation.md: loom train --eval.tasks=hellaswag,arc_easy --eval.core_bundle=eval_bundle --eval.every=500"
    " --eval.limit=500": _EVAL_DL,
    "docs/long-context.md: loom train --nproc 8 --parallel.cp=2 --parallel.tp=2 --parallel.pp=2"
    " --parallel.dp_impl=fsdp": _MANY,
    "docs/long-context.md: loom verify --strategies cp-ulysses,cp-ring --nproc 2": _VERIFY,
    "docs/long-context.md: loom verify --strategies dp-cp,cp-tp --nproc 4": _VERIFY,
    "docs/models.md: loom data prepare --input my_texts/ --out data/mine --tokenizer llama-dir/tokenizer.json": _HF,
    "docs/models.md: loom train --data.path=data/mine --model.init_from=hf:llama-dir --nproc 4"
    " --parallel.dp_impl=fsdp --model.block_size=1024 --train.steps=2000 --optim.lr=3e-5 --run.name=continued": _HF,
    "docs/models.md: loom export runs/continued --format hf --out llama-continued": _HF + " (the run above)",
    "docs/moe.md: loom verify --strategies ep,dp-ep,ep-fsdp,ep-tp,ep-pp --nproc 4": _VERIFY,
    "docs/operations.md: srun --ntasks-per-node=1 loom launch -- loom train": _CLUSTER,
    "docs/operations.md: pbsdsh -u loom launch -- loom train": _CLUSTER,
    "docs/operations.md: loom launch --nnodes 2 --node-rank 1 --master-addr HEAD -- loom train": _CLUSTER,
    "docs/operations.md: loom doctor --nodes HOSTFILE": _CLUSTER,
    "docs/operations.md: loom train --nproc 4 --max-restarts 3": _MANY,
    "docs/operations.md: loom train --nproc 4 --train.straggler_every=50": _MANY,
    "docs/operations.md: loom train --nproc 3 --ft.enabled=true --train.batch_size=12 --run.name=ft": _MANY,
    "docs/operations.md: loom train --nproc 2 --parallel.dp_replicate=2 --parallel.diloco_inner_steps=10"
    " --train.steps=100 --ft.enabled=true --run.name=ftd": (
        "DiLoCo ends a run on an outer step, and the page test's 4 steps are not a multiple of 10:"
        " tests/faults/test_ft_diloco.py runs ft DiLoCo"
    ),
    "docs/operations.md: loom launch --nproc-per-node 2 -- loom train --ft.enabled=true --run.name=ftl": (
        "loom launch runs the `loom` on PATH, which `make test` (the venv's python, not activated) does not put"
        " there: tests/faults/test_ft_launch.py::test_one_local_node_runs_loom_train_nproc runs it"
    ),
    "docs/operations.md: loom train --ft.enabled=true --ft.replica_groups=3 --ft.replica_id=2"
    " --ft.lighthouse=http://HOST:PORT --ft.job_name=ft --run.name=ft-g2 --train.resume=auto": (
        "a group of a job already running on a lighthouse: tests/faults/test_ft_ddp.py starts them"
    ),
    "docs/parallelism.md: loom train --nproc 4": _MANY,
    "docs/parallelism.md: loom train --nproc 4 --parallel.dp_impl=fsdp": _MANY,
    "docs/parallelism.md: loom train --nproc 4 --parallel.dp_impl=fsdp --parallel.dp_replicate=2": _MANY,
    "docs/parallelism.md: mpiexec -n 4 loom train --parallel.dp_impl=mpi": _CLUSTER,
    "docs/parallelism.md: loom verify --strategies ddp,zero1,zero2,fsdp,mpi-naive,mpi-bucketed --nproc 2": _VERIFY,
    "docs/parallelism.md: loom verify --strategies hsdp --nproc 4": _VERIFY,
    "docs/parallelism.md: loom train --nproc 8 --parallel.tp=2 --parallel.pp=2 --parallel.dp_impl=fsdp": _MANY,
    "docs/parallelism.md: loom verify --strategies tp,tp-sp,pp-1f1b,dp-tp,dp-pp,tp-pp,dp-tp-pp": _VERIFY,
    "docs/parallelism.md: loom plan --model llama3-8b --gpus 64 --gpu-mem 80 --check --top 3": (
        "dry-runs the planner's layouts in processes (minutes): tests/unit/test_plan_vs_dryrun.py"
    ),
    "docs/post-training.md: loom chat runs/sft": "interactive: reads the terminal until /quit",
    "docs/serving.md: loom serve runs/sft": _SERVER,
    "docs/serving.md: loom serve runs/sft --port 8080 --api-key sk-mine": _SERVER,
    "docs/serving.md: loom serve runs/sft --host 0.0.0.0 --max-seqs 32 --max-kv-tokens 65536 --max-queue 256"
    " --grace 60": _SERVER,
    "docs/serving.md: loom serve runs/sft --nproc 2": _SERVER,
    "docs/serving.md: torchrun --nproc-per-node 4 -m loom serve runs/sft": _CLUSTER,
    "docs/slow-links.md: loom train --nproc 4 --parallel.dp_impl=ddp --parallel.grad_compression=powersgd"
    " --parallel.powersgd_rank=4": _MANY,
    "docs/slow-links.md: loom train --nproc 4 --parallel.dp_replicate=2 --parallel.diloco_inner_steps=20"
    " --train.steps=1000": _MANY,
    "docs/slow-links.md: loom verify --strategies ddp-bf16,ddp-fp16,ddp-powersgd,diloco --steps 30": _VERIFY,
    "docs/slow-links.md: python scripts/netns_hosts.py up 2 --rate 100mbit --latency-ms 50": _NETNS,
    "docs/slow-links.md: python scripts/netns_hosts.py limit TAG 1gbit": _NETNS,
    "docs/slow-links.md: python scripts/netns_hosts.py bytes TAG": _NETNS,
    "docs/training.md: loom train --train.compile=true": (
        "torch.compile compiles for a minute here: test_precision_speed.py::test_compiled_run_reports_compile_time"
    ),
    "docs/training.md: loom train --optim.impl=triton": _GPU,
    "docs/training.md: loom train configs/gpt2_124m.toml --precision.dtype=bf16 --precision.fp8=tensorwise": _GPU,
    "docs/training.md: loom bench train configs/gpt2_124m.toml --synthetic --fp8 off,tensorwise,rowwise": _GPU,
}


def runs(cmd: Command) -> bool:
    """Run by the pages' test: a loom command not in NOT_RUN (help texts and plans: the unit test; the doctor:
    a test of its own), or a `python scripts/...` line (the page's way to make its input)."""
    if cmd.words[:1] == ("python",) and cmd.words[1:2] and cmd.words[1].startswith("scripts/"):
        return key(cmd) not in NOT_RUN
    argv = loom_argv(cmd.words)
    if argv is None or runs_here(cmd):  # help texts and plans: the unit test runs them
        return False
    return key(cmd) not in NOT_RUN and argv[:1] != ["doctor"]


def page_runs(page: str) -> list[Command]:
    return [c for c in commands(TOP / page) if runs(c)]


def with_env(words, monkeypatch, root: Path) -> None:
    """`VAR=value loom ...`: the variables for this command, gone after the test (PYTHONPATH's folders, relative
    to `root`, on sys.path; LOOM_PLUGINS's families registered into a copy of the table)."""
    import os
    import sys

    from loom.model import registry

    for w in words:
        m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", w)
        if not m:
            break
        monkeypatch.setenv(m[1], m[2])
        if m[1] == "PYTHONPATH":
            for sub in m[2].split(os.pathsep):
                monkeypatch.syspath_prepend(str(root / sub))
        if m[1] == "LOOM_PLUGINS":
            monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
            monkeypatch.setattr(registry, "_loaded", False)
            for name in m[2].split(","):
                monkeypatch.delitem(sys.modules, name, raising=False)


def run_in(folder: Path, words: tuple[str, ...], argv: list[str] | None, monkeypatch) -> tuple[int, str]:
    """Run a page's command in `folder`, in this process (loom's imports paid once), as the reader types it:
    `VAR=value` words set for it (PYTHONPATH's folders on sys.path, LOOM_PLUGINS's families registered into a
    copy of the table, gone after the test); `python scripts/X.py` as a process. (exit code, its output)."""
    import subprocess
    import sys

    monkeypatch.chdir(folder)
    if words[0] == "python":
        r = subprocess.run(
            [sys.executable, *words[1:]], cwd=folder, capture_output=True, text=True, timeout=300
        )
        return r.returncode, r.stdout + r.stderr
    from loom import cli

    with_env(words, monkeypatch, folder)
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return (0 if code is None else code), ""

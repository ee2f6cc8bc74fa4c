"""The `loom` command: the only reader of sys.argv. One module per verb (or small group of verbs), each
parsing its arguments and calling the library, which it imports only when run; `args.py` holds what several
share. `main` is the entry point (pyproject's `loom = "loom.cli:main"`, and `python -m loom`)."""

from __future__ import annotations

import errno
import os
import sys

# each verb's module: the names below are modules (loom.cli.train, ...), their verbs are functions in them
from loom.cli import data, eval, generate, plan, runs, serve, tools, train
from loom.errors import LoomError

VERBS = {
    "train": (train.train, "train a language model (no arguments: the demo on the built-in corpus)"),
    "sft": (train.sft, "fine-tune on conversations: loom sft --data.path=CHAT --model.init_from=run:BASE"),
    "dpo": (train.dpo, "preference-tune a chat model: loom dpo --data.path=PAIRS --model.init_from=run:SFT"),
    "rl": (
        train.rl,
        "RL on verifiable rewards (GRPO/DAPO): loom rl --rl.prompts=P.jsonl --data.path=CHAT --model.init_from=run:SFT",
    ),
    "data": (data.data, "prepare data: loom data prepare --input ... --out DIR"),
    "generate": (generate.generate, "sample from a trained run"),
    "chat": (generate.chat, "talk to a fine-tuned run: loom chat RUN [--prompt TEXT] (/help, /reset, /quit)"),
    "serve": (serve.serve, "serve a run with the OpenAI API: loom serve RUN [--port 8000] [--api-key KEY]"),
    "eval": (eval.evaluate, "validation loss and perplexity of a run"),
    "plot": (runs.plot, "plot loss curves of one or more runs"),
    "ckpt": (runs.ckpt, "checkpoints: loom ckpt inspect RUN | consolidate RUN --out DIR"),
    "export": (runs.export, "write a run's model as a transformers (gpt2, Llama) directory or safetensors"),
    "verify": (
        tools.verify,
        "prove N processes learn the same curve as one: loom verify --strategies ddp --nproc 2",
    ),
    "bench": (tools.bench, "benchmarks: loom bench comm | optim | peak | train | generate"),
    "doctor": (tools.doctor, "environment report: versions, devices, GPU links, MPI, compile (--json)"),
    "plan": (
        plan.plan,
        "memory / time estimates of dp/tp/pp/ZeRO layouts: loom plan --model 7b --gpus 64 --gpu-mem 80 "
        "(--check: dry-run the top layouts)",
    ),
    "launch": (
        tools.launch,
        "run a command under torchrun, mpiexec or srun: loom launch [opts] -- loom train ...",
    ),
}


def _usage() -> str:
    lines = ["usage: loom <verb> [args]   (loom <verb> --help for details)", ""]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in VERBS.items()]
    return "\n".join(lines)


_ENVIRONMENT_ERRNOS = {
    getattr(errno, name)
    for name in ("EACCES", "EPERM", "ENOSPC", "EDQUOT", "EROFS", "ENOTDIR", "EISDIR")
    if hasattr(errno, name)
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        argv.remove("--verbose")  # any verb: third-party warnings shown, in this and every started process
        os.environ["LOOM_DEBUG"] = "1"
    from loom import log

    log.quiet_third_party()  # unless LOOM_DEBUG=1
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from loom import __version__

        print(f"loom {__version__}")
        return 0
    verb = VERBS.get(argv[0])
    if verb is None:
        import difflib

        close = difflib.get_close_matches(argv[0], VERBS, n=1)
        print(
            f"loom: unknown verb '{argv[0]}'" + (f"; did you mean '{close[0]}'?" if close else ""),
            file=sys.stderr,
        )
        print(_usage(), file=sys.stderr)
        return 2
    try:
        # the model families (built-in, plug-in) register their presets and own keys before any config is
        # read; loom plan and plot stay free of torch (plan's CONFIG.toml loads them: loom.plan.shapes)
        if os.environ.get("LOOM_PLUGINS") or argv[0] not in ("plan", "plot"):
            from loom.model.registry import load_plugins

            load_plugins()
        return verb[0](argv[1:])
    except LoomError as e:
        print(f"loom: {'error: ' if e.code else ''}{e}", file=sys.stderr)  # code 0: a stop, not an error
        return e.code
    except OSError as e:
        # Outputs are checked before any work; what the filesystem refuses later (a full disk, a folder
        # made read-only meanwhile) is still the user's environment, not a bug: no traceback for it.
        if e.errno not in _ENVIRONMENT_ERRNOS or not e.filename:
            raise
        print(f"loom: error: cannot write or read '{e.filename}': {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loom: interrupted", file=sys.stderr)
        return 130

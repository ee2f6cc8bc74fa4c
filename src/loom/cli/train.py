"""`loom train`, `loom sft` and `loom dpo`: a config file and --section.key=value overrides, then loom.train.run (or
--nproc local processes, or --dry-run: loom.dryrun)."""

from __future__ import annotations

import argparse
import sys

from loom.cli.args import leave_job
from loom.errors import LoomError


def sft(argv: list[str]) -> int:
    """`loom sft`: `loom train` that first insists on what supervised fine-tuning needs (check_sft)."""
    return train(argv, stage="sft")


def dpo(argv: list[str]) -> int:
    """`loom dpo`: `loom train` that first insists on what preference tuning needs (check_dpo)."""
    return train(argv, stage="dpo")


def check_dpo(cfg) -> None:
    """Preference pairs (loom data prepare --pairs) and a chat model to start from, or one error before any
    work: the pairs' tokenizer must be the model's own, chat tokens included (a base run never answered in the
    chat template: `loom sft` it first)."""
    from loom.data.loader import read_meta
    from loom.data.pairs import check_start_model, is_preference_data

    prepare = "loom data prepare --pairs --input PAIRS.jsonl --tokenizer runs/SFT --out data/pref"
    if not cfg.data.path:
        raise LoomError("loom dpo needs preference pairs: data.path is not set", hint=prepare)
    meta = read_meta(cfg.data.path)
    if not is_preference_data(meta):
        raise LoomError(
            f"loom dpo needs preference pairs; {cfg.data.path} holds no pairs (its meta.json has no "
            "'preference' entry)",
            hint=prepare,
        )
    if not cfg.model.init_from:
        raise LoomError(
            "loom dpo starts from a trained chat model (the reference): model.init_from is not set",
            hint="--model.init_from=run:RUNS/SFT (a loom run fine-tuned on conversations)",
        )
    check_start_model(cfg.model.init_from, cfg.data.path, meta)  # a chat model, and pairs prepared for it


def rl(argv: list[str]) -> int:
    """`loom rl`: `loom train` that first insists on what RL needs (check_rl)."""
    return train(argv, stage="rl")


def check_rl(cfg) -> None:
    """Prompts, data with a tokenizer (chat data: answers sampled in its template; a base run's plain text:
    prompts as raw text, R1-Zero style) and a model to start from, or one error before any work."""
    from loom.data.loader import read_meta
    from loom.data.sft import is_chat_data

    if not cfg.rl.prompts:
        raise LoomError(
            "loom rl needs prompts: rl.prompts is not set",
            hint="--rl.prompts=PROMPTS.jsonl (one JSON object a line: prompt or messages, and the answer field); "
            "scripts/make_arith.py writes an arithmetic task",
        )
    if cfg.data.path and not is_chat_data(meta := read_meta(cfg.data.path)) and meta.get("tokenizer"):
        if not cfg.model.init_from:  # a base run's text: RL from the base model itself
            raise LoomError(
                "loom rl starts from a trained model: model.init_from is not set",
                hint="--model.init_from=run:RUNS/BASE (a base run: its prompts are raw text)",
            )
        return
    check_sft(cfg, verb="loom rl")


def check_sft(cfg, verb: str = "loom sft") -> None:
    """Conversation data (loom data prepare --chat) and a model to start from, or one error before any work:
    `loom train` itself decides the stage from the data, so a plain-text directory there would pretrain."""
    from loom.data.loader import read_meta
    from loom.data.pairs import is_preference_data
    from loom.data.sft import is_chat_data

    prepare = "loom data prepare --chat --input CONVERSATIONS.jsonl --tokenizer runs/BASE --out data/chat"
    if not cfg.data.path:
        raise LoomError(
            f"{verb} needs conversation data: data.path is not set",
            hint=f"{prepare}, then --data.path=data/chat",
        )
    meta = read_meta(cfg.data.path)
    if not is_chat_data(meta):
        raise LoomError(
            f"{verb} needs conversation data; {cfg.data.path} holds plain token shards (no loss masks)",
            hint=f"{prepare} (or loom train to pretrain on it)",
        )
    if verb == "loom sft" and is_preference_data(meta):  # loom train would choose preference tuning for it
        raise LoomError(
            f"loom sft needs conversation data; {cfg.data.path} holds preference pairs (loom data prepare "
            "--pairs), which loom train would preference-tune on",
            hint=f"loom dpo --data.path={cfg.data.path} to preference-tune a chat model on them; for SFT, {prepare}",
        )
    if not cfg.model.init_from:
        raise LoomError(
            f"{verb} starts from a trained model: model.init_from is not set",
            hint="--model.init_from=run:DIR (a loom run) or hf:DIR (a transformers directory)",
        )


_DESCRIPTIONS = {
    "train": "Train a language model. With no arguments: the built-in corpus and the demo model.",
    "sft": "Fine-tune a model on conversations (loom train, insisting on chat data and model.init_from).",
    "dpo": "Preference-tune a chat model on pairs of answers, DPO or IPO (loom train, insisting on preference "
    "pairs and model.init_from).",
    "rl": "Reinforcement learning on verifiable rewards, GRPO/DAPO (loom train, insisting on rl.prompts, chat "
    "data or a base run's text, and model.init_from).",
}
_CHECKS = {
    "sft": check_sft,
    "dpo": check_dpo,
    "rl": check_rl,
}  # what each verb insists on before `loom train` runs


def _parser(stage: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"loom {stage}",
        description=_DESCRIPTIONS[stage],
        epilog="Any config key can be set as --section.key=value; see --help-config.",
    )
    p.add_argument("config", nargs="?", help="a TOML config file (configs/*.toml)")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="continue from the newest valid checkpoint (of this run, or of PATH)",
    )
    p.add_argument("--force", action="store_true", help="replace a run directory that holds another run")
    p.add_argument("--help-config", action="store_true", help="list every config key with default and doc")
    p.add_argument("--nproc", type=int, default=None, help="start N local processes (data parallel)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart the local processes up to R times after a failure; each restart continues "
        "from the newest valid checkpoint",
    )
    p.add_argument("--log-all-ranks", action="store_true", help="every rank prints, prefixed with its rank")
    # handled before parsing (train(): loom.dryrun), listed here so that --help shows them
    fit = p.add_argument_group(
        "will it fit (a dry run on this CPU: loom train --dry-run --help for all options)"
    )
    fit.add_argument(
        "--dry-run",
        action="store_true",
        help="build and step the job on fake tensors at --world N ranks: memory per rank and whether it fits",
    )
    fit.add_argument(
        "--world", type=int, metavar="N", help="with --dry-run: the job's number of GPUs (ranks)"
    )
    return p


def train(argv: list[str], stage: str = "train") -> int:
    if "--dry-run" in argv:  # will the job fit at --world N: built and stepped on fake tensors (loom.dryrun)
        from loom.dryrun import dryrun_main

        return dryrun_main([a for a in argv if a != "--dry-run"])
    args, rest = _parser(stage).parse_known_args(argv)
    from loom import config

    if args.help_config:
        print(config.help_text())
        return 0
    if args.world is not None:
        raise LoomError("--world is an option of --dry-run", hint="add --dry-run (or use --nproc N to train)")
    args.config, rest = config.config_argv(argv, args.config, rest)
    cfg = config.load_config(args.config, rest)
    explicit = config.explicit_keys(args.config, rest)
    if stage in _CHECKS:  # on a resume, the run's own settings: `loom rl --resume RUN` needs no flag again
        _CHECKS[stage](_resumed(cfg, args.resume, explicit) if args.resume else cfg)
    if args.max_restarts < 0:
        raise LoomError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.nproc is not None and args.nproc > 1:
        from loom import log
        from loom.env import oversubscription

        if warning := oversubscription(args.nproc):
            log.warn(warning)
    from loom.train import RunRequest

    req = RunRequest(cfg, args.resume, args.force, frozenset(explicit))
    if (args.nproc is not None and args.nproc != 1) or args.max_restarts:
        from loom.train.spawn import launch_local, stop_server

        child = _without_options(argv, ("--nproc", "--max-restarts"))
        nproc = 1 if args.nproc is None else args.nproc
        try:
            return launch_local(nproc, req, child, args.max_restarts)
        finally:
            stop_server()
    return _run(req, args.log_all_ranks)


def _resumed(cfg, resume, explicit):
    """The config a --resume trains with (the run's saved config.toml, this command line's keys winning), which
    a verb's checks read as `loom train --resume` would; `cfg` itself when there is no saved config to read
    (the resume's own checks then say why)."""
    from loom.train.setup import resolve_run_dir, resumed_config

    run_dir = resolve_run_dir(cfg, resume, force=False)
    if not (run_dir / "config.toml").is_file():
        return cfg
    return resumed_config(run_dir, cfg, set(explicit))


def _run(req, log_all_ranks: bool) -> int:
    """This process's part of the run; a rank of a job of several prints its error and leaves the job."""
    from loom.env import detect_env
    from loom.errors import EXIT_ERROR, EXIT_PREEMPTED, PeerError
    from loom.train import run

    world_size = detect_env().world_size
    try:
        summary = run(req, log_all_ranks=log_all_ranks)
        code = EXIT_PREEMPTED if summary.get("stopped_by") else 0  # stopped by a signal, checkpoint saved
    except PeerError:
        code = EXIT_ERROR  # rank 0 printed the message
    except LoomError as e:
        if world_size == 1:
            raise
        print(f"loom: error: {e}", file=sys.stderr)
        code = e.code
    if world_size > 1:
        leave_job(code)
    return code


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the launcher's own options, in both the '--x=V' and the '--x V' forms."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not a.startswith(tuple(n + "=" for n in names)):
            out.append(a)
    return out

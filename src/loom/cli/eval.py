"""`loom eval`: its options checked, then loom.eval.run (the validation loss, HellaSwag, lm-evaluation-harness
tasks and CORE of a run or several)."""

from __future__ import annotations

import argparse

from loom.cli.args import SHARD_HELP, device_of, leave_job, refuse_options, run_model
from loom.errors import LoomError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom eval",
        description="Validation loss and perplexity of a run; HellaSwag accuracy (--task hellaswag --data "
        "hellaswag_val.jsonl); lm-evaluation-harness tasks (--tasks arc_easy,piqa,...); the CORE score "
        "(--suite core --bundle DIR).",
    )
    p.add_argument("run_dir", nargs="?")
    p.add_argument("--task", default="val", choices=["val", "hellaswag"], help="val (default) | hellaswag")
    p.add_argument("--data", help="val: another prepared data directory (same tokenizer); hellaswag: JSONL")
    p.add_argument("--batches", type=int, default=None, help="validation size in global batches")
    p.add_argument(
        "--limit", type=int, default=None, help="hellaswag, --tasks, CORE: only N examples per task"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--shard", action="store_true", help=SHARD_HELP)
    g = p.add_argument_group("capability evaluation (extra: eval)")
    g.add_argument("--tasks", help="lm-evaluation-harness task, group or tag names, comma-separated")
    g.add_argument("--suite", choices=["core"], help="core: the CORE score of the eval bundle at --bundle")
    g.add_argument("--bundle", help="the CORE eval bundle folder (core.yaml, eval_meta_data.csv, eval_data/)")
    g.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's)")
    g.add_argument("--include-path", help="a folder of task YAMLs of your own (the harness's --include_path)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass (default 16)")
    g.add_argument("--json", help="also write the results to this JSON file (its folder is made if missing)")
    g.add_argument("--runs", nargs="+", help="several runs (seeds): each scored, then mean ± spread")
    g.add_argument("--ckpt", help="a checkpoint directory of the run (default: the newest valid one)")
    g.add_argument(
        "--bootstrap-iters",
        type=int,
        default=0,
        help="N > 0: stderrs in the table (perplexities bootstrapped N times in a forked process pool); "
        "default 0: none",
    )
    return p


def evaluate(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.batches is not None and args.batches < 1:
        raise LoomError(
            f"--batches must be >= 1, got {args.batches}",
            hint="leave it out for the run's train.eval_batches",
        )
    if args.limit is not None and args.limit < 1:
        raise LoomError(f"--limit must be >= 1, got {args.limit}", hint="leave it out for every example")
    if args.bundle and args.suite != "core":  # alone it was ignored: the validation loss was computed instead
        raise LoomError(
            "--bundle is read by --suite core", hint="add --suite core (the CORE score of the bundle)"
        )
    if args.tasks is not None or args.suite or args.runs:
        refuse_options(
            p,
            argv,
            ("task", "data", "batches"),
            "of the validation loss and HellaSwag evaluation, which --tasks / --suite / --runs do not run",
            ": HellaSwag through the harness is --tasks hellaswag; the validation loss is loom eval RUN alone",
        )
        return _capability(args)
    refuse_options(
        p,
        argv,
        ("num_fewshot", "include_path", "batch_size", "json", "bootstrap_iters"),
        "of capability evaluation, which runs with --tasks or --suite core only",
        ", or add --tasks NAMES (or --suite core --bundle DIR)",
    )
    return _val_or_hellaswag(args)


def _val_or_hellaswag(args) -> int:
    """loom eval RUN: the validation loss (sized by --batches), or --task hellaswag --data FILE."""
    if not args.run_dir:
        raise LoomError(
            "loom eval needs a run directory", hint="loom eval runs/NAME (or --runs A B C --tasks ...)"
        )
    if args.task == "hellaswag":
        if not args.data:
            raise LoomError(
                "--task hellaswag needs --data FILE.jsonl", hint="the official hellaswag_val.jsonl"
            )
        from loom.env import detect_env
        from loom.eval.run import evaluate_hellaswag

        env = detect_env()
        evaluate_hellaswag(args.run_dir, args.data, args.limit, device_of(args, env), env, args.shard)
        if args.shard:  # the job's ranks held one model together: leave the job with it
            leave_job(0)
        return 0
    if args.limit is not None:  # the validation loss is sized by --batches
        raise LoomError(
            "--limit counts examples of hellaswag or --tasks", hint="size the val loss with --batches"
        )
    from loom.eval.run import evaluate_val

    with run_model(args, split=True) as run:  # a job's ranks each score a share of the windows
        evaluate_val(run, args.run_dir, args.data, args.batches, args.shard)
    return 0


def _capability(args) -> int:
    """lm-evaluation-harness tasks and/or CORE on one run or several (--runs): loom.eval.run."""
    from loom.eval import core
    from loom.eval.run import CapabilityRequest, check_capability, evaluate_capability, print_spread

    runs = list(args.runs or []) + ([args.run_dir] if args.run_dir else [])
    if not runs:
        raise LoomError("loom eval needs a run directory", hint="loom eval RUN --tasks ... (or --runs A B C)")
    if args.suite == "core" and not args.bundle:
        raise LoomError("--suite core needs --bundle DIR", hint=f"the bundle: {core.WHERE}")
    if not (args.tasks or args.suite):
        raise LoomError("--runs scores tasks: give --tasks and/or --suite core")
    if args.batch_size < 1:
        raise LoomError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.bootstrap_iters < 0:
        raise LoomError(f"--bootstrap-iters must be >= 0, got {args.bootstrap_iters}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise LoomError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    req = CapabilityRequest(
        runs,
        tasks=args.tasks,
        bundle=args.bundle if args.suite == "core" else None,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        include_path=args.include_path,
        batch_size=args.batch_size,
        bootstrap_iters=args.bootstrap_iters,
        json=args.json,
        shard=bool(args.shard),
        ckpt=args.ckpt,
    )
    check_capability(req)  # before the tasks are read and the device taken
    from loom.env import detect_env

    env = detect_env()
    records = evaluate_capability(req, device_of(args, env), env)
    if args.shard:  # the job's ranks held one model together: leave the job with it
        leave_job(0)
    if env.rank == 0:
        print_spread(records)
    return 0

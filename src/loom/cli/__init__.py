"""The `loom` command: the only reader of sys.argv. One subcommand per verb; each imports what it needs."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from loom.errors import LoomError


def _sft(argv: list[str]) -> int:
    """`loom sft`: `loom train` that first insists on what supervised fine-tuning needs (check_sft)."""
    return _train(argv, sft=True)


def check_sft(cfg) -> None:
    """Conversation data (loom data prepare --chat) and a model to start from, or one error before any work:
    `loom train` itself decides the stage from the data, so a plain-text directory there would pretrain."""
    from loom.data.loader import read_meta
    from loom.data.sft import is_chat_data

    prepare = "loom data prepare --chat --input CONVERSATIONS.jsonl --tokenizer runs/BASE --out data/chat"
    if not cfg.data.path:
        raise LoomError(
            "loom sft needs conversation data: data.path is not set",
            hint=f"{prepare}, then --data.path=data/chat",
        )
    if not is_chat_data(read_meta(cfg.data.path)):
        raise LoomError(
            f"loom sft needs conversation data; {cfg.data.path} holds plain token shards (no loss masks)",
            hint=f"{prepare} (or loom train to pretrain on it)",
        )
    if not cfg.model.init_from:
        raise LoomError(
            "loom sft starts from a trained model: model.init_from is not set",
            hint="--model.init_from=run:DIR (a loom run) or hf:DIR (a transformers directory)",
        )


def _train(argv: list[str], sft: bool = False) -> int:
    if "--dry-run" in argv:  # will the job fit at --world N: built and stepped on fake tensors (loom.dryrun)
        from loom.dryrun import dryrun_main

        return dryrun_main([a for a in argv if a != "--dry-run"])
    p = argparse.ArgumentParser(
        prog="loom sft" if sft else "loom train",
        description="Fine-tune a model on conversations (loom train, insisting on chat data and "
        "model.init_from)."
        if sft
        else "Train a language model. With no arguments: the built-in corpus and the demo model.",
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
    args, rest = p.parse_known_args(argv)
    from loom import config

    if args.help_config:
        print(config.help_text())
        return 0
    args.config, rest = config.config_argv(argv, args.config, rest)
    cfg = config.load_config(args.config, rest)
    if sft:
        check_sft(cfg)
    explicit = config.explicit_keys(args.config, rest)
    if args.max_restarts < 0:
        raise LoomError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.nproc is not None and args.nproc > 1:
        from loom import log
        from loom.env import oversubscription

        if warning := oversubscription(args.nproc):
            log.warn(warning)
    from loom.train import RunRequest, run

    req = RunRequest(cfg, args.resume, args.force, frozenset(explicit))
    if (args.nproc is not None and args.nproc != 1) or args.max_restarts:
        from loom.train.spawn import launch_local

        child = _without_options(argv, ("--nproc", "--max-restarts"))
        nproc = 1 if args.nproc is None else args.nproc
        return launch_local(nproc, req, child, args.max_restarts)
    from loom.env import detect_env
    from loom.errors import EXIT_ERROR, EXIT_PREEMPTED, PeerError

    world_size = detect_env().world_size
    try:
        summary = run(req, log_all_ranks=args.log_all_ranks)
        code = EXIT_PREEMPTED if summary.get("stopped_by") else 0  # stopped by a signal, checkpoint saved
    except PeerError:
        code = EXIT_ERROR  # rank 0 printed the message
    except LoomError as e:
        if world_size == 1:
            raise
        print(f"loom: error: {e}", file=sys.stderr)
        code = EXIT_ERROR
    if world_size > 1:
        _leave_job(code)
    return code


def _leave_job(code: int) -> None:
    """End a rank of a multi-process job. Every file is closed and the process group destroyed after a
    barrier; still, gloo jobs here sometimes abort in C++ static destructors at interpreter exit ("terminate
    called without an active exception"), which would turn a finished job into a failed one. Leave without
    them."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:  # mpiexec treats a rank that skips MPI_Finalize as failed
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(code)


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


def _data(argv: list[str]) -> int:
    if argv and argv[0] in ("convert", "inspect"):
        from loom.data.convert import data_convert_main, data_inspect_main

        return (data_convert_main if argv[0] == "convert" else data_inspect_main)(argv[1:])
    p = argparse.ArgumentParser(
        prog="loom data",
        description="Prepare, convert and inspect token data.",
        epilog="also: loom data convert --help, loom data inspect --help",
    )
    sub = p.add_subparsers(dest="verb", required=True)
    pp = sub.add_parser("prepare", help="text files, folders or JSONL -> tokenizer + train/val shards")
    src = pp.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="files, folders (recursive), .jsonl(.gz/.zst) or .parquet")
    src.add_argument("--corpus", help="a built-in corpus: python-stdlib")
    pp.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    pp.add_argument(
        "--tokenizer",
        default="char",
        help="char | bpe | PATH/tokenizer.json | a folder with one or with gpt2's encoder.json + "
        "vocab.bpe (default char)",
    )
    pp.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    pp.add_argument("--val-fraction", type=float, default=0.1, help="share of the text for val (default 0.1)")
    pp.add_argument(
        "--split-mode",
        default="docs",
        choices=["docs", "tail"],
        help="docs: whole documents by seeded shuffle; tail: last characters (nanogpt)",
    )
    pp.add_argument(
        "--jsonl-field",
        default="text",
        help="JSONL field / Parquet column holding the text; a dotted name reaches into objects (meta.text)",
    )
    pp.add_argument("--glob", default="*", help="file pattern inside folders, e.g. '*.py' (default *)")
    pp.add_argument("--seed", type=int, default=1337)
    pp.add_argument("--force", action="store_true", help="replace an existing output directory")
    pp.add_argument("--workers", type=int, default=0, help="encoding processes (default: every usable core)")
    pp.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    pp.add_argument(
        "--tokenizer-sample",
        type=int,
        default=200_000_000,
        help="characters of train text the BPE is trained on (default 200M)",
    )
    pp.add_argument("--doc-cap", type=int, default=10_000, help="characters per document in that sample")
    pp.add_argument(
        "--split-pattern", default="gpt2", choices=["gpt2", "gpt4"], help="BPE pre-tokenizer split"
    )
    pp.add_argument(
        "--bpe-trainer",
        default="auto",
        choices=["auto", "rustbpe", "tokenizers"],
        help="BPE training library (auto: rustbpe when installed)",
    )
    pp.add_argument("--text-separator", default=None, help="cut text files into documents at this string")
    pp.add_argument("--doc-chars", type=int, default=0, help="cut text files into documents of ~N characters")
    pp.add_argument("--strict", action="store_true", help="a bad JSONL line or corrupt file is an error")
    pp.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"], help="token dtype")
    pp.add_argument(
        "--encoder",
        default="auto",
        choices=["auto", "tiktoken", "tokenizers"],
        help="BPE encoding library (auto: tiktoken when it gives the same ids)",
    )
    chat = pp.add_argument_group("conversations for fine-tuning (--chat)")
    chat.add_argument(
        "--chat",
        action="store_true",
        help="--input is conversations ({messages: [...]} or {prompt, completion}) in JSONL (.gz, .zst) or "
        "Parquet: shards + loss masks "
        "+ the tokenizer with chat tokens; --tokenizer may also be a run directory (the model to fine-tune)",
    )
    chat.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="with --chat: the model's context length (default: the run's, when --tokenizer is a run directory)",
    )
    chat.add_argument(
        "--too-long",
        default=None,
        choices=["drop", "truncate"],
        help="with --chat: a conversation longer than --block-size + 1 tokens is dropped (default) or cut",
    )
    chat.add_argument(
        "--chat-template",
        default=None,
        choices=["loom", "tokenizer"],
        help="with --chat: loom's template with its chat tokens added (default), or the Jinja chat_template of "
        "the HF tokenizer folder --tokenizer DIR (Llama 3, Qwen; nothing added; needs loom[hf])",
    )
    args = p.parse_args(argv)
    if args.chat:
        _refuse_options(
            pp,
            argv[1:],
            _TEXT_ONLY,
            "of plain-text preparation, which --chat does not read",
            ": --chat reads each --input file as conversations (JSONL lines, or Parquet rows, of messages or of "
            "prompt and completion)",
        )
        return _data_prepare_chat(args)
    if args.block_size is not None or args.too_long is not None or args.chat_template is not None:
        raise LoomError(
            "--block-size, --too-long and --chat-template are options of --chat",
            hint="add --chat, or leave them out",
        )
    from loom.paths import check_not_endless, check_output_dir

    for path in args.input or []:
        check_not_endless(path, "--input")
    check_output_dir(args.out, "--out", temp_beside=True)  # written beside it first, then renamed
    # what prepare() would refuse only after reading (and tokenizing) the whole corpus
    if not 0.0 < args.val_fraction < 1.0:
        raise LoomError(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
    if args.tokenizer not in ("char", "bpe"):
        from loom.data.tokenizers import tokenizer_files

        tokenizer_files(args.tokenizer)  # a tokenizer.json, a folder with one, or gpt2's vocabulary files
    from loom.data.corpus import corpus_files
    from loom.data.prepare import prepare

    inputs = corpus_files(args.corpus) if args.corpus else args.input
    prepare(
        inputs,
        args.out,
        args.tokenizer,
        args.vocab_size,
        args.val_fraction,
        args.split_mode,
        args.jsonl_field,
        args.glob,
        args.seed,
        args.force,
        source=f"built-in corpus {args.corpus}" if args.corpus else None,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        tokenizer_sample=args.tokenizer_sample,
        doc_cap=args.doc_cap,
        pattern=args.split_pattern,
        bpe_trainer=args.bpe_trainer,
        text_separator=args.text_separator,
        doc_chars=args.doc_chars,
        strict=args.strict,
        dtype=args.dtype,
        encoder=args.encoder,
    )
    return 0


# `loom data prepare` options that conversations (--chat) have no use for: refused beside it, not ignored
_TEXT_ONLY = (
    "split_mode",
    "jsonl_field",
    "glob",
    "workers",
    "shard_tokens",
    "tokenizer_sample",
    "doc_cap",
    "split_pattern",
    "bpe_trainer",
    "text_separator",
    "doc_chars",
    "strict",
    "dtype",
    "encoder",
)


def _refuse_options(parser, argv: list[str], dests: tuple[str, ...], why: str, remedy: str = "") -> None:
    """Refuse the options among `dests` that argv gives (even at their default value: argparse sets a default
    only on a namespace that lacks the attribute, so a pre-filled one tells what the command line set)."""
    unset = object()
    ns = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    given = ["--" + d.replace("_", "-") for d in dests if getattr(ns, d) is not unset]
    if given:
        are = "is an option" if len(given) == 1 else "are options"
        raise LoomError(f"{', '.join(given)} {are} {why}", hint=f"leave out {', '.join(given)}{remedy}")


def _data_prepare_chat(args) -> int:
    """loom data prepare --chat: conversations -> shards + loss masks (loom.data.chat_prepare)."""
    from loom.paths import check_output_dir

    if args.corpus:
        raise LoomError(
            "--chat reads JSONL conversations, not a built-in corpus", hint="use --input FILE.jsonl"
        )
    from loom.data.chat_prepare import check_tokenizer_spec, prepare_chat, run_block_size
    from loom.data.messages import check_inputs

    block_size = args.block_size
    if block_size is None:  # a run to fine-tune knows its context length
        block_size = run_block_size(args.tokenizer)
        if block_size is None:
            raise LoomError(
                "--chat needs --block-size (the context length of the model to fine-tune)",
                hint="e.g. --block-size 1024, or --tokenizer RUN_DIR to take the run's; conversations longer "
                "than it are dropped (or cut: --too-long truncate)",
            )
        from loom import log

        log.info(
            f"--block-size {block_size}: the model.block_size of run '{args.tokenizer}' (its config.toml)"
        )
    check_inputs(args.input)
    check_output_dir(args.out, "--out", temp_beside=True)
    check_tokenizer_spec(args.tokenizer, args.vocab_size, args.chat_template or "loom")
    prepare_chat(
        args.input,
        args.out,
        args.tokenizer,
        block_size,
        args.too_long or "drop",
        args.val_fraction,
        args.seed,
        args.force,
        vocab_size=args.vocab_size,
        chat_template=args.chat_template or "loom",
    )
    return 0


def _generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loom generate", description="Sample text from a trained run.")
    p.add_argument("run_dir")
    p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--no-cache", action="store_true", help="recompute the context every token (slower)")
    p.add_argument("--device", default="auto")
    p.add_argument("--shard", action="store_true", help=SHARD_HELP)
    args = p.parse_args(argv)
    _check_sampling(args)
    with _run_model(args) as run:
        return _generate_samples(args, run)


def _chat(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="loom chat",
        description="Talk to a fine-tuned run (chat data: loom data prepare --chat), turn by turn, with "
        "streaming tokens; --prompt answers once and exits.",
    )
    p.add_argument("run_dir")
    p.add_argument(
        "--prompt", default=None, help="one user turn: print only the assistant's answer, then exit"
    )
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto")
    p.add_argument("--ckpt", default=None, help="a checkpoint folder of the run (default: its newest)")
    args = p.parse_args(argv)
    args.num_samples = 1
    _check_sampling(args)
    from loom.chat import ChatSession, Sampling, chat_template, repl
    from loom.data.loader import read_meta
    from loom.model.registry import spec_of

    meta = read_meta(Path(args.run_dir) / "tokenizer") if (Path(args.run_dir) / "tokenizer").is_dir() else {}
    with _run_model(args) as run:
        template = chat_template(run.tok, meta, args.run_dir)
        session = ChatSession(
            run.model,
            template,
            run.tok,
            run.device,
            Sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed),
            args.system,
            spec_of(run.cfg).extends_context(run.model.cfg),
        )
        if args.prompt is not None:
            sys.stdout.write(session.reply(args.prompt) + "\n")
            return 0
        repl(session)
    return 0


SHARD_HELP = (
    "in a job of several processes (torchrun, srun, mpiexec): split the model over them with FSDP, "
    "each reading only its part of the checkpoint (for a model that does not fit one device)"
)


@dataclass
class _Loaded:
    """A trained run's model for eval/generate, whole on one device or FSDP-sharded over the job's processes."""

    model: object
    tok: object
    cfg: object
    path: Path
    device: object
    rank: int
    world: int
    all_reduce_sum: object  # a sum over the ranks (sharded: a collective)


@contextlib.contextmanager
def _run_model(args, split: bool = False):
    """args.run_dir's model (`_Loaded`) on args.device; with --shard, FSDP-sharded over the processes of a
    torchrun/srun/mpiexec job (each reading its part of the checkpoint), the process group left at the end.
    `split`: in a job of several processes without --shard, each holds the whole model and the caller splits
    the work by the ranks (they sum through a process group); else every process does it all alone."""
    from loom.env import detect_env
    from loom.runs import load_run, load_run_sharded
    from loom.train.setup import resolve_device

    env = detect_env()
    device = resolve_device(args.device, env.local_rank, key="--device")
    if not getattr(args, "shard", False):
        cfg, model, tok, _, path = load_run(args.run_dir, device, getattr(args, "ckpt", None))
        if not split or env.world_size == 1:
            yield _Loaded(model, tok, cfg, path, device, 0, 1, lambda t: t)
            return
        yield from _whole_on_every_rank(
            _Loaded(model, tok, cfg, path, device, env.rank, env.world_size, None), env
        )
        return
    if env.world_size == 1:
        raise LoomError(
            "--shard splits the model over the processes of a job, and this is one process",
            hint="start it with torchrun --nproc-per-node N -m loom ... --shard (or srun / mpiexec)",
        )
    from loom import log
    from loom.distributed import process_group

    log.setup(rank=env.rank, stderr=True)  # rank 0 tells; stdout keeps only the result
    clean = False
    try:
        cfg, par, tok, _, path = load_run_sharded(args.run_dir, device, env)
        yield _Loaded(par.model, tok, cfg, path, device, env.rank, env.world_size, par.all_reduce_sum)
        clean = True
    finally:
        process_group.shutdown(clean)
    _leave_job(0)  # the command has printed its result


def _whole_on_every_rank(run: _Loaded, env):
    """`run` (the whole model) on each rank of the job, with a gloo/NCCL group to sum the ranks' shares: a
    torchrun `loom eval RUN` without --shard did the whole evaluation on every rank and printed it as often."""
    import torch.distributed as dist

    from loom import log
    from loom.distributed import process_group

    log.setup(rank=env.rank)
    process_group.init(env, run.device, 600.0)
    clean = False
    try:
        yield replace(run, all_reduce_sum=lambda t: (dist.all_reduce(t), t)[1])
        clean = True  # shutdown's barrier: every rank has its sums before any leaves
    finally:
        process_group.shutdown(clean)
    _leave_job(0)  # rank 0 has printed the result


def _generate_samples(args, run: _Loaded) -> int:
    """Every rank runs the same sampling (the same generator seed; a sharded forward is a collective); rank 0
    prints."""
    import torch

    from loom.generate import generate
    from loom.model.registry import spec_of

    model, tok, device = run.model, run.tok, run.device
    if tok is None:
        raise LoomError(
            f"run '{args.run_dir}' was trained on data without a tokenizer: cannot turn text into ids",
            hint="prepare the data with loom (or give nanogpt's meta.pkl) to get a tokenizer",
        )
    ids = tok.encode(args.prompt) if args.prompt else [tok.eot_id]
    if len(ids) > model.cfg.block_size:
        ids = ids[-model.cfg.block_size :]
    g = torch.Generator(device=device).manual_seed(args.seed)
    extend = spec_of(run.cfg).extends_context(model.cfg)  # past block_size: run on (RoPE) or crop
    for i in range(args.num_samples):
        idx = torch.tensor([ids], dtype=torch.long, device=device)
        out = generate(
            model,
            idx,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=g,
            use_cache=not args.no_cache,
            vocab_size=tok.vocab_size,
            extends_context=extend,
        )
        if run.rank:
            continue
        if i:
            print("\n---------------")
        sys.stdout.write(args.prompt + tok.decode(out[0, len(ids) :].tolist()) + "\n")
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """Sampling options outside their domain are refused, never silently read as 'off' (before any load)."""
    import math

    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise LoomError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k <= 0:
        raise LoomError(
            f"--top-k must be a positive number of tokens, got {args.top_k}",
            hint="leave --top-k out (default 200), or give a vocabulary-sized value to keep every token",
        )
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise LoomError(f"--top-p must be in (0, 1], got {args.top_p}", hint="1 keeps every token")
    if args.max_new_tokens < 0:
        raise LoomError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise LoomError(f"--num-samples must be >= 1, got {args.num_samples}")


def _eval(argv: list[str]) -> int:
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
        _refuse_options(
            p,
            argv,
            ("task", "data", "batches"),
            "of the validation loss and HellaSwag evaluation, which --tasks / --suite / --runs do not run",
            ": HellaSwag through the harness is --tasks hellaswag; the validation loss is loom eval RUN alone",
        )
        return _eval_capability(args)
    _refuse_options(
        p,
        argv,
        ("num_fewshot", "include_path", "batch_size", "json", "bootstrap_iters"),
        "of capability evaluation, which runs with --tasks or --suite core only",
        ", or add --tasks NAMES (or --suite core --bundle DIR)",
    )
    if not args.run_dir:
        raise LoomError(
            "loom eval needs a run directory", hint="loom eval runs/NAME (or --runs A B C --tasks ...)"
        )
    if args.task == "hellaswag":
        return _eval_hellaswag(args)
    if args.limit is not None:  # the validation loss is sized by --batches
        raise LoomError(
            "--limit counts examples of hellaswag or --tasks", hint="size the val loss with --batches"
        )
    with _run_model(args, split=True) as run:  # a job's ranks each score a share of the windows
        return _eval_val(args, run)


def _eval_capability(args) -> int:
    """lm-evaluation-harness tasks and/or CORE on one run or several (--runs): the tasks and the bundle are read
    before any model. One process; a job whose ranks each hold the model (the harness splits the requests); or
    --shard (FSDP over the job, forwards in lockstep)."""
    from loom.eval import core, harness

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
    for r in runs:
        if not (Path(r) / "config.toml").is_file():
            raise LoomError(
                f"'{r}' is not a loom run (no config.toml)", hint="give run directories of loom train"
            )
    if args.shard and len(runs) > 1:
        raise LoomError("--shard scores one run per job", hint="start one job per run")
    if args.ckpt and (len(runs) > 1 or args.shard):
        raise LoomError(
            "--ckpt names one checkpoint of one run, read whole", hint="leave out --runs / --shard"
        )
    if args.json:  # checked, and its folder made, before the tasks are read and the runs scored
        from loom.paths import check_output_file

        check_output_file(args.json, "--json")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    tasks = harness.load_tasks(args.tasks, args.include_path, args.num_fewshot) if args.tasks else None
    core_tasks = core.read_bundle(args.bundle, args.limit) if args.suite == "core" else None
    from loom.env import detect_env

    env = detect_env()
    records = []
    if args.shard or env.world_size == 1:  # --shard: the job is left when the (one) run's block ends
        for r in runs:
            with _run_model(argparse.Namespace(**{**vars(args), "run_dir": r})) as run:
                records.append(_score_run(args, r, run, tasks, core_tasks, env))
    else:  # every rank holds the whole model; the harness splits the requests
        import torch.distributed as dist

        from loom import log
        from loom.distributed import process_group
        from loom.runs import load_run
        from loom.train.setup import resolve_device

        device = resolve_device(args.device, env.local_rank, key="--device")
        log.setup(rank=env.rank)
        process_group.init(env, device, 600.0)
        try:
            for r in runs:
                cfg, model, tok, _, path = load_run(r, device, args.ckpt)
                run = _Loaded(model, tok, cfg, path, device, env.rank, env.world_size, None)
                records.append(_score_run(args, r, run, tasks, core_tasks, env))
            dist.barrier()
        finally:
            process_group.shutdown()
    if env.rank == 0:
        _print_spread(records)
    return 0


def _score_run(args, run_dir, run: _Loaded, tasks, core_tasks, env) -> dict:
    """One run's scores: the harness's table and CORE printed, <run>/evals/step_N.json (and --json) written."""
    import json
    import re

    import torch

    from loom.eval import capability, core, harness

    device = run.device
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    lm = harness.make_lm(
        run.model,
        run.tok,
        device,
        batch_size=args.batch_size,
        autocast=(lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else None,
        rank=env.rank if env.world_size > 1 else 0,
        world_size=env.world_size,
        sharded=bool(args.shard),
    )
    if tasks is not None:
        harness.check_encodable(tasks, run.tok, args.limit)
    results = harness.evaluate(lm, tasks, args.limit, args.bootstrap_iters) if tasks is not None else None
    core_r = core.evaluate(lm, core_tasks) if core_tasks else None
    if env.rank != 0:
        return {}
    m = re.search(r"step_(\d+)", str(run.path))
    step = int(m.group(1)) if m else None
    print(f"checkpoint {run.path} ({env.world_size} process(es){', sharded' if args.shard else ''})")
    out = {"run": str(run_dir), "checkpoint": str(run.path), "step": step}
    out["scores"] = capability.record_of(results, core_r)  # the keys an in-loop record has
    if results is not None:
        print(harness.table(results))
        out["results"] = {k: results.get(k) for k in ("results", "groups", "n-shot", "versions", "n-samples")}
    if core_r is not None:
        width = max(len(k) for k in core_r["accuracy"])
        for label, acc in core_r["accuracy"].items():
            print(
                f"{label:<{width}}  accuracy {acc:.4f}  centered {core_r['centered'][label]:+.4f}  ({core_r['n'][label]} examples)"
            )
        print(f"CORE {core_r['core']:.4f} ({len(core_r['accuracy'])} tasks)")
        out["core"] = core_r
    text = json.dumps(out, indent=1, default=str)
    evals = Path(run_dir) / "evals"
    evals.mkdir(exist_ok=True)
    name = f"step_{step}.json" if step is not None else "final.json"
    (evals / name).write_text(text, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    return out


def _print_spread(records: list[dict]) -> None:
    """Several runs: each score's mean ± standard deviation and range over the runs."""
    import statistics

    if len(records) < 2:
        return
    keys = [k for k in records[0]["scores"] if all(k in r["scores"] for r in records)]
    print(f"\nover {len(records)} runs: mean ± std (min - max)")
    for k in keys:
        v = [r["scores"][k] for r in records]
        print(f"  {k:<40} {statistics.mean(v):.4f} ± {statistics.stdev(v):.4f} ({min(v):.4f} - {max(v):.4f})")


def _eval_val(args, run: _Loaded) -> int:
    """Validation loss of a run's model; in a job of several processes (the model sharded with --shard, or
    whole on each) the ranks each score a share of the windows."""
    import math

    from loom.data.loader import read_meta
    from loom.eval.val_loss import val_loss
    from loom.runs import run_data_dir
    from loom.train.setup import check_data_dir

    cfg, tok, path = run.cfg, run.tok, run.path
    from loom.data.tokenizers import run_tokenizer_dir

    meta = read_meta(run_tokenizer_dir(args.run_dir))
    data_dir = Path(args.data) if args.data else run_data_dir(args.run_dir, cfg)
    data_meta = check_data_dir(data_dir)
    if data_meta["vocab_size"] != meta["vocab_size"]:
        raise LoomError(
            f"'{data_dir}' was prepared with another tokenizer than the run's (vocabulary of "
            f"{data_meta['vocab_size']}, the run's {meta['vocab_size']})",
            hint="prepare it with the run's tokenizer (<run>/tokenizer/)",
        )
    from loom.data.tokenizers import check_same_tokenizer

    check_same_tokenizer(Path(args.run_dir) / "tokenizer", meta, data_dir, data_meta)  # by content, not size
    n_rows = (cfg.train.eval_batches if args.batches is None else args.batches) * cfg.train.batch_size
    vs, what = _val_set(cfg, data_dir, data_meta, n_rows, run)
    micro = cfg.train.micro_batch_size or cfg.train.batch_size
    loss = val_loss(run.model, vs, micro, run.device, all_reduce_sum=run.all_reduce_sum)
    line = f"val loss {loss:.4f} | perplexity {math.exp(loss):.2f}"
    # bits per byte: comparable across tokenizers (not an SFT set's measure: ChatValSet says so)
    if tok is not None and getattr(vs, "tokens_per_byte", True) is not False:
        from loom.eval.val_loss import bits_per_byte, tokens_per_byte

        tpb = tokens_per_byte(vs, tok, run.device, run.all_reduce_sum)
        line += f" | bits per byte {bits_per_byte(loss, tpb):.4f}"
    if run.rank == 0:
        print(
            f"checkpoint {path}\ndata {data_dir} ({vs.total_rows} {what})"
            + (_split(args, run) if run.world > 1 else "")
        )
        print(line)
    return 0


def _val_set(cfg, data_dir: Path, data_meta: dict, n_rows: int, run: _Loaded):
    """The validation set the run itself measured, and what its rows are: for chat data (SFT) the val
    conversations packed as training packed them, only the assistant's tokens scored (loom.data.sft), as the
    run's own val loss; for text, windows of the token stream, every token scored."""
    from loom.data.sft import is_chat_data, validation_set

    block = cfg.model.block_size
    vs = validation_set(cfg, data_dir, data_meta, n_rows, (run.rank, run.world))
    if is_chat_data(data_meta):
        packing = "several a row, each to itself" if cfg.data.doc_mask else "one a row"
        return (
            vs,
            f"rows of {block} tokens: conversations {packing}, the assistant's tokens scored (as the run)",
        )
    return vs, f"windows of {block} tokens"


def _split(args, run: _Loaded) -> str:
    if args.shard:
        return f", {_sharding(run.model, run.world)}"
    return f", split over {run.world} processes (each with the whole model; --shard splits the model too)"


def _sharding(model, world: int) -> str:
    """How much of the model this rank holds (a DTensor's numel is the whole tensor's)."""
    from loom.parallel.tensor import local

    here, total = (sum(f(p).numel() for p in model.parameters()) for f in (local, lambda p: p))
    return f"model sharded over {world} processes ({here:,} of its {total:,} parameters on rank 0)"


def _eval_hellaswag(args) -> int:
    """HellaSwag on one process, or split across the ranks of a torchrun/srun/mpiexec job: each rank with the
    whole model (or, with --shard, its FSDP share of it) scores examples rank, rank + world, ..."""
    if not args.data:
        raise LoomError("--task hellaswag needs --data FILE.jsonl", hint="the official hellaswag_val.jsonl")
    from loom.env import detect_env
    from loom.eval import hellaswag

    examples, lines = hellaswag.read_examples_and_lines(args.data, args.limit)  # before the model is read
    env = detect_env()
    if env.world_size > 1 and not args.shard:  # whole model on every rank, the examples split
        import torch.distributed as dist

        from loom import log
        from loom.distributed import process_group
        from loom.runs import load_run
        from loom.train.setup import resolve_device

        device = resolve_device(args.device, env.local_rank, key="--device")
        _, model, tok, _, path = load_run(args.run_dir, device)
        _need_tokenizer(args, tok)
        hellaswag.check_encodable(examples, tok, args.data, lines)  # before any example is scored
        log.setup(rank=env.rank)
        process_group.init(env, device, 600.0)
        try:
            r = hellaswag.evaluate(
                model, tok, examples, device, env.rank, env.world_size, lambda t: (dist.all_reduce(t), t)[1]
            )
        finally:
            process_group.shutdown()
        return _print_hellaswag(args, path, r, env)
    with _run_model(args) as run:  # one process, or --shard (which leaves the job when the block ends)
        _need_tokenizer(args, run.tok)
        hellaswag.check_encodable(examples, run.tok, args.data, lines)
        r = hellaswag.evaluate(
            run.model, run.tok, examples, run.device, run.rank, run.world, run.all_reduce_sum
        )
        return _print_hellaswag(args, run.path, r, env)


def _print_hellaswag(args, path, r: dict, env) -> int:
    if env.rank == 0:
        print(f"checkpoint {path}\nhellaswag {args.data}: {r['n']} examples on {env.world_size} process(es)")
        print(f"acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f}")
    return 0


def _need_tokenizer(args, tok) -> None:
    if tok is None:
        raise LoomError(
            f"run '{args.run_dir}' has no tokenizer, so HellaSwag text cannot be encoded",
            hint="train on data prepared by loom (or nanogpt data with meta.pkl)",
        )


def _export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loom export", description="Write a run's model for other tools.")
    p.add_argument("run_dir")
    p.add_argument(
        "--format",
        required=True,
        choices=["hf", "peft", "safetensors"],
        help="hf: a transformers directory (GPT2LMHeadModel, or LlamaForCausalLM for the llama family; a "
        "LoRA run's adapters merged); peft: a LoRA run as OUT/base (transformers) and OUT/adapter (peft's "
        "adapter format); safetensors: loom's raw state",
    )
    p.add_argument("--out", required=True, help="output directory (must be empty unless --force)")
    p.add_argument("--ckpt", default=None, help="a checkpoint directory (default: the newest valid one)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    args = p.parse_args(argv)
    from loom.paths import check_output_dir

    check_output_dir(args.out, "--out", temp_beside=True)  # before the checkpoint is read
    import torch

    from loom.model import hf
    from loom.outputs import check_apart, check_replaceable, staged_output
    from loom.runs import load_run

    out = Path(args.out)
    check_apart(out, [args.run_dir, *([args.ckpt] if args.ckpt else [])], inside_ok=True)
    check_replaceable(out, "export", args.force)  # again when written; here before the checkpoint is read
    if args.format == "peft":
        from loom.export import export_peft

        notes = export_peft(args.run_dir, out, args.ckpt, args.force)
    else:
        cfg, model, tok, meta, path = load_run(args.run_dir, torch.device("cpu"), args.ckpt)
        # written beside --out and renamed when whole: a full disk leaves no export that looks complete
        with staged_output(out, "export", args.force) as tmp:
            if args.format == "hf":
                from loom.export import export_hf_dir

                notes = export_hf_dir(cfg, model, tok, meta, tmp, False)
            else:
                hf.export_safetensors(model, tmp, False)
                notes = [f"wrote {out / 'model.safetensors'} from {path}"]
        if args.format == "hf":
            import json

            config = json.loads((out / "config.json").read_text(encoding="utf-8"))
            arch = config["architectures"][0]
            print(
                f"wrote {args.out} from {path}: a {arch} directory for AutoModelForCausalLM.from_pretrained"
            )
    for n in notes:
        print(n)
    return 0


def _ckpt(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loom ckpt", description="Inspect or consolidate a run's checkpoints.")
    sub = p.add_subparsers(dest="verb", required=True)
    ins = sub.add_parser("inspect", help="format, step, layout, files and sizes, valid or not")
    ins.add_argument("target", help="a run directory, its ckpt/ folder or one RUN/ckpt/step_N")
    ins.add_argument("--json", action="store_true", help="print JSON")
    con = sub.add_parser("consolidate", help="one model.safetensors + config + tokenizer, tensor by tensor")
    con.add_argument("run_dir")
    con.add_argument("--step", type=int, default=None, help="default: the newest valid checkpoint")
    con.add_argument(
        "--out", required=True, help="output folder (a small run: loom generate/eval/export read it)"
    )
    con.add_argument("--force", action="store_true", help="write into a non-empty output folder")
    args = p.parse_args(argv)
    from loom import checkpoint_tools

    if args.verb == "inspect":
        return checkpoint_tools.inspect_main(args.target, args.json)
    target = checkpoint_tools.consolidate(args.run_dir, args.out, args.step, args.force)
    rest = (
        "config.toml and tokenizer/"
        if (target.parent / "tokenizer").is_dir()
        else "config.toml (the run has no tokenizer/)"
    )
    print(f"wrote {target} ({target.stat().st_size / 2**20:.1f} MiB), {rest}")
    return 0


def _plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loom plot", description="Train and val loss against tokens.")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", default=None, help="PNG file (default: <first run>/loss.png)")
    args = p.parse_args(argv)
    from loom.paths import check_output_file
    from loom.plot import plot_runs

    if args.out or Path(args.run_dirs[0]).is_dir():  # before reading the runs
        check_output_file(args.out or Path(args.run_dirs[0]) / "loss.png", "--out")

    out = plot_runs(args.run_dirs, args.out)
    print(f"wrote {out}")
    return 0


def _launch(argv: list[str]) -> int:
    from loom.launch import launch_main

    return launch_main(argv)


def _bench(argv: list[str]) -> int:
    benches = {
        "comm": "loom.bench.comm:comm_main",
        "optim": "loom.bench.optim:optim_main",
        "peak": "loom.bench.peak:peak_main",
        "train": "loom.bench.train:train_main",
    }
    if not argv or argv[0] not in benches:
        print(
            f"usage: loom bench {{{','.join(benches)}}} [args]   (loom bench <name> --help)", file=sys.stderr
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module, fn = benches[argv[0]].split(":")
    return getattr(importlib.import_module(module), fn)(argv[1:])


def _doctor(argv: list[str]) -> int:
    from loom.doctor import doctor_main

    return doctor_main(argv)


def _verify(argv: list[str]) -> int:
    from loom.verify import verify_main

    return verify_main(argv)


def _plan(argv: list[str]) -> int:
    """`loom plan ...`; with --check [--gpu NAME] the planner's top layouts are also dry-run (loom.dryrun.check)
    and each measurement is printed beside the planner's estimate."""
    from loom.plan import plan_main

    if "--check" not in argv:
        return plan_main(argv)
    from loom.dryrun.check import check_checkable, plan_check
    from loom.plan.report import build_parser, run_plan

    p = build_parser()
    p.add_argument("--check", action="store_true", help="dry-run the top layouts (loom train --dry-run)")
    p.add_argument("--gpu", default="H100", help="with --check: the GPU the dry run takes (default H100)")
    args = p.parse_args(argv)
    shape, cluster, wl, cands = run_plan(args)
    check_checkable(shape)
    plain = [a for a in argv if a != "--check" and not a.startswith("--gpu=")]
    if "--gpu" in plain:  # "--gpu NAME": both go
        i = plain.index("--gpu")
        del plain[i : i + 2]
    plan_main(plain)
    return plan_check(
        args.model, shape, cluster, wl, [c for c in cands if c.fits][: min(args.top, 3)], args.gpu
    )


VERBS = {
    "train": (_train, "train a language model (no arguments: the demo on the built-in corpus)"),
    "sft": (_sft, "fine-tune on conversations: loom sft --data.path=CHAT --model.init_from=run:BASE"),
    "data": (_data, "prepare data: loom data prepare --input ... --out DIR"),
    "generate": (_generate, "sample from a trained run"),
    "chat": (_chat, "talk to a fine-tuned run: loom chat RUN [--prompt TEXT] (/help, /reset, /quit)"),
    "eval": (_eval, "validation loss and perplexity of a run"),
    "plot": (_plot, "plot loss curves of one or more runs"),
    "ckpt": (_ckpt, "checkpoints: loom ckpt inspect RUN | consolidate RUN --out DIR"),
    "export": (_export, "write a run's model as a transformers (gpt2, Llama) directory or safetensors"),
    "verify": (
        _verify,
        "prove N processes learn the same curve as one: loom verify --strategies ddp --nproc 2",
    ),
    "bench": (_bench, "benchmarks: loom bench comm | optim | peak | train"),
    "doctor": (_doctor, "environment report: versions, devices, GPU links, MPI, compile (--json)"),
    "plan": (
        _plan,
        "memory / time estimates of dp/tp/pp/ZeRO layouts: loom plan --model 7b --gpus 64 --gpu-mem 80 "
        "(--check: dry-run the top layouts)",
    ),
    "launch": (
        _launch,
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
        if os.environ.get("LOOM_PLUGINS"):  # plug-in model families register before any config is read
            from loom.model.registry import load_plugins

            load_plugins()
        return verb[0](argv[1:])
    except LoomError as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2
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

"""`loom generate` and `loom chat`: sampling from a trained run (loom.generate, loom.chat)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loom.cli import speculate
from loom.cli.args import SHARD_HELP, run_model
from loom.errors import LoomError

if TYPE_CHECKING:
    from loom.runs import LoadedRun


# the sampling options' help, shared by loom generate and loom chat
RUN_HELP = "a run folder (runs/NAME): its newest valid checkpoint is loaded"
TEMPERATURE_HELP = "divides the logits before sampling: lower is more predictable, 0 greedy"
TOP_K_HELP = "sample among the k most likely tokens only"
TOP_P_HELP = "sample among the most likely tokens whose probabilities add up to p (nucleus; default: off)"
SEED_HELP = "random seed of the sampling (default 1337)"
DEVICE_HELP = "auto (default: this process's GPU, else mps, else the CPU), or a device such as cpu, cuda:1"


def generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loom generate", description="Sample text from a trained run.")
    p.add_argument("run_dir", help=RUN_HELP)
    p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    p.add_argument(
        "--max-new-tokens", type=int, default=200, help="tokens to sample per sample (default 200)"
    )
    p.add_argument("--temperature", type=float, default=0.8, help=TEMPERATURE_HELP + " (default 0.8)")
    p.add_argument("--top-k", type=int, default=200, help=TOP_K_HELP + " (default 200)")
    p.add_argument("--top-p", type=float, default=None, help=TOP_P_HELP)
    p.add_argument("--seed", type=int, default=1337, help=SEED_HELP)
    p.add_argument("--num-samples", type=int, default=1, help="how many samples to print (default 1)")
    p.add_argument("--no-cache", action="store_true", help="recompute the context every token (slower)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--shard", action="store_true", help=SHARD_HELP)
    speculate.add_options(p)
    args = p.parse_args(argv)
    check_sampling(args)
    speculate.check_options(args)
    if args.shard and (args.quantize or args.speculate or args.draft):
        raise LoomError(
            "--shard runs the model FSDP-sharded: --quantize, --speculate and --draft need it whole"
        )
    with run_model(args) as run:
        return _generate_samples(args, run)


def chat(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="loom chat",
        description="Talk to a fine-tuned run (chat data: loom data prepare --chat), turn by turn, with "
        "streaming tokens; --prompt answers once and exits.",
    )
    p.add_argument("run_dir", help=RUN_HELP)
    p.add_argument(
        "--prompt", default=None, help="one user turn: print only the assistant's answer, then exit"
    )
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    p.add_argument("--temperature", type=float, default=0.0, help=TEMPERATURE_HELP + " (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=None, help=TOP_K_HELP + " (default: every token)")
    p.add_argument("--top-p", type=float, default=None, help=TOP_P_HELP)
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer in tokens (default 256)")
    p.add_argument("--seed", type=int, default=1337, help=SEED_HELP)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--ckpt", default=None, help="a checkpoint folder of the run (default: its newest)")
    args = p.parse_args(argv)
    args.num_samples = 1
    check_sampling(args)
    from loom.chat import ChatSession, Sampling, chat_template, repl
    from loom.data.loader import read_meta
    from loom.model.registry import spec_of

    meta = read_meta(Path(args.run_dir) / "tokenizer") if (Path(args.run_dir) / "tokenizer").is_dir() else {}
    with run_model(args) as run:
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


def _generate_samples(args, run: LoadedRun) -> int:
    """Every rank runs the same sampling (the same generator seed; a sharded forward is a collective); rank 0
    prints."""
    import torch

    from loom.generate import generate
    from loom.model.quant import quantize_weights
    from loom.model.registry import spec_of

    model, tok, device = run.model, run.tok, run.device
    quantize_weights(model, args.quantize)
    speculator = speculate.speculator_for(args, device, model)
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
            speculator=speculator,
            spec_tokens=args.spec_tokens,
        )
        if run.rank:
            continue
        if i:
            print("\n---------------")
        sys.stdout.write(args.prompt + tok.decode(out[0, len(ids) :].tolist()) + "\n")
    return 0


def check_sampling(args: argparse.Namespace) -> None:
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

"""`loom serve RUN`: the run behind an OpenAI-compatible HTTP API (loom.serve)."""

from __future__ import annotations

import argparse
import math
import os
import sys

from loom.cli import speculate
from loom.cli.args import run_model
from loom.errors import LoomError


def serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="loom serve",
        description="Serve a trained run with the OpenAI API (/v1/chat/completions, /v1/completions, "
        "/v1/models), /health and /metrics. Needs the serve extra: pip install 'loom[serve]'.",
    )
    p.add_argument("run_dir")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument(
        "--api-key", default=None, help="required as 'Authorization: Bearer KEY' (or LOOM_API_KEY)"
    )
    p.add_argument("--model-name", default=None, help="the model's id in the API (default: the run's folder)")
    p.add_argument("--max-seqs", type=int, default=16, help="requests decoded together (rows of the batch)")
    p.add_argument(
        "--max-kv-tokens", type=int, default=None, help="KV-cache tokens the rows may hold together"
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row; past it: 429")
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="prompt tokens whose keys and values are kept for later requests that start alike (default: "
        "--max-kv-tokens, else max-seqs x context)",
    )
    p.add_argument(
        "--no-prefix-cache", action="store_true", help="every prompt is prefilled whole (no prefix cache)"
    )
    speculate.add_options(p)
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds SIGTERM (or Ctrl-C) waits for requests in flight; what still runs then is cancelled",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--ckpt", default=None, help="a checkpoint folder of the run (default: its newest)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="split the model over N local processes (tensor parallel); rank 0 serves HTTP. Under torchrun "
        "(or srun, mpiexec) the job's processes split it without --nproc",
    )
    args = p.parse_args(argv)
    _check(args)
    speculate.check_options(args)
    from loom.env import detect_env
    from loom.serve import ServeOptions, bind

    key = _api_key(args)
    opts = ServeOptions(
        args.host,
        args.port,
        key,
        args.model_name,
        args.max_seqs,
        args.max_kv_tokens,
        args.max_queue,
        args.grace,
        0 if args.no_prefix_cache else args.prefix_cache_tokens,
        spec_tokens=args.spec_tokens,
    )
    env = detect_env()
    _warn_open(args.host, key, env.rank)
    split = (args.nproc or 1) > 1 or env.world_size > 1
    if split and (args.quantize or args.speculate or args.draft):
        raise LoomError(
            "--quantize, --speculate and --draft serve a whole model: not with --nproc (tensor parallel)",
            hint="leave them out, or serve on one process",
        )
    if args.nproc is not None and args.nproc > 1:
        return _launch(args, argv, env)
    if env.world_size > 1:
        return _serve_tp(args, opts, env)
    sock = bind(args.host, args.port)  # before loading: a port in use fails at once
    _serve_one(args, opts, sock)
    return 0


def _serve_one(args: argparse.Namespace, opts, sock) -> None:
    """Serve on one process: the run loaded (quantized, with its speculator), until SIGTERM."""
    from loom.serve import run_server, served_for

    with run_model(args) as run:
        if run.tok is None:
            raise LoomError(
                f"run '{args.run_dir}' was trained on data without a tokenizer: cannot turn text into ids",
                hint="prepare the data with loom (or give nanogpt's meta.pkl) to get a tokenizer",
            )
        from loom.model.quant import quantize_weights

        quantize_weights(run.model, args.quantize)
        opts.speculator = speculate.speculator_for(args, run.device, run.model)
        run_server(served_for(run, args.run_dir, opts), sock, args.grace)


def _check(args: argparse.Namespace) -> None:
    """Bad options refused before anything loads; the serve extra present."""
    for name in ("max_seqs", "max_queue"):
        if getattr(args, name) < 1:
            raise LoomError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.prefix_cache_tokens is not None and args.prefix_cache_tokens < 0:
        raise LoomError(f"--prefix-cache-tokens must be >= 0, got {args.prefix_cache_tokens}")
    if args.max_kv_tokens is not None and args.max_kv_tokens < 1:
        raise LoomError(f"--max-kv-tokens must be at least 1, got {args.max_kv_tokens}")
    if args.nproc is not None and args.nproc < 1:
        raise LoomError(f"--nproc must be at least 1, got {args.nproc}")
    if not 0 <= args.port < 65536:
        raise LoomError(f"--port must be in 0..65535, got {args.port}")
    if not math.isfinite(args.grace) or args.grace < 0:
        raise LoomError(
            f"--grace must be a number of seconds >= 0, got {args.grace}",
            hint="0: requests in flight are cancelled at once on SIGTERM",
        )
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise LoomError(f"loom serve needs {e.name}", hint="pip install 'loom[serve]'") from None


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else LOOM_API_KEY, else None (no key). Given but empty (`--api-key="$UNSET"`) is an error: read
    as "no key" it would open the server that the key was meant to close."""
    if args.api_key is not None:
        given, where = args.api_key, "--api-key"
    elif "LOOM_API_KEY" in os.environ:
        given, where = os.environ["LOOM_API_KEY"], "LOOM_API_KEY"
    else:
        return None
    if not given.strip():
        raise LoomError(
            f"{where} is empty: the server would answer without a key",
            hint="give a real key (is the variable you meant to pass set?), or leave out --api-key and unset "
            "LOOM_API_KEY to serve this machine only without one",
        )
    return given


def _warn_open(host: str, key: str | None, rank: int) -> None:
    """A loud warning when the server is reachable from other machines and answers anyone."""
    from loom import log
    from loom.serve import is_loopback

    if key is None and not is_loopback(host) and rank == 0:
        log.warn(
            f"--host {host} is not this machine's loopback and no --api-key is set: anyone who can reach this "
            "machine can use the model (and its compute). Give --api-key (or LOOM_API_KEY), or bind 127.0.0.1"
        )


def _launch(args: argparse.Namespace, argv: list[str], env) -> int:
    """`loom serve RUN --nproc N`: N local processes (as `loom train --nproc` starts its ranks), each running
    `loom serve RUN` in the job; checked here first, before any of them loads the model."""
    from loom.runs import check_tp_run
    from loom.serve import bind
    from loom.train.spawn import run_local, stop_server

    if env.world_size > 1:
        raise LoomError(
            f"--nproc starts processes of its own, and this is already rank {env.rank} of a job of "
            f"{env.world_size}",
            hint="leave out --nproc: the job's processes split the model",
        )
    check_tp_run(args.run_dir, args.nproc)
    bind(args.host, args.port).close()  # a port in use fails now, not after every rank has loaded
    child = _without_nproc(argv)
    try:
        # the processes wait (SIGKILL after) for rank 0 to drain its requests: --grace, and a margin to leave
        return run_local(args.nproc, ["serve", *child], 600.0, args.grace + 60.0)
    finally:
        stop_server()


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _serve_tp(args: argparse.Namespace, opts, env) -> int:
    """One rank of a tensor-parallel server (loom.serve.tp): the model split over the job's processes, rank 0
    serving HTTP; the rank leaves the job (its exit code) when the server has drained."""
    from loom import log
    from loom.cli.args import device_of, leave_job
    from loom.distributed import process_group
    from loom.runs import LoadedRun, load_run_tp
    from loom.serve import bind
    from loom.serve.tp import serve_rank

    log.setup(rank=env.rank)
    code = 1
    try:
        sock = bind(args.host, args.port) if env.rank == 0 else None
        device = device_of(args, env)
        cfg, model, tok, _, path = load_run_tp(args.run_dir, device, env, args.ckpt)
        run = LoadedRun(model, tok, cfg, path, device, env.rank, env.world_size, None)
        code = serve_rank(run, args.run_dir, opts, sock, heartbeat=min(30.0, cfg.parallel.timeout_s / 4))
    except LoomError as e:
        print(f"loom: error: {e}", file=sys.stderr)
        code = e.code
    finally:
        if code == 0:  # a failed rank leaves at once: the others see its connections close, not a timeout
            process_group.shutdown()
    leave_job(code)
    return code

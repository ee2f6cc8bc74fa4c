"""`loom serve RUN`: the run behind an OpenAI-compatible HTTP API (loom.serve)."""

from __future__ import annotations

import argparse
import os

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
    p.add_argument("--grace", type=float, default=30.0, help="seconds SIGTERM waits for requests in flight")
    p.add_argument("--device", default="auto")
    p.add_argument("--ckpt", default=None, help="a checkpoint folder of the run (default: its newest)")
    args = p.parse_args(argv)
    _check(args)
    from loom.serve import ServeOptions, bind, run_server, served_for

    key = args.api_key or os.environ.get("LOOM_API_KEY") or None
    opts = ServeOptions(
        args.host,
        args.port,
        key,
        args.model_name,
        args.max_seqs,
        args.max_kv_tokens,
        args.max_queue,
        args.grace,
    )
    sock = bind(args.host, args.port)  # before loading: a port in use fails at once
    with run_model(args) as run:
        if run.tok is None:
            raise LoomError(
                f"run '{args.run_dir}' was trained on data without a tokenizer: cannot turn text into ids",
                hint="prepare the data with loom (or give nanogpt's meta.pkl) to get a tokenizer",
            )
        run_server(served_for(run, args.run_dir, opts), sock, args.grace)
    return 0


def _check(args: argparse.Namespace) -> None:
    """Bad options refused before anything loads; the serve extra present."""
    for name in ("max_seqs", "max_queue"):
        if getattr(args, name) < 1:
            raise LoomError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_kv_tokens is not None and args.max_kv_tokens < 1:
        raise LoomError(f"--max-kv-tokens must be at least 1, got {args.max_kv_tokens}")
    if not 0 <= args.port < 65536:
        raise LoomError(f"--port must be in 0..65535, got {args.port}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise LoomError(f"loom serve needs {e.name}", hint="pip install 'loom[serve]'") from None

"""`loom serve RUN`: a trained run behind the OpenAI API (FastAPI on uvicorn), generating with loom.engine.

  app.py       the routes: /v1/chat/completions (the run's chat template), /v1/completions, /v1/models,
               /health, /metrics (Prometheus' text format); the API key; server-sent events
  protocol.py  the OpenAI requests read and checked (400 for a bad field, a prompt past the context,
               max_tokens <= 0, n = 0), and the responses and stream chunks written
  worker.py    the thread that owns the engine and steps it; the event loop hands it requests
  tp.py        the model split tensor-parallel over the processes of a job (--nproc, torchrun): rank 0's
               engine thread sends the other ranks each change to its requests, so every engine runs the same
               forwards

Why FastAPI + uvicorn: the ASGI stack vLLM's, SGLang's and litgpt's OpenAI servers use, maintained, with
server-sent events (StreamingResponse) and a graceful shutdown (uvicorn stops accepting, waits for the
requests in flight up to --grace seconds) built in. Both are the `loom[serve]` extra.

Binds 127.0.0.1 unless --host says otherwise. --api-key (or LOOM_API_KEY) makes /v1/* answer 401 without
`Authorization: Bearer KEY`; /health and /metrics stay open (a load balancer's and Prometheus' probes). An
empty key is refused (an unset variable must not open the server), and a host other than loopback without a
key is warned about.
SIGTERM or Ctrl-C: no new connections, the requests in flight finish (within --grace seconds; what still runs
then is cancelled), the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loom import log
from loom.errors import LoomError


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    max_seqs: int = 16
    max_kv_tokens: int | None = None
    max_queue: int = 64
    grace: float = 30.0
    # prompt tokens whose keys and values are kept across requests (loom.engine.prefix_cache); None: as many
    # as the running rows may hold (max_kv_tokens), 0: off (--no-prefix-cache)
    prefix_cache_tokens: int | None = None
    # loom.engine.speculative's NgramProposer or DraftProposer (--speculate, --draft); None: no speculation
    speculator: object = None
    spec_tokens: int = 4

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise LoomError(
                "the API key is empty: the server would answer without one",
                hint="give a real key (--api-key or LOOM_API_KEY), or leave both unset to serve without a key",
            )


def is_loopback(host: str) -> bool:
    """Whether `host` binds this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_of(host: str, port: int) -> str:
    """The server's base URL (an IPv6 address in brackets: http://[::1]:8000/v1)."""
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def checkpoint_of(path) -> dict:
    """The served checkpoint: {"path", "step"} (step None where the folder does not say: a consolidated file)."""
    path = Path(path).resolve()
    m = re.fullmatch(r"step_(\d+)", path.name)
    step = int(m.group(1)) if m else None
    if step is None and path.suffix == ".safetensors":
        with contextlib.suppress(Exception):  # a file without loom's metadata: no step
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                step = int((f.metadata() or {}).get("loom_step"))
    return {"path": str(path), "step": step}


def engine_for(run, opts: ServeOptions):
    """The engine that generates for a loaded run (every rank of a tensor-parallel job builds the same one)."""
    from loom.engine import Engine

    return Engine(
        run.model.eval(),
        max_seqs=opts.max_seqs,
        max_len=run.model.cfg.block_size,
        max_kv_tokens=opts.max_kv_tokens,
        vocab_size=run.tok.vocab_size,
        decode=run.tok.decode,
        device=run.device,
        fail_alone=True,  # a request's own failure fails it alone: the server answers the others
        prefix_cache_tokens=(
            opts.max_kv_tokens or opts.max_seqs * run.model.cfg.block_size
            if opts.prefix_cache_tokens is None
            else opts.prefix_cache_tokens
        ),
        speculator=opts.speculator,
        spec_tokens=opts.spec_tokens,
    )


def served_for(run, run_dir, opts: ServeOptions, worker=None):
    """The Served state (loom.serve.app) of a loaded run: its engine and worker (default: a Worker of
    engine_for's engine), tokenizer, chat template."""
    from pathlib import Path

    from loom.data.chat import chat_template_of
    from loom.data.loader import read_meta
    from loom.serve.app import Served
    from loom.serve.worker import Worker

    tok = run.tok
    meta_dir = Path(run_dir) / "tokenizer"
    meta = read_meta(meta_dir) if meta_dir.is_dir() else {}
    template = chat_template_of(tok, meta) if isinstance(meta.get("chat"), dict) else None
    return Served(
        worker=worker or Worker(engine_for(run, opts), opts.max_queue),
        model=opts.model_name or Path(run_dir).resolve().name,
        context=run.model.cfg.block_size,
        tokenizer=tok,
        template=template,
        eot_id=tok.eot_id,
        api_key=opts.api_key,
        longest_token_chars=_longest_token(tok),
        checkpoint=checkpoint_of(run.path),
    )


def _longest_token(tok) -> int:
    """The most characters one token decodes to: a prompt of more characters than this x context tokens
    cannot fit, and is refused before it is encoded (a 1 MB prompt costs nothing)."""
    longest = 1
    for i in range(tok.vocab_size):
        try:
            longest = max(longest, len(tok.decode([i])))
        except Exception:  # noqa: BLE001  (an id the tokenizer cannot decode alone: a piece of a character)
            continue
    return longest


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: any free one, printed), bound before the server starts. A host that does
    not resolve or a port that is taken is one LoomError."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LoomError(
            f"cannot serve on --host {host}: it does not resolve ({e.strerror})",
            hint="give an address of this machine (127.0.0.1, 0.0.0.0, ::1) or a name that resolves to one",
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise LoomError(
            f"cannot listen on {host} port {port}: {e.strerror}",
            hint="the port is taken: stop what uses it or pick another (--port; 0: any free one)"
            if e.errno == errno.EADDRINUSE
            else "give an address of this machine (--host) and a port you may use (--port)",
        ) from None
    sock.setblocking(False)
    return sock


def make_server(served, grace: float):
    """The uvicorn server of the app: the worker starts with it and, once the requests in flight are done
    (uvicorn waits for them up to `grace` seconds), stops."""
    import contextlib

    import uvicorn

    from loom.serve.app import build_app

    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.worker.start()
        yield
        # uvicorn has waited for the requests in flight (up to `grace` seconds) and cancelled what still ran:
        # their rows are cancelled now, and the engine's thread ends, waited for off the event loop (a wait
        # on it would keep the cancelled requests' own clean-up from running)
        served.worker.draining = True
        served.worker.stop(abort=True)
        await asyncio.to_thread(served.worker.join, 30)

    app = build_app(served)
    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace, lifespan="on")
    return uvicorn.Server(config)


@contextlib.contextmanager
def serving_in_thread(served, grace: float = 5) -> Iterator[int]:
    """The app served on 127.0.0.1 (any free port) by a thread of this process while the block runs; yields
    the port (loom bench generate's load test, the tests)."""
    sock = bind("127.0.0.1", 0)
    server = make_server(served, grace)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def run_server(served, sock: socket.socket, grace: float) -> None:
    """Serve until SIGTERM or Ctrl-C, then drain: uvicorn closes the socket, waits for the requests in flight
    (up to `grace` seconds), and the worker stops. Returns normally (exit 0)."""
    server = make_server(served, grace)
    # uvicorn raises the signal it caught again once it has shut down, under the handler found at its start:
    # these only ask it to stop, so a drained server exits 0 instead of dying by SIGTERM (or KeyboardInterrupt:
    # Ctrl-C); and a signal that comes before uvicorn has put up its own handlers stops it all the same
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    host, port = sock.getsockname()[:2]
    ckpt = served.checkpoint
    step = f"step {ckpt['step']}" if ckpt.get("step") is not None else "step unknown"
    log.info(f"loom serve: checkpoint {ckpt.get('path')} ({step})")
    log.info(f"loom serve: {served.model} on {url_of(host, port)} (context {served.context} tokens)")
    server.run(sockets=[sock])
    # a second Ctrl-C makes uvicorn skip the lifespan's end: the engine's thread is ended here then, so the
    # process never exits with it inside a forward
    served.worker.stop(abort=True)
    if served.worker.is_alive():
        served.worker.join(30)
    log.info("loom serve: stopped")

"""`loom bench generate`: generation speed of loom.engine, beside transformers' `generate` on the same model.

    loom bench generate [RUN] [--batch 1,16,64] [--prompt-len 64] [--new-tokens 64] [--rounds 3]
                        [--dtype fp32|bf16] [--device auto] [--no-hf] [--clients 32] [--requests 10]
                        [--json FILE] [--model.key=value ...]

The model: RUN's (its newest checkpoint), or without RUN one built from the model.* keys with random weights
(speed does not depend on the weights: the GPU kit's GPT-2 124M). transformers' model is loom's export of it
(loom.model.hf.export_hf, what `loom export` writes), loaded back with AutoModelForCausalLM, in the same dtype
on the same device, so the two run the same weights side by side in one process; their greedy tokens are
compared too (`same_tokens`).

Per batch B: B prompts of --prompt-len random ids, greedy, exactly --new-tokens each (no stop). Each side is
timed generating 1 token (t1: the prefill and one sample) and N tokens (tN), in interleaved rounds (loom, hf,
loom, hf, ...) so a machine that gets busier slows both alike; medians. prefill tok/s = B x prompt / t1, decode
tok/s = B x (N - 1) / (tN - t1), total tok/s = B x N / tN. On CUDA, decoding's memory-bandwidth use: the bytes
one decode step reads (the weights once, and the KV cache of every row) over the step's time, and that over
the device's measured copy bandwidth (loom bench peak's), as nanochat's infer_bench reports it.

With RUN and --clients C > 0: `loom serve`'s app on 127.0.0.1 (a thread of this process, a real socket), C
clients each sending --requests completions one after another: every request's latency (p50, p99) and the
generated tokens/s, once with continuous batching (max_seqs = C) and once one request at a time (max_seqs 1);
their ratio is `batching_speedup`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loom import config, log
from loom.bench.peak import measure_copy_bandwidth, resolve_device, sync
from loom.engine import Engine, Request, SamplingParams
from loom.errors import LoomError
from loom.model.cpu_paths import inference_layout
from loom.model.registry import spec_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom bench generate", description="Generation tokens/s of loom's engine beside transformers'."
    )
    p.add_argument(
        "run_dir", nargs="?", default=None, help="a run (default: random weights of the model.* keys)"
    )
    p.add_argument("--batch", default="1,16,64", help="batch sizes (default 1,16,64)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per side and batch (median)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-hf", action="store_true", help="loom only (no transformers side)")
    p.add_argument("--clients", type=int, default=0, help="with RUN: concurrent clients of loom serve")
    p.add_argument("--requests", type=int, default=10, help="requests per client")
    p.add_argument("--json", metavar="FILE", help="write the records as JSON")
    return p


def generate_main(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    batches = _check(args, rest)
    device = resolve_device(args.device)
    model, run_ctx = _model(args, rest, device)
    with run_ctx as run:
        model = (run.model if run is not None else model).float().eval()
        hf = None if args.no_hf else _hf_twin(model, device, DTYPES[args.dtype])
        model = model.to(DTYPES[args.dtype])
        inference_layout(model)  # as open_run gives a run's model (random weights: not through it)
        records = [_speed(model, hf, b, args, device) for b in batches]
        if run is not None and args.clients:
            records.append(_load(run, args))
    for r in records:
        log.info(_line(r))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return 0


def _check(args, rest: list[str]) -> list[int]:
    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        raise LoomError(f"--batch takes sizes like 1,16,64, got '{args.batch}'") from None
    if not batches or min(batches) < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.rounds < 1:
        raise LoomError("need --batch sizes >= 1, --prompt-len >= 1, --new-tokens >= 2 and --rounds >= 1")
    if args.clients < 0 or args.requests < 1:
        raise LoomError("need --clients >= 0 and --requests >= 1")
    if args.run_dir and rest:
        raise LoomError(f"with RUN the model is the run's: {' '.join(rest)} not taken")
    if args.clients and not args.run_dir:
        raise LoomError("--clients serves a run (its tokenizer reads the requests)", hint="give RUN")
    if args.json:
        from loom.paths import check_output_file

        check_output_file(args.json, "--json")
    return batches


def _model(args, rest: list[str], device):
    """(model, context manager yielding the LoadedRun or None): a run's, or random weights of model.*."""
    import contextlib

    if args.run_dir:
        from loom.env import detect_env
        from loom.runs import open_run

        return None, open_run(args.run_dir, device, detect_env())
    cfg = config.load_config(None, rest)
    vocab = cfg.model.vocab_size or 50304
    torch.manual_seed(0)  # built on the device: its modules' own random init
    return spec_of(cfg).build_model(cfg, vocab, device), contextlib.nullcontext(None)


def _hf_twin(model, device, dtype):
    """transformers' model of loom's export of `model` (fp32), on the same device, in `dtype`."""
    try:
        import transformers
    except ImportError:
        raise LoomError(
            "the transformers side needs transformers", hint="pip install 'loom[hf]', or --no-hf"
        ) from None
    from loom.model.hf import export_hf

    with tempfile.TemporaryDirectory(prefix="loom-bench-generate-") as tmp:
        export_hf(model, Path(tmp) / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf")
    return hf.to(device=device, dtype=dtype).eval()


def _prompts(B: int, T: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(B)).to(device)


def _loom_run(model, ids: torch.Tensor, new: int, vocab: int) -> list[list[int]]:
    engine = Engine(model, max_seqs=ids.size(0), max_len=ids.size(1) + new, vocab_size=vocab)
    greedy = SamplingParams(new, 0.0)  # no stop: exactly `new` tokens a row
    return [r.tokens for r in engine.run([Request(row, greedy) for row in ids.tolist()])]


def _hf_run(hf, ids: torch.Tensor, new: int) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, ids.size(1) :].tolist()


def _timed(fn, device) -> tuple[float, object]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def _speed(model, hf, B: int, args, device) -> dict:
    """One batch size: each side's t1 and tN in interleaved rounds, the tokens/s derived from their medians."""
    vocab, P, N = model.cfg.vocab_size, args.prompt_len, args.new_tokens
    if P + N > model.cfg.block_size:
        raise LoomError(
            f"--prompt-len + --new-tokens = {P + N} exceed the model's block_size {model.cfg.block_size}"
        )
    ids = _prompts(B, P, vocab, device)
    sides = {"loom": lambda n: _loom_run(model, ids, n, vocab)}
    if hf is not None:
        sides["hf"] = lambda n: _hf_run(hf, ids, n)
    times: dict[str, dict[int, list[float]]] = {k: {1: [], N: []} for k in sides}
    tokens = {}
    for side, run in sides.items():  # warm-up (allocator, kernels' first calls), untimed
        tokens[side] = run(N)
    for _ in range(args.rounds):
        for n in (1, N):
            for side, run in sides.items():
                times[side][n].append(_timed(lambda run=run, n=n: run(n), device)[0])
    rec = {"kind": "speed", "batch": B, "prompt_len": P, "new_tokens": N, "dtype": args.dtype}
    rec["device"] = str(device)
    for side in sides:
        t1, tn = statistics.median(times[side][1]), statistics.median(times[side][N])
        rec[side] = {
            "t1_s": t1,
            "tN_s": tn,
            "prefill_tok_s": B * P / t1,
            "decode_tok_s": B * (N - 1) / max(tn - t1, 1e-9),
            "total_tok_s": B * N / tn,
        }
    if hf is not None:
        rec["same_tokens"] = tokens["loom"] == tokens["hf"]
        rec["decode_vs_hf"] = rec["loom"]["decode_tok_s"] / rec["hf"]["decode_tok_s"]
        rec["total_vs_hf"] = rec["loom"]["total_tok_s"] / rec["hf"]["total_tok_s"]
    if device.type == "cuda":
        rec["bandwidth"] = _bandwidth(model, B, P + N / 2, rec["loom"]["decode_tok_s"] / B, device)
    return rec


def _bandwidth(model, B: int, avg_len: float, steps_per_s: float, device) -> dict:
    """Decoding's bytes per step (weights once, every row's KV cache up to its length) and their rate, over the
    device's measured copy bandwidth."""
    cfg = model.cfg
    elem = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    kv = B * avg_len * cfg.n_layer * 2 * cfg.kv_heads * cfg.head_dim * elem
    rate = (weights + kv) * steps_per_s
    copy = measure_copy_bandwidth(device, None)["bandwidth_gbps"] * 1e9
    return {
        "bytes_per_step": weights + kv,
        "gb_s": rate / 1e9,
        "copy_gb_s": copy / 1e9,
        "utilisation": rate / copy,
    }


def _load(run, args) -> dict:
    """C clients x R completions against loom serve on 127.0.0.1: continuous batching (max_seqs = C), then
    one request at a time (max_seqs 1)."""
    rec = {"kind": "load", "clients": args.clients, "requests": args.requests, "new_tokens": args.new_tokens}
    vocab = run.tok.vocab_size
    g = torch.Generator().manual_seed(0)
    texts = [
        run.tok.decode(torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist())
        for _ in range(args.clients * args.requests)
    ]
    for mode, seqs in (("batched", args.clients), ("serial", 1)):
        rec[mode] = _serve_and_load(run, args, texts, seqs)
    rec["batching_speedup"] = rec["batched"]["tok_s"] / rec["serial"]["tok_s"]
    return rec


def _serve_and_load(run, args, texts: list[str], max_seqs: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from loom.serve import ServeOptions, served_for, serving_in_thread

    opts = ServeOptions(model_name="bench", max_seqs=max_seqs, max_queue=2 * args.clients)
    with serving_in_thread(served_for(run, args.run_dir, opts)) as port:
        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            chunks = [texts[k :: args.clients] for k in range(args.clients)]
            done = [x for got in pool.map(lambda c: _client(port, c, args.new_tokens), chunks) for x in got]
        wall = time.perf_counter() - start
    lat = sorted(t for t, _ in done)
    tokens = sum(n for _, n in done)
    return {
        "max_seqs": max_seqs,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "requests_s": len(done) / wall,
        "p50_s": lat[len(lat) // 2],
        "p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
    }


def _client(port: int, texts: list[str], new: int) -> list[tuple[float, int]]:
    """One client: its requests one after another, each (latency, completion tokens)."""
    import http.client

    out = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    for text in texts:
        body = json.dumps({"model": "bench", "prompt": text, "max_tokens": new, "temperature": 0})
        t = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(conn.getresponse().read())
        if "error" in answer:
            raise LoomError(f"loom serve refused a request: {answer['error']['message']}")
        out.append((time.perf_counter() - t, answer["usage"]["completion_tokens"]))
    conn.close()
    return out


def _line(r: dict) -> str:
    if r["kind"] == "load":
        b, s = r["batched"], r["serial"]
        return (
            f"serve {r['clients']} clients x {r['requests']}: batched {b['tok_s']:.0f} tok/s "
            f"p50 {b['p50_s'] * 1e3:.0f} ms p99 {b['p99_s'] * 1e3:.0f} ms | one at a time {s['tok_s']:.0f} tok/s "
            f"p50 {s['p50_s'] * 1e3:.0f} ms p99 {s['p99_s'] * 1e3:.0f} ms | batching x{r['batching_speedup']:.2f}"
        )
    out = f"batch {r['batch']:>3}: loom prefill {r['loom']['prefill_tok_s']:.0f} decode {r['loom']['decode_tok_s']:.0f} tok/s"
    if "hf" in r:
        out += (
            f" | hf prefill {r['hf']['prefill_tok_s']:.0f} decode {r['hf']['decode_tok_s']:.0f} tok/s"
            f" | decode x{r['decode_vs_hf']:.2f}, total x{r['total_vs_hf']:.2f}, same tokens {r['same_tokens']}"
        )
    if "bandwidth" in r:
        out += f" | {r['bandwidth']['gb_s']:.0f} GB/s ({100 * r['bandwidth']['utilisation']:.0f}% of copy)"
    return out

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

--quantize int8: the speed above for the model as it is and with int8 weights (loom.model.quant), and with RUN
the validation loss of both over --val-windows windows of its validation split (the quantization's cost).

--speculate ngram or --draft DRAFT_RUN (with RUN): per batch, greedy decoding of prompts cut from RUN's
validation text (real text: prompt lookup finds what a random prompt never repeats), without and with
speculation: tokens/s, the drafted tokens accepted, tokens per forward, whether the tokens are the same.

--shared-prefix P: --prefix-requests R requests (default 64) that share one P-token system prompt, each with
--prompt-len tokens of its own, all submitted at once to an engine of --batch's largest size, with and without
the prefix cache (loom.engine.prefix_cache): time to first token (mean, p50, p99, from submission) and
tokens/s, prompt tokens computed, and whether the answers are the same.

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

import numpy as np
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
    p.add_argument("--quantize", choices=["int8"], default=None, help="also time int8 weights (torchao)")
    p.add_argument("--val-windows", type=int, default=64, help="with RUN and --quantize: val windows scored")
    p.add_argument(
        "--speculate",
        choices=["ngram", "mtp"],
        default=None,
        help="with RUN: prompt lookup or its MTP modules",
    )
    p.add_argument("--draft", metavar="RUN", default=None, help="with RUN: speculation by a draft run")
    p.add_argument("--spec-tokens", type=int, default=4, help="tokens drafted per step (default 4)")
    p.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens of a system prompt shared by requests"
    )
    p.add_argument("--prefix-requests", type=int, default=64, help="requests sharing --shared-prefix")
    return p


def generate_main(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    batches = _check(args, rest)
    device = resolve_device(args.device)
    model, run_ctx = _model(args, rest, device)
    with run_ctx as run:
        model = (run.model if run is not None else model).float().eval()
        only_loom = args.no_hf or args.shared_prefix or args.speculate or args.draft
        hf = None if only_loom else _hf_twin(model, device, DTYPES[args.dtype])
        model = model.to(DTYPES[args.dtype])
        inference_layout(model)  # as open_run gives a run's model (random weights: not through it)
        if args.shared_prefix:
            records = [_prefix_bench(model, max(batches), args, device)]
        elif args.speculate or args.draft:
            records = _spec_records(model, run, batches, args, device)
        elif args.quantize:
            records = []  # the int8 record times the model as it is too
        else:
            records = [_speed(model, hf, b, args, device) for b in batches]
        if args.quantize:
            records += _quant_records(model, run, batches, args, device)
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
    if (args.speculate or args.draft) and not args.run_dir:
        raise LoomError(
            "speculation is timed on a run's text (prompts from its validation split)", hint="give RUN"
        )
    if args.draft:
        from loom.cli.speculate import check_draft

        check_draft(args.run_dir, args.draft)  # another vocabulary: refused before anything loads
    if args.quantize:
        from loom.model.quant import check_quantize

        check_quantize(args.quantize)
    if args.shared_prefix < 0 or args.prefix_requests < 1 or args.spec_tokens < 1 or args.val_windows < 1:
        raise LoomError("need --shared-prefix >= 0, --prefix-requests, --spec-tokens and --val-windows >= 1")
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
    if r["kind"] in ("prefix", "speculate", "quantize"):
        return _line2(r)
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


# ----------------------------------------------------------------------------- prefix cache, speculation, int8
def _prefix_bench(model, B: int, args, device) -> dict:
    """R requests sharing a P-token system prompt, all submitted at once, without and with the prefix cache."""
    vocab, P, N = model.cfg.vocab_size, args.shared_prefix, args.new_tokens
    L = P + args.prompt_len + N
    if L > model.cfg.block_size:
        raise LoomError(
            f"--shared-prefix + --prompt-len + --new-tokens = {L} exceed block_size {model.cfg.block_size}"
        )
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, vocab, (P,), generator=g).tolist()
    ps = [
        system + torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.prefix_requests)
    ]
    rec = {"kind": "prefix", "batch": B, "shared_prefix": P, "prompt_len": args.prompt_len, "new_tokens": N}
    rec["requests"], rec["dtype"], rec["device"] = len(ps), args.dtype, str(device)
    runs = {}
    for name, tokens in (("off", 0), ("on", 10 * L * B)):  # the cache: room for every request's prefix
        _prefix_run(model, ps, B, L, tokens, device)  # warm-up, untimed
        best = None
        for _ in range(args.rounds):
            out = _prefix_run(model, ps, B, L, tokens, device)
            best = out if best is None or out["wall_s"] < best["wall_s"] else best
        runs[name] = best
    rec["same_tokens"] = runs["off"].pop("tokens") == runs["on"].pop("tokens")
    rec.update(runs)
    rec["ttft_speedup"] = runs["off"]["ttft_mean_s"] / runs["on"]["ttft_mean_s"]
    rec["throughput_speedup"] = runs["on"]["tok_s"] / runs["off"]["tok_s"]
    return rec


def _prefix_run(model, ps: list[list[int]], B: int, L: int, tokens: int, device) -> dict:
    engine = Engine(model, max_seqs=B, max_len=L, vocab_size=model.cfg.vocab_size, prefix_cache_tokens=tokens)
    first: dict[int, float] = {}
    params = SamplingParams(L - len(ps[0]), 0.0)

    def on_token(r, first=first):
        first.setdefault(id(r), time.perf_counter())

    reqs = [Request(p, params, on_token=on_token) for p in ps]
    sync(device)
    start = time.perf_counter()
    engine.run(reqs)
    sync(device)
    wall = time.perf_counter() - start
    ttft = sorted(first[id(r)] - start for r in reqs)
    return {
        "wall_s": wall,
        "tok_s": sum(len(r.tokens) for r in reqs) / wall,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "prefilled_tokens": engine.prefilled,
        "forwards": engine.forwards,
        "tokens": [r.tokens for r in reqs],
    }


def _val_tokens(run, run_dir: str) -> np.ndarray:
    """RUN's validation tokens (its data's val shards, in order)."""
    from loom.data.shards import read_shard
    from loom.runs import run_data_dir

    data = run_data_dir(run_dir, run.cfg)
    files = sorted(Path(data).glob("*val*.bin"))
    if not files:
        raise LoomError(f"no validation shards in {data}: speculation and int8's loss are measured on them")
    return np.concatenate([read_shard(f) for f in files])


def _spec_records(model, run, batches: list[int], args, device) -> list[dict]:
    """Per batch: greedy decoding of text prompts without and with speculation."""
    from loom.cli.speculate import speculator_for

    vocab, P, N = run.tok.vocab_size, args.prompt_len, args.new_tokens
    val = _val_tokens(run, args.run_dir)
    records = []
    for B in batches:
        starts = torch.linspace(0, len(val) - P - 1, B).long().tolist()
        ps = [val[s : s + P].tolist() for s in starts]
        sides = {}
        for name in ("plain", "spec"):
            spec = speculator_for(args, device, model) if name == "spec" else None
            if spec is not None and hasattr(spec, "model"):
                spec.model.to(DTYPES[args.dtype])
            out = None
            for _ in range(args.rounds + 1):  # the first: warm-up
                engine = Engine(
                    model,
                    max_seqs=B,
                    max_len=P + N,
                    vocab_size=vocab,
                    speculator=spec,
                    spec_tokens=args.spec_tokens,
                )
                t, reqs = _timed(
                    lambda e=engine, ps=ps: e.run([Request(p, SamplingParams(N, 0.0)) for p in ps]), device
                )
                if out is None or t < out[0]:
                    out = (t, reqs, engine)
            t, reqs, engine = out
            sides[name] = {
                "s": t,
                "tok_s": B * N / t,
                "forwards": engine.forwards,
                "tokens": [r.tokens for r in reqs],
            }
            if spec is not None:
                sides[name]["proposed"], sides[name]["accepted"] = engine.spec_proposed, engine.spec_accepted
                sides[name]["acceptance"] = engine.spec_accepted / max(engine.spec_proposed, 1)
                # a row's tokens per verify: the accepted drafts and the pick after them
                sides[name]["tokens_per_verify"] = 1 + engine.spec_accepted / max(engine.spec_rows, 1)
        rec = {"kind": "speculate", "batch": B, "prompt_len": P, "new_tokens": N, "dtype": args.dtype}
        rec["drafter"] = args.draft or args.speculate
        rec["spec_tokens"], rec["device"] = args.spec_tokens, str(device)
        rec["same_tokens"] = sides["plain"].pop("tokens") == sides["spec"].pop("tokens")
        rec.update(sides)
        rec["speedup"] = sides["spec"]["tok_s"] / sides["plain"]["tok_s"]
        records.append(rec)
    return records


def _quant_records(model, run, batches: list[int], args, device) -> list[dict]:
    """Decode tokens/s of the model as it is and with int8 weights; with RUN, both models' validation loss."""
    import copy

    from loom.model.quant import quantize_weights

    q = copy.deepcopy(model)
    quantize_weights(q, args.quantize)
    rec = {"kind": "quantize", "quantize": args.quantize, "dtype": args.dtype, "device": str(device)}
    rec["speed"] = {}
    for B in batches:
        both = {}
        for name, m in (("base", model), (args.quantize, q)):
            r = _speed(m, None, B, args, device)
            both[name] = r["loom"]
        both["decode_speedup"] = both[args.quantize]["decode_tok_s"] / both["base"]["decode_tok_s"]
        rec["speed"][str(B)] = both
    if run is not None:
        val = _val_tokens(run, args.run_dir)
        rec["val_loss"] = {"base": _val_loss(model, val, args), args.quantize: _val_loss(q, val, args)}
        rec["val_loss"]["change"] = rec["val_loss"][args.quantize] - rec["val_loss"]["base"]
    return [rec]


def _val_loss(model, val, args) -> float:
    """Mean next-token cross-entropy over --val-windows block_size windows spread over the validation tokens."""
    import torch.nn.functional as F

    T = model.cfg.block_size
    starts = torch.linspace(0, len(val) - T - 2, args.val_windows).long().tolist()
    losses = []
    with torch.no_grad():
        for s in starts:
            x = torch.as_tensor(val[s : s + T + 1].astype("int64"))[None]
            logits = model(x[:, :-1].to(next(model.parameters()).device)).float()
            losses.append(
                F.cross_entropy(logits[0, :, : model.cfg.vocab_size], x[0, 1:].to(logits.device)).item()
            )
    return statistics.mean(losses)


def _line2(r: dict) -> str:
    if r["kind"] == "prefix":
        off, on = r["off"], r["on"]
        return (
            f"{r['requests']} requests sharing {r['shared_prefix']} tokens (batch {r['batch']}): time to first "
            f"token {off['ttft_mean_s'] * 1e3:.0f} -> {on['ttft_mean_s'] * 1e3:.0f} ms (x{r['ttft_speedup']:.2f}), "
            f"{off['tok_s']:.0f} -> {on['tok_s']:.0f} tok/s (x{r['throughput_speedup']:.2f}), prompt tokens computed "
            f"{off['prefilled_tokens']} -> {on['prefilled_tokens']}, same tokens {r['same_tokens']}"
        )
    if r["kind"] == "speculate":
        p, s = r["plain"], r["spec"]
        return (
            f"batch {r['batch']:>3}: {r['drafter']} k={r['spec_tokens']}: {p['tok_s']:.0f} -> {s['tok_s']:.0f} tok/s "
            f"(x{r['speedup']:.2f}), acceptance {100 * s['acceptance']:.0f}%, {s['tokens_per_verify']:.2f} tokens "
            f"a row per verify, same tokens {r['same_tokens']}"
        )
    out = ", ".join(
        f"batch {b}: decode {v['base']['decode_tok_s']:.0f} -> {v[r['quantize']]['decode_tok_s']:.0f} tok/s "
        f"(x{v['decode_speedup']:.2f})"
        for b, v in r["speed"].items()
    )
    if "val_loss" in r:
        v = r["val_loss"]
        out += f" | val loss {v['base']:.4f} -> {v[r['quantize']]:.4f} ({v['change']:+.4f})"
    return f"{r['quantize']} weights ({r['dtype']}): {out}"

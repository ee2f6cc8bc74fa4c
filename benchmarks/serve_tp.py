"""Generation tokens/s of `loom serve RUN --nproc 2` (the model split tensor-parallel over two processes) against
`loom serve RUN` (one process), through the OpenAI API, on the same run and the same greedy requests.

    python benchmarks/serve_tp.py [--run RUNS/NAME] [--layers 4 --width 256 --heads 4] [--clients 1 8]
                                  [--requests 4] [--new-tokens 64] [--rounds 2] [--json FILE]

Without --run, trains a model of --layers x --width on the built-in corpus (BPE 4096) for 30 steps under tp=2
(`loom train --nproc 2 --parallel.tp=2`). Each round starts each server in turn (interleaved), sends one
warm-up request, then for each --clients count C: C concurrent clients, each sending --requests completions of
--new-tokens tokens (greedy, a prompt of its own); generated tokens / wall time. The servers' answers must be
the same text. On a CPU, one process takes every core and each of the two processes half of them
(OMP_NUM_THREADS = cores / 2, as `--nproc` sets).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the king said that we shall go to the river and see what light comes over the hill".split()


def train(runs: Path, layers: int, width: int, heads: int) -> Path:
    cmd = [sys.executable, "-m", "loom", "train", "--nproc", "2", "--parallel.tp=2", f"--run.dir={runs}"]
    cmd += [
        "--run.name=tp",
        f"--model.n_layer={layers}",
        f"--model.n_embd={width}",
        f"--model.n_head={heads}",
    ]
    cmd += ["--model.block_size=256", "--train.steps=30", "--train.sample_every=0", "--train.device=cpu"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return runs / "tp"


def start(run: Path, nproc: int, clients: int, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "loom", "serve", str(run), "--port", "0", "--device", "cpu"]
    cmd += ["--model-name", "m", "--max-seqs", str(clients)] + (["--nproc", str(nproc)] if nproc > 1 else [])
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    for _ in range(1200):
        for line in log.read_text().splitlines():
            if "loom serve:" in line and "http://" in line:
                return proc, "http://" + line.split("http://")[1].split()[0]
        if proc.poll() is not None:
            sys.exit(log.read_text())
        time.sleep(0.25)
    sys.exit("no address:\n" + log.read_text())


def load(url: str, clients: int, requests: int, new_tokens: int) -> tuple[float, list[str]]:
    """(generated tokens/s, the answers) of `clients` concurrent clients sending `requests` each."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)

    def one(k: int) -> list[tuple[str, int]]:
        out = []
        for i in range(requests):
            prompt = " ".join(WORDS[(k * requests + i) % len(WORDS) :][:8])
            r = client.completions.create(model="m", prompt=prompt, max_tokens=new_tokens, temperature=0)
            out.append((r.choices[0].text, r.usage.completion_tokens))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        got = [a for answers in pool.map(one, range(clients)) for a in answers]
    wall = time.perf_counter() - t0
    return sum(n for _, n in got) / wall, [t for t, _ in got]


def measure(run: Path, nproc: int, args, tmp: Path) -> dict:
    proc, url = start(run, nproc, max(args.clients), tmp / f"serve-{nproc}.log")
    try:
        load(url, 1, 1, 4)  # warm-up
        out = {}
        for c in args.clients:
            out[c] = load(url, c, args.requests, args.new_tokens)
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        if code:
            sys.exit(
                f"loom serve --nproc {nproc} exited {code}:\n" + (tmp / f"serve-{nproc}.log").read_text()
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run = args.run or train(tmp / "runs", args.layers, args.width, args.heads)
        rows = []
        for r in range(args.rounds):
            one, tp = measure(run, 1, args, tmp), measure(run, 2, args, tmp)
            for c in args.clients:
                same = one[c][1] == tp[c][1]
                rows.append(
                    {"round": r, "clients": c, "one_tok_s": one[c][0], "tp2_tok_s": tp[c][0], "same": same}
                )
                print(
                    f"round {r} clients {c}: one process {one[c][0]:.0f} tok/s, tp=2 {tp[c][0]:.0f} tok/s, same {same}"
                )
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()

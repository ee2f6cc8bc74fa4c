"""Peak host memory (RSS) of each rank while it saves a checkpoint, and how long the save blocks it.

    python benchmarks/ckpt_memory.py --nproc 4 -- --parallel.dp_impl=fsdp --model.n_layer=12 ...
    python benchmarks/ckpt_memory.py --src /tmp/old-checkout/src --src src -- ...   # two checkouts compared

Each rank's `Checkpointer.save` (loom.train.checkpointing) is wrapped, through a `sitecustomize` module put
first on PYTHONPATH, by a function that resets the kernel's peak-RSS mark (`5 > /proc/self/clear_refs`, Linux),
runs the real save, reads the peak back (VmHWM in /proc/self/status), writes both figures and the seconds
the save took, and exits. So what is measured is the save alone: the resident state before it, and the most
the process held at any moment during it. The hook needs nothing from loom, so any checkout is measured the
same way (`--src`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from hooked import rank_files, run_hooked

HOOK = """
def _kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def _patch():
    cls = _loaded("loom.train.checkpointing", "Checkpointer")
    real = cls.save

    def save(self, *a, **k):
        if os.environ.get("LOOM_CKPT_RSS_TRIM"):  # hand freed heap back first: RSS = live memory
            import ctypes
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t0 = time.perf_counter()
        out = real(self, *a, **k)
        took = time.perf_counter() - t0
        rank = os.environ.get("RANK", "0")
        rec = {"rank": int(rank), "rss_before": before, "peak_during": _kib("VmHWM"), "save_s": took}
        with open(os.path.join(os.environ["LOOM_CKPT_RSS_DIR"], f"rank{rank}.json"), "w") as f:
            json.dump(rec, f)
        sys.stdout.flush()
        os._exit(0)

    cls.save = save

if os.environ.get("LOOM_CKPT_RSS_DIR"):
    threading.Thread(target=_patch, daemon=True).start()
"""


def measure(nproc: int, train_args: list[str], src: str | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out")
        out.mkdir()
        argv = ["train", f"--nproc={nproc}", f"--run.dir={tmp}/runs", *train_args]
        r = run_hooked(HOOK, argv, {"LOOM_CKPT_RSS_DIR": str(out)}, src)
        return [json.loads(p.read_text()) for p in rank_files(out, nproc, r)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--src", action="append", default=[], help="a checkout's src/ folder (repeat to compare)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--trim",
        action="store_true",
        help="malloc_trim before the save, so that memory freed by training (on a CPU, FSDP's gathered "
        "parameters) is not counted as held, nor silently reused by the save",
    )
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments of `loom train`")
    args = p.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    results = []
    if args.trim:
        os.environ["LOOM_CKPT_RSS_TRIM"] = "1"
    for src in args.src or [None]:
        ranks = measure(args.nproc, train_args, src)
        mib = lambda b: round(b / 2**20)  # noqa: E731
        rec = {
            "src": src or "installed",
            "nproc": args.nproc,
            "rank0_rss_before_mib": mib(ranks[0]["rss_before"]),
            "rank0_peak_during_save_mib": mib(ranks[0]["peak_during"]),
            "peak_during_save_mib": [mib(r["peak_during"]) for r in ranks],
            "save_s": [round(r["save_s"], 2) for r in ranks],
        }
        print(json.dumps(rec))
        results.append(rec)
    if len(results) > 1:
        base = results[0]["rank0_peak_during_save_mib"]
        for r in results[1:]:
            print(
                f"{r['src']}: rank 0 peak during the save {r['rank0_peak_during_save_mib']} MiB = "
                f"{r['rank0_peak_during_save_mib'] / base:.2f}x of {results[0]['src']} ({base} MiB)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, "results": results}, indent=1))


if __name__ == "__main__":
    main()

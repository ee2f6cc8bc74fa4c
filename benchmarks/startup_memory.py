"""Peak host memory (RSS) of each rank from process start to its first training step.

    python benchmarks/startup_memory.py --nproc 4 -- --parallel.dp_impl=fsdp --model.n_layer=24 ...
    python benchmarks/startup_memory.py --src /tmp/old-checkout/src ...   # the same, for another checkout

Each rank's `Trainer.train_step` is replaced, through a `sitecustomize` module put first on PYTHONPATH, by a
function that writes the process's peak RSS (getrusage ru_maxrss) and exits: what is measured is everything
before the first step (imports, process group, model construction, sharding, initialisation, optimizer),
and nothing of the step itself. The hook needs nothing from loom, so any checkout can be measured the same
way (`--src`), which is how a change is compared with the code before it in one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hooked import rank_files, run_hooked

HOOK = """
import resource

def _patch():
    trainer = _loaded("loom.train.trainer", "Trainer")

    def first_step(self, *a, **k):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(os.environ["LOOM_STARTUP_RSS_DIR"], f"rank{rank}.json"), "w") as f:
            json.dump({"rank": int(rank), "peak_rss_bytes": rss}, f)
        sys.stdout.flush()
        os._exit(0)

    trainer.train_step = first_step

if os.environ.get("LOOM_STARTUP_RSS_DIR"):
    threading.Thread(target=_patch, daemon=True).start()
"""


def measure(nproc: int, train_args: list[str], src: str | None) -> list[int]:
    """Peak RSS in bytes of each rank, in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        r = run_hooked(HOOK, ["train", f"--nproc={nproc}", *train_args], {"LOOM_STARTUP_RSS_DIR": tmp}, src)
        return [json.loads(p.read_text())["peak_rss_bytes"] for p in rank_files(out, nproc, r)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument(
        "--src",
        action="append",
        default=[],
        help="a checkout's src/ folder to measure (repeat to compare; default: the installed loom)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments of `loom train`")
    args = p.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    results = []
    for src in args.src or [None]:
        rss = measure(args.nproc, train_args, src)
        rec = {
            "src": src or "installed",
            "nproc": args.nproc,
            "peak_rss_mib": [round(b / 2**20) for b in rss],
            "max_peak_rss_mib": round(max(rss) / 2**20),
        }
        print(json.dumps(rec))
        results.append(rec)
    if len(results) > 1:
        base = results[0]["max_peak_rss_mib"]
        for r in results[1:]:
            print(
                f"{r['src']}: max rank peak {r['max_peak_rss_mib']} MiB = {r['max_peak_rss_mib'] / base:.2f}x "
                f"of {results[0]['src']} ({base} MiB)"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"command": sys.argv, "train_args": train_args, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()

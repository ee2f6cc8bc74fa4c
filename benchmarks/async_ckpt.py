"""How long a checkpoint save blocks the training loop, synchronous vs background (train.async_ckpt).

    python benchmarks/async_ckpt.py -- --model.n_layer=12 --model.n_embd=640 ... --train.ckpt_every=4

Runs `loom train` twice, with train.async_ckpt=false and =true. A `sitecustomize` hook times every call of
`Checkpointer.save` (what the loop waits for: the whole save, or staging to host memory plus waiting for the
previous save); metrics.jsonl gives each step's time. Reported per mode: the median normal step, the blocked
seconds per save, the step that starts a save (its step time + the blocked time) over a normal step, and the
step that runs while the writer thread works over a normal step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from hooked import run_hooked

HOOK = """
def _patch():
    cls = _loaded("loom.train.checkpointing", "Checkpointer")
    real = cls.save

    def save(self, *a, **k):
        t0 = time.perf_counter()
        out = real(self, *a, **k)
        rec = {"step": self.tr.step, "blocked_s": time.perf_counter() - t0, "background": bool(k.get("background") or a)}
        if os.environ.get("RANK", "0") == "0":
            with open(os.environ["LOOM_CKPT_TIMES"], "a") as f:
                f.write(json.dumps(rec) + "\\n")
        return out

    cls.save = save

if os.environ.get("LOOM_CKPT_TIMES"):
    threading.Thread(target=_patch, daemon=True).start()
"""


def run(mode: str, train_args: list[str], tmp: Path) -> dict:
    times = tmp / f"{mode}.jsonl"
    argv = ["train", f"--run.dir={tmp}", f"--run.name={mode}", f"--train.async_ckpt={mode}", "--train.log_every=1",
            *train_args]  # fmt: skip
    r = run_hooked(HOOK, argv, {"LOOM_CKPT_TIMES": str(times)})
    if r.returncode != 0:
        raise SystemExit(r.stdout[-2000:] + r.stderr[-3000:])
    saves = [json.loads(x) for x in times.read_text().splitlines()]
    dt = {rec["step"]: rec["dt"] for rec in map(json.loads, (tmp / mode / "metrics.jsonl").read_text().splitlines())
          if "dt" in rec}  # fmt: skip
    mid = [s for s in saves if s["step"] != max(dt)]  # the last save is always waited for
    starts = {s["step"] for s in mid}
    normal = statistics.median(v for k, v in dt.items() if k > 2 and k not in starts and k - 1 not in starts)
    return {
        "mode": f"async_ckpt={mode}",
        "normal_step_s": round(normal, 3),
        "blocked_s": [round(s["blocked_s"], 3) for s in mid],
        "save_step_ratio": [round((dt[s["step"]] + s["blocked_s"]) / normal, 2) for s in mid],
        "next_step_ratio": [round(dt[s["step"] + 1] / normal, 2) for s in mid if s["step"] + 1 in dt],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments of `loom train`")
    args = p.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(mode, train_args, Path(tmp)) for mode in ("false", "true")]
    for r in results:
        print(json.dumps(r))
    sync, bg = (statistics.median(r["blocked_s"]) for r in results)
    print(f"blocked per save: background {bg:.3f}s = {bg / sync:.2f}x of synchronous {sync:.3f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, "results": results}, indent=1))


if __name__ == "__main__":
    main()

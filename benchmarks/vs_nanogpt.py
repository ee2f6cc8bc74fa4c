"""loom against nanoGPT on the same machine, data and shapes, interleaved in one run.

    python benchmarks/vs_nanogpt.py --nanogpt PATH [--shapes baby,6l] [--text input.txt] [--json out.json]
                                    [--loom-before OTHER_LOOM_CHECKOUT]

PATH is a checkout of https://github.com/karpathy/nanoGPT; this script only runs its train.py (with the
interpreter running this script, which needs torch and numpy). Both train on Tiny Shakespeare characters in
nanoGPT's own format, data/shakespeare_char/{train,val}.bin + meta.pkl (written here from --text, exactly as
its prepare.py does, when missing); loom reads that directory as it is.

Shapes (nanoGPT's settings for both; loom takes the same from configs/*.toml):
  baby  nanoGPT README's CPU "baby GPT": 4 layers, 4 heads, 128 wide, T=64, B=12, dropout 0, 2000 steps,
        eval every 250 steps on 20 batches. loom: configs/shakespeare_char.toml.
  6l    config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide, T=256, B=64, dropout 0.2) for a
        fixed --steps-6l with a short warm-up; eval at the end. loom: configs/shakespeare_char_6l.toml.
nanoGPT runs fp32 on CPUs (its autocast context is CUDA-only); loom runs what its config says (--loom-arg
adds overrides, e.g. --loom-arg=--precision.dtype=fp32). On Linux loom also keeps freed memory for reuse
(train.reuse_cpu_memory); --nanogpt-malloc-reuse gives nanoGPT's process the same allocator setting.

Interleaving: both processes live at once but only one runs: the script lets one run for --slice seconds
while the other is stopped (SIGSTOP/SIGCONT), and alternates until both finish. Each process's clock is its
own running time, so a machine that gets busier slows both alike, and neither competes with the other.
  tokens/s: tokens per step / running time between consecutive step lines, over the steps that contain no
            evaluation, checkpoint or pause (both print a line per step); also the median step.
  time to target: running time from process start (imports and data included) to the first evaluation at
            or below --target (the baby shape), and the val loss at the last step.
  val loss: each tool's own at the last step, and both final models on the whole val split with one
            evaluator. --loom-seeds 2,3 adds loom runs with other seeds (interleaved too) whose spread is the
            seed-to-seed noise that a difference between the tools has to exceed to mean something.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "baby": {
        "nanogpt": [
            "--block_size=64",
            "--batch_size=12",
            "--n_layer=4",
            "--n_head=4",
            "--n_embd=128",
            "--dropout=0.0",
            "--eval_iters=20",
        ],
        "loom_config": "configs/shakespeare_char.toml",
        "tokens_per_step": 64 * 12,
        "eval_every": 250,
        "loom_eval_batches": 20,  # 20 x 12 windows, as nanoGPT's eval_iters=20 x batch 12
        "warmup": 100,
    },
    "6l": {
        "nanogpt": ["--eval_iters=7"],  # config/train_shakespeare_char.py as it is otherwise
        "loom_config": "configs/shakespeare_char_6l.toml",
        "tokens_per_step": 256 * 64,
        "eval_every": 0,  # only at the end
        "loom_eval_batches": 7,  # the whole val split
        "warmup": 5,
    },
}
# What loom's train.reuse_cpu_memory does inside its own process (loom.train.setup.cpu_memory_reuse).
GLIBC_REUSE = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"
NANO_STEP = re.compile(r"^iter (\d+): loss ([-\d.naif]+), time ([\d.]+)ms")
NANO_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
# loom's step line: `step 12 | loss` or, from a run, `step 12/300 | 5s, ETA 2m | loss` (loom.metrics.format_step)
LOOM_STEP = re.compile(r"^step\s+(\d+)(?:/\d+)?(?: \| [^|]*?)? \| loss ([-\d.naif]+) \|.*\| dt ([\d.]+)ms")
LOOM_EVAL = re.compile(r"^step\s+(\d+) \| val loss ([\d.]+)")


def ensure_data(nanogpt: Path, text: Path | None) -> Path:
    """nanoGPT's data/shakespeare_char, written as its prepare.py writes it (90/10 split by characters)."""
    d = nanogpt / "data" / "shakespeare_char"
    if all((d / f).is_file() for f in ("train.bin", "val.bin", "meta.pkl")):
        return d
    src = text or d / "input.txt"
    if not src.is_file():
        raise SystemExit(f"no {d}/train.bin and no text to make it from: pass --text tinyshakespeare.txt")
    data = src.read_text(encoding="utf-8")
    chars = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = len(data)
    ids = np.array([stoi[c] for c in data], dtype=np.uint16)
    d.mkdir(parents=True, exist_ok=True)
    ids[: int(n * 0.9)].tofile(d / "train.bin")
    ids[int(n * 0.9) :].tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return d


class Runner:
    """One training process: started on its first slice, stopped and continued; lines timed by its running time."""

    def __init__(self, name: str, argv: list[str], cwd: Path, step_re, eval_re, env: dict | None = None):
        self.name, self.argv, self.cwd, self.step_re, self.eval_re = name, argv, cwd, step_re, eval_re
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.active, self.since = 0.0, None  # running time so far; start of the current slice
        self.pauses = 0
        self.steps: list[tuple[int, float, int, float]] = []  # (step, running time, pauses so far, self dt)
        self.evals: list[tuple[int, float, float]] = []  # (step, val loss, running time)
        self.tail: list[str] = []
        self.lock = threading.Lock()

    def clock(self) -> float:
        with self.lock:
            return self.active + (time.monotonic() - self.since if self.since is not None else 0.0)

    def resume(self) -> None:
        with self.lock:
            self.since = time.monotonic()
        if self.proc is None:
            env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            threading.Thread(target=self._read, daemon=True).start()
        else:
            os.kill(self.proc.pid, signal.SIGCONT)

    def pause(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
        with self.lock:
            self.active += time.monotonic() - self.since
            self.since = None
            self.pauses += 1

    def _read(self) -> None:
        for line in self.proc.stdout:
            t = self.clock()
            line = line.rstrip("\n")
            self.tail = (self.tail + [line])[-40:]
            m = self.step_re.match(line)
            if m:
                self.steps.append((int(m.group(1)), t, self.pauses, float(m.group(3)) / 1e3))
            m = self.eval_re.match(line)
            if m:
                self.evals.append((int(m.group(1)), float(m.group(m.lastindex)), t))

    @property
    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


def interleave(runners: list[Runner], slice_s: float) -> None:
    """Run the runners one at a time in slices of slice_s seconds until all have exited."""
    try:
        while not all(r.done for r in runners):
            for r in runners:
                if r.done:
                    continue
                r.resume()
                deadline = time.monotonic() + slice_s
                while time.monotonic() < deadline and r.proc.poll() is None:
                    time.sleep(0.02)
                r.pause()
    finally:  # never leave a stopped process behind (Ctrl-C, an error here)
        for r in runners:
            if r.proc is not None and r.proc.poll() is None and not all(x.done for x in runners):
                os.kill(r.proc.pid, signal.SIGCONT)
                r.proc.terminate()
    for r in runners:
        r.proc.wait()
        time.sleep(0.2)  # let the reader thread drain the pipe
        if r.proc.returncode:
            raise SystemExit(f"{r.name} failed ({r.proc.returncode}):\n" + "\n".join(r.tail))


def throughput(r: Runner, tokens_per_step: int, eval_every: int) -> dict:
    """tokens/s from running time between consecutive step lines, leaving out steps with an evaluation,
    a checkpoint or a pause between them."""
    dts, own = [], []
    for (s0, t0, p0, _), (s1, t1, p1, dt) in zip(r.steps, r.steps[1:], strict=False):
        own.append(dt)
        if s1 != s0 + 1 or p1 != p0 or s1 <= 3:  # first steps: warm-up
            continue
        if eval_every and (s0 % eval_every == 0 or s1 % eval_every == 0):  # eval on either side
            continue
        dts.append(t1 - t0)
    if not dts:
        return {"steps_timed": 0}
    return {
        "steps_timed": len(dts),
        "tokens_per_s": tokens_per_step * len(dts) / sum(dts),
        "tokens_per_s_median_step": tokens_per_step / statistics.median(dts),
        "ms_per_step": 1e3 * sum(dts) / len(dts),
        "ms_per_step_median": 1e3 * statistics.median(dts),
        "self_reported_ms_median": 1e3 * statistics.median(own) if own else None,
    }


def compare(shape: str, args, nanogpt: Path, work: Path) -> dict:
    spec = SHAPES[shape]
    steps = args.steps_baby if shape == "baby" else args.steps_6l
    every = spec["eval_every"]
    eval_every = every if every and steps % every == 0 else steps  # both evaluate after the last step
    warmup = min(spec["warmup"], steps // 2)
    nano_argv = [
        sys.executable,
        "train.py",
        "config/train_shakespeare_char.py",
        "--device=cpu",
        "--compile=False",
        "--dtype=float32",
        f"--out_dir={work / f'nanogpt-{shape}'}",
        "--always_save_checkpoint=True",
        "--log_interval=1",
        f"--eval_interval={eval_every}",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        f"--warmup_iters={warmup}",
        *spec["nanogpt"],
    ]
    data = nanogpt / "data" / "shakespeare_char"
    loom_argv = [
        sys.executable,
        "-m",
        "loom",
        "train",
        str(ROOT / spec["loom_config"]),
        f"--data.path={data}",
        f"--run.dir={work}",
        "--force",
        f"--train.steps={steps}",
        "--train.log_every=1",
        f"--train.eval_every={eval_every}",
        f"--train.ckpt_every={eval_every}",
        f"--train.eval_batches={spec['loom_eval_batches']}",
        f"--optim.warmup_steps={warmup}",
        "--train.sample_every=0",
        *args.loom_arg,
    ]
    nano_env = {"GLIBC_TUNABLES": GLIBC_REUSE} if args.nanogpt_malloc_reuse else {}
    runners = [Runner("nanoGPT", nano_argv, nanogpt, NANO_STEP, NANO_EVAL, nano_env)]
    looms = {"loom": f"loom-{shape}"}  # runner name -> run name; the first is the one timed
    looms.update({f"loom seed={sd}": f"loom-{shape}-seed{sd}" for sd in args.loom_seeds})
    for i, (name, run) in enumerate(looms.items()):
        seed = [f"--run.seed={args.loom_seeds[i - 1]}"] if i else []
        runners.append(Runner(name, [*loom_argv, f"--run.name={run}", *seed], ROOT, LOOM_STEP, LOOM_EVAL))
    if args.loom_before:  # another checkout of loom, its own code and config, for a before/after in one run
        tree = args.loom_before.resolve()
        argv = [
            *loom_argv[:4],
            str(tree / spec["loom_config"]),
            *loom_argv[5:],
            f"--run.name=loom-{shape}-before",
        ]
        looms["loom before"] = f"loom-{shape}-before"
        runners.append(
            Runner("loom before", argv, tree, LOOM_STEP, LOOM_EVAL, {"PYTHONPATH": str(tree / "src")})
        )
    slice_s = args.slice or (3.0 if shape == "baby" else 40.0)
    print(f"[{shape}] {steps} steps each, interleaved in slices of {slice_s:.0f}s ...", flush=True)
    t0 = time.monotonic()
    interleave(runners, slice_s)
    out = {
        "shape": shape,
        "steps": steps,
        "tokens_per_step": spec["tokens_per_step"],
        "slice_s": slice_s,
        "wall_s": time.monotonic() - t0,
        "loom_args": runners[1].argv[4:],
        "nanogpt_args": nano_argv[2:],
        "nanogpt_env": nano_env,
        "runners": [r.name for r in runners],
    }
    for r in runners:
        rec = throughput(r, spec["tokens_per_step"], eval_every)
        final = [v for s, v, _ in r.evals if s == steps]
        rec["final_val_loss"] = final[-1] if final else None
        rec["evals"] = [(s, v) for s, v, _ in r.evals]
        rec["running_s"] = r.active
        if args.target is not None and shape == "baby":
            hit = next(((s, t) for s, v, t in r.evals if v <= args.target), None)
            rec["target"] = args.target
            rec["time_to_target_s"], rec["step_at_target"] = (hit[1], hit[0]) if hit else (None, None)
        out[r.name] = rec
    n, lo = out["nanoGPT"], out["loom"]
    if n.get("tokens_per_s") and lo.get("tokens_per_s"):
        out["tokens_per_s_ratio"] = lo["tokens_per_s"] / n["tokens_per_s"]
        out["tokens_per_s_ratio_median_step"] = lo["tokens_per_s_median_step"] / n["tokens_per_s_median_step"]
    before = out.get("loom before", {})
    if before.get("tokens_per_s") and lo.get("tokens_per_s"):
        out["after_before_tokens_per_s_ratio"] = lo["tokens_per_s"] / before["tokens_per_s"]
        out["after_before_ratio_median_step"] = (
            lo["tokens_per_s_median_step"] / before["tokens_per_s_median_step"]
        )
    if n.get("time_to_target_s") and lo.get("time_to_target_s"):
        out["time_to_target_ratio"] = n["time_to_target_s"] / lo["time_to_target_s"]
    out["same_evaluator"] = same_evaluator(nanogpt, work, shape, steps, data, looms)
    return out


class _NanoLoss(torch.nn.Module):
    """nanoGPT's model behind loom's evaluator, which calls model(x, y) for the mean loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(x.contiguous(), y.contiguous())[1]


def same_evaluator(nanogpt: Path, work: Path, shape: str, steps: int, data: Path, looms: dict) -> dict:
    """Both final models on the whole val split, the same windows, fp32, loom's evaluator: each tool's own
    val loss uses its own sample of windows (nanoGPT: random batches; loom: a fixed set)."""
    from loom.data.loader import ValSet
    from loom.eval.val_loss import val_loss
    from loom.runs import load_run

    cpu = torch.device("cpu")
    sys.path.insert(0, str(nanogpt))
    try:
        import model as nanogpt_model  # nanoGPT's model.py
    finally:
        sys.path.remove(str(nanogpt))
    ck = torch.load(work / f"nanogpt-{shape}" / "ckpt.pt", map_location=cpu, weights_only=True)
    if ck["iter_num"] != steps:
        return {"skipped": f"nanoGPT's checkpoint is from step {ck['iter_num']}, not {steps}"}
    nano = nanogpt_model.GPT(nanogpt_model.GPTConfig(**ck["model_args"]))
    nano.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()})
    block = ck["model_args"]["block_size"]
    vs = ValSet(data, block, n_rows=10**9)  # every window of the val split
    out = {"windows": vs.total_rows, "tokens": vs.total_rows * block}
    with torch.no_grad():
        out["nanoGPT"] = val_loss(_NanoLoss(nano), vs, 64, cpu)
        for name, run_name in looms.items():
            run = work / run_name
            _, loom_model, _, _, _ = load_run(run, cpu, run / "ckpt" / f"step_{steps:06d}")
            out[name] = val_loss(loom_model, vs, 64, cpu)
    return out


def report(res: dict) -> None:
    print(
        f"\n== {res['shape']}: {res['steps']} steps, {res['tokens_per_step']} tokens/step "
        f"(slices of {res['slice_s']:.0f}s, {res['wall_s']:.0f}s wall)"
    )
    for name in res["runners"]:
        r = res[name]
        line = (
            f"  {name:8s} {r.get('tokens_per_s', 0):9,.0f} tok/s  ({r.get('ms_per_step', 0):7.1f} ms/step mean, "
            f"{r.get('ms_per_step_median', 0):7.1f} median, {r['steps_timed']} steps)  final val loss "
            f"{r['final_val_loss'] if r['final_val_loss'] is None else round(r['final_val_loss'], 4)}"
        )
        if "time_to_target_s" in r:
            t = r["time_to_target_s"]
            line += f"  | val <= {r['target']}: " + (
                f"{t:.1f}s (step {r['step_at_target']})" if t else "never"
            )
        print(line)
    if "tokens_per_s_ratio" in res:
        print(
            f"  loom / nanoGPT tokens/s: {res['tokens_per_s_ratio']:.2f}x "
            f"(median step: {res['tokens_per_s_ratio_median_step']:.2f}x)"
        )
    if "after_before_tokens_per_s_ratio" in res:
        print(
            f"  loom (this tree) / loom before tokens/s: {res['after_before_tokens_per_s_ratio']:.3f}x "
            f"(median step: {res['after_before_ratio_median_step']:.3f}x)"
        )
    same = res.get("same_evaluator", {})
    if "loom" in same:
        print(
            f"  final val loss, each on the whole val split ({same['windows']} windows, fp32, one evaluator): "
            + ", ".join(f"{k} {v:.4f}" for k, v in same.items() if k == "nanoGPT" or k.startswith("loom"))
        )
        seeds = [v for k, v in same.items() if k.startswith("loom") and k != "loom before"]
        if len(seeds) > 1:
            print(
                f"  loom seed-to-seed spread (max - min over {len(seeds)} seeds): {max(seeds) - min(seeds):.4f}; "
                f"loom mean - nanoGPT: {statistics.mean(seeds) - same['nanoGPT']:+.4f}"
            )
    if "time_to_target_ratio" in res:
        print(
            f"  time to val <= {res['loom']['target']}: nanoGPT / loom = {res['time_to_target_ratio']:.2f}x"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--nanogpt", required=True, type=Path, help="a nanoGPT checkout (train.py, config/)")
    p.add_argument("--text", type=Path, help="Tiny Shakespeare text, used when the .bin files are missing")
    p.add_argument("--shapes", default="baby,6l", help="comma list of baby, 6l (default both)")
    p.add_argument("--steps-baby", type=int, default=2000)
    p.add_argument("--steps-6l", type=int, default=50)
    p.add_argument("--target", type=float, default=2.0, help="val loss for the time-to-target (baby)")
    p.add_argument("--slice", type=float, default=None, help="seconds per slice (default 3 baby, 40 6l)")
    p.add_argument(
        "--loom-arg",
        action="append",
        default=[],
        help="extra loom override, e.g. --loom-arg=--precision.dtype=fp32 (repeatable)",
    )
    p.add_argument(
        "--nanogpt-malloc-reuse",
        action="store_true",
        help="start nanoGPT with the allocator setting loom applies to itself on Linux CPUs "
        f"(GLIBC_TUNABLES={GLIBC_REUSE}), to compare the code alone",
    )
    p.add_argument(
        "--loom-seeds",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="extra loom runs with these run.seed values (comma list), for the val loss noise",
    )
    p.add_argument(
        "--loom-before",
        type=Path,
        help="another loom checkout run beside this one, interleaved (its src/ and configs/): the "
        "step time of a change, before and after in one run",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    nanogpt = args.nanogpt.resolve()
    if (
        not (nanogpt / "train.py").is_file()
        or not (nanogpt / "config" / "train_shakespeare_char.py").is_file()
    ):
        raise SystemExit(
            f"{nanogpt} is not a nanoGPT checkout (no train.py / config/train_shakespeare_char.py)"
        )
    ensure_data(nanogpt, args.text)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_avg_start": os.getloadavg(),
    }
    results = []
    with tempfile.TemporaryDirectory(prefix="loom-vs-nanogpt-") as tmp:
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            if shape not in SHAPES:
                raise SystemExit(f"unknown shape {shape!r}: use baby, 6l")
            res = compare(shape, args, nanogpt, Path(tmp))
            report(res)
            results.append(res)
    meta["load_avg_end"] = os.getloadavg()
    print(
        f"\nload average at start {meta['load_avg_start']}, at end {meta['load_avg_end']} "
        "(other work on the machine slows both tools alike: they run in alternating slices)"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"meta": meta, "results": results}, indent=1) + "\n", encoding="utf-8"
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

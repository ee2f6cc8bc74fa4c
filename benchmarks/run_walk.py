"""The walk of a run request: which loom modules resolving `loom train` passes through, and how often control
climbs back up a layer to be sent down again (issue 44's measure of "one owner per question").

    python benchmarks/run_walk.py [--work DIR]

A tiny char-level run trains 2 steps with a checkpoint, then `loom.train.run` is traced (sys.setprofile)
while it resumes that run with train.steps=4 (--fresh: while it starts the first run instead), from its entry until the Trainer is constructed: everything the
run request asks before any model exists. Every Python call and return between loom modules is a move of
the walk; a move into a module of a higher layer (tests/unit/test_layers.py's table: a callee returning to
its caller in train/ from config/, data/, checkpoint.py, ...) is a climb, any other a stay. Printed: calls,
modules, climbs, and the climbs that land in each function (plan_run's were most of them).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from unit.test_layers import LAYER  # noqa: E402


def _layer(module: str) -> int:
    return LAYER.get(module.split(".")[1] if "." in module else "__init__", 0)


def _data(root: Path) -> Path:
    from loom.data.prepare import prepare

    rng = random.Random(0)
    docs = root / "docs"
    docs.mkdir()
    words = "the a run loom step loss model data token rank layer".split()
    for i in range(4):
        (docs / f"d{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(3000)) + ".\n")
    prepare([docs], root / "prepared", tokenizer="char", val_fraction=0.25, seed=0)
    return root / "prepared"


def walk(work: Path, fresh: bool = False) -> dict:
    from loom import train
    from loom.config import load_config
    from loom.train.trainer import Trainer

    data = _data(work)
    args = [
        f"--data.path={data}",
        f"--run.dir={work / 'runs'}",
        "--run.name=walk",
        "--model.n_layer=1",
        "--model.n_head=2",
        "--model.n_embd=16",
        "--model.block_size=16",
        "--train.batch_size=4",
        "--train.eval_every=0",
        "--train.sample_every=0",
        "--train.device=cpu",
        "--train.ckpt_every=2",
    ]
    cfg = load_config(None, [*args, "--train.steps=4"])
    req = train.RunRequest(cfg, resume=True, explicit=frozenset({"train.steps"}))
    if fresh:  # the walk of a new run instead
        req = train.RunRequest(load_config(None, [*args, "--train.steps=2"]))
    else:
        train.run(load_config(None, [*args, "--train.steps=2"]))

    stack: list[str] = []  # the loom frames on the path (their module), innermost last
    names: list[str] = []  # their functions
    moves: list[tuple[str, str, str, bool]] = []  # (kind, from module, to function, within plan_run)
    calls, modules = 0, set()

    class Done(Exception):
        pass

    def move(into: str, out: str, fn: str) -> None:
        kind = "climb" if _layer(into) > _layer(out) else "stay"
        moves.append((kind, out, fn, "plan_run" in names))

    def prof(frame, event, arg):
        nonlocal calls
        mod = frame.f_globals.get("__name__", "")
        if event == "call" and frame.f_code is Trainer.__init__.__code__:
            raise Done
        if not mod.startswith("loom") or frame.f_code.co_name == "<module>":  # a module's import: no move
            return
        if event == "call":
            calls += 1
            modules.add(mod)
            if stack and stack[-1] != mod:
                move(mod, stack[-1], frame.f_code.co_name)
            stack.append(mod)
            names.append(frame.f_code.co_name)
        elif event == "return" and stack:
            done = stack.pop()
            names.pop()
            if stack and stack[-1] != done:
                move(stack[-1], done, names[-1])

    sys.setprofile(prof)
    try:
        train.run(req)
    except Done:
        pass
    finally:
        sys.setprofile(None)
    climbs = [m for m in moves if m[0] == "climb"]
    return {
        "calls": calls,
        "modules": len(modules),
        "stays": len(moves) - len(climbs),
        "climbs": len(climbs),
        "climbs_in_plan_run": sum(m[3] for m in climbs),
        "climbs_into": dict(collections.Counter(m[2] for m in climbs).most_common()),
        "climb_list": [f"{m[1]} -> {m[2]}" for m in climbs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--detail", action="store_true", help="list every climb (from module -> into function)")
    ap.add_argument("--fresh", action="store_true", help="walk a new run's request instead of a resume's")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = walk(work, a.fresh)
    print(f"{r['calls']} loom calls in {r['modules']} modules; {r['stays']} stays, {r['climbs']} climbs")
    print(f"  {r['climbs_in_plan_run']} of them while plan_run resolves the run (in it or below it)")
    for fn, n in r["climbs_into"].items():
        print(f"  {n:3d} climbs into {fn}")
    if a.detail:
        print("\n".join(r["climb_list"]))


if __name__ == "__main__":
    main()

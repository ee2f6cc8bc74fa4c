"""Interleaved A/B: the straggler monitor on (straggler_every=20) vs off (0), FSDP and pp, 2 processes."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

LAY = {"fsdp": ["--parallel.dp_impl=fsdp"], "pp": ["--parallel.pp=2", "--parallel.pp_microbatches=2"]}
out = Path("/tmp/ab59/runs")
out.mkdir(parents=True, exist_ok=True)
res = {}
for rnd in range(int(sys.argv[1])):
    for lay, extra in LAY.items():
        for every in (20, 0) if rnd % 2 == 0 else (0, 20):
            name = f"{lay}-{every}-{rnd}"
            cmd = [
                sys.executable,
                "-m",
                "loom",
                "train",
                "--nproc",
                "2",
                "--train.steps=80",
                "--train.log_every=1",
                "--train.eval_every=0",
                "--train.ckpt_every=0",
                "--train.sample_every=0",
                "--precision.dtype=fp32",
                f"--train.straggler_every={every}",
                f"--run.dir={out}",
                f"--run.name={name}",
                "--force",
                *extra,
            ]
            subprocess.run(cmd, check=True, capture_output=True, cwd="/work/main")
            dts = [
                json.loads(line)["dt"]
                for line in (out / name / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line and json.loads(line).get("step", 0) > 10 and "dt" in json.loads(line)
            ]
            res.setdefault(f"{lay} every={every}", []).extend(dts)
            print(name, round(1000 * statistics.median(dts), 1), flush=True)
for k, v in res.items():
    print(k, len(v), "median ms", round(1000 * statistics.median(v), 1))
json.dump(res, open("/tmp/ab59/ab.json", "w"))

"""The GPU acceptance kit's own logic on CPU (`benchmarks/gpu_check.py --cpu`, tiny shapes): it exits 0, its
report lists every line it would run on a GPU (the GPU-only ones with the command they would run), in the
order of their priority; a line made to fail on purpose (--fail-check) makes the kit exit non-zero; a line the
time budget leaves is cut and fails nothing; a kit stopped by SIGTERM in the middle leaves a report with the
lines done; --export writes at most 8 flat files (what a device command brings back: 8 files, 2 folders deep);
and the `first` plan's estimate (benchmarks/gpu_check_times.toml) stays under 6 minutes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tarfile
import time
from importlib.util import find_spec, module_from_spec, spec_from_file_location
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
# every line, in the order the default plan (`all`) runs them: first, second, rest
CHECKS = [
    "bench-train-eager",
    "bench-optim",
    "bench-long-flash",
    "prepare-data",
    "train-ddp",
    "bench-train-compile",
    "bench-train-fp8-1b",
    "speedrun-gpt2",
    "bench-decode",
    "bench-decode-int8",
    "bench-long-doc-mask",
    "bench-train-fp8-gpt2",
    "bench-train-moe",
    "nanogpt",
    "tests-gpu",
    "train-zero1",
    "train-zero2",
    "train-fsdp",
    "train-tp-pp",
    "train-cp-ring",
    "prepare-chat",
    "sft-lora",
    "chat",
    "rl-tis",
    "verify",
]
EXPORTED = {"gpu-report.md", "gpu-report.json", "gpu-check-console.log", "gpu-check-files.tar.gz"}


def load_kit():
    spec = spec_from_file_location("gpu_check", SCRIPT)
    module = module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def kit(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((out / "gpu-report.json").read_text())
    return r, report, (out / "gpu-report.md").read_text()


def assert_exported(folder: Path) -> None:
    """What a device command brings back: at most 8 files, at most 2 folders deep (the kit's are flat)."""
    found = [p for p in folder.rglob("*") if p.is_file()]
    assert {p.name for p in found} == EXPORTED, found
    assert len(found) <= 8 and all(len(p.relative_to(folder).parts) <= 3 for p in found)
    assert not [p for p in folder.rglob("*") if p.is_dir()]  # flat: no folder at all


def test_cpu_run_passes_and_lists_every_check(tmp_path):
    r, report, md = kit(tmp_path / "all", "--export", str(tmp_path / "export"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = {c["check"]: c for c in report["checks"]}
    assert list(rows) == CHECKS and report["plan"] == "all" and report["state"] == "done"
    assert_exported(tmp_path / "export")
    with tarfile.open(tmp_path / "export" / "gpu-check-files.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{n}.log" for n, row in rows.items() if "command" in row} <= names
    assert "runs/sft-lora/metrics.jsonl" in names and "bench-optim.json" in names
    assert json.loads((tmp_path / "export" / "gpu-report.json").read_text()) == report
    console = (tmp_path / "export" / "gpu-check-console.log").read_text()
    assert "train-ddp: pass" in console and "last_loss" in console  # each line's figures on its status line
    assert all(f"| {name} |" in md for name in CHECKS)
    for name in (
        "tests-gpu",
        "prepare-data",
        "train-ddp",
        "train-zero1",
        "train-zero2",
        "train-fsdp",
        "train-tp-pp",
        "train-cp-ring",
        "prepare-chat",
        "sft-lora",
        "chat",
        "bench-optim",
        "bench-train-eager",
        "bench-long-flash",
        "bench-long-doc-mask",
        "bench-train-moe",
        "bench-decode",
    ):
        assert rows[name]["status"] == "pass", rows[name]
    assert rows["tests-gpu"]["figures"]["skipped"] >= 8  # on CPU every GPU test is skipped, with its reason
    assert rows["tests-gpu"]["figures"]["skip_reasons"] == ["needs a CUDA GPU"]
    assert rows["verify"]["reason"].startswith("gpu only") and "loom verify" in rows["verify"]["reason"]
    assert "would run" in rows["bench-train-compile"]["reason"] and "--train.compile=true" in md
    if find_spec("torchao") is not None:  # the loom[fp8] extra: bf16 and fp8 timed in the same rounds
        figs = rows["bench-train-fp8-gpt2"]["figures"]
        assert rows["bench-train-fp8-gpt2"]["status"] == "pass", rows["bench-train-fp8-gpt2"]
        assert figs["off_vs_bf16"] == 1.0 and figs["tensorwise_vs_bf16"] > 0
        assert figs["tensorwise_fp8_linears"] == "12/13"  # fp8_filter=all: every block linear, not the head
        reason = rows["bench-train-fp8-1b"]["reason"]  # --cpu: the same tiny shape, run once
        assert reason.startswith("gpu only") and "--fp8" in reason
    else:
        assert "needs torchao" in rows["bench-train-fp8-gpt2"]["reason"]
    assert rows["sft-lora"]["figures"]["steps"] == 5 and rows["chat"]["figures"]["answer"]  # chat: its answer
    # loom rl from the base, batch-invariance off: the truncated importance weights recorded (1 up to the CPU's
    # fp32 differences; a GPU's bf16 gives the figures the issue asks for)
    tis = rows["rl-tis"]
    assert tis["status"] == "pass", tis
    assert tis["figures"]["steps"] == 5 and 0.99 < tis["figures"]["is_weight_mean"] < 1.01
    assert tis["figures"]["logprob_diff_max"] is not None and tis["figures"]["is_weight_max"] is not None
    decode = rows["bench-decode"]["figures"]  # loom.engine beside transformers on the same weights
    assert decode["b4_decode_tok_s"] > 0 and decode.get("b4_same_tokens", True) is True
    if find_spec("torchao") is not None:  # int8 weight-only decoding beside the weights as they are
        int8 = rows["bench-decode-int8"]
        assert int8["status"] == "pass", int8
        assert int8["figures"]["b4_int8_decode_tok_s"] > 0 and int8["figures"]["b4_int8_vs_base"] > 0
    else:
        assert "needs torchao" in rows["bench-decode-int8"]["reason"]
    moe = rows["bench-train-moe"]["figures"]  # grouped GEMM and loop timed in the same rounds
    assert moe["grouped_tokens_per_s"] > 0 and moe["loop_tokens_per_s"] > 0 and moe["grouped_vs_loop"] > 0
    long = rows["bench-long-doc-mask"]["figures"]
    assert long["block_size"] == 256 and long["tokens_per_s"] > 0 and long["over_flash"] > 0
    # the 1-process DP wrappers, and tp x pp at degree 1, apply the same update: the same loss whatever the layout
    assert (
        len(
            {
                rows[f"train-{i}"]["figures"]["last_loss"]
                for i in ("ddp", "zero1", "zero2", "fsdp", "tp-pp", "cp-ring")
            }
        )
        == 1
    )


def test_speedrun_line_trains_the_recipe_to_its_token_budget(tmp_path):
    """speedrun-gpt2 (plan second) runs configs/speedrun_gpt2_124m.toml; --cpu keeps the recipe's optimizer
    (Muon, bf16 Newton-Schulz), schedule and norms on a tiny shape for 4 steps after prepare-data, and reports
    the tokens trained, the val loss, tokens/s and MFU; the GPU command is the recipe as it is."""
    r, report, md = kit(tmp_path / "speedrun", "--only", "speedrun-gpt2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = {c["check"]: c for c in report["checks"]}
    assert [n for n, row in rows.items() if row["status"] == "pass"] == ["prepare-data", "speedrun-gpt2"]
    figs = rows["speedrun-gpt2"]["figures"]
    assert figs["steps"] == 4 and figs["tokens"] == 4 * 2 * 32  # steps x batch x block: the budget
    assert 0 < figs["val_loss"] < 10 and figs["tokens_per_s"] > 0 and figs["mfu"] is not None
    config = (tmp_path / "speedrun" / "runs" / "speedrun-gpt2" / "config.toml").read_text()
    assert 'name = "muon"' in config and 'muon_ns_dtype = "bf16"' in config and 'schedule = "wsd"' in config
    g = load_kit()
    assert g.PLANS["second"][1] == "speedrun-gpt2"
    gpu = g.speedrun_check(True, tmp_path).argvs({})[0]
    assert "--train.steps=4" not in gpu and gpu[4].endswith("configs/speedrun_gpt2_124m.toml")


def test_a_failing_check_fails_the_kit(tmp_path):
    r, report, md = kit(
        tmp_path / "fail", "--only", "prepare-data,bench-optim", "--fail-check", "bench-optim"
    )
    assert r.returncode == 1
    rows = {c["check"]: c for c in report["checks"]}
    assert sorted(rows) == sorted(CHECKS) and not report["ok"]
    assert list(rows)[:2] == ["prepare-data", "bench-optim"]  # the lines selected, in the order given
    assert rows["prepare-data"]["status"] == "pass"
    assert rows["bench-optim"]["status"] == "fail" and "deliberate failure" in rows["bench-optim"]["reason"]
    assert rows["train-ddp"]["reason"] == "not selected (--only)"
    assert "FAILED" in md


def test_plans_put_the_open_questions_first_and_first_fits_in_6_minutes():
    """Every line has one place in the priorities; plan `first` holds the open questions (GPT-2 124M eager and
    compiled, the optimizers, DDP, long-context flash) and its estimate from the time table stays under 6
    minutes on one GPU; a line comes after the lines it needs."""
    g = load_kit()
    assert g.PLANS["all"] == tuple(CHECKS) and len(set(CHECKS)) == len(CHECKS)
    first = g.resolve_plan(g.PLANS["first"])
    assert {
        "bench-train-eager",
        "bench-train-compile",
        "bench-optim",
        "train-ddp",
        "bench-long-flash",
    } <= set(first)
    assert g.plan_estimate(g.PLANS["first"], cuda=True) < 6 * 60
    assert "bench-train-fp8-1b" == g.PLANS["second"][0]
    times = g.line_times(cuda=True)
    assert set(CHECKS) <= set(times), "every line has an estimate"
    assert g.resolve_plan(["chat"]) == ["prepare-data", "train-ddp", "prepare-chat", "sft-lora", "chat"]
    rest = g.resolve_plan(g.PLANS["rest"])
    assert rest.index("prepare-data") < rest.index("train-zero1") and rest.index("train-ddp") < rest.index(
        "prepare-chat"
    )


def test_a_line_the_budget_leaves_is_cut_not_failed(tmp_path):
    """A line whose estimate exceeds the budget left is cut before it starts, one that runs past the budget is
    stopped and cut; neither fails the kit."""
    times = tmp_path / "times.toml"
    times.write_text("[cpu]\noverhead = 0\nprepare-data = 1\nbench-optim = 0.1\ntrain-ddp = 1000\n")
    r, report, md = kit(
        tmp_path / "cut",
        "--only",
        "bench-optim,train-ddp",
        "--hang-check",  # a real bench-optim may finish inside 0.15 s (CI's faster machine did)
        "bench-optim",
        "--budget-s",
        "0.15",
        "--times",
        str(times),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = {c["check"]: c for c in report["checks"]}
    assert rows["bench-optim"]["status"] == "cut" and "budget" in rows["bench-optim"]["reason"]
    assert rows["bench-optim"]["seconds"] < 10  # stopped at the budget, not left to finish
    assert rows["train-ddp"]["status"] == "cut"  # prepare-data (needed) took the last of it, or ~1000 s left
    assert report["ok"] and "cut" in md and "FAILED" not in md


def test_a_stopped_kit_leaves_the_report_of_the_lines_done(tmp_path):
    """SIGTERM (what `timeout` sends) in the middle of the kit: the running line is stopped and cut, those
    after it are cut, the lines done keep their figures, in the report and in the export."""
    out, export = tmp_path / "stopped", tmp_path / "export"
    only = "prepare-data,train-ddp,train-zero1"  # train-ddp: a few seconds, even forked warm
    argv = [sys.executable, str(SCRIPT), "--cpu", "--out", str(out), "--export", str(export), "--only", only]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    report, t0 = {}, time.monotonic()
    while time.monotonic() - t0 < 300:  # until prepare-data is reported done: train-ddp starts then
        if (export / "gpu-report.json").exists():
            report = json.loads((export / "gpu-report.json").read_text())
            if any(c["check"] == "prepare-data" and c["status"] == "pass" for c in report["checks"]):
                break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    console, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, console
    report = json.loads((export / "gpu-report.json").read_text())
    rows = {c["check"]: c for c in report["checks"]}
    assert report["state"] == "stopped by SIGTERM" and report["ok"]
    assert rows["prepare-data"]["status"] == "pass"
    assert rows["train-ddp"]["status"] == "cut" and "SIGTERM" in rows["train-ddp"]["reason"]
    assert rows["train-zero1"]["status"] == "cut"
    assert "stopped by SIGTERM" in (export / "gpu-report.md").read_text()
    assert_exported(export)
    with tarfile.open(export / "gpu-check-files.tar.gz") as tar:
        assert "prepare-data.log" in tar.getnames()


def test_bare_machine_runs_from_the_tree_without_pip(tmp_path):
    """A GPU machine without a package index, simulated: an interpreter that has loom's dependencies but not loom,
    whose pip (module and command) only records that it was called. `make gpu-check` must run the kit from the
    working tree with it, reach the checks, and never call pip."""
    import os
    import sysconfig

    bare, fake = tmp_path / "bare", tmp_path / "fakepip"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    called = tmp_path / "pip-called"
    record = f"import pathlib, sys\npathlib.Path({str(called)!r}).write_text(repr(sys.argv))\nsys.exit(3)\n"
    (fake / "pip").mkdir(parents=True)
    (fake / "pip" / "__init__.py").write_text("")
    (fake / "pip" / "__main__.py").write_text(record)
    (fake / "bin").mkdir()
    for name in ("pip", "pip3"):
        (fake / "bin" / name).write_text(f"#!{bare / 'bin' / 'python'}\n{record}")
        (fake / "bin" / name).chmod(0o755)
    # the dependencies through a plain path entry: site-packages' own .pth files (loom's editable install) are
    # not read from it, so loom is importable only from the tree; the fake pip comes first
    site = Path(
        subprocess.run(
            [str(bare / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "deps.pth").write_text(f"{fake}\n{sysconfig.get_paths()['purelib']}\n")
    py = str(bare / "bin" / "python")
    assert subprocess.run([py, "-c", "import loom"], capture_output=True, cwd=tmp_path).returncode != 0
    assert (
        subprocess.run([py, "-m", "pip", "install", "x"], capture_output=True).returncode == 3
        and called.exists()
    )
    called.unlink()  # the fake pip records a call: its absence below means none was made

    env = {**os.environ, "PATH": f"{fake / 'bin'}{os.pathsep}{os.environ['PATH']}", "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)
    out = tmp_path / "kit"
    r = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "gpu-check",
            f"PY={py}",
            f"ARGS=--cpu --only prepare-data --out {out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "running from the working tree, no virtualenv, no pip" in r.stdout
    assert not called.exists(), called.read_text()
    report = json.loads((out / "gpu-report.json").read_text())
    rows = {c["check"]: c for c in report["checks"]}
    assert rows["prepare-data"]["status"] == "pass"
    assert report["versions"]["torch"] and report["versions"]["executable"] == py

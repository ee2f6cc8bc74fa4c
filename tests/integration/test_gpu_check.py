"""The GPU acceptance kit's own logic on CPU (`benchmarks/gpu_check.py --cpu`, tiny shapes): it exits 0, its
report lists every check it would run on a GPU (the GPU-only ones with the command they would run), and a
check made to fail on purpose (--fail-check) makes the kit exit non-zero and is reported as failed."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECKS = [
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
    "verify",
    "bench-optim",
    "bench-train-eager",
    "bench-train-compile",
    "bench-long-flash",
    "bench-long-doc-mask",
    "bench-train-moe",
    "nanogpt",
    "bench-train-fp8-gpt2",
    "bench-train-fp8-1b",
]


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


def test_cpu_run_passes_and_lists_every_check(tmp_path):
    r, report, md = kit(tmp_path / "all")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = {c["check"]: c for c in report["checks"]}
    assert list(rows) == CHECKS
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
        reason = rows["bench-train-fp8-1b"]["reason"]  # --cpu: the same tiny shape, run once
        assert reason.startswith("gpu only") and "--fp8" in reason
    else:
        assert "needs torchao" in rows["bench-train-fp8-gpt2"]["reason"]
    assert rows["sft-lora"]["figures"]["steps"] == 5 and rows["chat"]["figures"]["answer"]  # chat: its answer
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


def test_a_failing_check_fails_the_kit(tmp_path):
    r, report, md = kit(
        tmp_path / "fail", "--only", "prepare-data,bench-optim", "--fail-check", "bench-optim"
    )
    assert r.returncode == 1
    rows = {c["check"]: c for c in report["checks"]}
    assert list(rows) == CHECKS and not report["ok"]
    assert rows["prepare-data"]["status"] == "pass"
    assert rows["bench-optim"]["status"] == "fail" and "deliberate failure" in rows["bench-optim"]["reason"]
    assert rows["train-ddp"]["reason"] == "not selected (--only)"
    assert "FAILED" in md


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

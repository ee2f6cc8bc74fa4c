"""The GPU acceptance kit's own logic on CPU (`benchmarks/gpu_check.py --cpu`, tiny shapes): it exits 0, its
report lists every check it would run on a GPU (the GPU-only ones with the command they would run), and a
check made to fail on purpose (--fail-check) makes the kit exit non-zero and is reported as failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECKS = ["tests-gpu", "prepare-data", "train-ddp", "train-zero1", "train-zero2", "train-fsdp", "train-tp-pp",
          "verify", "bench-optim", "bench-train-eager", "bench-train-compile", "nanogpt"]  # fmt: skip


def kit(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    r = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    report = json.loads((out / "gpu-report.json").read_text())
    return r, report, (out / "gpu-report.md").read_text()


def test_cpu_run_passes_and_lists_every_check(tmp_path):
    r, report, md = kit(tmp_path / "all")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = {c["check"]: c for c in report["checks"]}
    assert list(rows) == CHECKS
    assert all(f"| {name} |" in md for name in CHECKS)
    for name in ("tests-gpu", "prepare-data", "train-ddp", "train-zero1", "train-zero2", "train-fsdp",
                 "train-tp-pp", "bench-optim", "bench-train-eager"):  # fmt: skip
        assert rows[name]["status"] == "pass", rows[name]
    assert rows["tests-gpu"]["figures"]["skipped"] >= 8  # on CPU every GPU test is skipped, with its reason
    assert rows["tests-gpu"]["figures"]["skip_reasons"] == ["needs a CUDA GPU"]
    assert rows["verify"]["reason"].startswith("gpu only") and "loom verify" in rows["verify"]["reason"]
    assert "would run" in rows["bench-train-compile"]["reason"] and "--train.compile=true" in md
    # the 1-process DP wrappers, and tp x pp at degree 1, apply the same update: the same loss whatever the layout
    assert (
        len({rows[f"train-{i}"]["figures"]["last_loss"] for i in ("ddp", "zero1", "zero2", "fsdp", "tp-pp")})
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

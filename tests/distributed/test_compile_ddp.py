"""torch.compile under DDP (2 gloo processes) against one eager process on the same global batch: the
compiled data-parallel run reports its compile time apart and follows the reference losses."""

from __future__ import annotations

import loomrun
import pytest
from loomrun import loom_run

from loom.cli import main
from loom.metrics import read_jsonl

TINY = [*loomrun.TINY, "--train.steps=4"]


@pytest.mark.slow
def test_compiled_ddp_matches_eager_single_process(tmp_path, char_data):
    pytest.importorskip("torch._inductor")
    common = [f"--data.path={char_data}", f"--run.dir={tmp_path}", *TINY]
    r = loom_run("train", "--nproc", "2", *common, "--run.name=ddp", "--train.compile=true", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert main(["train", *common, "--run.name=ref"]) == 0
    recs = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("ddp", "ref")}
    ddp = [x for x in recs["ddp"] if "loss" in x]
    ref = [x for x in recs["ref"] if "loss" in x]
    assert [x["step"] for x in ddp] == [1, 2, 3, 4]
    for a, b in zip(ddp, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a["loss"], b["loss"])
    summary = next(x["summary"] for x in recs["ddp"] if "summary" in x)
    assert ddp[0]["compile_s"] == summary["compile_s"] > 0 and summary["tokens_per_s_per_device"] > 0
    assert "torch.compile: the first step" in r.stdout + r.stderr

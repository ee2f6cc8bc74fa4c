"""loom.plan (arithmetic) against loom.dryrun (the real code path on fake tensors under torch's memory tracker).

Compared against: the dry run of small models on a fake world of 4 (widths that make each term count, 2-4 blocks
so each step takes a second or two), term by term; and the dry-run figures of the five layouts of issue 29
(Llama-3 8B on 64 GPUs three ways, 70B on 512, 405B on 1,024), recorded from `loom train --dry-run` (the issue
asks 15 %; the planner is within 0.2 %, and a 2 % drift fails). A planner term that drifts from what loom's code holds fails here.
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from loom.config import load_config, validate
from loom.dryrun.layout import Target, gpu_precision, pipeline_supported, planner_estimate
from loom.dryrun.report import dry_run

BASE = [
    "--model.n_layer=2",
    "--model.n_head=8",
    "--model.n_embd=1024",
    "--model.block_size=512",
    "--model.vocab_size=8000",
    "--precision.dtype=bf16",
    "--train.batch_size=8",
    "--train.micro_batch_size=2",
]
LLAMA = ["--model.family=llama", "--model.n_kv_head=2", "--model.ffn_hidden=2816"]
NEEDS_PIPELINE = pytest.mark.skipif(
    not pipeline_supported(), reason="the dry run of pipeline layouts needs torch >= 2.13's pipelining"
)
# The planner models torch 2.13. Under tensor parallel torch 2.11 keeps more at the head's backward (+25 MiB in
# these layouts, about 1.6 of the loss's fp32 vocabulary shards: its loss_parallel), within 10 % of the peak.
TORCH_213 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
TERMS = {
    "params": "params",
    "grads": "grads",
    "optim": "optim",
    "act_peak": "activations",
    "buffers": "buffers",
}


@pytest.mark.parametrize(
    "layout, exact_terms",
    [
        # the head's backward peaks: every block's activations and the loss's temporaries, FSDP's root and a block
        (LLAMA + ["--parallel.dp_impl=fsdp"], True),
        # tensor x sequence parallel: full-length sub-layer inputs, the loss over a vocabulary shard
        (LLAMA + ["--parallel.tp=2", "--parallel.sp=true", "--parallel.dp_impl=fsdp"], True),
        # DDP: fp32 parameters, autocast's 16-bit weight copies kept for backward, DDP's buckets
        (LLAMA + ["--parallel.dp_impl=ddp"], True),
        # gpt2's block: LayerNorm, GELU, learned positions, a tied head
        (["--model.family=gpt2", "--parallel.dp_impl=fsdp"], True),
        # full recomputation with accumulation: the top block's reduce-scatter peaks (the dry run counts the
        # reduce-scatter input as a temporary, the planner as a buffer: the peak is compared)
        (
            LLAMA
            + [
                "--parallel.dp_impl=fsdp",
                "--train.micro_batch_size=1",
                "--train.activation_checkpointing=full",
            ],
            False,
        ),
        (LLAMA + ["--parallel.dp_impl=zero2"], False),
        # fp8: FSDP all-gathers the blocks' weights in float8 (1 byte), the rest as bf16-mixed
        pytest.param(
            LLAMA + ["--parallel.dp_impl=fsdp", "--precision.fp8=tensorwise", "--precision.fp8_filter=all"],
            True,
            marks=pytest.mark.skipif(
                find_spec("torchao") is None, reason="the loom[fp8] extra is not installed"
            ),
        ),
        pytest.param(
            LLAMA + ["--parallel.pp=2", "--parallel.dp_impl=fsdp", "--model.n_layer=4"],
            True,
            marks=NEEDS_PIPELINE,
        ),
    ],
    ids=["fsdp", "tp-sp", "ddp", "gpt2", "full-recompute-accum", "zero2", "fsdp-fp8", "pp-fsdp"],
)
def test_planner_terms_equal_the_dry_run(layout, exact_terms):
    """Model states within 0.5 %; activations and buffers within 1 % where the planner's moment is the dry
    run's; the peak within 5 %."""
    cfg = load_config(None, BASE + layout)
    result = dry_run(cfg, Target(4), advise=False)
    worst = max(result.ranks, key=lambda r: r.peak)
    measured, planned = result.row(worst), result.planner
    for key in ("params", "grads", "optim"):
        assert planned[key] == pytest.approx(measured[key], rel=0.005), key
    older = not TORCH_213 and any(flag.startswith("--parallel.tp=") for flag in layout)
    if exact_terms and not older:
        for key in ("act_peak", "buffers"):
            assert planned[TERMS[key]] == pytest.approx(measured[key], rel=0.01, abs=2**20), key
    assert planned["total"] == pytest.approx(measured["peak"], rel=0.10 if older else 0.05)


# `loom train --dry-run CONFIG --world N [flags]` on torch 2.13, after issue 29's fixes: the largest rank's peak
# in bytes (GiB: 63.98, 13.96, 19.12, 6.11, 55.82); the planner is within 0.2 % of each
ISSUE_29 = [
    ("configs/llama3_8b.toml", 64, [], 68_697_581_464),
    ("configs/llama3_8b.toml", 64, ["--parallel.tp=8", "--parallel.sp=true"], 14_988_174_496),
    (
        "configs/llama3_8b.toml",
        64,
        ["--parallel.tp=8", "--parallel.sp=true", "--parallel.pp=4"],
        20_529_766_828,
    ),
    ("configs/llama3_70b.toml", 512, ["--parallel.tp=8", "--parallel.sp=true"], 6_558_249_824),
    ("configs/llama3_405b.toml", 1024, ["--parallel.tp=8", "--parallel.sp=true"], 59_932_245_976),
]


@pytest.mark.parametrize(
    "path, world, flags, dry_peak", ISSUE_29, ids=["8b-fsdp", "8b-tp", "8b-pp", "70b", "405b"]
)
def test_planner_within_15_percent_of_the_dry_run_at_scale(path, world, flags, dry_peak):
    cfg = load_config(path, flags)
    dims = validate(cfg, world)[1]
    est = planner_estimate(cfg, dims, Target(world), cfg.model.vocab_size, gpu_precision(cfg, "H100"))
    assert est.memory_gb["total"] * 1e9 == pytest.approx(dry_peak, rel=0.02)  # the issue asks 15 %


@pytest.mark.parametrize(
    "layout",
    [
        LLAMA + ["--parallel.cp=2", "--parallel.dp_impl=fsdp"],
        LLAMA + ["--model.n_kv_head=4", "--parallel.cp=2", "--parallel.tp=2", "--parallel.sp=true"],
    ],
    ids=["cp2-fsdp", "cp2-tp2"],
)
def test_planner_models_context_parallel_within_15_percent(layout):
    """Context parallel (Ulysses): model states sharded over dp x cp as the dry run holds them; activations of
    s / cp tokens a rank. The planner leaves out Ulysses' all-to-all copies (the dry run's activations are
    ~15 % above its own at cp 2-4), so its peak is held to the issue's 15 %, not the 5 % of the rest."""
    cfg = load_config(None, BASE + ["--model.block_size=2048"] + layout)
    result = dry_run(cfg, Target(4), advise=False)
    worst = max(result.ranks, key=lambda r: r.peak)
    measured, planned = result.row(worst), result.planner
    for key in ("params", "grads", "optim"):
        assert planned[key] == pytest.approx(measured[key], rel=0.005), key
    # The planner models torch 2.13 (cp2-tp2: dry run 444.6 MB, planner 426.4). torch 2.11 holds 65 MB more at
    # cp2-tp2's peak (509.7 MB): its loss_parallel's extra (above) and more; 20 % there, the issue's 15 % here.
    older = not TORCH_213 and "--parallel.tp=2" in layout
    assert planned["total"] == pytest.approx(measured["peak"], rel=0.20 if older else 0.15)

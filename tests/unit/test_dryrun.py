"""The dry run (loom.dryrun) on a fake process group: a layout that cannot start fails with the real job's error
before anything is built; one that does not fit exits 1 naming the rank, the term and a layout, which fits; the
shortcuts that make large models fast (the repeated accumulation micro-steps left out, blocks and 1F1B
micro-batches extended along a line) give the same bytes as stepping everything; the GPU code path's
RMSNorm keeps what CUDA's fused kernel keeps; and two memory bugs it found stay fixed (FSDP holding unsharded
gradients between accumulation micro-steps, the last pipeline stage keeping every micro-batch's logits). Against real processes: tests/distributed/test_dryrun_vs_processes.py."""

from __future__ import annotations

import re

import pytest
import torch
from loomrun import loom_run

from loom.config import load_config, validate
from loom.dryrun import blocks, dryrun_main, fake, step
from loom.dryrun.layout import pipeline_supported, vocab_size
from loom.errors import LoomError

# the dry run of a pipeline layout needs torch 2.13's pipelining internals; the oldest torch CI runs (2.11) lacks
# them, and there the dry run refuses such a layout with that reason (test_a_pipeline_layout_says_what_...)
NEEDS_PIPELINE = pytest.mark.skipif(
    not pipeline_supported(), reason="the dry run of pipeline layouts needs torch >= 2.13's pipelining"
)
SMALL = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=16"]


def measure_role(
    cfg, world: int, rank: int, vocab_size: int, precision: str, exact: bool = False
) -> blocks.RankMemory:
    """Rank `rank`'s memory (measure_roles for one rank)."""
    return blocks.measure_roles(cfg, world, [rank], vocab_size, precision, exact)[0]


def measure_rank_apart(
    cfg, world: int, rank: int, vocab_size: int, precision: str, n_microbatches: int | None = None
) -> blocks.RankMemory:
    """measure_rank in a child process of its own (measure_apart for one step)."""
    return blocks.measure_apart([(cfg, world, rank, vocab_size, precision, n_microbatches)], 1)[0]


def _terms(r: step.RankMemory) -> dict:
    return {"params": r.params, "grads": r.grads, "optim": r.optim, "phases": r.phases, "ddp": r.ddp_buckets}


def test_layout_that_cannot_start_fails_as_a_real_job_before_anything_is_built(monkeypatch, capsys):
    argv = ["configs/llama3_70b.toml", "--world", "512", "--parallel.tp=128"]
    with pytest.raises(LoomError) as real:
        validate(load_config("configs/llama3_70b.toml", ["--parallel.tp=128"]), 512)
    monkeypatch.setattr("loom.dryrun.report.measure_roles", lambda *a, **k: pytest.fail("a rank was built"))
    with pytest.raises(LoomError) as dry:
        dryrun_main(argv)
    assert str(dry.value) == str(real.value) and "parallel.tp=128 does not divide model.n_head=64" in str(
        dry.value
    )
    r = loom_run("train", "--dry-run", *argv, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"loom: error: {real.value}"), r.stderr


def test_layout_that_does_not_fit_names_rank_term_and_a_layout_that_fits(char_data, capsys):
    job = ["--world", "4", "--gpu-mem", "0.0015", f"--data.path={char_data}", "--train.batch_size=8", *SMALL]
    assert dryrun_main([*job, "--parallel.dp_impl=ddp"]) == 1
    out = capsys.readouterr().out
    assert re.search(
        r"DOES NOT FIT: rank 0 \(pipeline rank 0, tp rank 0\) peaks at [\d.]+ MiB > 1.4 MiB usable; "
        r"its largest term is optimizer state",
        out,
    ), out
    advice = re.search(r"a layout that fits \(one of the planner's, dry-run\): (.*)", out)
    assert advice and "--parallel.dp_impl=" in advice.group(1), out
    assert dryrun_main([*job, *advice.group(1).split()]) == 0, capsys.readouterr().out


def _fsdp_accum(char_data, accum: int):
    cfg = load_config(
        None,
        [
            f"--data.path={char_data}",
            f"--train.batch_size={2 * accum}",
            "--train.micro_batch_size=1",
            "--parallel.dp_impl=fsdp",
            *SMALL,
            "--model.n_layer=4",
        ],
    )
    assert validate(cfg, 2)[0].grad_accum == accum
    return cfg


def test_accumulation_steps_between_the_second_and_the_last_are_left_out_exactly(char_data, monkeypatch):
    """And FSDP reduce-scatters every micro-step: with 4 of them a step holds no more unsharded blocks (gathered
    parameters, gradients) at its peak than with one (skipping the reduce-scatter kept all 4 blocks' unsharded
    gradients from the first micro-step to the last: loom.parallel.fsdp.set_gradient_sync)."""
    cfg = _fsdp_accum(char_data, 4)
    vocab = vocab_size(cfg)
    short = measure_rank_apart(cfg, 2, 0, vocab, "fp32")
    one = measure_rank_apart(_fsdp_accum(char_data, 1), 2, 0, vocab, "fp32")

    def most_gathered(r: step.RankMemory) -> int:  # at the peak of whichever phase holds the most
        return max(phase["gathered"] for phase in r.phases.values())

    assert most_gathered(short) == most_gathered(one) > 0
    monkeypatch.setattr(step, "micro_steps", lambda accum: list(range(accum)))
    full = measure_rank_apart(cfg, 2, 0, vocab, "fp32")
    assert _terms(short) == _terms(full)


@NEEDS_PIPELINE
def test_the_last_pipeline_stage_keeps_no_outputs_across_micro_batches():
    """The schedule's step returns no outputs (loom.parallel.pipeline): the last stage's peak grows by its receive
    buffers per micro-batch, not by a micro-batch's logits, which it kept to the end of the step before."""
    peaks = []
    for m in (2, 4):
        job = [f"--train.batch_size={m}", "--train.micro_batch_size=1", "--parallel.pp=2"]
        cfg = load_config(None, [*SMALL, "--model.vocab_size=4096", *job])
        peaks.append(measure_rank_apart(cfg, 2, 1, 4096, "fp32").peak)
    logits = 16 * 4096 * 4  # one micro-batch's: 1 x block_size x vocab, fp32
    assert 0 < (peaks[1] - peaks[0]) / 2 < logits / 8, peaks


@pytest.mark.parametrize(
    "layout, rank",
    [
        (["--parallel.dp_impl=fsdp"], 0),
        pytest.param(["--parallel.pp=2", "--parallel.dp_impl=fsdp"], 0, marks=NEEDS_PIPELINE),
        pytest.param(["--parallel.pp=2"], 2, marks=NEEDS_PIPELINE),
    ],
    ids=["fsdp-blocks", "pp-first-stage", "pp-last-stage"],
)
def test_blocks_and_microbatches_extended_along_the_line_give_every_byte(char_data, layout, rank):
    """5 blocks from 3 and 4, or a pipeline stage's 6 from 4 and 5 (loom.dryrun.blocks says why one more); 6
    micro-batches from 3 and 4 (the first stage: 2 in flight) or 2 and 3."""
    args = [
        f"--data.path={char_data}",
        "--model.family=llama",
        "--model.n_kv_head=1",
        "--train.batch_size=12",
        "--train.micro_batch_size=1",
        *SMALL,
        *layout,
    ]
    pp = "--parallel.pp=2" in layout
    cfg = load_config(None, [*args, f"--model.n_layer={12 if pp else 5}"])
    extended = measure_role(cfg, 4, rank, vocab_size(cfg), "fp32")
    assert extended.measured_blocks == ([4, 5] if pp else [3, 4])
    assert extended.measured_microbatches == (
        [] if "--parallel.pp=2" not in layout else [3 - rank // 2, 4 - rank // 2]
    )
    assert _terms(extended) == _terms(measure_role(cfg, 4, rank, vocab_size(cfg), "fp32", exact=True))


def test_rms_norm_keeps_what_cudas_fused_kernel_keeps():
    """Under autocast a norm runs in fp32 (CUDA's policy) and RMSNorm saves its fp32 input and rstd only."""
    norm = torch.nn.RMSNorm(8).to(torch.bfloat16)
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with fake.fake_mode(), fake.gpu_paths(), torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = norm(x)
    assert y.dtype == torch.float32
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((2, 4, 8), torch.float32),
        ((8,), torch.float32),
        ((2, 4, 1), torch.float32),
    ]


def test_plan_check_prints_the_dry_run_beside_the_planner(capsys):
    from loom.cli import main

    assert main(["plan", "--params", "20M", "--gpus", "2", "--gpu-mem", "80", "--check", "--top", "1"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^ 1 tp=\d+ .* ([\d.]+) +([\d.]+) +([\d.]+)  yes", out, re.M)
    assert "planner GiB dry run GiB" in out and row, out
    planned, measured, ratio = map(float, row.groups())
    assert measured > 0 and ratio == pytest.approx(measured / planned, rel=0.02)  # printed to 2 decimals


def test_a_pipeline_layout_says_what_this_torch_lacks_or_runs(char_data, monkeypatch):
    """On a torch without the pipelining switch the dry run refuses a pp layout with the reason, before any rank is
    built (the planner's advice leaves pp layouts out there too)."""
    monkeypatch.setattr("loom.dryrun.layout.pipeline_supported", lambda: False)
    monkeypatch.setattr("loom.dryrun.report.measure_roles", lambda *a, **k: pytest.fail("a rank was built"))
    job = ["--world", "4", f"--data.path={char_data}", "--train.batch_size=8", "--train.micro_batch_size=2"]
    job += ["--parallel.pp=2", *SMALL]
    with pytest.raises(LoomError, match=r"(?s)parallel.pp=2: the dry run .*InferenceMode.*torch >= 2.13"):
        dryrun_main(job)


def test_nproc_beside_dry_run_is_the_jobs_world_size(capsys):
    """Issue 42 item 6: `loom train --dry-run --nproc 2` said "config file '2' does not exist". --nproc N is
    the job's N ranks, the dry run's --world N: taken as it (adding --dry-run to the command line that would
    start the job dry-runs that job); a --world that disagrees, or neither, is refused naming both."""
    from loom.cli import main

    tiny = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.vocab_size=64"]
    assert main(["train", "--dry-run", "--nproc", "2", *tiny]) == 0
    assert "job       2 GPUs" in capsys.readouterr().out
    assert main(["train", "--nproc=2", "--dry-run", "--world", "4", *tiny]) == 2
    assert "--world 4 and --nproc 2 disagree" in capsys.readouterr().err
    assert main(["train", "--dry-run", *tiny]) == 2
    assert "add --world N (or --nproc N, as for loom train)" in capsys.readouterr().err

"""Context parallel composed with the other dimensions, with real processes (gloo, loopback): FSDP sharding
over dp_shard x cp (`dp-cp`) and cp with tensor + sequence parallel (`cp-tp`) against one process; a
checkpoint written by cp ranks resumes in one process and continues the one-process curve; sampling from a
cp-trained run."""

from __future__ import annotations

from loomrun import TINY, loom_here, loom_ok, run_losses, verify_records

LLAMA = ["--model.family=llama", "--model.n_head=4", "--model.n_kv_head=4"]


def test_verify_cp_with_fsdp_and_with_tensor_parallel(tmp_path, char_data):
    recs = verify_records(tmp_path, char_data, "dp-cp,cp-tp", "--model.family=llama", "--model.n_kv_head=4")
    assert [(r["dp"], r["cp"], r["tp"]) for r in recs] == [(2, 2, 1), (1, 2, 2)]


def test_cp_checkpoint_resumes_in_one_process_and_samples(tmp_path, char_data):
    """FSDP over the 2 cp ranks (dp 1) writes sharded state at step 4; one process resumes it and its steps
    5..8 equal the one-process run's; the cp-trained run then samples through `loom generate`."""
    base = [
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        *TINY,
        *LLAMA,
        "--train.steps=8",
        "--train.ckpt_every=4",
    ]
    loom_here("train", "--run.name=ref", "--parallel.dp_impl=none", *base)
    reference = dict(run_losses(tmp_path / "ref"))
    loom_here("train", "--nproc=2", "--parallel.cp=2", "--parallel.dp_impl=fsdp", "--run.name=cp", *base)
    for step, loss in run_losses(tmp_path / "cp"):
        assert abs(loss - reference[step]) <= 1e-5, (step, loss, reference[step])
    loom_here(
        "train", "--resume", str(tmp_path / "cp" / "ckpt" / "step_000004"), "--nproc=1", "--parallel.cp=1"
    )
    continued = run_losses(tmp_path / "cp", start=8)
    assert [s for s, _ in continued] == [5, 6, 7, 8]
    for step, loss in continued:
        assert abs(loss - reference[step]) <= 1e-5, (step, loss, reference[step])
    out = loom_ok("generate", str(tmp_path / "cp"), "--prompt", "The", "--max-new-tokens", "10").stdout
    assert out.startswith("The") and len(out) >= 10

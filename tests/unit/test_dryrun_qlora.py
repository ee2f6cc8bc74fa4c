"""The dry run counts torchao's memory savers (loom.dryrun.torchao_states): an NF4 base (QLoRA), int8/int4 AdamW
states and the optimizer offloaded to the host. Each job is stepped on fake tensors with them off, and its held
bytes rewritten from the rank's own tensors; compared against: the same job stepped without them plus the
formula worked out here by hand from the model's shapes (NF4: n/2 + n/64 + 4n/16,384 bytes; int8: 2 (n + 4n/256);
int4: 2 (n/2 + 4n/128); a tensor under 4,096 values keeps 8n), torchao's own NF4Tensor for the NF4 bytes of one
weight, and FSDP's per-rank share (half of each quantized weight on each of 2 ranks)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torchao", reason="QLoRA and the low-bit optimizers are torchao's (the loom[fp8] extra)")

from test_dryrun import measure_rank_apart  # noqa: E402

from loom.config import load_config  # noqa: E402
from loom.dryrun.torchao_states import state_bytes  # noqa: E402
from loom.model.nf4 import nf4_bytes  # noqa: E402

# 128 wide, 2 blocks of GPT-2: q k v o 128 x 128 and the MLP 128 x 512 / 512 x 128 in each (12 linears)
WIDE = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=128", "--model.block_size=16"]
JOB = [*WIDE, "--model.vocab_size=512", "--train.batch_size=2", "--precision.dtype=fp32"]
LORA = ["--finetune.lora_rank=4", "--finetune.lora_targets=all-linear"]
LINEARS = 2 * [128 * 128] * 4 + 2 * [128 * 512] * 2


def _measure(*argv: str, world: int = 1):
    cfg = load_config(None, [*JOB, *argv])
    return measure_rank_apart(cfg, world, 0, 512, "fp32")


def test_an_nf4_base_is_counted_at_its_4_bit_size():
    plain, q = _measure(*LORA), _measure(*LORA, "--finetune.quantize_base=nf4")
    want = sum(nf4_bytes(n) - 4 * n for n in LINEARS)  # every block linear from fp32 to NF4
    assert q.params - plain.params == round(want) and want < -0.8 * 4 * sum(LINEARS)
    assert (q.grads, q.optim) == (plain.grads, plain.optim)  # the adapters' are the same
    for name, ph in q.phases.items():  # the base is held in every phase of the step
        assert ph["total"] - plain.phases[name]["total"] == round(want), name
    # torchao's own NF4Tensor of one weight holds what nf4_bytes says (the formula the rewrite uses)
    import torch

    from loom.model.nf4 import nf4_api

    w = nf4_api()[1](torch.randn(512, 128), 64, 256)
    inner = (w.quantized_data, w.quantized_scalers, w.quantization_factor)
    assert sum(t.numel() * t.element_size() for t in inner) == nf4_bytes(512 * 128)


def test_an_nf4_base_under_fsdp_is_counted_per_rank():
    plain = _measure(*LORA, "--parallel.dp_impl=fsdp", world=2)
    q = _measure(*LORA, "--parallel.dp_impl=fsdp", "--finetune.quantize_base=nf4", world=2)
    assert q.params - plain.params == round(sum(nf4_bytes(n // 2) - 4 * (n // 2) for n in LINEARS))


@pytest.mark.parametrize("state_dtype, per_param", [("int8", 2 + 8 / 256), ("int4", 1 + 8 / 128)])
def test_low_bit_adamw_states_are_counted(state_dtype, per_param):
    """Full training (every tensor trains): the block linears (>= 4,096 values) get low-bit moments; the
    norms and biases (128 or 512 values) keep fp32's 8 bytes."""
    plain, low = _measure(), _measure(f"--optim.state_dtype={state_dtype}")
    big = [*LINEARS, 512 * 128]  # and the token embedding (tied head): 65,536 values
    want = sum(state_bytes(n, state_dtype) - 8 * n for n in big)
    assert want == pytest.approx(sum((per_param - 8) * n for n in big))
    assert low.optim - plain.optim == round(want)
    assert low.params == plain.params and low.grads == plain.grads
    assert state_bytes(4095, state_dtype) == 8 * 4095  # under torchao's threshold: fp32 moments


def test_offloaded_optimizer_state_leaves_the_device_for_the_host():
    plain, off = _measure(*LORA), _measure(*LORA, "--optim.offload=cpu")
    adapters = 2 * (4 * 4 * (128 + 128) + 2 * 4 * (128 + 512))  # rank x (in + out) of each linear
    assert plain.optim == 8 * adapters and off.optim == 0
    assert off.host_optim == 12 * adapters and plain.host_optim == 0
    assert off.peak == plain.peak - 8 * adapters


def test_the_report_says_what_it_counted(capsys):
    from loom.cli import main

    argv = ["train", "--dry-run", "--world", "1", *JOB, *LORA, "--finetune.quantize_base=nf4"]
    assert main([*argv, "--optim.state_dtype=int8"]) == 0
    out = capsys.readouterr().out
    assert "the NF4 base at 0.516 bytes a weight" in out and "AdamW's int8 moments" in out


def test_plan_check_dry_runs_the_planned_qlora_run(capsys, monkeypatch):
    """`loom plan --check --lora-rank R --quantize-base nf4 --optim-state int8`: every dry run takes the LoRA/QLoRA
    keys (not a full training of the shape), and its params term is the NF4 base's."""
    from loom.cli import main
    from loom.dryrun import check

    seen = []
    real = check.dry_run

    def recording(cfg, *args, **kw):
        seen.append(cfg)
        return real(cfg, *args, **kw)

    monkeypatch.setattr(check, "dry_run", recording)
    argv = ["plan", "--model", "gpt2", "--gpus", "1", "--gpu-mem", "24", "--seq-len", "128"]
    argv += ["--global-batch-tokens", "256", "--check", "--top", "1"]
    qlora = ["--lora-rank", "16", "--quantize-base", "nf4", "--optim-state", "int8"]
    assert main([*argv, *qlora]) == 0
    (cfg,) = seen
    f = cfg.finetune
    assert (f.lora_rank, f.lora_targets, f.quantize_base, cfg.optim.state_dtype) == (
        16,
        "all-linear",
        "nf4",
        "int8",
    )
    out = capsys.readouterr().out
    assert re.search(r"^ 1 tp=1 .* yes", out, re.M), out

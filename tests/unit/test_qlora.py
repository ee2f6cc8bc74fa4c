"""QLoRA (finetune.quantize_base=nf4: loom.model.nf4) and torchao's low-bit AdamW (optim.state_dtype).

Compared against: the same LoRA model with each base weight replaced by its NF4 dequantization (plain fp32), whose
logits and adapter gradients a QLoRA forward and backward must give within float tolerance; the adapters-merged
model (the dequantized base plus scaling * B A); the run's own reported val loss (`loom eval` of a QLoRA run reads
its base back through NF4: equal to 4 decimals); a resumed int8-state run against one run straight through
(equal losses); torchao's own NF4Tensor for the byte count. Bad input: a weight NF4's blocks do not divide (or,
under FSDP, the ranks cannot split into whole scale blocks), NF4 without LoRA, NF4 on a layout it cannot serve
(tensor or pipeline parallel, DDP, HSDP...), optimizer offload on a CPU, each refused before any work. Under FSDP
against one process: tests/distributed/test_qlora_fsdp.py; the dry run's counts: test_dryrun_qlora.py.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao", reason="QLoRA and the low-bit optimizers are torchao's (the loom[fp8] extra)")

from loom.cli import main  # noqa: E402
from loom.config import Config, validate  # noqa: E402
from loom.errors import LoomError  # noqa: E402
from loom.metrics import read_jsonl  # noqa: E402
from loom.model.gpt.gpt import GPT, GPTConfig  # noqa: E402
from loom.model.lora import apply_lora, lora_modules, merge_lora  # noqa: E402
from loom.model.nf4 import (  # noqa: E402
    check_nf4,
    dequantized,
    is_nf4,
    nf4_bytes,
    nf4_round_trip,
    nf4_targets,
    quantize_base,
)
from loom.optim.build import build_optimizer  # noqa: E402

# n_embd 128: every linear's size a multiple of NF4's 64 x 256 = 16,384 (q_proj 128 x 128, the MLP 128 x 512)
WIDE = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=128", "--model.block_size=64"]
QUIET = [
    "--train.batch_size=8",
    "--train.eval_every=0",
    "--train.sample_every=0",
    "--train.eval_batches=2",
    "--train.device=cpu",
    "--precision.dtype=fp32",
    "--train.log_every=1",
]


def lora_gpt(n_embd: int = 128, seed: int = 0) -> GPT:
    """A 2-layer GPT-2-shaped model with rank-4 adapters on every linear, B random (not zero) so the adapters
    change the output."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=n_embd, block_size=16))
    apply_lora(model, rank=4, alpha=8.0, targets="all-linear", seed=seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0, 0.05)
    return model


def test_qlora_forward_and_backward_are_the_dequantized_base_plus_lora():
    q = lora_gpt()
    ref = copy.deepcopy(q)
    names = quantize_base(q)
    assert names == list(nf4_targets(ref)) and len(names) == 12  # q k v o up down in each of 2 blocks
    for n in names:
        assert is_nf4(q.get_submodule(n).weight)
        ref.get_submodule(n).weight.data.copy_(nf4_round_trip(ref.get_submodule(n).weight))
    assert not is_nf4(q.lm_head.weight) and not is_nf4(q.wte.weight)  # head and embedding stay fp32
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    lq, lr = q(x), ref(x)
    torch.testing.assert_close(lq, lr, rtol=1e-5, atol=1e-5)
    for logits in (lq, lr):
        nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    for n, m in lora_modules(q).items():
        r = ref.get_submodule(n)
        torch.testing.assert_close(m.lora_A.grad, r.lora_A.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(m.lora_B.grad, r.lora_B.grad, rtol=1e-4, atol=1e-6)
        assert m.weight.grad is None  # the NF4 base never gets a gradient
    # NF4 differs from the fp32 base (a real quantization), by a few percent of the weights' scale
    w = ref.blocks[0].attn.q_proj.weight
    base = copy.deepcopy(lora_gpt()).blocks[0].attn.q_proj.weight
    err = (w - base).abs().max() / base.abs().max()
    assert 0 < err < 0.2
    # merged: the dequantized base plus scaling * B A, plain tensors, the same logits
    merge_lora(q)
    assert not any(is_nf4(p) for p in q.parameters())
    torch.testing.assert_close(q(x), lr, rtol=1e-5, atol=1e-5)


def test_nf4_holds_about_half_a_byte_a_weight_and_training_moves_only_adapters():
    q = lora_gpt()
    quantize_base(q)
    w = q.blocks[0].mlp.up_proj.weight
    inner = (w.quantized_data, w.quantized_scalers, w.quantization_factor)
    held = sum(t.numel() * t.element_size() for t in inner)
    assert held == nf4_bytes(w.numel())  # 0.516 bytes a weight (the mean and the 16 levels aside)
    assert held < w.numel() * 4 / 7
    before = {n: dequantized(m.weight).clone() for n, m in lora_modules(q).items()}
    opt = torch.optim.AdamW([p for p in q.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        q(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for n, m in lora_modules(q).items():
        assert torch.equal(dequantized(m.weight), before[n])


def _linear_model(shape: tuple[int, int]) -> nn.Module:
    with torch.device("meta"):
        m = nn.Sequential()
        m.add_module("proj", nn.Linear(shape[1], shape[0], bias=False))
    m.requires_grad_(False)
    return m


@pytest.mark.parametrize(
    "shape, says",
    [
        ((36, 36), "not a multiple of NF4's block size 64"),  # 1,296 values: 20.25 blocks
        ((64, 100), "100 blocks of 64, not a multiple of NF4's scaler block size 256"),
    ],
)
def test_a_weight_nf4_cannot_block_is_refused(shape, says):
    with pytest.raises(LoomError, match=re.escape(says)) as e:
        check_nf4(_linear_model(shape))
    assert "proj" in str(e.value) and "16,384" in str(e.value)


@pytest.mark.parametrize(
    "shape, says",
    [
        ((128, 128), "128 rows and 1 blocks of 16,384 values"),  # one fp32 scale factor: not split in 2
        ((1, 32768), "1 rows and 2 blocks of 16,384 values"),  # two scale blocks, but one row
    ],
)
def test_a_weight_fsdp_cannot_split_into_whole_nf4_blocks_is_refused(shape, says):
    check_nf4(_linear_model(shape))  # one process holds it
    with pytest.raises(LoomError, match=re.escape(says)) as e:
        check_nf4(_linear_model(shape), shards=2)
    assert "under FSDP over 2 ranks cannot shard proj" in str(e.value)
    check_nf4(_linear_model((256, 128)), shards=2)  # 2 blocks, 256 rows: one each


def _cfg(**keys) -> Config:
    cfg = Config()
    for k, v in keys.items():
        section, name = k.split("__")
        setattr(getattr(cfg, section), name, v)
    return cfg


def test_bad_qlora_configs_are_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(LoomError, match="without LoRA every weight trains"):
        validate(_cfg(finetune__quantize_base="nf4"))
    q = {"finetune__quantize_base": "nf4", "finetune__lora_rank": 8}
    validate(_cfg(**q))  # one process: served
    validate(_cfg(**q, parallel__dp_impl="fsdp"), world=2)  # FSDP's data-parallel sharding: served
    validate(_cfg(**q, parallel__dp_impl="zero2"), world=2)
    # every other layout over several processes: named, with what NF4 lacks for it
    for keys, says in [
        ({}, "not by parallel.dp_impl=ddp"),  # auto: ddp
        ({"parallel__dp_impl": "zero1"}, "not by parallel.dp_impl=zero1"),
        ({"parallel__tp": 2, "parallel__dp_impl": "none"}, "not by parallel.tp=2:"),
        ({"parallel__tp": 2, "parallel__dp_impl": "fsdp"}, "not by parallel.tp=2"),
        ({"parallel__pp": 2, "parallel__dp_impl": "fsdp"}, "not by parallel.pp=2"),
        ({"parallel__dp_impl": "fsdp", "parallel__dp_replicate": 2}, "parallel.dp_replicate=2 (HSDP)"),
    ]:
        world = 4 if "parallel__dp_replicate" in keys or "parallel__pp" in keys else 2
        with pytest.raises(LoomError, match=re.escape(says)) as e:
            validate(_cfg(**q, **keys), world=world)
        assert "NF4Tensor implements FSDP2's all-gather" in str(e.value)
    with pytest.raises(LoomError, match="train.device=cpu keeps it there"):
        validate(_cfg(optim__offload="cpu", train__device="cpu"))
    with pytest.raises(LoomError, match="optim.name=muon has its own"):
        validate(_cfg(optim__state_dtype="int8", optim__name="muon"))
    # the CLI: the 32-wide model's q_proj (1,024 values) refused before data or a model is made
    capsys.readouterr()
    argv = ["train", f"--data.path={tmp_path / 'none'}", "--model.n_embd=32", "--model.n_head=2"]
    assert main([*argv, "--finetune.lora_rank=4", "--finetune.quantize_base=nf4", "--train.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot quantize blocks.0.attn.q_proj" in err and "1,024 values" in err


def test_offload_on_a_cpu_device_is_refused_when_building():
    model = nn.Linear(64, 64)
    with pytest.raises(LoomError, match="CUDA and XPU parameters only"):
        build_optimizer(model, _cfg(optim__offload="cpu").optim, torch.device("cpu"))


@pytest.mark.parametrize("state_dtype, cls", [("int8", "OptimState8bit"), ("int4", "OptimState4bit")])
def test_low_bit_adamw_steps_on_cpu_with_a_float_lr(state_dtype, cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 8))  # 16,384 and 1,024 values
    ref = copy.deepcopy(model)
    w0 = model[0].weight.detach().clone()
    opt = build_optimizer(model, _cfg(optim__state_dtype=state_dtype).optim, torch.device("cpu"))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    x = torch.randn(4, 128)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            for g in o.param_groups:
                g["lr"] = 1e-3 * (step + 1)  # loom's schedule writes a float
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert all(isinstance(g["lr"], float) for g in opt.param_groups)
    big, small = model[0].weight, model[1].weight
    assert type(opt.state[big]["exp_avg"]).__name__ == cls  # quantized moments
    assert type(opt.state[small]["exp_avg"]) is torch.Tensor  # under 4,096 values: full precision
    # the update torch's AdamW makes, up to the moments' quantization: the same direction, not the same bits
    ours, theirs = (big - w0).detach().flatten(), (ref[0].weight - w0).detach().flatten()
    cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=0)
    assert cos > {"int8": 0.99, "int4": 0.9}[state_dtype] and not torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 128-wide char-level base run (3 steps) and its data."""
    import random

    root = tmp_path_factory.mktemp("qlora")
    words = "apple river stone cloud green house music paper light table".split()
    rng = random.Random(0)
    # the chat tests need every character of their conversations in the char vocabulary
    (root / "t.txt").write_text(
        " ".join(rng.choice(words) for _ in range(8000)) + " reverse: again be brief\n"
    )
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(root / "t.txt"),
                "--out",
                str(root / "text"),
                "--tokenizer",
                "char",
            ]
        )
        == 0
    )
    common = [f"--data.path={root / 'text'}", f"--run.dir={root / 'runs'}", *WIDE, *QUIET]
    assert main(["train", *common, "--run.name=base", "--train.steps=3"]) == 0
    return root, common


def test_a_qlora_run_trains_resumes_and_reads_back_its_nf4_base(base_run, capsys):
    root, common = base_run
    run = root / "runs" / "q"
    q = [*common, "--run.name=q", f"--model.init_from=run:{root / 'runs' / 'base'}", "--finetune.lora_rank=4"]
    q += ["--finetune.lora_targets=all-linear", "--finetune.quantize_base=nf4"]
    capsys.readouterr()
    assert main(["train", *q, "--train.steps=3"]) == 0
    assert "QLoRA: 12 base linears in NF4" in capsys.readouterr().out
    assert main(["train", *q, "--train.steps=5", "--train.resume=auto", "--train.eval_every=5"]) == 0
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss" in r and "step" in r][-2:] == [4, 5]
    reported = [r["val_loss"] for r in recs if "val_loss" in r][-1]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0  # the base read back through NF4: the loss the run reported
    assert f"val loss {reported:.4f}" in capsys.readouterr().out
    # the checkpoint holds the adapters, not the base
    from loom.parallel.dcp_state import saved_keys

    keys = saved_keys(run / "ckpt" / "step_000005" / "model")
    assert keys and all(k.endswith((".lora_A", ".lora_B")) for k in keys)
    # exported merged: plain weights, the dequantized base plus the adapters
    assert main(["export", str(run), "--format", "hf", "--out", str(root / "hf")]) == 0
    assert (root / "hf" / "config.json").is_file()


def test_a_resumed_int8_state_run_follows_the_run_straight_through(base_run):
    root, common = base_run

    def losses(name):
        return {
            r["step"]: r["loss"] for r in read_jsonl(root / "runs" / name / "metrics.jsonl") if "loss" in r
        }

    o8 = [*common, "--optim.state_dtype=int8", "--train.steps=4"]
    assert main(["train", *o8, "--run.name=straight"]) == 0
    assert main(["train", *o8[:-1], "--train.steps=2", "--run.name=resumed"]) == 0
    assert main(["train", *o8, "--run.name=resumed", "--train.resume=auto"]) == 0
    a, b = losses("straight"), losses("resumed")
    assert set(a) == {1, 2, 3, 4} and all(a[s] == pytest.approx(b[s], abs=1e-6) for s in a), (a, b)


def _plan(*argv: str):
    from loom.plan.report import build_parser, run_plan

    args = ["--model", "llama3-8b", "--seq-len", "512", "--global-batch-tokens", "8192", "--gpu-mem", "24"]
    return run_plan(build_parser().parse_args([*args, *argv]))


def test_the_planner_counts_an_nf4_base_and_low_bit_states():
    from loom.plan.memory import NF4_BYTES

    shape, _, _, cands = _plan("--gpus", "1", "--lora-rank", "16", "--quantize-base", "nf4")
    best = cands[0]
    assert best.fits and best.memory_gb["total"] < 24 * 0.9
    # the base's block linears in NF4 (4.127 bits a weight), embedding, head and norms in fp32, adapters fp32
    C, F, kv, L = 4096, 14336, 1024, 32
    linears = L * (2 * C * C + 2 * C * kv + 3 * C * F)
    adapters = L * 16 * (2 * (C + C) + 2 * (C + kv) + 3 * (C + F))
    want = linears * NF4_BYTES + (shape.param_count() - linears) * 4 + adapters * 4
    assert best.memory_gb["params"] == pytest.approx(want / 1e9, rel=1e-9)
    assert best.memory_gb["optim"] == pytest.approx(adapters * 8 / 1e9)
    int8 = _plan("--gpus", "1", "--lora-rank", "16", "--quantize-base", "nf4", "--optim-state", "int8")[3][0]
    assert int8.memory_gb["optim"] == pytest.approx(adapters * (2 + 8 / 256) / 1e9)
    with pytest.raises(LoomError, match="fits nowhere"):  # the same LoRA over an fp32 base: 49 GB
        _plan("--gpus", "1", "--lora-rank", "16")
    with pytest.raises(LoomError, match="on one GPU"):
        _plan("--gpus", "2", "--lora-rank", "16", "--quantize-base", "nf4")


def test_qlora_dpo_starts_at_log_2_its_reference_the_same_nf4_model(base_run):
    """loom dpo's reference log-probabilities are the policy's before the first step: with an NF4 base the
    two are one model, so the loss starts at log 2 exactly as bf16 LoRA's does."""
    import json
    import math

    from sftkit import _conversations

    root, common = base_run
    runs = root / "runs"
    (root / "conv.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _conversations(60, seed=1)))
    prep = ["data", "prepare", "--chat", "--input", str(root / "conv.jsonl"), "--out", str(root / "chat")]
    assert main([*prep, "--tokenizer", str(runs / "base"), "--block-size", "64"]) == 0
    sft = [f"--data.path={root / 'chat'}", f"--model.init_from=run:{runs / 'base'}", f"--run.dir={runs}"]
    assert main(["sft", *sft, "--run.name=chat", *QUIET, "--train.steps=2"]) == 0
    pairs = [
        {"prompt": f"reverse: {a} {b}", "chosen": f"{b} {a}", "rejected": f"{a} {b}"}
        for a, b in [
            ("apple", "river"),
            ("stone", "cloud"),
            ("green", "house"),
            ("music", "paper"),
            ("light", "table"),
        ]
        * 4
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prep = ["data", "prepare", "--pairs", "--input", str(root / "pairs.jsonl"), "--out", str(root / "pref")]
    assert main([*prep, "--tokenizer", str(runs / "chat")]) == 0
    dpo = [
        "dpo",
        f"--data.path={root / 'pref'}",
        f"--model.init_from=run:{runs / 'chat'}",
        f"--run.dir={runs}",
    ]
    dpo += ["--run.name=qdpo", *QUIET, "--train.steps=2", "--finetune.lora_rank=4"]
    dpo += ["--finetune.lora_targets=all-linear", "--finetune.quantize_base=nf4", "--optim.warmup_steps=0"]
    assert main(dpo) == 0
    recs = [r for r in read_jsonl(runs / "qdpo" / "metrics.jsonl") if "loss" in r and "step" in r]
    assert recs[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and len(recs) == 2


def test_qlora_rl_reference_is_the_policy_s_nf4_base(base_run):
    """loom rl's KL reference is a model of its own (loom.rl.stage.reference_model): under QLoRA its linears
    are NF4 as the policy's base, so at the start (B = 0) the two give the same logits and the KL is 0."""
    from loom.config import read_config
    from loom.data.loader import read_meta
    from loom.rl.stage import reference_model
    from loom.runs import pretrained_state

    root, _ = base_run
    cfg = read_config(root / "runs" / "base" / "config.toml")
    cfg.model.init_from = f"run:{root / 'runs' / 'base'}"
    cfg.finetune.lora_rank, cfg.finetune.lora_targets, cfg.finetune.quantize_base = 4, "all-linear", "nf4"
    meta = read_meta(root / "text")
    ref = reference_model(cfg, meta, torch.device("cpu"))
    assert is_nf4(ref.blocks[0].attn.q_proj.weight) and not is_nf4(ref.lm_head.weight)
    policy = GPT(ref.cfg)  # as the trainer makes it: LoRA, the base's weights, then NF4
    apply_lora(policy, 4, 16.0, "all-linear", seed=0)
    policy.load_state_dict(pretrained_state(cfg, policy), strict=False)
    quantize_base(policy)
    x = torch.randint(0, meta["vocab_size"], (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(policy(x), ref(x), rtol=0, atol=0)


def test_loom_rl_trains_a_qlora_policy(tmp_path, monkeypatch):
    """`loom rl` end to end with an NF4 base (one process): the sampler and the trainer agree on the answers'
    log-probabilities (the same NF4 model), the KL to the NF4 reference is 0 before the first update and not
    after it, and the adapters get a gradient (a reward that varies within a group: a digit 0-4 anywhere)."""
    import rlkit

    from loom.metrics import read_jsonl

    monkeypatch.setattr(rlkit, "MODEL", [*WIDE[:3], "--model.block_size=32"])  # 128 wide: NF4's blocks
    root = rlkit.make_rl_root(tmp_path, sft_steps=2)
    args = rlkit.rl_args(root, "qrl", "--train.steps=2", "--train.sample_every=0", "--train.eval_every=0")
    args = [a for a in args if a != "--rl.reward=exact"] + ["--rl.reward=regex", "--rl.pattern=[0-4]"]
    args += ["--finetune.lora_rank=4", "--finetune.lora_targets=all-linear", "--finetune.quantize_base=nf4"]
    assert main([*args, "--rl.kl_coef=0.1"]) == 0
    recs = [r for r in read_jsonl(root / "runs" / "qrl" / "metrics.jsonl") if "rl/kl" in r]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["rl/logprob_diff"] == 0 for r in recs) and recs[0]["rl/kl"] == 0 < recs[1]["rl/kl"]
    assert all(r["grad_norm"] > 0 for r in recs)

"""`loom plan` against published figures and a measured run.

Compared against: the ZeRO paper's worked example (Rajbhandari et al. 2020, section 5 / figure 1: 7.5B
parameters, 64 GPUs, mixed-precision Adam: 120 / 31.4 / 16.6 / 1.9 GB per GPU for stages 0-3, GB = 1e9
bytes); the released GPT-2 parameter counts; and the bytes loom's own GPT saves for backward, measured on
CPU with saved_tensors_hooks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plankit import model_activation_bytes

from loom.cli import main
from loom.errors import LoomError
from loom.plan import PRECISIONS, PRESETS, model_state_bytes
from loom.plan.memory import Precision
from loom.plan.report import build_parser, run_plan
from loom.plan.shapes import ModelShape, parse_count, resolve_model


def _plan(*argv: str):
    return run_plan(build_parser().parse_args(list(argv)))


# The paper's mixed-precision Adam: fp16 parameters and gradients, an fp32 master copy in the optimizer (2+2+12)
PAPER = Precision("paper", 2, 2, 12, 2, "Rajbhandari et al. 2020, section 3.1")


@pytest.mark.parametrize("zero, paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(zero, paper_gb):
    states = model_state_bytes(7.5e9, PAPER, zero, dp=64)
    assert sum(states) / 1e9 == pytest.approx(paper_gb, rel=0.05)


def test_loom_holds_4_4_8_and_the_planner_says_so(capsys):
    """loom keeps fp32 parameters and gradients and AdamW's two fp32 moments in bf16 training (the paper's total,
    another split): the paper's example through `loom plan --params 7.5B --gpus 64 --json`, pure dp=64 layouts,
    gives 120 GB replicated, 60.9 with ZeRO-1 (8 bytes of the 16 sharded), 1.9 with ZeRO-2 or 3 (loom's zero2 is
    FSDP without the reshard: its parameters rest sharded too)."""
    assert main(["plan", "--params", "7.5B", "--gpus", "64", "--gpu-mem", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["params"] == 7_500_000_000 and out["model"]["shape_assumed"]
    for zero, gb in ((0, 120.0), (1, 60.9), (2, 1.875), (3, 1.875)):
        c = next(c for c in out["candidates"] if (c["dp"], c["zero"], c["replicate"]) == (64, zero, 1))
        m = c["memory_gb"]
        assert m["params"] + m["grads"] + m["optim"] == pytest.approx(gb, rel=0.01)
        assert (m["params"], m["grads"]) == pytest.approx((4 * 7.5 / (64 if zero >= 2 else 1),) * 2, rel=0.01)


def test_fp32_is_4_4_8():
    assert sum(model_state_bytes(1e9, PRECISIONS["fp32"], 0, 8)) == 16e9
    assert model_state_bytes(1e9, PRECISIONS["fp32"], 1, 8) == (4e9, 4e9, 1e9)


@pytest.mark.parametrize(
    "name, released",
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_gpt2_preset_counts(name, released):
    """Released counts (vocabulary 50257, tied head); loom pads the vocabulary to 50304 (+47·n_embd)."""
    from loom.model import GPTConfig
    from loom.model.flops import param_count

    s = PRESETS[name]
    assert s.param_count() == pytest.approx(released, rel=1e-3)
    cfg = GPTConfig(s.vocab_size, s.n_layer, s.n_head, s.n_embd, s.block_size, bias=s.bias)
    assert s.param_count() == param_count(cfg)


def test_large_presets_are_their_class():
    assert [round(PRESETS[k].param_count() / 1e9, 1) for k in ("7b", "13b", "70b")] == [6.6, 12.8, 64.7]


def test_parse_count():
    assert parse_count("7.5B") == 7_500_000_000 and parse_count("124M") == 124_000_000
    assert parse_count("1.3e9") == 1_300_000_000
    with pytest.raises(LoomError):
        parse_count("lots")


def test_enumeration_is_valid_and_complete():
    shape, cluster, wl, cands = _plan(
        "--model", "7b", "--gpus", "64", "--gpus-per-node", "8", "--gpu-mem", "80"
    )
    seqs = wl.global_batch_tokens // wl.seq_len
    keys = set()
    for c in cands:
        assert c.dp * c.cp * c.tp * c.pp == 64
        assert shape.n_head % c.tp == 0 and 8 % c.tp == 0  # tensor parallel inside a node
        kv = shape.n_kv_head or shape.n_head
        assert c.cp == 1 or (8 % (c.cp * c.tp) == 0 and (kv // c.tp) % c.cp == 0 and c.zero != 1)  # Ulysses
        assert 1 <= c.pp <= shape.n_layer
        assert seqs == c.dp * c.micro_batch * c.n_micro and c.n_micro >= c.pp  # 1F1B: m >= pp
        assert c.zero in (0, 1, 2, 3) and (c.dp * c.cp > 1 or c.zero == 0)
        assert c.activation_checkpointing in ("none", "full")  # flash attention: selective == none
        assert 0 <= c.bubble < 1 and c.step_time_s > 0
        assert c.replicate == 1 or (c.zero == 3 and 1 < c.replicate < c.dp and c.dp % c.replicate == 0)
        keys.add((c.dp, c.cp, c.tp, c.pp, c.zero, c.replicate, c.micro_batch, c.activation_checkpointing))
    assert len(keys) == len(cands)
    degrees = {(c.dp, c.tp, c.pp) for c in cands if c.cp == 1}
    assert {(64, 1, 1), (8, 8, 1), (1, 8, 8), (2, 1, 32), (4, 2, 8)} <= degrees
    assert not {(4, 16, 1), (1, 1, 64)} & degrees  # tp=16 would cross nodes; 64 stages > 32 layers
    fits = [c.fits for c in cands]
    assert fits == sorted(fits, reverse=True)  # fitting layouts first


def test_eager_attention_adds_selective():
    _, _, _, cands = _plan("--model", "gpt2", "--gpus", "2", "--gpu-mem", "80", "--attention", "eager")
    assert {c.activation_checkpointing for c in cands} == {"none", "selective", "full"}
    by = {
        (c.dp, c.zero, c.micro_batch, c.activation_checkpointing): c.memory_gb["activations"] for c in cands
    }
    assert by[(2, 0, 1, "full")] < by[(2, 0, 1, "selective")] < by[(2, 0, 1, "none")]


def test_bubble_and_communication_formulas():
    # m = 1 micro-batch per rank: the all-reduce of fp32 gradients (DDP, ZeRO-1); ZeRO-2 one reduce-scatter of
    # them and one all-gather of bf16 parameters; ZeRO-3 two all-gathers (ZeRO paper 7.2.2: 1.5x the all-reduce
    # when parameters and gradients have one dtype; with loom's bf16 gathers and fp32 reductions, 1x)
    _, _, wl, cands = _plan(
        "--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--global-batch-tokens", "8192"
    )
    flat = {
        c.zero: c
        for c in cands
        if c.tp == c.pp == c.cp == 1 and c.activation_checkpointing == "none" and c.replicate == 1
    }
    psi = wl.shape.param_count()
    assert flat[0].comm_gb["dp"] == pytest.approx(2 * 7 / 8 * psi * 4 / 1e9, rel=1e-3)
    assert flat[1].comm_gb["dp"] == flat[0].comm_gb["dp"]
    assert flat[2].comm_gb["dp"] == pytest.approx(7 / 8 * psi * (4 + 2) / 1e9, rel=1e-3)
    assert flat[3].comm_gb["dp"] == pytest.approx(7 / 8 * psi * (2 + 2 + 4) / 1e9, rel=1e-3)
    _, _, _, cands = _plan("--model", "gpt2", "--gpus", "8", "--gpu-mem", "80")
    for c in cands:
        assert c.bubble == pytest.approx((c.pp - 1) / (c.n_micro + c.pp - 1))


def test_fp8_gathers_weights_at_one_byte():
    # fp8-mixed (precision.fp8=tensorwise): FSDP's two all-gathers move 1 byte a parameter, the reduce-scatter
    # fp32 as before; bf16-mixed gathers 2 bytes
    args = ("--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--global-batch-tokens", "8192")
    got = {}
    for prec in ("bf16-mixed", "fp8-mixed"):
        _, _, wl, cands = _plan(*args, "--precision", prec)
        got[prec] = next(
            c
            for c in cands
            if (c.zero, c.replicate, c.tp, c.pp, c.cp) == (3, 1, 1, 1, 1)
            and c.activation_checkpointing == "none"
        )
    psi = wl.shape.param_count()
    assert got["fp8-mixed"].comm_gb["dp"] == pytest.approx(7 / 8 * psi * (1 + 1 + 4) / 1e9, rel=1e-3)
    assert got["fp8-mixed"].memory_gb["buffers"] < got["bf16-mixed"].memory_gb["buffers"]
    assert got["fp8-mixed"].memory_gb["activations"] == got["bf16-mixed"].memory_gb["activations"]


def test_hsdp_shards_within_a_group_and_all_reduces_across_replicas():
    # HSDP r x s (dp = r * s): model states sharded s ways; FSDP's gathers within the s-rank group, plus one
    # all-reduce of each gradient shard (psi / s) across the r replicas per step
    args = ("--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--global-batch-tokens", "8192")
    _, _, wl, cands = _plan(*args)
    psi, prec = wl.shape.param_count(), wl.precision
    by = {
        c.replicate: c
        for c in cands
        if c.tp == c.pp == c.cp == 1 and c.zero == 3 and c.activation_checkpointing == "none"
    }
    assert sorted(by) == [1, 2, 4]  # 8 ranks: groups of 8 (plain FSDP), 4 x 2, 2 x 4
    for r, c in by.items():
        shard = 8 // r
        gather = psi * (shard - 1) / shard * (2 * prec.gather + prec.grad)  # bf16 gathers, fp32 reductions
        across = 2 * (r - 1) / r * psi / shard * prec.grad
        assert c.comm_gb["dp"] == pytest.approx((gather + across) / 1e9, rel=1e-3)
        assert c.memory_gb["optim"] == pytest.approx(psi * prec.optim / shard / 1e9, rel=1e-3)
    assert by[1].memory_gb["optim"] < by[2].memory_gb["optim"] < by[4].memory_gb["optim"]
    assert "--parallel.dp_replicate=2" in by[2].reason and "groups of 4 inside a node" in by[2].reason
    # a slow link between nodes and one micro-batch per rank: FSDP over all 64 ranks waits on it, HSDP with its
    # shard group inside a node does not (only the gradient shards' all-reduce crosses nodes)
    _, _, _, big = _plan(
        "--model",
        "7b",
        "--gpus",
        "64",
        "--gpus-per-node",
        "8",
        "--gpu-mem",
        "80",
        "--inter-bw",
        "5",
        "--global-batch-tokens",
        "262144",
    )
    assert big[0].zero == 3 and big[0].replicate > 1 and "HSDP" in big[0].reason
    flat_fsdp = min(
        (c for c in big if c.zero == 3 and c.replicate == 1 and c.tp == c.pp == c.cp == 1),
        key=lambda c: c.step_time_s,
    )
    assert big[0].step_time_s < flat_fsdp.step_time_s


def test_decision_rules_in_the_ranking():
    _, _, _, small = _plan("--model", "gpt2", "--gpus", "8", "--gpu-mem", "24")
    assert (small[0].zero, small[0].tp, small[0].pp) == (0, 1, 1) and "plain data parallel" in small[0].reason
    _, _, _, big = _plan("--model", "7b", "--gpus", "64", "--gpus-per-node", "8", "--gpu-mem", "80")
    assert big[0].fits and big[0].zero > 0 and "ZeRO" in big[0].reason  # 105 GB of states do not replicate
    _, _, _, huge = _plan("--model", "70b", "--gpus", "64", "--gpus-per-node", "8", "--gpu-mem", "80")
    assert huge[0].fits and (huge[0].tp > 1 or huge[0].pp > 1 or huge[0].zero == 3)


def test_fits_nowhere_names_the_smallest_memory(capsys):
    with pytest.raises(LoomError, match=r"fits nowhere .* needs \d+\.\d GB per GPU"):
        _plan("--model", "70b", "--gpus", "8", "--gpu-mem", "80")
    assert main(["plan", "--model", "gpt2-xl", "--gpus", "1", "--gpu-mem", "8"]) == 2
    assert "GPUs of at least" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "gtp2", "--gpus", "8", "--gpu-mem", "80"], "did you mean 'gpt2'"),
        (["--model", "gpt2", "--gpus", "12", "--gpu-mem", "80"], "whole number of 8-GPU nodes"),
        (
            ["--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--seq-len", "4096"],
            "outside the model's context",
        ),
        (
            ["--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--global-batch-tokens", "1000"],
            "whole number",
        ),
        (["--model", "gpt2", "--gpus", "0", "--gpu-mem", "80"], "must be positive"),
        (["--gpus", "8", "--gpu-mem", "80"], "give a model"),
    ],
)
def test_bad_input(argv, match):
    with pytest.raises(LoomError, match=match):
        _plan(*argv)


def test_json_schema(capsys):
    assert main(["plan", "--model", "gpt2-medium", "--gpus", "16", "--gpu-mem", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidates"]
    for c in out["candidates"]:
        assert {
            "dp",
            "tp",
            "pp",
            "zero",
            "micro_batch",
            "activation_checkpointing",
            "memory_gb",
            "step_time_s",
            "bubble",
            "fits",
        } <= set(c)
        assert set(c["memory_gb"]) == {"params", "grads", "optim", "activations", "buffers", "total"}
        m = c["memory_gb"]
        # the peak: the states, activations and buffers; the gradients only when they exist by then
        base = m["params"] + m["optim"] + m["activations"] + m["buffers"]
        assert m["total"] == pytest.approx(base) or m["total"] == pytest.approx(base + m["grads"])
        assert c["zero"] in (0, 1, 2, 3) and isinstance(c["fits"], bool)


def test_config_toml_and_params(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text("[model]\nn_layer = 6\nn_head = 6\nn_embd = 384\nblock_size = 256\nvocab_size = 65\n")
    s = resolve_model(str(cfg), None)
    assert (s.n_layer, s.n_head, s.n_embd, s.block_size, s.vocab_size) == (6, 6, 384, 256, 65)
    _, _, wl, cands = _plan("--model", str(cfg), "--gpus", "2", "--gpu-mem", "16")
    assert wl.seq_len == 256 and cands[0].fits
    s = resolve_model(None, "13B")
    assert s.assumed and s.param_count() == 13_000_000_000
    assert abs(s.counted_params() - 13e9) / 13e9 < 0.1  # the assumed shape is near the count


def test_cli_subprocess_and_no_torch_import():
    code = (
        "import sys; from loom.cli import main; rc = main(['plan', '--model', '7b', '--gpus', '64', "
        "'--gpus-per-node', '8', '--gpu-mem', '80', '--top', '3']); assert 'torch' not in sys.modules; "
        "sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "valid layouts" in r.stdout and " 1  " in r.stdout and "ZeRO" in r.stdout


# ------------------------------------------------------------------ activation memory, measured on CPU


def _measured_saved_bytes(shape: ModelShape, b: int) -> int:
    """Bytes of the tensors one training forward of loom's GPT keeps for backward (fp32, CPU): every
    tensor passed to a saved-tensor hook, deduplicated by storage, parameters excluded."""
    import torch

    from loom.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            shape.vocab_size,
            shape.n_layer,
            shape.n_head,
            shape.n_embd,
            shape.block_size,
            dropout=shape.dropout,
        )
    ).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}  # holding the storages keeps their addresses unique

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st
        return t

    idx = torch.randint(0, shape.vocab_size, (b, shape.block_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(st.nbytes() for st in saved.values())


@pytest.mark.parametrize("dropout, attention", [(0.0, "flash"), (0.1, "eager")])
def test_activation_estimate_matches_a_measured_run(dropout, attention):
    """Without dropout CPU SDPA runs the fused (flash) kernel: Q, K, V, output and a log-sum-exp are kept.
    With dropout it falls back to the math path, which keeps the s×s softmax, its mask and the dropped-out
    scores, as Korthikanti's eq. 1; on CPU dropout masks have the activation dtype (4 bytes, not CUDA's 1).
    The formula counts every tensor; the measured run adds only position ids and the loss scalar."""
    shape = ModelShape(
        "tiny", n_layer=3, n_head=4, n_embd=128, vocab_size=1000, block_size=64, dropout=dropout
    )
    measured = _measured_saved_bytes(shape, b=4)
    estimate = model_activation_bytes(shape, s=64, b=4, act_bytes=4, attention=attention, mask_bytes=4)
    assert measured / estimate == pytest.approx(1.0, abs=0.02), (measured, estimate)


# ------------------------------------------------------------------ the llama family's Qwen options

QWEN = {
    # Qwen3: q/k norm and heads wider than n_embd / n_head (q and o map 64 <-> 4 x 32), grouped kv heads
    "qwen3": ["--model.qk_norm=true", "--model.tie_embeddings=true", "--model.head_size=32"],
    # Qwen 2.5: biases on q, k and v only
    "qwen2.5": ["--model.qkv_bias=true"],
}


def _saved_bytes(model, vocab: int, b: int, s: int) -> int:
    """Bytes one training forward keeps for backward (fp32, CPU), parameters excluded (as above)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t

    idx = torch.randint(0, vocab, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(st.nbytes() for st in saved.values())


@pytest.mark.parametrize("kind", QWEN)
def test_qwen_options_count_as_the_built_model(kind):
    """The planner's parameters and FLOPs per token of a Qwen3-like and a Qwen2.5-like llama config equal the
    built model's (num_params, loom.model.flops), and what head_size and qkv_bias add to the saved activations
    equals what they add to a measured forward on CPU. Compared as differences: on a CPU, RMSNorm is composite
    and also keeps its fp32 output (for the gain's gradient), which the planner (CUDA's fused kernel: input and
    rstd) does not count; for q/k norm that is one (q, k)-sized tensor per layer, wider with head_size."""
    import torch

    from loom.config import load_config
    from loom.model import GPT
    from loom.model.flops import flops_per_token
    from loom.model.gpt.family import gpt_config
    from loom.plan.shapes import shape_of_model

    base = ["--model.family=llama", "--model.n_layer=2", "--model.n_head=4", "--model.n_kv_head=2"]
    base += ["--model.n_embd=64", "--model.block_size=32"]
    built = {}
    for name, extra in (("qwen", QWEN[kind]), ("without", QWEN[kind][:-1])):
        cfg = load_config(None, [*base, *extra])
        torch.manual_seed(0)
        model = GPT(gpt_config(cfg, 300)).train()
        shape = shape_of_model(cfg.model, 300)
        estimate = model_activation_bytes(shape, s=32, b=4, act_bytes=4)
        built[name] = (shape, model, _saved_bytes(model, 300, 4, 32) - estimate)
    shape, model, gap = built["qwen"]
    assert shape.counted_params() == model.num_params() != built["without"][0].counted_params()
    assert 6 * shape.matmul_params() + shape.attn_flops(32) == flops_per_token(model.cfg)
    q_and_k = shape.q_dim + shape.kv_dim - built["without"][0].q_dim - built["without"][0].kv_dim
    assert gap - built["without"][2] == (shape.n_layer * 4 * 4 * 32 * q_and_k if shape.qk_norm else 0)

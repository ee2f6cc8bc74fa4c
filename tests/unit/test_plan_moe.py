"""`loom plan` for mixtures of experts (issue 32) against loom's MoE model and the planner's own dense figures.

Compared against: MoEGPT's num_params() / num_active_params() (the shape's counts), the bytes a MoE training
forward keeps for backward measured on CPU with saved_tensors_hooks (the routed-activation term), and the same
layout at ep = 1 (expert states divided by ep, the rest unchanged; no all-to-all). The dry run refuses MoE (its
fake tensors cannot route), which is checked too.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from plankit import model_activation_bytes

from loom.cli import main
from loom.config import load_config
from loom.errors import LoomError
from loom.model.moe.family import moe_config
from loom.model.moe.moe import MoEGPT
from loom.plan import PRESETS
from loom.plan.report import build_parser, run_plan
from loom.plan.shapes import ModelShape, resolve_model, shape_of_model

MOE = [
    "--model.family=moe",
    "--model.n_layer=4",
    "--model.n_head=4",
    "--model.n_embd=64",
    "--model.block_size=32",
]


def _plan(*argv: str):
    return run_plan(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--model.n_shared_experts=1", "--model.moe_first_dense=1", "--model.moe_every=2"],
        ["--model.moe_ffn_hidden=96", "--model.moe_top_k=1", "--model.qk_norm=true", "--model.n_kv_head=2"],
        ["--model.tie_embeddings=true", "--model.n_experts=6", "--model.moe_top_k=3"],
    ],
    ids=["plain", "shared-dense-every2", "width-k1-qknorm-gqa", "tied-6x3"],
)
def test_shape_counts_equal_the_model(extra):
    cfg = load_config(None, MOE + extra)
    shape = shape_of_model(cfg.model, 300)
    with torch.device("meta"):
        model = MoEGPT(moe_config(cfg, 300))
    assert shape.counted_params() == model.num_params()
    assert shape.active_params() == model.num_active_params() < model.num_params()
    assert shape.moe_layers == model.cfg.moe_layers


def _saved_bytes(model: torch.nn.Module, vocab: int, b: int, s: int) -> int:
    """Bytes of the tensors one training forward keeps for backward (fp32, CPU): every tensor passed to a
    saved-tensor hook, deduplicated by storage, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}  # holding the storages keeps their addresses unique

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st
        return t

    idx = torch.randint(0, vocab, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()(idx, idx)
    return sum(st.nbytes() for st in saved.values())


def test_routed_activations_match_a_measured_run():
    """What a MoE model keeps for backward beyond the same Llama without experts (fp32, CPU), measured, equals
    what model_activation_bytes adds for its MoE layers (the routed rows: N·k whatever the router's balance;
    the experts' SwiGLU tensors, the router's scores, top-k weights and indices, a shared expert) within 2 %.
    The difference is compared: the dense model's own figure is test_plan.py's."""
    from loom.model import GPT
    from loom.model.gpt.family import gpt_config

    over = MOE + ["--model.n_shared_experts=1", "--model.moe_first_dense=1", "--model.vocab_size=500"]
    moe_cfg, dense_cfg = load_config(None, over), load_config(None, [*over, "--model.n_experts=0"])
    dense_cfg.model.family = "llama"
    torch.manual_seed(0)
    measured = _saved_bytes(MoEGPT(moe_config(moe_cfg, 500)), 500, 4, 32)
    measured -= _saved_bytes(GPT(gpt_config(dense_cfg, 500)), 500, 4, 32)
    estimate = sum(
        sign * model_activation_bytes(shape_of_model(c.model, 500), 32, 4, 4, "flash", 4)
        for sign, c in ((1, moe_cfg), (-1, dense_cfg))
    )
    assert measured > 0 and measured / estimate == pytest.approx(1.0, abs=0.02), (measured, estimate)


def _layout(cands, **want):
    return next(c for c in cands if all(getattr(c, k) == v for k, v in want.items()))


def test_expert_states_divide_by_ep_and_all_to_all_appears():
    """The same layout at ep 1 and 4: the routed experts' states per rank are 1/4, every other state equal; the
    all-to-all is zero at ep 1, and at ep 4 crosses the node's links (ep x tp = 4 <= 8 GPUs a node)."""
    *_, cands = _plan("--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu-mem", "80")
    same = {
        "dp": 16,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "replicate": 1,
        "zero": 0,
        "micro_batch": 1,
        "activation_checkpointing": "full",
    }
    one, four = _layout(cands, ep=1, **same), _layout(cands, ep=4, **same)
    assert four.moe["expert_states_gb"] == pytest.approx(one.moe["expert_states_gb"] / 4)
    assert four.moe["other_states_gb"] == pytest.approx(one.moe["other_states_gb"])
    assert one.moe["experts_per_rank"] == 128 and four.moe["experts_per_rank"] == 32
    assert one.comm_gb["ep"] == 0 and one.moe["a2a_link"] == "none"
    assert four.comm_gb["ep"] > 0 and four.moe["a2a_link"] == "intra-node"
    # fully sharded: the experts' states shard over dp / ep = 4 ranks, the rest over 16
    f1, f4 = _layout(cands, ep=1, **{**same, "zero": 3}), _layout(cands, ep=4, **{**same, "zero": 3})
    assert f4.moe["expert_shard"] == 4 and f4.moe["expert_states_gb"] == pytest.approx(
        f1.moe["expert_states_gb"]
    )
    # across nodes: ep 16 over 2 nodes of 8
    sixteen = _layout(cands, ep=16, **same)
    assert sixteen.moe["a2a_link"] == "inter-node" and sixteen.moe["a2a_s"] > four.moe["a2a_s"]


@pytest.mark.slow  # plans a 512-GPU DeepSeek-V3 layout: minutes of CPU
def test_active_flops_and_presets(capsys):
    """MFU on active parameters; the presets' configs/*.toml are the presets' shapes; the MoE table prints."""
    for name, path in (
        ("deepseek-v3-shaped", "configs/deepseek_v3_shaped.toml"),
        ("qwen3-30b-a3b", "configs/qwen3_30b_a3b.toml"),
    ):
        preset, toml = PRESETS[name], resolve_model(path, None)
        assert toml.counted_params() == preset.counted_params()
        assert toml.active_params() == preset.active_params() < preset.counted_params()
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--gpu-mem", "80", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["active_params"] == PRESETS["qwen3-30b-a3b"].active_params()
    assert {c["ep"] for c in out["candidates"]} >= {1, 8}
    assert all(0 < c["moe"]["mfu_active"] <= 0.45 + 1e-9 for c in out["candidates"])
    assert (
        main(["plan", "--model", "deepseek-v3-shaped", "--gpus", "512", "--gpu-mem", "80", "--top", "3"]) == 0
    )
    text = capsys.readouterr().out
    assert "active per token" in text and "MFU active" in text and "experts/rank" in text


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--model", "deepseek-v3-shaped", "--gpus", "512", "--gpu-mem", "80", "--ep", "3"],
            "does not divide n_experts",
        ),
        (["--model", "7b", "--gpus", "8", "--gpu-mem", "80", "--ep", "2"], "not a mixture of experts"),
        (
            ["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--ep", "64"],
            "divides the data-parallel",
        ),
    ],
)
def test_bad_ep(argv, match):
    with pytest.raises(LoomError, match=match):
        _plan(*argv)


def test_dry_run_refuses_moe():
    from loom.dryrun.layout import Target
    from loom.dryrun.report import dry_run

    cfg = load_config(None, MOE + ["--model.vocab_size=300"])
    with pytest.raises(LoomError, match="routing decides"):
        dry_run(cfg, Target(4), advise=False)


def test_plan_check_of_a_moe_preset_says_why_it_cannot_dry_run(capsys):
    """Issue 42 item 5: `loom plan --check` on a MoE preset dry-ran the layouts without model.family=moe (the
    gpt2 family then refused parallel.ep, or a dense stand-in crashed). The dry run cannot step a MoE (its
    routing needs tensor values), so --check is refused before anything is printed, naming that; the dry run's
    overrides of a MoE shape carry the moe family and its experts."""
    from loom.dryrun.check import shape_overrides

    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu-mem", "80", "--check"]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert (
        "loom plan --check dry-runs the planner's layouts, and the dry run cannot step qwen3-30b-a3b (model.family=moe)"
        in (out.err)
    )
    assert "leave out --check" in out.err and "gpt2" not in out.err and out.out == ""

    class Workload:
        seq_len, global_batch_tokens = 4096, 4096 * 8
        precision = type("P", (), {"name": "bf16-mixed"})

    flags = shape_overrides(PRESETS["qwen3-30b-a3b"], Workload)
    assert (
        "--model.family=moe" in flags and "--model.n_experts=128" in flags and "--model.moe_top_k=8" in flags
    )


def test_moe_layers_below_counts_what_moe_layers_lists():
    """The planner counts a stage's MoE layers arithmetically; the list is the definition (MoEConfig's)."""
    base = ModelShape("x", 12, 4, 64, vocab_size=100, block_size=32, n_experts=8)
    for n_layer, first_dense, every in itertools.product(range(1, 14), range(5), range(1, 4)):
        s = dataclasses.replace(base, n_layer=n_layer, first_dense=first_dense, moe_every=every)
        assert [s.moe_layers_below(x) for x in range(16)] == [
            sum(i < x for i in s.moe_layers) for x in range(16)
        ]
        assert s.n_moe == len(s.moe_layers)
    assert dataclasses.replace(base, n_experts=0).n_moe == 0

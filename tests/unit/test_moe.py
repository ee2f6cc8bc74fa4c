"""The moe family (loom.model.moe, moe_parallel, flops, config's checks) against references written here:
grouped_mm and the experts' grouped GEMM against a matmul per group and the loop of matmuls; MoE's forward
against a naive per-token router and SwiGLU experts (softmax/sigmoid, top-1/2, shared experts, the balance
bias); the balance loss against DeepSeek-V3's sequence-wise formula computed by hand; the bias update, the
per-layer load figures and the parameter counts against hand arithmetic and MoEGPT itself; config.validate's
refusals; and a tiny `loom train` of model.family=moe in this process whose metrics.jsonl has the load
figures and a bias that moves."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from loom.cli import main
from loom.config import load_config, validate
from loom.errors import LoomError
from loom.metrics import read_jsonl
from loom.model import flops
from loom.model.moe import moe_parallel
from loom.model.moe.moe import _CPU_GROUPED, MoE, MoEConfig, MoEGPT, grouped_mm, grouped_ok

# torch._grouped_mm has a CPU kernel from torch 2.13 (make test-oldest runs 2.11: the loop is all it has there)
CPU_GROUPED = pytest.mark.skipif(not _CPU_GROUPED, reason="torch._grouped_mm runs on CPUs from torch 2.13")

TOL = dict(rtol=1e-5, atol=1e-6)  # float32: the same products in another grouping


def tiny(**kw) -> MoEConfig:
    """A Llama-shaped MoE of 2 layers, 4 experts of width 8, top-2, the loop GEMM (the reference's order)."""
    base = dict(
        vocab_size=64,
        n_layer=2,
        n_head=2,
        n_embd=16,
        block_size=16,
        pos="rope",
        norm="rmsnorm",
        mlp="swiglu",
        tie_embeddings=False,
        bias=False,
        n_experts=4,
        top_k=2,
        expert_hidden=8,
        gemm="loop",
    )
    return MoEConfig(**{**base, **kw})


def moe_layer(seed: int = 0, **kw) -> MoE:
    """A MoE with random experts and a router sharp enough that the top-k choice differs between tokens."""
    torch.manual_seed(seed)
    m = MoE(tiny(**kw))
    with torch.no_grad():
        m.router.weight.normal_(0.0, 0.5)
        for p in m.experts.parameters():
            p.normal_(0.0, 0.3)
        if m.shared is not None:
            for p in m.shared.parameters():
                p.normal_(0.0, 0.3)
    return m


def hidden(B: int = 3, T: int = 5, C: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed))


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert on one token, weights in nn.Linear's (out, in) layout."""
    return down @ (F.silu(gate @ h) * (up @ h))


def reference_scores(m: MoE, h: torch.Tensor) -> torch.Tensor:
    """One token's normalised router scores (E,), in fp32."""
    logits = m.router.weight.detach().double() @ h.detach().double()
    return (logits.softmax(-1) if m.score == "softmax" else logits.sigmoid()).float()


def reference_choice(m: MoE, s: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The k experts by score + bias (highest first) and their weights: the scores without the bias,
    renormalised to sum to 1 when norm_topk and k > 1."""
    biased = (s + m.expert_bias).tolist()
    ids = sorted(range(m.n_experts), key=lambda i: -biased[i])[: m.top_k]
    w = s[ids]
    if m.norm_topk and m.top_k > 1:
        w = w / w.sum()
    return ids, w


def reference_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE's output token by token: the weighted sum of the chosen SwiGLU experts, plus the shared ones."""
    B, T, C = x.shape
    gate, up, down = m.experts.gate_proj, m.experts.up_proj, m.experts.down_proj
    out = torch.zeros(B * T, C)
    for n, h in enumerate(x.reshape(-1, C)):
        ids, w = reference_choice(m, reference_scores(m, h))
        y = sum(w[j] * swiglu(h, gate[i], up[i], down[i]) for j, i in enumerate(ids))
        if m.shared is not None:
            s = m.shared
            y = y + swiglu(h, s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight)
        out[n] = y
    return out.view(B, T, C)


def reference_aux(m: MoE, x: torch.Tensor) -> float:
    """DeepSeek-V3's sequence-wise balance loss (without its coefficient), per sequence E * sum_i f_i P_i,
    f_i = (E / (k T)) x the sequence's choices of expert i and P_i the mean over its tokens of expert i's score
    normalised over the experts (softmax: as is), then the mean over sequences."""
    B, T, C = x.shape
    E, k = m.n_experts, m.top_k
    total = 0.0
    for b in range(B):
        f, P = [0.0] * E, [0.0] * E
        for h in x[b]:
            s = reference_scores(m, h)
            for i in reference_choice(m, s)[0]:
                f[i] += 1.0 / (k * T)
            p = s / s.sum()
            for i in range(E):
                P[i] += float(p[i]) / T
        total += E * sum(fi * pi for fi, pi in zip(f, P, strict=True))
    return total / B


# ------------------------------------------------------------------------------------------ grouped GEMM


@CPU_GROUPED
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 4, 0, 0], [0, 0, 0, 0]])  # empty groups; no rows at all
def test_grouped_mm_equals_the_loop_and_a_matmul_per_group(counts):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(len(counts), 12, 8, generator=g)  # (G, out, in)
    x = torch.randn(sum(counts), 8, generator=g)
    c = torch.tensor(counts)
    assert grouped_ok(x, w)  # auto takes torch._grouped_mm here
    ref = torch.cat([x[sum(counts[:i]) : sum(counts[: i + 1])] @ w[i].t() for i in range(len(counts))])
    grouped, loop = grouped_mm(x, w, c, "grouped"), grouped_mm(x, w, c, "loop")
    assert grouped.shape == loop.shape == (sum(counts), 12)
    torch.testing.assert_close(grouped, ref, **TOL)
    torch.testing.assert_close(loop, ref, **TOL)
    torch.testing.assert_close(grouped_mm(x, w, c, "auto"), ref, **TOL)  # on this CPU: grouped


@CPU_GROUPED
def test_grouped_mm_backward_equals_the_loop():
    counts = torch.tensor([2, 0, 3, 4])
    g = torch.Generator().manual_seed(0)
    w0, x0, dy = (
        torch.randn(4, 12, 8, generator=g),
        torch.randn(9, 8, generator=g),
        torch.randn(9, 12, generator=g),
    )
    grads = []
    for impl in ("grouped", "loop"):
        w, x = w0.clone().requires_grad_(), x0.clone().requires_grad_()
        (grouped_mm(x, w, counts, impl) * dy).sum().backward()
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[0], grads[1], **TOL)
    assert grads[0][1][1].abs().max() == 0  # the empty group's matrix has no gradient


@CPU_GROUPED
def test_auto_takes_the_loop_where_the_grouped_kernel_refuses():
    """torch._grouped_mm on a CPU wants rows of 16 bytes in its input and output (the output's in backward)
    and no float64: auto must take the loop there, or a MoE of expert width 6 fails in backward."""
    x, w = torch.randn(5, 8), torch.randn(4, 12, 8)
    assert grouped_ok(x, w) and grouped_ok(x.bfloat16(), w.bfloat16()[:, :8])
    assert not grouped_ok(x, w[:, :6])  # the output's rows: 24 bytes
    assert not grouped_ok(torch.randn(5, 6), torch.randn(4, 12, 6))  # the input's rows
    assert not grouped_ok(x.bfloat16(), w.bfloat16())  # 12 bf16: 24 bytes
    assert not grouped_ok(x.double(), w.double())
    runs = []
    for gemm in ("auto", "loop"):
        m = moe_layer(expert_hidden=6, gemm=gemm).train()
        x = hidden().requires_grad_()
        y = m(x)
        y.square().sum().backward()
        runs.append((y, x.grad, m.experts.down_proj.grad))
    torch.testing.assert_close(runs[0], runs[1], **TOL)


@CPU_GROUPED
@pytest.mark.parametrize("n_shared", [0, 1])
def test_moe_forward_and_backward_grouped_equals_loop(n_shared):
    runs = []
    for gemm in ("grouped", "loop"):
        m = moe_layer(n_shared=n_shared, gemm=gemm).train()
        x = hidden().requires_grad_()
        y = m(x)
        (y * hidden(seed=2)).sum().backward()
        runs.append((y.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y1, dx1, g1), (y2, dx2, g2) = runs
    torch.testing.assert_close(y1, y2, **TOL)
    torch.testing.assert_close(dx1, dx2, **TOL)
    assert g1.keys() == g2.keys() and "experts.gate_proj" in g1 and "router.weight" in g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], **TOL, msg=n)


# ------------------------------------------------------------------------------------------ routing


@pytest.mark.parametrize("n_shared", [0, 1])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_moe_forward_equals_a_per_token_reference(score, top_k, n_shared):
    m = moe_layer(score=score, top_k=top_k, n_shared=n_shared).eval()
    x = hidden()
    with torch.no_grad():
        y = m(x)
        torch.testing.assert_close(y, reference_moe(m, x), **TOL)
        ids = m.route(x.reshape(-1, 16))[1]
    assert len(set(ids[:, 0].tolist())) > 1  # the tokens do not all go to one expert: the test routes


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_balance_bias_chooses_the_experts_but_the_scores_weigh_them(score):
    m = moe_layer(score=score).eval()
    x = hidden()
    h = x.reshape(-1, 16)
    with torch.no_grad():
        before = m.route(h)[1]
        m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))  # expert 3 wins every token's first place
        scores, ids, weights = m.route(h)
        assert (ids[:, 0] == 3).all() and not (before[:, 0] == 3).all()
        picked = scores.gather(-1, ids)  # no bias in the weights: they come from the scores
        torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))
        assert (weights < 1).all()
        torch.testing.assert_close(m(x), reference_moe(m, x), **TOL)


def test_top1_weights_are_the_score_not_renormalised():
    m = moe_layer(top_k=1, score="sigmoid")
    scores, ids, weights = m.route(hidden().reshape(-1, 16))
    torch.testing.assert_close(weights, scores.max(-1, keepdim=True).values)
    assert (weights < 1).all()  # 1 everywhere if the single weight were renormalised


# ------------------------------------------------------------------------------------------ balance loss


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_is_the_sequence_wise_formula(score):
    m = moe_layer(score=score, aux_loss_coef=0.01).train()
    x = hidden(B=3, T=5)
    m(x)
    assert m.aux_loss.item() == pytest.approx(reference_aux(m, x), rel=1e-5)
    assert m.aux_loss.requires_grad  # it trains the router
    stats = m.stats(4, "cpu")  # load (E), the loss summed over sequences, the sequences
    assert stats[:4].sum().item() == 3 * 5 * 2 and stats[5].item() == 3
    assert stats[4].item() == pytest.approx(3 * reference_aux(m, x), rel=1e-5)


def test_aux_loss_of_two_half_batches_is_that_of_the_whole():
    """Per sequence: a batch split over data-parallel ranks or micro-steps gives the same mean balance loss."""
    m = moe_layer(aux_loss_coef=0.01).train()
    x = hidden(B=4, T=6)
    m(x)
    whole = m.aux_loss.item()
    m.balance_step(torch.ones(4), update=False)  # forget the counts
    halves = []
    for part in (x[:2], x[2:]):
        m(part)
        halves.append(m.aux_loss.item())
    assert sum(halves) / 2 == pytest.approx(whole, rel=1e-6)
    assert halves[0] != pytest.approx(halves[1], rel=1e-3)  # the two halves differ: the test means something
    stats = m.stats(4, "cpu")
    assert stats[4].item() / stats[5].item() == pytest.approx(whole, rel=1e-6) and stats[5].item() == 4


def test_aux_loss_joins_the_training_loss_only_with_targets_and_a_coefficient():
    coef = 0.05
    torch.manual_seed(0)
    model = MoEGPT(tiny(n_layer=3, first_dense=1, aux_loss_coef=coef))
    for m in model.modules():
        if isinstance(m, MoE):
            torch.nn.init.normal_(m.router.weight, 0.0, 0.5)
    g = torch.Generator().manual_seed(3)
    idx, tgt = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
    inputs: dict[int, torch.Tensor] = {}
    layers = moe_parallel.moe_layers(model)
    assert sorted(layers) == [1, 2]
    for i, m in layers.items():
        m.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach()))

    model.eval()
    with torch.no_grad():
        ce = model(idx, tgt)  # eval: the cross-entropy alone
        logits = model(idx)
    model.train()
    loss = model(idx, tgt)
    want = ce + coef * sum(reference_aux(m, inputs[i]) for i, m in layers.items())
    assert loss.item() == pytest.approx(want.item(), rel=1e-5) and loss.item() > ce.item()
    loss.backward()
    assert all(m.router.weight.grad.abs().sum() > 0 for m in layers.values())
    torch.testing.assert_close(model(idx), logits)  # training without targets: the logits, nothing added

    model.cfg.aux_loss_coef = 0.0  # the family's check: no coefficient, no balance loss
    torch.testing.assert_close(model(idx, tgt), ce)


# ------------------------------------------------------------------------------------------ balance step


def test_balance_step_moves_the_bias_by_the_sign_of_the_load_and_forgets_the_counts():
    m = moe_layer(bias_update_rate=0.1).train()
    m(hidden())
    assert m.load is not None and m.load.sum().item() == 3 * 5 * 2 and m.aux_rows == 3
    load = torch.tensor([6.0, 2.0, 4.0, 4.0])  # mean 4
    figures = m.balance_step(load, update=False)  # a skipped step: no move
    assert torch.equal(m.expert_bias, torch.zeros(4))
    assert (m.load, m.aux_sum, m.aux_rows) == (None, 0.0, 0)
    assert figures == {"max_mean": 1.5, "bias_norm": 0.0}
    figures = m.balance_step(load)
    torch.testing.assert_close(m.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert figures["max_mean"] == 1.5 and figures["bias_norm"] == pytest.approx(math.sqrt(0.02))
    m.balance_step(load)
    torch.testing.assert_close(m.expert_bias, torch.tensor([-0.2, 0.2, 0.0, 0.0]))
    assert math.isnan(m.balance_step(torch.zeros(4))["max_mean"])  # no tokens: no ratio
    still = moe_layer(bias_update_rate=0.0)
    still.balance_step(load)
    assert torch.equal(still.expert_bias, torch.zeros(4))  # no rate: no move


def test_after_step_reports_each_moe_layer_and_moves_by_the_jobs_load():
    rate = 0.01
    torch.manual_seed(0)
    model = MoEGPT(tiny(n_layer=4, first_dense=1, moe_every=2, bias_update_rate=rate)).train()
    layers = moe_parallel.moe_layers(model)
    assert sorted(layers) == [1, 3] == model.cfg.moe_layers
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(idx, idx).backward()
    mine = {i: (m.load.clone(), m.aux_sum / m.aux_rows) for i, m in layers.items()}

    out = moe_parallel.after_step(model, lambda t: t, update=True)  # one rank: the sum is the identity
    keys = {f"moe/{i}/{k}" for i in (1, 3) for k in ("max_mean", "bias_norm", "balance")} | {"moe/max_mean"}
    assert set(out) == keys
    for i, (load, balance) in mine.items():
        assert out[f"moe/{i}/max_mean"] == pytest.approx((load.max() / load.mean()).item())
        assert out[f"moe/{i}/balance"] == pytest.approx(float(balance), rel=1e-6)
        torch.testing.assert_close(layers[i].expert_bias, rate * torch.sign(load.mean() - load))
        assert out[f"moe/{i}/bias_norm"] == pytest.approx(layers[i].expert_bias.norm().item())
    assert out["moe/max_mean"] == max(out["moe/1/max_mean"], out["moe/3/max_mean"])

    # another rank whose tokens all went to expert 0: the bias follows the job's load, not this rank's
    model(idx, idx)
    before = {i: m.expert_bias.clone() for i, m in layers.items()}
    totals = {}

    def sum_all(t):
        other = torch.zeros_like(t)
        other[:, 0] = 1000.0
        t = t + other
        totals.update({i: t[i, :4].clone() for i in layers})
        return t

    out = moe_parallel.after_step(model, sum_all, update=True)
    for i, m in layers.items():
        total = totals[i]
        torch.testing.assert_close(m.expert_bias - before[i], rate * torch.sign(total.mean() - total))
        assert m.expert_bias[0] - before[i][0] == pytest.approx(-rate)
        assert out[f"moe/{i}/max_mean"] == pytest.approx((total.max() / total.mean()).item())
    assert moe_parallel.after_step(model, sum_all, update=False)["moe/1/bias_norm"] == out["moe/1/bias_norm"]


# ------------------------------------------------------------------------------------------ parameters


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"n_shared": 1},
        {"first_dense": 1, "moe_every": 2, "n_layer": 4},
        {"expert_hidden": 24, "n_shared": 2, "top_k": 1},
        {"expert_hidden": 0},  # the dense MLP's width
        {"tie_embeddings": True, "n_kv_head": 1, "qk_norm": True},
        {"bias": True},
        {"bias": True, "n_shared": 1, "expert_hidden": 12, "mlp": "gelu"},
    ],
)
def test_parameter_counts_equal_the_models(extra):
    cfg = tiny(**extra)
    model = MoEGPT(cfg)
    E, k, C, H = cfg.n_experts, cfg.top_k, cfg.n_embd, cfg.expert_width
    assert model.num_params() == flops.param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert model.num_active_params() == flops.active_param_count(cfg)
    idle = (E - k) * 3 * C * H * len(cfg.moe_layers)  # the routed experts a token skips
    assert flops.param_count(cfg) - flops.active_param_count(cfg) == idle > 0


def test_matmul_params_count_the_active_experts_and_the_router():
    cfg = tiny(n_layer=3, first_dense=1, n_shared=1)
    dense = tiny(n_layer=3, n_experts=0)
    C, H, E, k = cfg.n_embd, cfg.expert_width, cfg.n_experts, cfg.top_k
    per_moe = C * E + 3 * C * H * (k + 1) - 3 * C * cfg.ffn_width
    assert flops.matmul_params(cfg) == flops.matmul_params(dense) + 2 * per_moe


# ------------------------------------------------------------------------------------------ config


def moe_args(*args: str) -> list[str]:
    return ["--model.family=moe", "--model.n_layer=2", "--train.batch_size=8", *args]


@pytest.mark.parametrize(
    "args,world,match",
    [
        (
            moe_args("--model.n_experts=4", "--model.moe_top_k=5"),
            1,
            "model.moe_top_k=5 is more than model.n_experts=4",
        ),
        (moe_args("--model.n_experts=0"), 1, "model.family=moe needs model.n_experts >= 1"),
        (
            moe_args("--model.n_experts=6", "--parallel.ep=4", "--parallel.dp_impl=ddp"),
            4,
            "parallel.ep=4 does not divide model.n_experts=6",
        ),
        (
            moe_args("--model.n_experts=8", "--parallel.ep=4", "--parallel.dp_impl=ddp"),
            2,
            "parallel.ep=4 does not divide the data-parallel x cp ranks, 2 x 1",
        ),
        (
            moe_args("--parallel.ep=2", "--parallel.dp_impl=zero1"),
            2,
            "parallel.ep > 1 does not compose with parallel.dp_impl=zero1",
        ),
        (
            moe_args("--parallel.ep=2", "--parallel.dp_impl=mpi"),
            2,
            "parallel.ep > 1 does not compose with parallel.dp_impl=mpi",
        ),
        (
            ["--model.family=llama", "--model.n_experts=4"],
            1,
            "model.n_experts is for model.family=moe; the family is 'llama'",
        ),
        (
            ["--parallel.ep=2", "--parallel.dp_impl=ddp"],
            2,
            "parallel.ep=2 is for a family with expert layers (moe); the family is 'gpt2'",
        ),
        (moe_args("--model.moe_first_dense=2"), 1, "model.moe_first_dense=2 leaves no MoE layer among 2"),
        (
            moe_args("--model.moe_gemm=grouped", "--train.compile=true", "--precision.dtype=fp32"),
            1,
            "model.moe_gemm=grouped with train.compile in fp32: the grouped GEMM compiles in bf16 only",
        ),
        (
            moe_args("--model.moe_score=relu"),
            1,
            "model.moe_score must be one of softmax, sigmoid; got 'relu'",
        ),
        (moe_args("--model.moe_gemm=cutlass"), 1, "model.moe_gemm must be one of auto, grouped, loop"),
        (
            moe_args("--model.moe_aux_loss_coef=0.01", "--parallel.pp=2"),
            2,
            "moe_aux_loss_coef > 0 is not supported with pipeline parallel",
        ),
    ],
)
def test_validate_refuses(args, world, match):
    with pytest.raises(LoomError, match=re.escape(match)):
        validate(load_config(None, args), world=world)


def test_validate_accepts_the_family_and_expert_parallelism():
    cfg = load_config(None, moe_args("--parallel.ep=2", "--parallel.dp_impl=fsdp"))
    assert cfg.model.n_experts == 8 and cfg.model.mlp == "swiglu"  # the preset: Llama's, with 8 experts
    dims = validate(cfg, world=2)[1]
    assert (dims.ep, dims.ep_enabled, dims.dp) == (2, True, 2)
    validate(
        load_config(
            None,
            moe_args("--model.moe_bias_update_rate=0.001", "--parallel.pp=2", "--parallel.pp_microbatches=2"),
        ),
        world=2,
    )  # the bias, unlike the balance loss, works with pipeline stages


# ------------------------------------------------------------------------------------------ training


def test_train_reports_the_load_and_moves_the_bias(tmp_path, char_data):
    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=moe",
        "--model.family=moe",
        "--model.n_layer=2",
        "--model.n_head=2",
        "--model.n_embd=32",
        "--model.block_size=32",
        "--model.n_experts=4",
        "--model.moe_top_k=2",
        "--model.moe_bias_update_rate=0.01",
        "--model.moe_aux_loss_coef=0.01",
        "--train.steps=3",
        "--train.batch_size=4",
        "--train.eval_batches=1",
        "--train.sample_every=0",
        "--train.eval_every=0",
        "--train.ckpt_every=0",
        "--optim.warmup_steps=1",
        "--train.log_every=1",
        "--train.device=cpu",
    ]
    assert main(args) == 0
    recs = [r for r in read_jsonl(tmp_path / "moe" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for key in ("moe/0/max_mean", "moe/1/max_mean", "moe/0/bias_norm", "moe/1/bias_norm", "moe/max_mean"):
            assert math.isfinite(r[key]), (key, r)
        assert r["moe/0/max_mean"] >= 1 and r["moe/max_mean"] == max(r["moe/0/max_mean"], r["moe/1/max_mean"])
        assert math.isfinite(r["moe/0/balance"]) and r["moe/0/balance"] > 0
    # the first step moves every unbalanced expert's bias by 0.01 from 0: the norm is 0.01 x sqrt(#moved)
    for i in (0, 1):
        assert 0 < recs[0][f"moe/{i}/bias_norm"] <= 0.01 * 2 + 1e-6
    # run.json records the total and the active parameters (k of E experts): MFU counts the active ones
    info = json.loads((tmp_path / "moe" / "run.json").read_text())
    assert 0 < info["active_params"] < info["params"]


@CPU_GROUPED
@pytest.mark.parametrize("gemm", ["grouped", "loop"])
def test_experts_compute_in_the_autocast_dtype(gemm):
    """Under autocast the experts' GEMMs run in its dtype (as nn.Linear's would; autocast does not cover
    torch._grouped_mm), so a CUDA bf16 run takes the grouped kernel, and both GEMMs give the same numbers."""
    m = moe_layer(gemm=gemm).train()
    x = hidden()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = []
        hook = m.experts.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
        y = m(x)
        hook.remove()
    assert seen == [torch.bfloat16] and y.dtype == x.dtype
    ref = moe_layer(gemm="loop").train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(y, ref(x), rtol=0, atol=0)


def test_bench_moe_gemm_refuses_a_dense_model_and_unknown_gemms(capsys):
    base = ["bench", "train", "--synthetic", "--model.vocab_size=64"]
    assert main([*base, "--moe-gemm", "grouped,loop"]) == 2
    assert main([*base, "--model.family=moe", "--moe-gemm", "grouped,cutlass"]) == 2
    assert main([*base, "--model.family=moe", "--moe-gemm", "loop", "--fp8", "off"]) == 2
    err = capsys.readouterr().err
    assert "compares a mixture of experts' GEMMs" in err and "--moe-gemm: unknown mode(s) cutlass" in err
    assert "give one" in err


def test_experts_compile_in_fp32():
    """Under torch.compile the grouped GEMM's meta function takes bf16 only: in fp32 auto takes the loop
    there (a compiled MoE run on a CPU stopped with 'Expected inputs of BF16 type'), the same numbers."""
    from loom.model.moe.moe import grouped_mm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(12, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    counts = torch.tensor([5, 0, 7])
    compiled = torch.compile(lambda x, w, c: grouped_mm(x, w, c), backend="eager")
    torch.testing.assert_close(compiled(x, w, counts), grouped_mm(x, w, counts, "loop"))

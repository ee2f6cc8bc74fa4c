"""LoRA adapters (loom.model.lora) on tiny GPT-2 and Llama-family GPTs, compared against the base model itself:
at init (B = 0) the logits are the base model's bit for bit; training moves only the adapters (every base
tensor bit-identical); a merged model gives the unmerged one's logits (fp32, 1e-6) under the base model's
state-dict keys; a meta-device build initialised per name gives the eager build's values. Also target matching,
counts, adapter-only state and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from loom.errors import LoomError
from loom.model.gpt.gpt import GPT, GPTConfig, LMHead
from loom.model.lora import (
    LoRALinear,
    apply_lora,
    count_trainable,
    init_lora_param,
    is_lora_name,
    lora_scaling,
    lora_state_dict,
    merge_lora,
    merge_lora_state,
    trainable_summary,
)

LLAMA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def linear_names(model: nn.Module) -> list[str]:
    """The qualified names of the model's linears (adapted or not)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def load_lora_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors (lora_state_dict's) into a model with the same adapters; every adapter must be
    given and nothing else."""
    have = set(lora_state_dict(model))
    missing, extra = sorted(have - set(sd)), sorted(set(sd) - have)
    if missing or extra:
        raise LoomError(
            f"the adapters do not fit the model: missing {missing[:4]}, unexpected {extra[:4]}",
            hint="apply_lora with the rank and targets the adapters were trained with",
        )
    model.load_state_dict(sd, strict=False)


def gpt2_cfg() -> GPTConfig:
    return GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16)


def llama_cfg() -> GPTConfig:
    return GPTConfig(
        vocab_size=60,  # padded to 64: the head masks 4 padding ids
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=16,
        norm="rmsnorm",
        mlp="swiglu",
        pos="rope",
        n_kv_head=2,
        tie_embeddings=False,
    )


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batch(cfg: GPTConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
    return x, torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)


def train(model: GPT, cfg: GPTConfig, steps: int = 3) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    x, y = batch(cfg)
    for _ in range(steps):
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("make_cfg", [gpt2_cfg, llama_cfg], ids=["gpt2", "llama"])
def test_starts_as_the_base_model_exactly(make_cfg):
    cfg = make_cfg()
    base = build(cfg)
    model = copy.deepcopy(base)
    apply_lora(model, rank=4, alpha=8.0, targets="all-linear", seed=3)
    x, _ = batch(cfg)
    assert torch.equal(model(x), base(x))
    assert model.blocks[0].attn.q_proj.lora_A.abs().sum() > 0  # A random, B zero
    assert model.blocks[0].attn.q_proj.lora_B.abs().sum() == 0


@pytest.mark.parametrize("make_cfg", [gpt2_cfg, llama_cfg], ids=["gpt2", "llama"])
def test_training_moves_only_the_adapters(make_cfg):
    cfg = make_cfg()
    model = build(cfg)
    targets = LLAMA_TARGETS if cfg.mlp == "swiglu" else "q_proj,v_proj"
    names = apply_lora(model, rank=4, alpha=8.0, targets=targets, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, cfg)
    for k, v in model.state_dict().items():
        if is_lora_name(k):
            assert not torch.equal(v, before[k]), k
        else:
            assert torch.equal(v, before[k]), k  # bit-identical: embeddings, norms and head frozen too
    for n, p in model.named_parameters():
        assert p.requires_grad == is_lora_name(n), n
        assert (p.grad is None) or is_lora_name(n), n
    assert len(names) == (7 if cfg.mlp == "swiglu" else 2) * cfg.n_layer


@pytest.mark.parametrize("make_cfg", [gpt2_cfg, llama_cfg], ids=["gpt2", "llama"])
def test_merged_model_equals_the_adapted_one_under_base_names(make_cfg):
    cfg = make_cfg()
    base_keys = list(build(cfg).state_dict())
    model = build(cfg)
    apply_lora(model, rank=4, alpha=16.0, targets="all-linear", seed=3)
    train(model, cfg)
    x, _ = batch(cfg, seed=5)
    with torch.no_grad():
        adapted = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    scaling = lora_scaling(model)
    assert scaling == 16.0 / 4
    merged_names = merge_lora(model)
    assert len(merged_names) == len(linear_names(model)) - 1  # every linear but the head
    with torch.no_grad():
        merged = model(x)
    assert (merged - adapted).abs().max() <= 1e-6
    assert list(model.state_dict()) == base_keys
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert type(model.blocks[0].attn.q_proj) is nn.Linear and type(model.lm_head) is LMHead
    # the same fold on a state dict alone (an export from a checkpoint)
    folded = merge_lora_state(state, scaling)
    assert list(folded) == base_keys
    for k, v in model.state_dict().items():
        assert torch.equal(folded[k], v), k


def test_an_unmatched_target_lists_the_linears():
    model = build(gpt2_cfg())
    with pytest.raises(LoomError, match="'qkv' matches no linear") as e:
        apply_lora(model, rank=4, alpha=8.0, targets="q_proj,qkv")
    assert "blocks.*.attn.q_proj" in e.value.hint and "blocks.*.mlp.down_proj" in e.value.hint
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing changed
    assert all(p.requires_grad for p in model.parameters())


def test_counts_and_adapter_only_state(capsys):
    cfg = llama_cfg()
    model = build(cfg)
    _, total_base = count_trainable(model)
    rank = 4
    names = apply_lora(model, rank=rank, alpha=8.0, targets=LLAMA_TARGETS, seed=0)
    C, H, K, F = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_width
    per_layer = rank * ((C + H) + 2 * (C + K) + (H + C) + 2 * (C + F) + (F + C))  # q, k+v, o, gate+up, down
    expected = per_layer * cfg.n_layer
    trainable, total = count_trainable(model)
    print(trainable_summary(model))
    assert (trainable, total) == (expected, total_base + expected)
    assert f"trainable {expected:,} of {total_base + expected:,}" in capsys.readouterr().out
    sd = lora_state_dict(model)
    assert len(sd) == 2 * len(names) and all(is_lora_name(k) for k in sd)
    assert sum(v.numel() for v in sd.values()) == expected
    # adapter-only round trip into a fresh model with the same adapters
    train(model, cfg, steps=1)
    other = build(cfg)
    apply_lora(other, rank=rank, alpha=8.0, targets=LLAMA_TARGETS, seed=1)
    load_lora_state_dict(other, lora_state_dict(model))
    x, _ = batch(cfg)
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    with pytest.raises(LoomError, match="do not fit"):
        load_lora_state_dict(other, {k: v for k, v in sd.items() if "mlp" not in k})


def test_flops_per_token_count_a_trained_head_at_six():
    """MFU's FLOPs under LoRA: 6 a parameter for the adapters and for a head that trains
    (finetune.lora_embeddings: auto trains it when the data added tokens), 4 for every frozen matrix."""
    from loom.config import load_config
    from loom.model.flops import flops_per_token, matmul_params
    from loom.model.registry import spec_of
    from loom.train.finetune import lora_flops_per_token

    flags = ["--model.family=llama", "--model.n_layer=2", "--model.n_head=4", "--model.n_embd=32"]
    cfg = load_config(None, [*flags, "--finetune.lora_rank=4", "--finetune.lora_targets=all-linear"])
    plain, chat = {"vocab_size": 60}, {"vocab_size": 60, "chat": {"base_vocab_size": 54}}
    model = spec_of(cfg).build_model(cfg, 60)  # meta
    mcfg = model.cfg
    apply_lora(model, rank=4, alpha=8.0, targets="all-linear")
    adapters = sum(v.numel() for v in lora_state_dict(model).values())
    full = flops_per_token(mcfg)
    attention = full - 6 * matmul_params(mcfg)  # what no parameter counts
    head = mcfg.padded_vocab * mcfg.n_embd
    assert lora_flops_per_token(cfg, plain, mcfg, full) == attention + 4 * matmul_params(mcfg) + 6 * adapters
    assert lora_flops_per_token(cfg, chat, mcfg, full) == (
        attention + 4 * (matmul_params(mcfg) - head) + 6 * (adapters + head)
    )


def test_target_forms():
    cfg = llama_cfg()
    names = lambda t: apply_lora(build(cfg), 2, 2.0, t, seed=0)  # noqa: E731
    attn = [f"blocks.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mlp = [f"blocks.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    assert names("attn") == attn
    assert names("mlp") == mlp
    assert names(["attn", "mlp"]) == names("all-linear") == names(LLAMA_TARGETS)
    assert names("blocks.*.attn.q_proj") == ["blocks.0.attn.q_proj", "blocks.1.attn.q_proj"]
    assert names("blocks.1.attn.q_proj, mlp.up_proj") == [
        "blocks.0.mlp.up_proj",
        "blocks.1.attn.q_proj",
        "blocks.1.mlp.up_proj",
    ]
    assert "lm_head" not in names("*")  # wildcards and shorthands leave the head alone
    assert names("lm_head") == ["lm_head"]


def test_untied_head_adapted_when_named_keeps_its_padding_mask():
    cfg = llama_cfg()
    model = build(cfg)
    apply_lora(model, 2, 4.0, "q_proj,lm_head", seed=0)
    assert isinstance(model.lm_head, LMHead) and isinstance(model.lm_head, LoRALinear)
    train(model, cfg, steps=2)
    x, _ = batch(cfg)
    with torch.no_grad():
        logits = model(x)
    assert (logits[..., cfg.vocab_size :] == torch.finfo(logits.dtype).min).all()
    merge_lora(model)
    assert type(model.lm_head) is LMHead and lora_scaling(model) is None


def test_a_tied_head_is_refused():
    with pytest.raises(LoomError, match="shared with another module"):
        apply_lora(build(gpt2_cfg()), 2, 4.0, "lm_head")


def test_a_moe_router_is_never_adapted_and_every_adapter_trains():
    """Routing reads the router's weight in fp32, not through its forward: adapters there would get no
    gradient (one process: silently dead; DDP: stops). all-linear and mlp skip it, naming it is refused."""
    from loom.model.moe.moe import MoEConfig, MoEGPT

    cfg = MoEConfig(
        vocab_size=64,
        n_layer=2,
        n_head=2,
        n_embd=16,
        block_size=16,
        pos="rope",
        norm="rmsnorm",
        mlp="swiglu",
        tie_embeddings=False,
        n_experts=4,
        top_k=2,
        expert_hidden=8,
        n_shared=1,
        gemm="loop",
    )
    torch.manual_seed(0)
    model = MoEGPT(cfg)
    names = apply_lora(model, rank=2, alpha=4.0, targets="all-linear", seed=0)
    assert names and not any(n.endswith(".router") for n in names)
    x, y = batch(cfg)
    model(x, y).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if is_lora_name(n))
    for target in ("router", "mlp.router", "blocks.*.mlp.router"):
        with pytest.raises(LoomError, match="is a MoE router"):
            apply_lora(MoEGPT(cfg), 2, 4.0, target)
    assert not any(n.endswith(".router") for n in apply_lora(MoEGPT(cfg), 2, 4.0, "mlp"))


def test_meta_build_initialises_as_the_eager_one():
    """The hook GPT.init_param is to get: names ending in lora_A / lora_B go to init_lora_param."""
    from loom.parallel.init import materialize

    cfg, seed = llama_cfg(), 1234
    eager = build(cfg)
    eager.reset_parameters(seed)
    apply_lora(eager, 4, 8.0, "all-linear", seed=seed)
    with torch.device("meta"):
        meta = GPT(cfg)
    apply_lora(meta, 4, 8.0, "all-linear")
    assert meta.blocks[0].attn.q_proj.lora_A.is_meta

    def init(name: str, whole: torch.Tensor) -> None:
        if is_lora_name(name):
            init_lora_param(name, whole, seed)
        else:
            meta.init_param(name, whole, seed)

    materialize(meta, torch.device("cpu"), init, {})
    sd = meta.state_dict()
    assert list(sd) == list(eager.state_dict())
    for k, v in eager.state_dict().items():
        assert torch.equal(sd[k], v), k
    for n, p in meta.named_parameters():
        assert p.requires_grad == is_lora_name(n), n  # to_empty keeps the frozen flags


def test_kaiming_uniform_bound_and_dropout():
    a = torch.empty(8, 400)
    init_lora_param("x.lora_A", a, 0)
    bound = 1 / 400**0.5  # kaiming_uniform_(a=sqrt(5)): nn.Linear's default
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    cfg = gpt2_cfg()
    model = build(cfg)
    apply_lora(model, 2, 4.0, "all-linear", dropout=0.5, seed=0)
    train(model, cfg, steps=1)  # B non-zero, so dropout on the adapters' input shows
    x, _ = batch(cfg)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model(x))
        model.train()
        assert not torch.equal(model(x), model(x))


def test_bad_arguments():
    with pytest.raises(LoomError, match="rank must be >= 1"):
        apply_lora(build(gpt2_cfg()), 0, 1.0, "q_proj")
    with pytest.raises(LoomError, match="no LoRA targets"):
        apply_lora(build(gpt2_cfg()), 2, 1.0, " , ")
    model = build(gpt2_cfg())
    apply_lora(model, 2, 1.0, "q_proj")
    with pytest.raises(LoomError, match="already has LoRA"):
        apply_lora(model, 2, 1.0, "q_proj")


def test_a_rank_above_the_smallest_adapted_width_is_refused():
    """Issue 42 item 1: rank 100,000 on a 32-wide model was accepted (25.6M trainable parameters for a 47k
    model). A rank up to min(in, out) of every adapted linear is taken; above it, refused naming the linear
    (before training: a run trained before the rule still loads)."""
    from loom.model.lora import check_rank

    cfg = llama_cfg()  # k_proj: 32 in, 2 kv heads x 8 = 16 out
    model = build(cfg)
    apply_lora(model, 16, 1.0, "k_proj")
    check_rank(model)
    model = build(cfg)
    apply_lora(model, 17, 1.0, "q_proj,k_proj")
    with pytest.raises(
        LoomError, match=r"lora_rank=17 is above 16.*blocks\.0\.attn\.k_proj: 32 in, 16 out"
    ) as e:
        check_rank(model)
    assert "at most 16" in e.value.hint


def test_train_refuses_a_huge_rank_before_anything_is_written(char_data, tmp_path, capsys):
    from loom.cli import main

    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=r",
        "--model.n_layer=1",
        "--model.n_head=2",
        "--model.n_embd=32",
        "--model.block_size=16",
        "--train.device=cpu",
        "--finetune.lora_rank=100000",
    ]
    assert main(args) == 2
    assert "finetune.lora_rank=100000 is above 32" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()

"""LoRA under data and tensor parallelism with real processes (gloo), against one process on the whole batch.

A Llama-family model (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head with padding ids) is built
on the meta device, given adapters on every linear but the head (every base parameter frozen), and laid out by
loom.parallel.parallelize: DDP, FSDP2 (fully_shard per block, then the root: frozen base weights and trainable
adapters in one FSDP group) and tensor parallel with the adapters placed as Megatron's (loom.parallel.lora: A replicated and B split for a
column-parallel linear, A split and B replicated for a row-parallel one). Each takes 3 SGD
steps (data parallel: each rank half the batch) and ends with one process's adapters (1e-6) and its base
weights bit for bit; the materialized initial state is one process's exactly. FSDP also on a GPT-2 (biases,
the head tied to the embedding, both frozen in the root's FSDP group)."""

from __future__ import annotations

import torch
from gloo_ranks import spawn_gloo

ARGS = [
    "--model.n_layer=2",
    "--model.n_head=4",
    "--model.n_embd=32",
    "--model.block_size=16",
    "--train.device=cpu",
]
MODELS = {
    "llama": [
        "--model.n_kv_head=2",
        "--model.pos=rope",
        "--model.norm=rmsnorm",
        "--model.mlp=swiglu",
        "--model.tie_embeddings=false",
    ],
    "gpt2": ["--model.bias=true"],  # the head tied to the embedding: both frozen in FSDP's root group
}
LAYOUTS = {
    "none": ["--parallel.dp_impl=none"],
    "ddp": ["--parallel.dp_impl=ddp"],
    "fsdp": ["--parallel.dp_impl=fsdp"],
    "tp": ["--parallel.tp=2", "--parallel.dp_impl=none"],
}
VOCAB, SEED, STEPS, LR = 60, 11, 3, 2.0  # lr: every adapter moves (A's by 1.5e-6 to 0.1)


def _batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (4, 16), generator=g)
    return x, torch.randint(0, VOCAB, (4, 16), generator=g)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _run(layout: str, world: int, rank: int, family: str = "llama") -> dict:
    """{'init': state, 'end': state, 'placements': {name: str}} of one layout after STEPS steps."""
    from loom.config import load_config, validate
    from loom.model.lora import apply_lora, is_lora_name
    from loom.model.registry import spec_of
    from loom.parallel import parallelize

    cfg = load_config(None, [*ARGS, *MODELS[family], *LAYOUTS[layout]])
    dims = validate(cfg, world, rank)[1]
    spec = spec_of(cfg)
    model = spec.build_model(cfg, VOCAB)  # on the meta device
    apply_lora(model, rank=4, alpha=8.0, targets="all-linear")
    par = parallelize(
        model,
        dims,
        cfg,
        torch.device("cpu"),
        spec,
        init=lambda name, whole: model.init_param(name, whole, SEED),
    )
    m = par.model
    init_state = {n: _whole(v) for n, v in m.state_dict().items()}
    # SGD: AdamW's first steps are sign-like (m / sqrt(v) = g / |g|), so float rounding in an adapter's tiny
    # gradient (A's is 0 at the first step, B being 0) moves it by up to lr: 3e-6 of 1e-2 here
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR, momentum=0.9, foreach=False)
    x, y = _batch()
    if dims.dp > 1:  # data parallel: this rank's half of the batch (equal token counts: the mean of means)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    for _ in range(STEPS):
        with par.loss_context():
            loss = par.forward(x, y)
            loss.backward()
        par.sync_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
    end = {n: _whole(v) for n, v in m.state_dict().items()}
    placements = {
        n: str(p.placements) for n, p in m.named_parameters() if is_lora_name(n) and hasattr(p, "placements")
    }
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    return {"init": init_state, "end": end, "placements": placements, "frozen": frozen}


def _worker(rank: int, world: int, out: str) -> None:
    results = {
        "ddp": _run("ddp", world, rank),
        "fsdp": _run("fsdp", world, rank),
        "tp": _run("tp", world, rank),
        "fsdp-gpt2": _run("fsdp", world, rank, family="gpt2"),
    }
    if rank == 0:
        torch.save(results, out)


def test_lora_ddp_fsdp_tp_equal_one_process(tmp_path):
    out = tmp_path / "out.pt"
    spawn_gloo(_worker, 2, tmp_path, str(out))
    got = torch.load(out)
    refs = {family: _run("none", 1, 0, family) for family in MODELS}
    from loom.model.lora import is_lora_name

    for layout, res in got.items():
        ref = refs["gpt2" if layout.endswith("gpt2") else "llama"]
        assert any(is_lora_name(n) for n in ref["end"]) and ref["frozen"]
        assert list(res["end"]) == list(ref["end"]), layout  # the single-device names in every layout
        assert res["frozen"] == ref["frozen"], layout
        for n, v in ref["init"].items():
            assert torch.equal(res["init"][n], v), (layout, n)  # materialized as one process
        for n, v in ref["end"].items():
            if is_lora_name(n):
                assert not torch.equal(v, ref["init"][n]), n  # A moves too (from its second step)
                torch.testing.assert_close(res["end"][n], v, rtol=0, atol=1e-6, msg=f"{layout} {n}")
            else:
                assert torch.equal(res["end"][n], ref["init"][n]), (layout, n)  # frozen: untouched
    assert set(got["fsdp"]["placements"].values()) == {"(Shard(dim=0),)"}  # the adapters sharded by FSDP too
    col, row = "blocks.0.attn.q_proj", "blocks.0.attn.o_proj"
    meg = got["tp"]["placements"]  # Megatron's placements (loom.parallel.lora)
    assert meg[f"{col}.lora_A"] == "(Replicate(),)" and meg[f"{col}.lora_B"] == "(Shard(dim=0),)"
    assert meg[f"{row}.lora_A"] == "(Shard(dim=1),)" and meg[f"{row}.lora_B"] == "(Replicate(),)"

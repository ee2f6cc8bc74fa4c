"""model.mtp_depth: the training loss equals DeepSeek-V3's L_main + lambda / D * sum_k L^k written out here
step by step from the model's own weights; evaluation and generation see the main model only; `mtp_logits`
predicts k + 1 ahead; `loom verify` passes ddp and fsdp with it; pipeline parallel and a family without MTP
modules are refused before any work. The FLOPs per token count the modules (against torch's FLOP counter), and
with data.doc_mask the modules' attention keeps to each position's document (a later document's MTP states
equal those of the same document run alone)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loomrun import TINY, verify_records

from loom.cli import main
from loom.model.flops import flops_per_token, matmul_params, param_count
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.model.mtp import mtp_hidden


def _model(depth: int = 2, weight: float = 0.3, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=32, block_size=16, mtp_depth=depth, **kw)
    cfg.mtp_weight = weight
    return GPT(cfg)


def _reference(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """L_main + lambda / D * sum_k CE(head(TRM_k(M_k [rms(h^{k-1}); rms(Emb(t_{i+k}))])), t_{i+k+1})."""
    T, C = x.size(1), model.cfg.n_embd
    h = model.wte(x) + model.wpe(torch.arange(T))
    for block in model.blocks:
        h = block(h)

    def ce(hidden, targets):
        logits = model.lm_head(model.ln_f(hidden))[..., : model.cfg.vocab_size]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    main_loss, extra = ce(h, y), []
    for k, mod in enumerate(model.mtp, start=1):
        h_prev = h[:, : T - k]  # h^{k-1} at positions 0 .. T-1-k
        emb = model.wte(x[:, k:])  # Emb(t_{i+k})
        a = F.rms_norm(h_prev, (C,), mod.norm_h.weight, mod.norm_h.eps)
        b = F.rms_norm(emb, (C,), mod.norm_e.weight, mod.norm_e.eps)
        h = mod.block(torch.cat([a, b], dim=-1) @ mod.proj.weight.T)
        extra.append(ce(h, y[:, k:]))  # t_{i+k+1} = y_{i+k}
    return main_loss + model.cfg.mtp_weight / len(model.mtp) * sum(extra)


def test_mtp_loss_equals_the_reference():
    model = _model(depth=2, weight=0.3)
    for mod in model.mtp:  # gains away from 1, so the norms' weights count in the comparison
        mod.norm_h.weight.data.uniform_(0.5, 1.5)
        mod.norm_e.weight.data.uniform_(0.5, 1.5)
    x = torch.randint(0, 50, (3, 16))
    y = torch.randint(0, 50, (3, 16))
    model.train()
    torch.testing.assert_close(model(x, y), _reference(model, x, y), rtol=1e-5, atol=1e-6)
    model.eval()  # evaluation: the main model's loss alone
    plain = F.cross_entropy(model(x)[..., :50].reshape(-1, 50), y.reshape(-1))
    torch.testing.assert_close(model(x, y), plain, rtol=1e-5, atol=1e-6)
    logits = model.mtp_logits(x)
    assert [tuple(t.shape) for t in logits] == [(3, 15, 64), (3, 14, 64)]  # padded vocabulary: 64


def test_mtp_weight_zero_and_no_mtp_are_the_main_loss():
    x, y = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    with_mtp, without = _model(depth=1, weight=0.0), _model(depth=0)
    with_mtp.reset_parameters(7)  # each weight seeded by its name: the shared ones equal
    without.reset_parameters(7)
    with_mtp.train()
    without.train()
    assert without.mtp is None and without.mtp_logits(x) == []
    torch.testing.assert_close(with_mtp(x, y), without(x, y))  # same seeded weights by name


def test_verify_ddp_and_fsdp_with_mtp(tmp_path, char_data):
    verify_records(tmp_path, char_data, "ddp,fsdp", "--model.mtp_depth=2", steps=4)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model.mtp_depth=1", "--parallel.pp=2", "--nproc=2"], "runs on the data-parallel layouts"),
        (["--model.family=moe", "--model.mtp_depth=1"], "has no multi-token prediction modules"),
    ],
)
def test_mtp_refused_before_any_work(tmp_path, char_data, capsys, args, message):
    argv = ["train", f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=x", *TINY, *args]
    assert main(argv) != 0 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _training_flops(model: GPT, x: torch.Tensor, y: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    with FlopCounterMode(display=False) as counter:
        model(x, y).backward()
    return counter.get_total_flops()


def test_mtp_flops_per_token_count_the_modules():
    """Each module adds its projection, its block and the head (6 per weight per token) and one block's
    attention; torch's FLOP counter on a training step agrees on the matrices."""
    kw = {"vocab_size": 50, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64}
    plain, mtp = GPTConfig(**kw), GPTConfig(**kw, mtp_depth=2)
    C, T = 32, 64
    block = 4 * C * C + 2 * C * 4 * C  # q, k, v, o and the 4C MLP
    per_module = 6 * (2 * C * C + block + 64 * C) + 12 * C * T  # padded vocabulary 64
    assert flops_per_token(mtp) - flops_per_token(plain) == 2 * per_module
    assert matmul_params(mtp) - matmul_params(plain) == 2 * (2 * C * C + block + 64 * C)
    torch.manual_seed(0)
    assert param_count(mtp) == GPT(mtp).num_params()
    x, y = torch.randint(0, 50, (2, T)), torch.randint(0, 50, (2, T))
    torch.manual_seed(0)
    measured = (_training_flops(GPT(mtp), x, y) - _training_flops(GPT(plain), x, y)) / x.numel()
    # the counter sees module k's matrices on T - k of the T positions (the formula counts all T, as it counts
    # attention as if not causal), and counts no attention kernel on a CPU
    matrices = 6 * (2 * C * C + block + 64 * C)
    assert measured == sum(matrices * (T - k) / T for k in (1, 2))


def _mtp_states(model: GPT, x: torch.Tensor) -> list[torch.Tensor]:
    doc = model.documents(x)
    h = model.wte(x)
    for i, block in enumerate(model.blocks):
        h = block(h, None, i, doc=doc)
    return mtp_hidden(model.mtp, model.wte, h, x, doc)


@pytest.mark.parametrize("positions", ["continue", "restart"])
def test_mtp_attention_keeps_to_documents(positions):
    """data.doc_mask: MTP module k's position i belongs to token i's document. With restarting RoPE positions
    the states of a window's second document equal those of that document run alone; with continuing ones,
    changing the first document's tokens leaves them alone. Before, the modules' blocks attended across."""
    model = _model(depth=2, pos="rope", doc_mask=True, eot_id=0, doc_positions=positions).eval()
    T, s = 16, 6  # the second document opens at position s
    x = torch.randint(1, 50, (2, T))
    x[:, s] = 0
    states = _mtp_states(model, x)
    if positions == "restart":
        alone = _mtp_states(model, x[:, s:])
        for k, (h, a) in enumerate(zip(states, alone, strict=True), start=1):
            assert a.shape[1] == T - s - k
            torch.testing.assert_close(h[:, s:], a, rtol=1e-5, atol=1e-6)
    else:
        other = x.clone()
        other[:, :s] = torch.randint(1, 50, (2, s))
        for h, o in zip(states, _mtp_states(model, other), strict=True):
            torch.testing.assert_close(h[:, s:], o[:, s:], rtol=1e-5, atol=1e-6)
            assert not torch.allclose(h[:, :s], o[:, :s])
    model.train()  # the training loss runs the same path
    assert torch.isfinite(model(x, torch.randint(0, 50, (2, T))))

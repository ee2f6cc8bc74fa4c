"""data.doc_mask: attention within each document of a packed window (issue 30).

Compared against: each document run alone through the same model (the per-token losses of a window packing
documents A, B and C equal those of A, B and C run one by one, to 1e-6 in fp32), and the plain causal model
(a window holding one document is unchanged by the mask; a window of several is changed without it, so the
comparison can fail). FlexAttention's block mask (the GPU path; forward only on a CPU) is checked against the
dense mask the CPU trains with, and the compiled flex_attention a GPU runs against the eager one, on a CPU where
both run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loom.config import Config, load_config, validate
from loom.data.shards import write_shard
from loom.errors import LoomError
from loom.model.doc_mask import (
    DocMask,
    build_doc_mask,
    create_block_mask_fn,
    dense_doc_mask,
    doc_attention,
    flex_attention_fn,
)
from loom.model.gpt.gpt import GPT, GPTConfig

EOT = 0
VOCAB = 50


def documents(lengths=(7, 11, 6), seed=0) -> list[torch.Tensor]:
    """Documents as loom's data holds them: the end-of-text id first, then the text's ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.tensor([EOT]), torch.randint(1, VOCAB, (n - 1,), generator=g)]) for n in lengths]


def model(doc_mask: bool, pos: str = "learned", restart: bool = True, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=32,
        pos=pos,
        doc_mask=doc_mask,
        eot_id=EOT,
        doc_positions="restart" if restart else "continue",
        **kw,
    )
    return GPT(cfg).eval()


def token_losses(m: GPT, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = m(ids[None])[0]
    return F.cross_entropy(logits.float(), targets, reduction="none")


def packed_and_alone(m: GPT, docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses of the packed window and of each document alone (same targets: the next token of
    the stream, the last one's the next document's end-of-text)."""
    stream = torch.cat([*docs, torch.tensor([EOT])])
    window, targets = stream[:-1], stream[1:]
    alone, at = [], 0
    for d in docs:
        alone.append(token_losses(m, d, targets[at : at + len(d)]))
        at += len(d)
    return token_losses(m, window, targets), torch.cat(alone)


@pytest.mark.parametrize(
    "pos,kw",
    [
        ("learned", {}),
        ("rope", {"norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2, "tie_embeddings": False}),
    ],
)
def test_packed_window_equals_documents_alone(pos, kw):
    docs = documents()
    packed, alone = packed_and_alone(model(True, pos, **kw), docs)
    assert (packed - alone).abs().max() <= 1e-6
    plain_packed, plain_alone = packed_and_alone(model(False, pos, **kw), docs)
    # without the mask B and C see A: the comparison can fail
    assert (plain_packed - plain_alone).abs().max() > 1e-3
    # positions running on: the mask stops the attention, but B and C sit at later positions, which changes
    # learned positions; RoPE's scores depend only on the distance between tokens (up to rounding)
    cont_packed, cont_alone = packed_and_alone(model(True, pos, restart=False, **kw), docs)
    assert (cont_packed - cont_alone)[: len(docs[0])].abs().max() <= 1e-6
    if pos == "learned":
        assert (cont_packed - cont_alone).abs().max() > 1e-3
    else:
        assert (cont_packed - cont_alone).abs().max() <= 1e-5


def test_one_document_is_the_plain_causal_model():
    """A window that is one document (no end-of-text after its first token) is what the plain model computes,
    and training through the dense-mask path gives the plain model's gradients."""
    ids = documents((20,))[0][None]
    masked, plain = model(True).train(), model(False).train()
    targets = torch.roll(ids, -1, 1)
    lm, lp = masked(ids, targets), plain(ids, targets)
    assert (lm - lp).abs() <= 1e-6
    lm.backward()
    lp.backward()
    for (name, a), b in zip(masked.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_positions_and_documents():
    ids = torch.tensor([[5, 6, EOT, 7, 8, 9, EOT, 3], [EOT, 1, 2, 3, 4, EOT, EOT, 1]])
    m = build_doc_mask(ids, EOT, restart=True)
    assert m.doc.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 2, 3, 3]]
    assert m.positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 0, 0, 1]]
    assert build_doc_mask(ids, EOT, restart=False).positions is None
    dense = dense_doc_mask(m.doc)
    assert dense.shape == (2, 1, 8, 8) and dense[0, 0, 3].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_equals_the_dense_mask():
    """The GPU path (flex_attention with the block mask) against the CPU one, forward (flex has no CPU
    backward in torch 2.13)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4, (2, 40), generator=g)  # id 0 is frequent: many short documents
    q, k, v = (torch.randn(2, 4, 40, 8, generator=g) for _ in range(3))
    flex = build_doc_mask(ids, EOT, restart=False, flex=True)
    assert flex.block_mask is not None
    dense = DocMask(flex.doc, None)
    with torch.no_grad():
        assert (doc_attention(q, k, v, flex, 0.0) - doc_attention(q, k, v, dense, 0.0)).abs().max() < 1e-5


@pytest.mark.slow
def test_compiled_flex_equals_eager_flex():
    """The compiled flex_attention and create_block_mask (what a GPU runs: eager FlexAttention would build the
    whole T x T score matrix there) give the eager ones' numbers, and the dense mask's, on a CPU where both run
    forward (about a minute of C++ compilation)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 4, (2, 200), generator=g)  # two 128-token blocks, the second one partial
    q, k, v = (torch.randn(2, 4, 200, 8, generator=g) for _ in range(3))
    mask = build_doc_mask(ids, EOT, restart=False, flex=True)
    assert flex_attention_fn(compiled=True) is flex_attention_fn(compiled=True)  # one compiled function
    doc = mask.doc

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    compiled_mask = create_block_mask_fn(compiled=True)(same_doc_causal, 2, None, 200, 200, device="cpu")
    assert torch.equal(compiled_mask.to_dense(), mask.block_mask.to_dense())  # the GPU's block mask too
    with torch.no_grad():
        compiled = flex_attention_fn(compiled=True)(q, k, v, block_mask=mask.block_mask)
        eager = flex_attention_fn(compiled=False)(q, k, v, block_mask=mask.block_mask)
        dense = doc_attention(q, k, v, DocMask(mask.doc, None), 0.0)
    assert (compiled - eager).abs().max() < 1e-5
    assert (compiled - dense).abs().max() < 1e-5


def test_config_rules():
    cfg = load_config(None, ["--data.doc_positions=restart"])
    with pytest.raises(LoomError, match="data.doc_positions=restart needs data.doc_mask=true"):
        validate(cfg)
    cfg = load_config(None, ["--data.doc_mask=true", "--parallel.pp=2", "--model.n_layer=2"])
    with pytest.raises(LoomError, match="data.doc_mask=true is not supported with parallel.pp=2"):
        validate(cfg, world=2)
    with pytest.raises(LoomError, match="must be one of continue, restart"):
        load_config(None, ["--data.doc_positions=reset"])


def _data(tmp_path, tokenizer):
    tmp_path.mkdir()
    ids = torch.cat(documents((30,) * 20)).numpy().astype(np.uint16)
    for split in ("train", "val"):
        write_shard(tmp_path / f"{split}_000000.bin", ids, 1)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "tokenizer": tokenizer}))
    return tmp_path


def _trainer(data_dir, run_dir):
    from loom.train.trainer import Trainer

    cfg = Config()
    m, t = cfg.model, cfg.train
    m.n_layer, m.n_head, m.n_embd, m.block_size = 1, 2, 16, 16
    t.batch_size, t.eval_batches, t.device = 4, 1, "cpu"
    cfg.data.doc_mask, cfg.data.doc_positions = True, "restart"
    return Trainer(cfg, validate(cfg)[0], run_dir, data_dir, torch.device("cpu"))


def test_data_without_eot_is_refused_before_the_model(tmp_path, monkeypatch):
    from loom.model import registry

    def no_model(*a, **k):
        raise AssertionError("the model was built before the data was checked")

    with monkeypatch.context() as mp:
        mp.setattr(registry.ModelSpec, "build_model", no_model)
        with pytest.raises(LoomError, match="data.doc_mask=true needs the end-of-text id") as e:
            _trainer(_data(tmp_path / "d", None), tmp_path / "run")
    assert "data.doc_mask=false" in e.value.hint
    trainer = _trainer(
        _data(tmp_path / "ok", {"kind": "char", "chars": list("abcdefghij"), "eot_id": EOT}),
        tmp_path / "run2",
    )
    assert trainer.model.cfg.doc_mask and trainer.model.cfg.eot_id == EOT
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    assert all(np.isfinite(losses))

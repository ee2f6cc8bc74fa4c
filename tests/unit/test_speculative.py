"""Speculative decoding in loom.engine against the same engine decoding token by token: greedy answers are the
same tokens (learned positions and RoPE, a running batch, stop tokens inside accepted drafts, log-probabilities
within float rounding) with prompt lookup and with a draft model; a draft that is the model itself is always
accepted; sampled rows beside speculating ones draw what they draw without speculation."""

import pytest
import torch
from test_engine import model, prompts

from loom.engine import Engine, Request, SamplingParams
from loom.engine.speculative import DraftProposer, NgramProposer, lookup


def repetitive(n: int) -> list[list[int]]:
    """Prompts that repeat themselves (prompt lookup finds something to draft), and plain ones."""
    return [(p * 4)[:50] for p in prompts(n, 3, 12)] + prompts(n, 5, 40, seed=2)


def run(m, ps, params, **kw) -> tuple[list[Request], Engine]:
    e = Engine(m, max_seqs=8, **kw)
    return e.run([Request(p, params) for p in ps]), e


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_greedy_speculation_gives_the_tokens_of_decoding_one_at_a_time(pos):
    m = model(pos, block=64)  # learned positions run past block_size here: rows leave the cache at 64
    ps = repetitive(8)
    params = SamplingParams(40, 0.0, logprobs=True, stop_ids=frozenset({5, 17}))
    plain, _ = run(m, ps, params)
    for spec in (NgramProposer(), DraftProposer(model(pos, block=64, seed=5))):
        got, e = run(m, ps, params, speculator=spec, spec_tokens=4)
        assert [r.tokens for r in got] == [r.tokens for r in plain]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in plain]
        assert [r.stop_token for r in got] == [r.stop_token for r in plain]
        diff = max(
            abs(a - b)
            for x, y in zip(got, plain, strict=True)
            for a, b in zip(x.logprobs, y.logprobs, strict=True)
        )
        assert diff < 1e-4
        assert e.spec_forwards > 0 and e.spec_proposed > 0
    # prompt lookup on prompts that repeat: most drafts taken, fewer forwards than tokens
    _, e = run(m, ps, SamplingParams(40, 0.0), speculator=NgramProposer())
    assert e.spec_accepted > 0


def test_a_draft_that_is_the_model_is_always_right():
    m = model("rope")
    ps = prompts(8, 5, 40)
    plain, p = run(m, ps, SamplingParams(30, 0.0))
    got, e = run(m, ps, SamplingParams(30, 0.0), speculator=DraftProposer(m), spec_tokens=4)
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    assert e.spec_accepted == e.spec_proposed > 0
    assert e.forwards < p.forwards / 3


def test_sampled_rows_beside_speculating_ones_draw_what_they_draw_alone():
    m = model("rope")
    ps = prompts(8, 5, 40)
    params = [SamplingParams(20, 0.0) if i % 2 else SamplingParams(20, 1.0, seed=i) for i in range(8)]
    plain = Engine(m, max_seqs=8).run([Request(p, s) for p, s in zip(ps, params, strict=True)])
    e = Engine(m, max_seqs=8, speculator=NgramProposer())
    got = e.run([Request(p, s) for p, s in zip(ps, params, strict=True)])
    assert [r.tokens for r in got] == [r.tokens for r in plain]


def test_extending_rows_speculate_up_to_their_last_token():
    m = model("rope", block=32)
    ps = [(p * 4)[:30] for p in prompts(4, 3, 8)]
    params = SamplingParams(20, 0.0)  # 30 + 20 tokens: past block_size, the cache sized by the caller
    kw = {"max_len": 50, "extends_context": True}
    plain = Engine(m, max_seqs=4, **kw).run([Request(p, params) for p in ps])
    got = Engine(m, max_seqs=4, speculator=NgramProposer(), **kw).run([Request(p, params) for p in ps])
    assert [r.tokens for r in got] == [r.tokens for r in plain]


def test_prompt_lookup_takes_the_latest_longest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert lookup([5, 6, 1, 2, 3, 4, 6], 3) == [1, 2, 3]  # only the last token matches
    assert lookup([1, 2, 3], 4) == [] and lookup([4], 2) == []
    assert lookup([1, 2, 1, 2], 5) == [1, 2]  # up to the context's end


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_the_models_own_mtp_modules_draft_and_the_tokens_stay_the_same(pos):
    from loom.engine.speculative import MTPProposer
    from loom.model.gpt.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    rope = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2} if pos == "rope" else {}
    cfg = GPTConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=64, block_size=128, mtp_depth=2, **rope)
    m = GPT(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    ps = repetitive(4)
    plain, _ = run(m, ps, SamplingParams(20, 0.0))
    got, e = run(m, ps, SamplingParams(20, 0.0), speculator=MTPProposer(m), spec_tokens=4)
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    assert e.spec_proposed > 0 and e.spec_proposed <= 2 * e.spec_rows  # at most mtp_depth drafts a row
    with pytest.raises(ValueError, match="mtp_depth"):
        MTPProposer(model(pos))

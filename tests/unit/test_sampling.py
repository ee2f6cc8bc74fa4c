"""loom.engine.sampling at the edges (issue 57): a temperature so small that the scaled logits overflow float32
is greedy (it once drew the last id from a NaN softmax), a NaN in the logits is a SamplingError and never a
token, and a normal temperature draws exactly what the plain formula draws (compared against that formula,
written out here). And the engine around it: a row whose own bookkeeping fails fails alone."""

from __future__ import annotations

import pytest
import torch

from loom.engine import CANCELLED, Engine, Request, SamplingParams
from loom.engine.sampling import SamplingError, sample_next, sample_rows
from loom.model.gpt.gpt import GPT, GPTConfig


def _plain(logits: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    """The inverse-CDF draw as it was before the edge cases were handled."""
    cum = (logits.float() / temperature).softmax(-1).double().cumsum(-1)
    at = u.double()[:, None] * cum[:, -1:]
    return torch.searchsorted(cum, at, right=True)[:, 0].clamp_(max=logits.size(-1) - 1)


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-45, 1e-50, 1e-300])
def test_a_temperature_that_overflows_the_logits_is_greedy(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 97, generator=g) * 5
    logits[3] -= 100  # every logit negative: an overflow to -inf everywhere
    u = torch.rand(8, generator=g)
    assert torch.equal(sample_rows(logits, u, temperature), logits.argmax(-1))
    assert torch.equal(sample_rows(logits, u, temperature, top_k=5, top_p=0.5), logits.argmax(-1))
    assert sample_next(logits[:1], temperature, generator=g).item() == logits[0].argmax().item()


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 2.0])
def test_a_normal_temperature_draws_what_it_drew(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 500, generator=g) * 3
    u = torch.rand(64, generator=g)
    assert torch.equal(sample_rows(logits, u, temperature), _plain(logits, u, temperature))


def test_a_nan_in_the_logits_is_an_error_never_a_token():
    logits = torch.randn(4, 300)
    logits[2, 7] = torch.nan
    u = torch.rand(4)
    with pytest.raises(SamplingError, match=r"row\(s\) \[2\]"):
        sample_rows(logits, u, 1.0)
    with pytest.raises(SamplingError):
        sample_rows(logits, u, 1e-40)
    with pytest.raises(SamplingError):
        sample_next(logits, temperature=0)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, n_layer=1, n_head=2, n_embd=32, block_size=64)).eval()


def test_the_engine_at_a_tiny_temperature_answers_what_greedy_answers():
    m = _model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    greedy = Engine(m).run([Request(p, SamplingParams(10, 0.0)) for p in prompts])
    tiny = Engine(m).run([Request(p, SamplingParams(10, 1e-40, seed=i)) for i, p in enumerate(prompts)])
    assert [r.tokens for r in tiny] == [r.tokens for r in greedy]


def test_a_row_whose_callback_fails_fails_alone_in_a_servers_engine():
    """Any exception inside a row's own bookkeeping (here its callback) fails that row; the others finish."""
    m = _model()

    def broken(req):
        raise RuntimeError("a callback that fails")

    reqs = [Request([1, 2, 3], SamplingParams(8, 0.0)) for _ in range(3)]
    reqs[1].on_token = broken
    Engine(m, fail_alone=True).run(reqs)  # a server's engine
    assert reqs[1].finish_reason == CANCELLED and "a callback that fails" in reqs[1].error
    assert [len(r.tokens) for r in (reqs[0], reqs[2])] == [8, 8] and reqs[0].error is None
    # any other caller (generate, RL) hears of it: a failure is never a silently short answer
    with pytest.raises(RuntimeError, match="a callback that fails"):
        Engine(m).run([Request([1, 2, 3], SamplingParams(8, 0.0), on_token=broken)])


def test_a_seed_outside_the_generators_range_is_refused_before_it_queues():
    engine = Engine(_model())
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            engine.submit(Request([1, 2], SamplingParams(4, 1.0, seed=seed)))
    assert not engine.busy
    for seed in (2**64 - 1, -(2**63)):
        engine.submit(Request([1, 2], SamplingParams(4, 1.0, seed=seed)))
    engine.drain()

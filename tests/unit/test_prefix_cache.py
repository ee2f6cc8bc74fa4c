"""loom.engine's prefix cache against the same engine without it: requests that share a long system prompt get
the tokens they get without the cache (greedy and seeded sampling, a running batch of 8 over 24 requests), and
under batch_invariant() the same log-probabilities bit for bit; the shared blocks are computed once; the store
is exact (a prompt differing in a block's last token reuses nothing of it) and evicts least recently used,
the first blocks of a prefix last."""

import torch
from test_engine import model, prompts

from loom.engine import Engine, Request, SamplingParams
from loom.engine.prefix_cache import PrefixCache
from loom.model.batch_invariant import batch_invariant

SYSTEM = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def shared(n: int = 24) -> list[list[int]]:
    return [SYSTEM + p for p in prompts(n, 1, 30)]


def both(m, params: list[SamplingParams], tokens: int = 512):
    """(without, with) the prefix cache: the requests' answers, and the engine with the cache."""
    ps = shared(len(params))
    off = Engine(m, max_seqs=8).run([Request(p, s) for p, s in zip(ps, params, strict=True)])
    on = Engine(m, max_seqs=8, prefix_cache_tokens=tokens)
    got = on.run([Request(p, s) for p, s in zip(ps, params, strict=True)])
    return off, got, on


def seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(12, 1.0, top_k=20, seed=100 + i, logprobs=True) for i in range(n)]


GREEDY = [SamplingParams(12, 0.0, logprobs=True)] * 24


def test_answers_with_the_prefix_cache_are_those_without_it():
    for pos in ("learned", "rope"):
        m = model(pos)
        for params in (GREEDY, seeded(24)):
            off, on, engine = both(m, params)
            assert [r.tokens for r in on] == [r.tokens for r in off]
            # the 40-token system prompt's 2 whole blocks of 16 are computed by the first row alone
            assert engine.prefix.hits == 23 and engine.prefilled == sum(len(p) for p in shared()) - 23 * 32


def test_under_batch_invariance_the_log_probabilities_are_the_same_bit_for_bit():
    m = model("rope")
    with batch_invariant():
        for params in (GREEDY, seeded(24)):
            off, on, _ = both(m, params)
            assert [r.logprobs for r in on] == [r.logprobs for r in off]


def test_a_prompt_that_arrives_later_reuses_the_blocks_and_off_means_off():
    m = model()
    e = Engine(m, max_seqs=2, prefix_cache_tokens=256)
    first = e.run([Request(SYSTEM + [1, 2], GREEDY[0])])[0]
    before = e.prefilled
    again = e.run([Request(SYSTEM + [1, 2], GREEDY[0])])[0]
    assert again.tokens == first.tokens and e.prefilled - before == 42 - 32
    e = Engine(m, max_seqs=2, prefix_cache_tokens=0)
    e.run([Request(SYSTEM, GREEDY[0]), Request(SYSTEM, GREEDY[0])])
    assert e.prefix is None


def test_the_store_is_exact_and_evicts_the_least_recently_used_last_blocks_first():
    m = model()
    e = Engine(m, max_seqs=1, prefix_cache_tokens=64)  # 4 blocks of 16
    a = list(range(50))
    e.run([Request(a, GREEDY[0])])
    assert len(e.prefix.blocks) == 3  # the whole blocks of 50 tokens
    b = a[:31] + [96] + a[32:]  # its second block differs in its last token: only the first is reused
    assert len(e.prefix.match(b)) == 1
    assert len(e.prefix.match(a)) == 3
    e.run([Request(list(range(60, 94)), GREEDY[0])])  # 2 blocks more: 5 > 4, the oldest goes
    kept = sorted(len(k) for k in e.prefix.blocks)
    assert len(kept) == 4 and tuple(a[:16]) in e.prefix.blocks and tuple(a[:48]) not in e.prefix.blocks
    assert len(e.prefix.match(a)) == 2  # its first two blocks: still a prefix


def test_a_budget_under_one_block_holds_nothing():
    c = PrefixCache(8, block=16)
    m = model()
    e = Engine(m, max_seqs=1)
    e.run([Request(list(range(40)), GREEDY[0])])
    c.store(e.cache, 0, list(range(40)))
    assert not c.blocks and c.match(list(range(40))) == []

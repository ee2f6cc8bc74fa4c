"""loom.engine against generation one prompt at a time: a batch of prompts of different lengths gives every
prompt the tokens it gets alone (fp32, CPU), greedy decoding equals a cache-free argmax loop, and the running
batch's bookkeeping (joining between steps, a bounded queue, the KV-token budget, cancellation, stops, seeds,
log-probabilities) does what each says."""

import pytest
import torch
import torch.nn.functional as F

from loom.engine import CANCELLED, LENGTH, STOP, Engine, QueueFull, Request, SamplingParams
from loom.model.gpt.gpt import GPT, GPTConfig


def model(pos: str = "learned", block: int = 256, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    rope = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2} if pos == "rope" else {}
    m = GPT(GPTConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=64, block_size=block, **rope)).eval()
    with torch.no_grad():  # wider weights than init's: logits far apart, so greedy picks are not near-ties
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def prompts(n: int, lo: int, hi: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(lo, hi, n).round().long().tolist()
    return [torch.randint(0, 97, (L,), generator=g).tolist() for L in lengths]


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_64_prompts_in_one_batch_get_the_tokens_each_gets_alone(pos):
    m = model(pos)
    ps = prompts(64, 5, 200)
    batch = Engine(m, max_seqs=64).run([Request(p, GREEDY) for p in ps])
    alone = [Engine(m, max_seqs=1).run([Request(p, GREEDY)])[0] for p in ps]
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    # the numbers themselves: a row's matrix products run beside 63 others, so the kernels may add in another
    # order; the difference stays at float32 rounding (measured: at most 9.5e-7 on the top-5 log-probabilities,
    # 5 of 64 rows bit-exact with learned positions, 1 with RoPE)
    diff = max(
        abs(a[1] - b[1])
        for rb, ra in zip(batch, alone, strict=True)
        for tb, ta in zip(rb.top, ra.top, strict=True)
        for a, b in zip(tb, ta, strict=True)
    )
    assert diff < 1e-4


def reference_greedy(m: GPT, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding the slow way: the whole context through the model, no cache, for every token."""
    ids = list(prompt)
    for _ in range(n):
        logits = m(torch.tensor([ids[-m.cfg.block_size :]]))[0, -1, :97]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_greedy_equals_the_cache_free_loop(pos):
    m = model(pos, block=32)
    ps = prompts(6, 3, 30)
    reqs = Engine(m, max_seqs=4).run([Request(p, SamplingParams(20, 0.0)) for p in ps])
    # learned positions run past block_size 32 here (30 + 20): re-cropped as the loop does
    assert [r.tokens for r in reqs] == [reference_greedy(m, p, 20) for p in ps]
    assert all(r.finish_reason == LENGTH for r in reqs)


def test_requests_join_a_running_batch_and_leave_it():
    m = model()
    e = Engine(m, max_seqs=2)
    a, b, c = (Request(p, SamplingParams(6, 0.0)) for p in prompts(3, 4, 9))
    e.submit(a)
    e.step()
    e.step()
    assert len(a.tokens) == 2 and e.running == [a]
    e.submit(b)
    e.submit(c)  # waits: two slots
    e.step()
    assert e.running == [a, b] and list(e.waiting) == [c] and len(b.tokens) == 1 and len(a.tokens) == 3
    while e.busy:
        e.step()
    want = Engine(m, max_seqs=1)
    assert [r.tokens for r in (a, b, c)] == [
        want.run([Request(r.prompt, r.params)])[0].tokens for r in (a, b, c)
    ]
    assert e.free == [0, 1] and e.reserved == 0


def test_queue_and_kv_budget_are_bounded():
    m = model()
    e = Engine(m, max_seqs=4, max_queue=2, max_kv_tokens=30)
    reqs = [Request(p, SamplingParams(10, 0.0)) for p in prompts(3, 10, 10)]
    e.submit(reqs[0])
    e.submit(reqs[1])
    with pytest.raises(QueueFull):
        e.submit(reqs[2])
    e.step()
    assert e.running == [reqs[0]] and len(e.waiting) == 1  # 20 + 20 tokens > 30: the second waits
    with pytest.raises(ValueError, match="max_kv_tokens"):
        e.submit(Request([1] * 25, SamplingParams(10, 0.0)))
    while e.busy:
        e.step()
    assert all(len(r.tokens) == 10 for r in reqs[:2])


def test_cancel_frees_the_row_and_the_others_go_on():
    m = model()
    e = Engine(m, max_seqs=2)
    a, b = (Request(p, SamplingParams(8, 0.0)) for p in prompts(2, 5, 7))
    e.submit(a)
    e.submit(b)
    e.step()
    e.cancel(a)
    assert a.finish_reason == CANCELLED and e.running == [b] and e.free == [0]
    while e.busy:
        e.step()
    assert b.tokens == Engine(m, max_seqs=1).run([Request(b.prompt, b.params)])[0].tokens


def test_stop_ids_and_stop_texts_end_a_row():
    m = model()
    p = prompts(1, 6, 6)[0]
    free = Engine(m).run([Request(p, SamplingParams(12, 0.0))])[0].tokens
    by_id = Engine(m).run([Request(p, SamplingParams(12, 0.0, stop_ids=frozenset({free[3]})))])[0]
    assert by_id.tokens == free[: free.index(free[3])] and by_id.finish_reason == STOP
    decode = lambda ids: "".join(chr(65 + t % 26) for t in ids)  # noqa: E731
    stop = decode(free[4:6])
    e = Engine(m, decode=decode)
    by_text = e.run([Request(p, SamplingParams(12, 0.0, stop=(stop,)))])[0]
    assert by_text.finish_reason == STOP and decode(by_text.tokens).find(stop) >= 0
    assert len(by_text.tokens) <= 6


def test_seeded_sampling_does_not_depend_on_the_rows_beside_it():
    m = model()
    ps = prompts(5, 5, 40)
    # rows of three settings in one batch: each setting's rows are drawn together
    params = [SamplingParams(10, 1.0, top_p=0.9, seed=100 + i) for i in range(3)]
    params += [SamplingParams(10, 0.7, top_k=5, seed=200), SamplingParams(10, 0.0)]
    together = Engine(m, max_seqs=5).run([Request(p, s) for p, s in zip(ps, params, strict=True)])
    for p, s, r in zip(ps, params, together, strict=True):
        assert Engine(m, max_seqs=1).run([Request(p, s)])[0].tokens == r.tokens


def test_logprobs_are_the_model_log_softmax_of_the_sampled_tokens():
    m = model()
    p = prompts(1, 7, 7)[0]
    r = Engine(m).run([Request(p, SamplingParams(5, 0.7, seed=3, logprobs=True, top_logprobs=3))])[0]
    ids = torch.tensor([p + r.tokens])
    lp = F.log_softmax(m(ids)[0, len(p) - 1 : -1, :97].float(), dim=-1)
    want = lp.gather(1, torch.tensor(r.tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=1e-5, rtol=0)
    assert [[t for t, _ in top] for top in r.top] == lp.topk(3).indices.tolist()


def test_sample_rows_draws_each_token_at_its_probability_and_never_a_masked_one():
    """The inverse-CDF draw: 200k rows of one distribution give each token its probability (within 4 standard
    errors), top-k's masked tokens and zero-probability ones never come, and a uniform just past a token's
    cumulative probability draws the next token."""
    from loom.engine.sampling import sample_rows

    logits = torch.tensor([[2.0, 0.0, -torch.inf, 1.0, -1.0, 0.5]])
    probs = logits.softmax(-1)[0]
    n = 200_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample_rows(logits.expand(n, -1), u), minlength=6).double() / n
    se = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert bool(((counts - probs.double()).abs() <= 4 * se + 1e-12).all()), (counts, probs)
    assert counts[2] == 0
    top2 = torch.bincount(sample_rows(logits.expand(n, -1), u, top_k=2), minlength=6)
    assert set(top2.nonzero()[:, 0].tolist()) == {0, 3}
    cum = probs.double().cumsum(0)
    edges = torch.tensor([0.0, float(cum[0]) - 1e-6, float(cum[0]) + 1e-6, float(cum[3]) + 1e-6, 0.999999])
    assert sample_rows(logits.expand(5, -1), edges).tolist() == [0, 0, 1, 4, 5]


@pytest.mark.parametrize("V", [5, 256, 300, 4096, 50257])
def test_first_max_is_torchs_argmax_ties_nan_and_minus_inf_included(V):
    from loom.engine.sampling import first_max

    g = torch.Generator().manual_seed(V)
    x = torch.randint(-3, 3, (6, V), generator=g).float()  # many ties: the first maximum wins
    x[1] = -torch.inf
    x[2, V // 2] = x[2, -1] = torch.nan  # the first NaN wins
    x[3, -1] = torch.nan
    x[4, -1] = 10.0  # the maximum in the tail past the last whole block
    assert torch.equal(first_max(x), x.argmax(-1))
    rows = torch.randn(6, 3, V, generator=g)[:, -1]  # a strided view, as the engine's last positions are
    assert torch.equal(first_max(rows), rows.argmax(-1))


def test_rows_sharing_a_prompt_are_prefilled_once_and_sample_as_alone():
    """An RL group's samples or a request's n answers share their prompt: the engine computes it once and the
    other rows copy its keys, values and last logits. Each row's seeded samples are those it draws alone."""
    m = model("rope")
    p, other = prompts(2, 9, 30)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, logprobs=True) for s in range(4)]
    reqs = [Request(p, sp) for sp in params] + [Request(other, params[0])]
    engine = Engine(m, max_seqs=8)
    engine.run(reqs)
    assert engine.prefilled == len(p) + len(other)  # not 4 * len(p) + len(other)
    for r, sp in zip(reqs, [*params, params[0]], strict=True):
        alone = Engine(m, max_seqs=1).run([Request(r.prompt, sp)])[0]
        assert r.tokens == alone.tokens
        assert max(abs(a - b) for a, b in zip(r.logprobs, alone.logprobs, strict=True)) < 1e-5
    assert len({tuple(r.tokens) for r in reqs[:4]}) > 1  # the seeds drew different answers

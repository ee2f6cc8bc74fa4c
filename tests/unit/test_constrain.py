"""Constrained sampling (loom.engine.sampling.constrain, loom.serve.grammar) against the engine without it: a row
with a grammar samples only tokens its mask allows, at temperature 0 and 1, while the free rows of its batch
sample exactly what they sample with no constrained row beside them (the same tokens, seeded); a batch without
constraints is not touched (the same tensor). The llguidance bridge of a character vocabulary: its masks are
the characters the grammar allows next, its special tokens never text, and a grammar it cannot write is found
before the request runs."""

import pytest
import torch

from loom.engine import Engine, Request, SamplingParams
from loom.engine.sampling import constrain
from loom.model.gpt.gpt import GPT, GPTConfig


class Only:
    """A constraint allowing a fixed set of tokens (and recording the tokens it was shown)."""

    def __init__(self, allowed: set[int], vocab: int = 97):
        self.allowed = torch.zeros(vocab, dtype=torch.bool)
        self.allowed[list(allowed)] = True
        self.seen: list[list[int]] = []

    def mask(self, tokens):
        self.seen.append(list(tokens))
        return self.allowed


def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=64, block_size=64)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def test_no_constraint_leaves_the_logits_as_they_are():
    logits = torch.randn(3, 97)
    rows = [Request([1], SamplingParams()) for _ in range(3)]
    assert constrain(rows, logits) is logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_row_samples_its_mask_and_free_rows_are_unchanged(temperature):
    m = model()
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]

    def run(constrained: bool) -> list[Request]:
        reqs = [
            Request(p, SamplingParams(max_tokens=10, temperature=temperature, seed=i))
            for i, p in enumerate(prompts)
        ]
        if constrained:
            reqs[1].constraint = Only({3, 4, 40})
        return Engine(m, max_seqs=4).run(reqs)

    free, mixed = run(False), run(True)
    assert set(mixed[1].tokens) <= {3, 4, 40} and len(mixed[1].tokens) == 10
    assert mixed[1].constraint.seen[-1] == mixed[1].tokens[:-1]  # each mask after the row's tokens so far
    assert not set(free[1].tokens) <= {3, 4, 40}  # the model alone would not (the mask did it)
    for j in (0, 2):
        assert mixed[j].tokens == free[j].tokens


def test_a_stop_token_ends_a_constrained_row_where_its_mask_allows_it():
    m = model()
    req = Request([5, 6], SamplingParams(max_tokens=10, temperature=0.0, stop_ids=frozenset({7})))
    req.constraint = Only({7})
    Engine(m).run([req])
    assert req.tokens == [] and req.finish_reason == "stop" and req.stop_token == 7


# ------------------------------------------------------------------------------------------ llguidance
llguidance = pytest.importorskip("llguidance")


def grammars():
    from loom.data.chat import add_chat_tokens
    from loom.data.tokenizers import CharTokenizer
    from loom.serve.grammar import Grammars

    tok = add_chat_tokens(CharTokenizer.train(['{}":,0123456789 abcdefghijklmnopqrstuvwxyz']))
    return tok, Grammars(tok, tok.vocab_size)


def allowed_text(tok, mask) -> set[str]:
    return {tok.decode([i]) for i in mask.nonzero()[:, 0].tolist()}


def test_char_vocabulary_masks_follow_the_schema():
    tok, g = grammars()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    grammar = g.response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    c = g.constraint(grammar, [tok.eot_id])
    assert allowed_text(tok, c.mask([])) == {"{"}
    ids = tok.encode('{"n":')
    assert allowed_text(tok, c.mask(ids)) == set("0123456789")
    ids += tok.encode("7}")
    assert c.mask(ids).nonzero()[:, 0].tolist() == [tok.eot_id]  # complete: only the stop token
    assert c.dead is None


def test_a_grammar_the_vocabulary_cannot_write_is_refused_before_it_runs():
    from loom.serve.protocol import APIError

    tok, g = grammars()
    grammar = g.response_format({"type": "regex", "regex": "[A-Z]+"})
    with pytest.raises(APIError) as e:
        g.check_expressible(grammar, [tok.eot_id], "response_format")
    assert e.value.status == 400 and e.value.code == "grammar_not_expressible"
    # one that dead-ends later: the row ends there and says why
    c = g.constraint(g.response_format({"type": "regex", "regex": "a[A-Z]"}), [tok.eot_id])
    assert c.mask(tok.encode("a")).nonzero()[:, 0].tolist() == [tok.eot_id] and "no token" in c.dead

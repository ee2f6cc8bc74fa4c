"""int8 weight-only quantization (loom.model.quant, torchao) against the model it came from: every linear
layer's weight is int8 with a scale per output channel, the logits stay within int8's rounding of the float
model's, greedy decoding through loom.engine runs on it, and an unknown --quantize is refused."""

import pytest
import torch
from test_engine import model, prompts

from loom.engine import Engine, Request, SamplingParams
from loom.errors import LoomError
from loom.model.quant import check_quantize, quantize_weights


def test_int8_weights_keep_the_logits_within_rounding():
    m = model("rope")
    x = torch.tensor(prompts(2, 20, 20))
    with torch.no_grad():
        ref = m(x)
        n = quantize_weights(m, "int8")
        got = m(x)
    linears = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
    assert n == len(linears) > 0
    assert all(type(mod.weight).__name__ == "Int8Tensor" for mod in linears)
    # a weight's rounding is at most half a step of its row's scale (max |w| / 127): relative 0.4 %
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    reqs = Engine(m, max_seqs=2).run([Request(p, SamplingParams(6, 0.0)) for p in prompts(2, 5, 9)])
    assert all(len(r.tokens) == 6 for r in reqs)


def test_unknown_quantization_is_refused():
    with pytest.raises(LoomError, match="int8"):
        check_quantize("int4")
    assert quantize_weights(model(), None) == 0

"""loom.engine: batched generation, the one path `loom generate`, `loom chat`, the in-training sample, the
harness's generate_until and `loom serve` all take.

The choices, and why:
  - A static KV cache per running batch (loom.model.kv_cache.RowCache): slots x max_len tokens per layer,
    allocated once, each slot at its own length. Per-row positions instead of left padding: a row's tokens sit
    at positions 0.. of its own slot, so RoPE and learned positions see exactly what a batch of one sees, a row
    can join or leave between steps without moving the others, and no attention mask is needed in a prefill.
    A paged cache would let rows of very different lengths share memory better; a static one is simple, needs
    no custom attention kernel, and for loom's block sizes costs max_seqs x block_size tokens of memory.
  - Prompts that join in the same step are prefilled together, right-padded, in groups of similar length;
    decoding runs every cached row in one forward (one token each), its mask stopping each row at its length.
  - Continuous batching: requests wait in a bounded queue (QueueFull) and join between steps while the slots
    (max_seqs) and the KV-token budget (max_kv_tokens: each row reserves prompt + max_tokens, so a running
    row never runs out of room) allow; a finished or cancelled row frees its slot at once.
  - Per-request sampling (temperature, top-k, top-p, seed: a generator of its own), stops (token ids: end of
    turn, end of text; stop texts, read through the engine's decode), and the log-probability of each sampled
    token with the top-n alternatives (log-softmax of the raw logits, before temperature: what the OpenAI API
    reports). The rows that share settings are sampled together (sampling.sample_rows): each row draws one
    uniform number from its own generator per token, and the token is where that number falls in the row's
    cumulative distribution. A per-row torch.multinomial cost ~30 us a row (an RL rollout of 256 rows: a third
    of its time); one vectorised pass keeps a row's draws its own (no row's tokens depend on its neighbours').
  - A model with learned positions past block_size: the row leaves the cache and recomputes its newest
    block_size tokens every step, as cache-free generation does (what loom generate always did); a RoPE
    family that runs on past it (extends_context) keeps its cache, sized by the caller.

Batching changes the numbers only where the kernels do: a batch of one is the old loop's computation; in a
larger batch a row's matrix products run with other rows beside it (tests/unit/test_engine.py measures it).
"""

from loom.engine.engine import Engine, QueueFull
from loom.engine.request import CANCELLED, LENGTH, STOP, Request, SamplingParams, cut_at_stop

__all__ = ["CANCELLED", "LENGTH", "STOP", "Engine", "QueueFull", "Request", "SamplingParams", "cut_at_stop"]

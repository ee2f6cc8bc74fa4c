"""Sampling with a KV cache: temperature, top-k, top-p (nucleus), seeded; the loop is loom.engine's.

With the cache, the prompt is run once (prefill) and each new token costs one position. The cache holds the
key/value heads only (grouped-query attention shares them when attention runs) and, with RoPE, keys already
rotated by their positions. Past block_size the family decides (ModelSpec.extends_context): a RoPE model runs
on with its cache, as transformers' does, so an exported model samples what `loom generate` does; with learned
positions the context is re-cropped to block_size and recomputed every step, exactly as cache-free generation
does, so the result is the same either way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from loom import log
from loom.engine import Engine, Request, SamplingParams
from loom.engine.sampling import sample_next  # noqa: F401  (loom.generate.sample_next: the tests' name for it)
from loom.eval.evaluator import EvalContext, EvalSetup, Every, register_evaluator


def iter_tokens(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    vocab_size: int | None = None,
    extends_context: bool = False,
    stop_ids: frozenset[int] = frozenset(),
    speculator=None,
    spec_tokens: int = 4,
):
    """Sample up to max_new_tokens tokens after `idx` (B, T), yielding each step's (B, 1) ids as it is drawn (a
    caller streams them, or stops early). Padding ids >= vocab_size are never sampled. The rows run as one
    batch of loom.engine (sharing `generator`, drawn row after row). extends_context (the family's
    ModelSpec.extends_context): past block_size, run on with the cache instead of re-cropping the context.
    stop_ids: one row only (a chat turn): the tokens that end it, not yielded. The model is in eval mode while
    this runs. speculator (loom.engine.speculative): greedy tokens by speculative decoding, spec_tokens a step."""
    if max_new_tokens <= 0:
        return
    B, T = idx.shape
    extend = extends_context and use_cache
    engine = Engine(
        model,
        max_seqs=B,
        max_len=T + max_new_tokens if extend else model.cfg.block_size,
        vocab_size=vocab_size,
        extends_context=extends_context,
        use_cache=use_cache,
        device=idx.device,
        speculator=speculator,
        spec_tokens=spec_tokens,
    )
    params = SamplingParams(max_new_tokens, temperature, top_k, top_p, stop_ids=frozenset(stop_ids))
    if B == 1:
        for token in engine.stream(Request(idx[0].tolist(), params, generator)):
            yield torch.tensor([[token]], device=idx.device)
        return
    reqs = [engine.submit(Request(row, params, generator), bounded=False) for row in idx.tolist()]
    was_training = model.training
    model.eval()
    try:
        for k in range(max_new_tokens):
            while engine.busy and any(len(r.tokens) <= k and not r.done for r in reqs):
                engine.step()
            if any(len(r.tokens) <= k for r in reqs):
                return
            yield torch.tensor([[r.tokens[k]] for r in reqs], device=idx.device)
    finally:
        model.train(was_training)


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, *args, **kwargs) -> torch.Tensor:
    """Extend `idx` (B, T) by max_new_tokens sampled tokens: every one iter_tokens draws (its options, in its
    order)."""
    return torch.cat([idx, *iter_tokens(model, idx, max_new_tokens, *args, **kwargs)], dim=1)


class Sampler(Every):
    """A sample of text every train.sample_every steps (and at the end), printed and appended to the run's
    samples.txt. It has a generator of its own (seeded by run.seed + step), so training's RNG stream is untouched.
    Called on every rank: rank 0 samples, from a whole copy gathered once when the model is split (FSDP,
    tensor, pipeline: Parallelized.sampling_model), while the others wait."""

    name = "sample"
    in_metrics = False

    def __init__(self, every: int, max_new_tokens: int, seed: int, extends_context: bool, out: Path | None):
        super().__init__(every)
        self.max_new_tokens, self.seed, self.extends_context, self.out = (
            max_new_tokens,
            seed,
            extends_context,
            out,
        )

    def text(self, model: nn.Module, ctx: EvalContext, prompt: str = "") -> str:
        tok = ctx.tokenizer
        ids = tok.encode(prompt) if prompt else [tok.eot_id]
        idx = torch.tensor([ids], dtype=torch.long, device=ctx.device)
        g = torch.Generator(device=ctx.device).manual_seed(self.seed + ctx.step)
        with ctx.autocast():
            out = generate(
                model,
                idx,
                self.max_new_tokens,
                temperature=0.8,
                top_k=200,
                generator=g,
                vocab_size=tok.vocab_size,
                extends_context=self.extends_context,
            )
        return tok.decode(out[0, len(ids) :].tolist())

    def run(self, ctx: EvalContext) -> dict | None:
        model = ctx.parallel.sampling_model()  # rank 0: a whole copy (gathered once if split); others: None
        if model is not None and self.out is not None:  # a CPU's sample takes seconds: say what is under way
            log.info(f"sampling {self.max_new_tokens} tokens at step {ctx.step} (train.sample_tokens)")
        # eager even when train.compile compiled the blocks: each new length would recompile them, up to
        # torch.compile's recompile limit (and its warning block); a sample is too short to gain from compiling
        with torch.compiler.set_stance("force_eager"):
            text = self.text(model, ctx) if model is not None else None
        if text is None or self.out is None:
            return None
        with open(self.out, "a", encoding="utf-8") as f:
            f.write(f"=== step {ctx.step}\n{text}\n")
        return {"sample": text}

    def line(self, step: int, record: dict) -> str:
        return f"--- sample at step {step} ---\n{record['sample']}\n---"


class ChatSampler(Sampler):
    """On chat data (an SFT run) the sample is the model's greedy reply to the first validation
    conversation's first prompt, up to its end of turn, shown beside the answer the data holds: what
    `loom chat RUN --prompt` would answer, not text continued from end-of-text."""

    def __init__(self, prompt: list[int], expected: list[int], stop_ids, *args):
        super().__init__(*args)
        self.prompt, self.expected, self.stop_ids = prompt, expected, set(stop_ids)

    def text(self, model: nn.Module, ctx: EvalContext, prompt: str = "") -> str:
        tok = ctx.tokenizer
        idx = torch.tensor([self.prompt], dtype=torch.long, device=ctx.device)
        out: list[int] = []
        with ctx.autocast():
            for nxt in iter_tokens(
                model,
                idx,
                self.max_new_tokens,
                temperature=0.0,
                vocab_size=tok.vocab_size,
                extends_context=self.extends_context,
                stop_ids=frozenset(self.stop_ids),
            ):
                out.append(int(nxt[0, 0]))
        return (
            f"prompt:   {tok.decode(self.prompt[1:])}\n"  # [0] is the end-of-text that opens a conversation
            f"reply:    {tok.decode(out)}\nexpected: {tok.decode(self.expected)}"
        )


def _chat_sampler(setup: EvalSetup, *args) -> ChatSampler | None:
    """The chat sample's prompt and expected answer from the validation conversations, or None (plain data)."""
    from loom.data.chat import chat_template_of
    from loom.data.loader import read_meta
    from loom.data.sft import Conversations, is_chat_data

    meta = read_meta(setup.data_dir)
    if not is_chat_data(meta):
        return None
    val = Conversations(setup.data_dir, "val", setup.cfg.model.block_size)
    start, n = int(val.starts[0]), int(val.lengths[0])
    tokens, mask = val.tokens[start : start + n], val.mask[start : start + n]
    # the mask is 1 on the tokens the model is trained to produce: the first answer is the first run of 1s
    first = int(np.argmax(mask))
    end = first + (int(np.argmin(mask[first:])) or n - first)
    template = chat_template_of(setup.tokenizer, meta)
    expected = [t for t in tokens[first:end].tolist() if t not in template.stop_ids]
    return ChatSampler(tokens[:first].tolist(), expected, template.stop_ids, *args)


def _in_training(setup: EvalSetup) -> Sampler | None:
    """The sample every train.sample_every steps and at the end, when the data has a tokenizer: text from
    end-of-text, or on chat data a reply (ChatSampler)."""
    if setup.tokenizer is None:
        return None
    t = setup.cfg.train
    samples = setup.run_dir / "samples.txt" if setup.main else None
    extend = setup.spec.extends_context(setup.model_cfg)
    args = (t.sample_every, t.sample_tokens, setup.cfg.run.seed, extend, samples)
    return _chat_sampler(setup, *args) or Sampler(*args)


register_evaluator("sample", _in_training)

"""loom's model as an lm-evaluation-harness `LM`: the harness builds the requests, loom answers them.

`LoomLM` is a `TemplateLM` (the harness's own base for tokenizer-backed models, which HFLM also is), so a
request is tokenized exactly as the harness's `hf` backend tokenizes it (`_encode_pair`: trailing spaces move to
the continuation, the empty context becomes the prefix token: loom's end-of-text), and the same numbers come out
of the same model exported to transformers. The model's side (batching by length, the KV cache, lockstep
forwards of a sharded model) is loom.eval.scoring.Scorer.

  loglikelihood          Scorer.continuations
  loglikelihood_rolling  the harness's rolling windows (max context, each token predicted once), scored the same
  generate_until         Scorer.generate: every request through loom.engine's running batch (contexts of any
                         length); greedy unless the task asks to sample; stops at end-of-text or a stop text

Across processes (rank and world_size are what the harness splits requests by):
  one process, or rank 0 of a job with a whole copy (tensor/pipeline layouts): world 1
  every rank with the whole model (torchrun without --shard, a ddp run): the harness splits the requests, the
      results meet on rank 0 through `gather_object`
  an FSDP-sharded model (`--shard`, an fsdp run): split as above, the forwards in lockstep (Scorer).

This module needs lm-evaluation-harness (the `loom[eval]` extra); make one through loom.eval.harness.make_lm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from loom.errors import LoomError
from loom.eval.scoring import Scorer


class LoomLM(TemplateLM):
    def __init__(
        self,
        scorer: Scorer,
        tokenizer,
        *,
        rank: int = 0,
        world_size: int = 1,
        max_gen_toks: int = 256,
        seed: int = 1234,
    ):
        super().__init__()
        self.scorer, self.tok = scorer, tokenizer
        self._device = scorer.device
        self._rank, self._world_size = rank, world_size
        self._max_gen_toks, self.seed = max_gen_toks, seed

    # ----------------------------------------------------------------------------- what the harness asks
    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def max_length(self) -> int:
        return self.scorer.block_size

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return f"loom-{getattr(self.tok, 'kind', 'tokenizer')}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)  # loom's tokenizers add no special tokens

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    # ----------------------------------------------------------------------------- collectives
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        t = tensor.reshape(1, *tensor.shape) if tensor.dim() == 0 else tensor
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return torch.cat(out)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # ----------------------------------------------------------------------------- requests
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        return self.scorer.continuations([(ctx, cont) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text: the harness's rolling windows, scored as continuations."""
        windows, owner = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, self.scorer.continuations(windows), strict=True):
            totals[k] += lp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        todo = []
        for context, gen_kwargs in (req.args for req in requests):
            kw = dict(gen_kwargs)
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            if max_new >= self.max_length:
                raise LoomError(
                    f"a task asks for {max_new} generated tokens, and the model's window is {self.max_length}",
                    hint="lower the task's generation_kwargs.max_gen_toks (the context needs room too)",
                )
            sample = bool(kw.get("do_sample", False)) and float(kw.get("temperature", 1.0)) > 0
            temperature = float(kw.get("temperature", 1.0)) if sample else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_new) :] or [self.eot_token_id]
            todo.append((ids, until, max_new, temperature))
        return self.scorer.generate(todo, self.tok_decode, self.seed)

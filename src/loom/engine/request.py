"""One generation request: its prompt, its sampling settings, and what the engine writes back (tokens, their
log-probabilities, why it finished)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LENGTH, STOP, CANCELLED = "length", "stop", "cancelled"  # finish reasons (the OpenAI API's words)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it ends. temperature 0 is greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # a generator of its own; None: the request's generator, or torch's global one
    stop_ids: frozenset[int] = (
        frozenset()
    )  # tokens that end the answer (not part of it): end of turn, of text
    stop: tuple[str, ...] = ()  # texts that end it (the engine's decode reads them; the text is cut there)
    logprobs: bool = False  # the log-probability of each sampled token
    top_logprobs: int = 0  # and the n most likely tokens at each step with theirs


class Request:
    """A prompt (token ids) and its settings; the engine fills tokens, logprobs, top and finish_reason.
    on_token(request) is called after each new token and once more when it finishes (from the engine's
    thread)."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        on_token: Callable[[Request], None] | None = None,
    ):
        self.prompt, self.params, self.generator, self.on_token = list(prompt), params, generator, on_token
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        # the stop token a row ended on (not part of its tokens) and its log-probability: RL trains on it
        self.stop_token: int | None = None
        self.stop_logprob: float | None = None
        self.error: str | None = None  # a forward that failed (the server answers 500)
        self.slot: int | None = None
        self.recompute = (
            False  # past the cache (learned positions past block_size, or no cache): full forwards
        )
        self.prefilled = False
        # a grammar the answer must follow (loom.serve.grammar.Constraint, or any object with
        # mask(tokens) -> (vocab,) bool tensor of the tokens allowed next): applied by sampling.constrain
        self.constraint = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def finish(self, reason: str) -> None:
        self.finish_reason = reason

    def hits_stop_text(self, decode: Callable[[list[int]], str] | None) -> bool:
        """Whether the text of the newest tokens holds a stop text (a tail long enough for the longest: a
        character is at most 4 byte tokens)."""
        if not self.params.stop or decode is None:
            return False
        tail = self.tokens[-(4 * max(len(s) for s in self.params.stop) + 4) :]
        text = decode(tail)
        return any(s and s in text for s in self.params.stop)


def cut_at_stop(text: str, stops: tuple[str, ...] | list[str]) -> str:
    """The text before the first stop text it holds (all of it when none)."""
    cut = len(text)
    for s in stops:
        if s and s in text:
            cut = min(cut, text.index(s))
    return text[:cut]

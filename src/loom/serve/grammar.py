"""Constrained decoding for `loom serve`: `response_format` (a JSON schema, any JSON object, a regex or a Lark
grammar) and forced tool calls, compiled by llguidance into a matcher per request whose token mask the engine
applies to that row's logits before it samples (loom.engine.sampling.constrain).

Why llguidance (not xgrammar): a self-contained wheel with no torch or transformers dependency (xgrammar's wheels
are built against torch, and its tokenizer bridge reads transformers' tokenizers), it computes a mask for a
50k vocabulary in tens of microseconds without precomputation per grammar, its JSON-schema compiler names the
keywords it does not implement, and vLLM and SGLang use it as a backend too.

The tokenizer bridge: a `tokenizers` tokenizer (byte-level BPE, any tokenizer.json) is handed to llguidance as
its JSON; a character vocabulary as its characters' UTF-8 bytes, end-of-text and the chat tokens as special
tokens (never text of the grammar). A grammar the vocabulary cannot write (a character vocabulary without `{`
for a JSON schema) is found before the request runs: no token of it starts an answer (a 400 saying so); one that
runs into such a dead end later ends there and is answered 400 too (Constraint.dead).

Each row's matcher advances lazily: `mask(tokens)` first consumes the row's tokens it has not seen, so the
engine only asks for masks (one call per constrained row per step) and never reports what it sampled. The mask
allows the row's stop tokens (end of turn, end of text) only where the grammar accepts: an answer ends exactly
when it is complete (or at max_tokens: finish_reason "length", as the OpenAI API answers).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from loom.serve.protocol import bad

# JSON compiled without free whitespace: an answer is compact JSON, and a sampled model cannot spend its
# max_tokens on spaces between the keys (a schema's own "x-guidance" options may say otherwise)
JSON_OPTIONS = {"whitespace_flexible": False}
UNIMPLEMENTED = "Unimplemented keys"  # llguidance's words for a schema keyword it does not compile


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise bad(
            "constrained decoding (response_format, forced tool calls) needs llguidance, which this server "
            "does not have: pip install 'loom[serve]'",
            "response_format",
            "unsupported_field",
        ) from None
    return llguidance


class _CharVocab:
    """A character vocabulary as llguidance's TokenizerWrapper reads one."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_token_id = tok.eot_id
        self.bos_token_id = None
        self.tokens = [c.encode("utf-8") for c in tok.chars] + [tok.eot.encode("utf-8")]
        self.tokens += [t.encode("utf-8") for t in tok.specials]
        self.special_token_ids = [tok.eot_id, *tok.special_ids.values()]

    def __call__(self, text: bytes | str) -> list[int]:
        text = text.decode("utf-8", errors="ignore") if isinstance(text, bytes) else text
        return [self.tok.stoi[c] for c in text if c in self.tok.stoi]


class Grammars:
    """The served tokenizer's bridge to llguidance (built once, on the first constrained request), and the
    grammars of requests compiled and checked against it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltok = None

    def lltokenizer(self):
        if self._lltok is None:
            llg = _llguidance()
            tok = self.tokenizer
            if hasattr(tok, "chars"):  # loom.data.tokenizers.CharTokenizer
                self._lltok = llg.LLTokenizer(llg.TokenizerWrapper(_CharVocab(tok)), n_vocab=tok.vocab_size)
            else:  # HFTokenizer: its tokenizer.json, as llguidance reads Hugging Face tokenizers
                self._lltok = llg.LLTokenizer(tok.tok.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eot_id)
        return self._lltok

    # ------------------------------------------------------------------------------- grammars from requests
    def response_format(self, value) -> str | None:
        """The grammar of a request's response_format (None: free text), or a 400 naming what is wrong."""
        if value is None:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            raise bad("'response_format' must be an object with a 'type'", "response_format")
        kind = value["type"]
        llg = _llguidance()
        if kind == "text":
            return None
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad(
                    "'response_format.json_schema' must be an object {name, schema, strict} whose 'schema' "
                    "is a JSON schema (an object)",
                    "response_format",
                    "invalid_schema",
                )
            return self.json_schema(spec.get("schema", {}), "response_format")
        if kind == "regex":  # loom's extension (vLLM's guided_regex)
            return self._checked(llg.LLMatcher.grammar_from_regex(_text(value, "regex")), "regex")
        if (
            kind == "grammar"
        ):  # loom's extension: a Lark grammar in llguidance's dialect (vLLM's guided_grammar)
            return self._checked(llg.LLMatcher.grammar_from_lark(_text(value, "grammar")), "grammar")
        raise bad(
            f"'response_format.type' must be text, json_object, json_schema, regex or grammar, got {kind!r}",
            "response_format",
        )

    def json_schema(self, schema: dict, param: str) -> str:
        """A JSON schema's grammar; a schema llguidance cannot read is a 400: unsupported_schema_feature
        naming the keywords it does not implement, else invalid_schema with its reason."""
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise bad(f"invalid JSON schema: {e}", param, "invalid_schema") from None
        error = self.problem(grammar)
        if error and UNIMPLEMENTED in error:
            raise bad(
                f"the JSON schema uses a feature the grammar library (llguidance) cannot compile: {error}",
                param,
                "unsupported_schema_feature",
            )
        if error:
            raise bad(f"invalid JSON schema: {error}", param, "invalid_schema")
        return grammar

    def free_text(self) -> str:
        """Any text (no special token: tool_choice none keeps the model from opening a call)."""
        return _llguidance().LLMatcher.grammar_from_regex(r"(.|\n)*")

    def lark(self, text: str, param: str) -> str:
        """A Lark grammar (llguidance's dialect: %json, <[token id]>) checked; a 400 naming `param` otherwise."""
        grammar = _llguidance().LLMatcher.grammar_from_lark(text)
        error = self.problem(grammar)
        if error:
            code = "unsupported_schema_feature" if UNIMPLEMENTED in error else "invalid_schema"
            raise bad(f"the {param} cannot be compiled into a grammar: {error}", param, code)
        return grammar

    def problem(self, grammar: str) -> str | None:
        """Why llguidance refuses a grammar (its first error), else None."""
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer())
        return (messages[0] if messages else "invalid grammar") if is_error else None

    def _checked(self, grammar: str, what: str) -> str:
        error = self.problem(grammar)
        if error:
            raise bad(f"invalid {what}: {error}", "response_format", "invalid_grammar")
        return grammar

    # ------------------------------------------------------------------------------- constraints of rows
    def constraint(self, grammar: str, stop_ids: Iterable[int]) -> Constraint:
        llg = _llguidance()
        matcher = llg.LLMatcher(self.lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise bad(
                f"the grammar cannot be compiled: {matcher.get_error()}", "response_format", "invalid_grammar"
            )
        return Constraint(matcher, frozenset(stop_ids), self.vocab_size, self.tokenizer)

    def check_expressible(self, grammar: str, stop_ids: Iterable[int], param: str) -> None:
        """A 400 when no token of the vocabulary starts an answer the grammar allows (a character vocabulary
        without the characters JSON is written with)."""
        c = self.constraint(grammar, stop_ids)
        c.mask([])
        if c.dead is not None:
            forced = c.matcher.compute_ff_bytes().decode("utf-8", errors="replace")
            what = f" (it must start with {forced!r})" if forced else ""
            raise bad(
                f"the model's tokenizer cannot express this grammar: no token of its vocabulary starts an "
                f"answer the grammar allows{what}; a {self.tokenizer.kind} vocabulary of "
                f"{self.tokenizer.vocab_size} tokens lacks the characters it needs",
                param,
                "grammar_not_expressible",
            )


def _text(value: dict, key: str) -> str:
    text = value.get(key)
    if not isinstance(text, str) or not text:
        raise bad(
            f"'response_format' of type {value['type']} needs a non-empty string '{key}'", "response_format"
        )
    return text


class Constraint:
    """One row's grammar state (loom.engine.Request.constraint): `mask(tokens)` is the tokens the row may
    sample next, after its `tokens` so far."""

    def __init__(self, matcher, stop_ids: frozenset[int], vocab_size: int, tokenizer=None):
        self.matcher, self.stop_ids, self.vocab_size, self.tokenizer = (
            matcher,
            stop_ids,
            vocab_size,
            tokenizer,
        )
        self.seen = 0  # tokens of the row consumed by the matcher
        self.dead: str | None = None  # why the answer could not go on within the grammar

    def mask(self, tokens: list[int]) -> torch.Tensor:
        """(vocab_size,) bool: what the row may sample after `tokens`. A dead end (no token continues the
        grammar, or a token it refused) allows the stop tokens alone: the row ends, `dead` says why."""
        m = self.matcher
        for t in tokens[self.seen :]:
            if not m.consume_token(t) and self.dead is None:
                error = (m.get_error() or "").splitlines()[:1]  # its first line: the rest is a state dump
                self.dead = f"the token {self._text([t])!r} broke the grammar ({''.join(error)})"
        self.seen = len(tokens)
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        accepting = self.dead is None and m.is_accepting()
        if self.dead is None and not m.is_stopped():
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            n = min(len(bits), self.vocab_size)
            allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        stops = [s for s in self.stop_ids if s < self.vocab_size]
        allowed[stops] = False  # a stop token ends the answer: only where the grammar accepts it
        if not bool(allowed.any()) and not accepting and self.dead is None:
            self.dead = f"no token of the vocabulary continues the grammar after {self._text(tokens)!r}"
        if accepting or self.dead is not None:
            allowed[stops] = True
        return allowed

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else str(tokens)

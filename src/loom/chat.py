"""`loom chat RUN`: talk to a fine-tuned run, turn by turn, with the KV cache and streaming tokens.

A session holds the conversation (an optional system message, then user and assistant turns) and renders it
with the run's chat template (loom.data.chat: the tokens its chat data was prepared with, recorded in the run's
tokenizer/meta.json). Each reply continues the rendered prompt (which ends with the assistant's start token)
until the assistant's end-of-turn token or end-of-text, or max_new_tokens. A run trained on plain text (no chat
tokens) has no turns to end: it is refused.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loom.errors import LoomError


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 256
    seed: int = 1337


def chat_template(tokenizer, meta: dict, run_dir) -> object:
    """The run's chat template (loom's, or the tokenizer's own: loom.data.chat.chat_template_of), or a
    LoomError (exit 2) for a base model."""
    from loom.data.chat import chat_template_of

    if tokenizer is None or not isinstance(meta.get("chat"), dict):
        raise LoomError(
            f"run '{run_dir}' is a base model: its tokenizer has no chat tokens, so it has no turns to take",
            hint="fine-tune it on conversations first: loom data prepare --chat ... --tokenizer RUN, then "
            "loom sft --data.path=CHAT_DATA --model.init_from=run:RUN",
        )
    return chat_template_of(tokenizer, meta)


@dataclass
class ChatSession:
    """One conversation with a model: `reply(text)` adds the user's turn and the model's answer."""

    model: torch.nn.Module
    template: object
    tokenizer: object
    device: torch.device
    sampling: Sampling = field(default_factory=Sampling)
    system: str | None = None
    extends_context: bool = False
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.generator = torch.Generator(device=self.device).manual_seed(self.sampling.seed)
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str, on_text: Callable[[str], None] | None = None) -> str:
        """The assistant's answer to `text` (streamed to on_text piece by piece as it is sampled)."""
        from loom.generate import iter_tokens

        turn = {"role": "user", "content": text}
        ids = self.template.prompt([*self.messages, turn])  # a text the tokenizer cannot encode fails here
        block = self.model.cfg.block_size
        if len(ids) >= block and not self.extends_context:
            ids = ids[-(block - 1) :]  # learned positions: the newest block_size tokens of the conversation
        s = self.sampling
        stop = frozenset(self.template.stop_ids)
        out: list[int] = []
        shown = ""
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        tokens = iter_tokens(
            self.model,
            idx,
            s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            generator=self.generator,
            vocab_size=self.tokenizer.vocab_size,
            extends_context=self.extends_context,
            stop_ids=stop,
        )
        self.messages.append(turn)
        try:
            for nxt in tokens:  # the engine ends the stream at the end of turn (not yielded)
                token = int(nxt[0, 0])
                if token in stop:  # a stream that yields it anyway (a scripted one) ends there too
                    break
                out.append(token)
                text_so_far = self.tokenizer.decode(out)
                if on_text is not None and not text_so_far.endswith("\ufffd"):  # a character not yet complete
                    on_text(text_so_far[len(shown) :])
                    shown = text_so_far
            answer = self.tokenizer.decode(out)
            if on_text is not None and len(answer) > len(shown):
                on_text(answer[len(shown) :])
        except KeyboardInterrupt:  # Ctrl-C stops this answer only: the conversation keeps what was shown
            self._stopped(shown)
            raise
        if answer:
            self.messages.append({"role": "assistant", "content": answer})
        else:  # an empty message would make every later prompt of the conversation invalid: the turn is undone
            self.messages.pop()
        return answer

    def _stopped(self, shown: str) -> None:
        """An answer stopped by the user: the part shown is the assistant's turn; none shown, the user's turn
        is taken back (a message may not be empty), so the conversation is as it was."""
        if shown:
            self.messages.append({"role": "assistant", "content": shown})
        else:
            self.messages.pop()


COMMANDS = (
    ("/help", "lists these commands"),
    ("/reset", "starts a new conversation"),
    ("/quit", "leaves (so do /exit and Ctrl-D)"),
)
HELP = (
    "commands: "
    + ", ".join(f"{name} {what}" for name, what in COMMANDS)
    + "; Ctrl-C stops an answer; a line that starts with // is sent as text, with one /\n"
)


def _command(line: str) -> str | None:
    """The /command a line is (its first word: a slash and a name, '/reset'), else None: '/etc/hosts?' and
    '/ x' are text."""
    first = line.split(maxsplit=1)[0] if line.strip() else ""
    return first if re.fullmatch(r"/[A-Za-z][\w-]*", first) else None


def repl(session: ChatSession, read: Callable[[str], str] = input, write=sys.stdout) -> None:
    """The interactive loop: a line is the user's turn, a /command is not (COMMANDS; an unknown one is said so,
    never sent to the model); Ctrl-C during an answer stops it, at the prompt leaves, as end of input does."""
    write.write("loom chat: /help lists the commands, /reset starts a new conversation, /quit leaves\n")
    while True:
        try:
            line = read("you> ")
        except EOFError:
            write.write("\n")
            return
        cmd = _command(line)
        if cmd in ("/quit", "/exit"):
            return
        if cmd == "/reset":
            session.reset()
            write.write("(new conversation)\n")
        elif cmd == "/help":
            write.write(HELP)
        elif cmd is not None:
            write.write(f"unknown command {cmd} (nothing was sent); " + HELP)
        elif line.strip():
            _answer(session, line[1:] if line.startswith("//") else line, write)


def _answer(session: ChatSession, line: str, write) -> None:
    write.write("assistant> ")
    try:
        if not session.reply(line, lambda piece: (write.write(piece), write.flush())):
            write.write("(no answer)")
    except LoomError as e:  # a turn the tokenizer cannot encode: say so, the conversation goes on
        write.write(f"(not sent: {e})")
    except KeyboardInterrupt:  # the answer is stopped, the conversation goes on
        write.write(" [stopped]")
    write.write("\n")

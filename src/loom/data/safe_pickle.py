"""Read nanogpt's `meta.pkl` without unpickling: a tiny interpreter for the opcodes of a dict of ints and strs.

nanogpt's data/shakespeare_char/prepare.py writes `pickle.dump({'vocab_size': int, 'itos': {int: str},
'stoi': {str: int}}, f)`. `pickle.load` on a file from elsewhere can run any code (a `__reduce__` that calls
os.system), so loom never calls it. `pickletools.genops` only *parses* the opcode stream; the loop below
builds dicts, ints and strs from it and refuses every other opcode (GLOBAL, STACK_GLOBAL, REDUCE, BUILD,
INST, OBJ, NEWOBJ, EXT*, PERSID, ...) before anything could be imported or called.
"""

from __future__ import annotations

import pickletools
from pathlib import Path

from loom.errors import LoomError

_IGNORED = {"PROTO", "FRAME", "STOP"}
_SCALARS = {
    # ints (INT in protocol 0 also spells booleans as 00/01, which genops returns as bool: refused below)
    "INT",
    "LONG",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "LONG4",
    # strs
    "UNICODE",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
}
_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET = {"GET", "BINGET", "LONG_BINGET"}
MAX_BYTES = 64 << 20  # a character vocabulary is kilobytes; refuse to parse anything absurd


def _pop_to_mark(stack: list, marks: list[int], path: Path) -> list:
    if not marks:
        raise LoomError(f"'{path}' is a malformed pickle (no MARK before a collection)")
    start = marks.pop()
    items = stack[start:]
    del stack[start:]
    return items


def _set_items(d: object, items: list, path: Path) -> None:
    if not isinstance(d, dict) or len(items) % 2:
        raise LoomError(f"'{path}' is a malformed pickle (dict items without a dict)")
    for k, v in zip(items[::2], items[1::2], strict=True):
        if not isinstance(k, (int, str)):
            raise LoomError(f"'{path}' has a dict key of type {type(k).__name__}; only int and str are read")
        d[k] = v


def load_restricted(data: bytes, path: str | Path = "meta.pkl") -> dict:
    """The dict pickled in `data`, built only from dict/int/str opcodes; anything else is a LoomError.

    Nothing is imported or called: the bytes are parsed, never unpickled.
    """
    path = Path(path)
    if len(data) > MAX_BYTES:
        raise LoomError(f"'{path}' is {len(data)} bytes: too large for a nanogpt meta.pkl")
    stack: list = []
    marks: list[int] = []
    memo: dict[int, object] = {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in _IGNORED:
                continue
            if name in _SCALARS:
                if isinstance(arg, bool) or not isinstance(arg, (int, str)):
                    raise LoomError(
                        f"'{path}' holds a {type(arg).__name__}; only dicts of ints and strs are read"
                    )
                stack.append(arg)
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "DICT":
                d: dict = {}
                _set_items(d, _pop_to_mark(stack, marks, path), path)
                stack.append(d)
            elif name == "SETITEM":
                v, k = stack.pop(), stack.pop()
                _set_items(stack[-1], [k, v], path)
            elif name == "SETITEMS":
                items = _pop_to_mark(stack, marks, path)
                _set_items(stack[-1], items, path)
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in _PUT:
                memo[int(arg)] = stack[-1]
            elif name in _GET:
                stack.append(memo[int(arg)])
            else:
                raise LoomError(
                    f"'{path}' uses the pickle opcode {name}, which can import or run code: refused",
                    hint="loom reads only a dict of ints and strs from meta.pkl; if you trust the file, "
                    "re-save its vocabulary as meta.json (json.dump of the same dict)",
                )
    except (ValueError, IndexError, KeyError) as e:  # genops' malformed-stream errors, bad memo refs
        raise LoomError(f"'{path}' is not a readable pickle: {e}") from None
    if len(stack) != 1 or not isinstance(stack[0], dict):
        raise LoomError(f"'{path}' does not hold a single dict (nanogpt's meta.pkl does)")
    return stack[0]


def read_meta_pkl(path: str | Path) -> dict:
    """nanogpt's meta.pkl as a dict, read with `load_restricted` (never `pickle.load`)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LoomError(f"cannot read '{path}': {e}") from None
    return load_restricted(data, path)

"""Built-in environments for multi-turn RL (rl.env=loom.rl.envs:Calculator); the protocol is loom.rl.env's.

Calculator: arithmetic as a tool. The model may write a call, `<calc>123*45</calc>` (its turn ends at
`</calc>`, the environment's `stop`), and reads `<result>5535</result>` back; a turn without a call is its final
answer, scored 1.0 when its last number equals the row's `answer` field, else 0.0, and the episode ends. A
malformed call (no expression, characters other than digits, + - * / ( ) and spaces, a division by zero, a
number over 12 digits) is answered `<result>error</result>` and counted in `tool_errors`, never raised.
"""

from __future__ import annotations

import ast
import operator
import re

CALL_START, CALL_END = "<calc>", "</calc>"
RESULT_START, RESULT_END = "<result>", "</result>"
ERROR = "error"

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv,
}
_ALLOWED = re.compile(r"^[0-9+\-*/() ]+$")
_MAX = 10**12  # a result past 12 digits is an error: the tool computes small products, not bignums
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate(expr: str) -> int | float | None:
    """The value of an arithmetic expression of integers (+ - * / //, parentheses), or None when it is not one
    (a name, a call, a power, a division by zero, a number past 12 digits): never Python's eval."""
    expr = expr.strip()
    if not expr or len(expr) > 64 or not _ALLOWED.match(expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("not arithmetic")

    try:
        value = ev(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    if abs(value) >= _MAX:
        return None
    if isinstance(value, float):
        value = int(value) if value.is_integer() else round(value, 6)
    return value


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


class Calculator:
    """A calculator tool (the module's docstring). One instance per episode."""

    stop = (CALL_END,)

    def __init__(self, answer_field: str = "answer"):
        self.answer_field = answer_field
        self.answer: str | None = None
        self.tool_errors = 0
        self.calls = 0

    def reset(self, row: dict) -> str:
        self.answer = str(row[self.answer_field]).strip()
        return ""  # the prompt says it all; nothing more to read before the first turn

    def step(self, text: str) -> tuple[str | None, float, bool]:
        start = text.rfind(CALL_START)
        if start >= 0:  # a tool call: answered, the episode goes on
            self.calls += 1
            body = text[start + len(CALL_START) :]
            end = body.find(CALL_END)
            value = evaluate(body[:end]) if end >= 0 else None
            if value is None:
                self.tool_errors += 1
                return f"{RESULT_START}{ERROR}{RESULT_END}", 0.0, False
            return f"{RESULT_START}{value}{RESULT_END}", 0.0, False
        got = last_number(text)
        return None, float(got is not None and got == self.answer), True


# the environments rl.env takes by a short name (rl.env=calculator), besides any module:Class
BUILT_IN = {"calculator": Calculator}

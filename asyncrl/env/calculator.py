"""A calculator tool: the model asks for arithmetic mid-answer and reads the value back.

    model: ... the area is <calc>48*52</calc>      (the stop string "</calc>" ends the turn)
    env:   <result>2496</result>                   (appended; the model's next turn goes on)
    model: ... so the answer is \\boxed{2496}       (no call: the episode is done)

Only a call that ends the turn counts (the stop string makes every call end one); its expression
is what lies between the last "<calc>" and that "</calc>". It is arithmetic on int and float
literals: + - * / // % **, unary minus and plus, parentheses. It is parsed with `ast` and walked
here, never eval'd; names, calls, attributes and everything else are refused. Every intermediate
value is held under 1e100 and a power is checked before it is computed, so `9**9**9` fails at
once instead of hanging the step. Whole values below 1e16 print as ints (`8/2` -> 4), other
floats with 10 significant digits. A bad expression is answered `<result>error: why</result>`.

The call limit (`max_calls`, tool_calls.py, the same in python_tool.py): the first call past it is
refused with `error: too many calls` and the episode goes on, so that the model can still give
its final answer; a second call past it ends the episode. (A step that ends the episode has its
observation dropped, env/base.py, so ending at the first refused call would leave the model's
response ending in a call it never saw answered.)

Reward: None. The final answer is scored by the run's verifier like any single-turn answer.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from asyncrl.env.tool_calls import ToolEnvironment

MAX_EXPRESSION_CHARS = 500  # also keeps ast's and our recursion shallow
MAX_MAGNITUDE = 1e100  # a float: compares exactly with ints of any size
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalcError(ValueError):
    """An expression the calculator will not evaluate; the message is shown to the model."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (module docstring); raises CalcError."""
    expression = expression.strip()
    if not expression:
        raise CalcError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError("expression too long")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):
        raise CalcError("syntax error") from None
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("result too large") from None
    except RecursionError:
        raise CalcError("expression too deep") from None


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass; complex, str are out
            raise CalcError(f"not a number: {node.value!r:.20}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalcError("^ is not a power, use **")
    raise CalcError(f"not allowed: {_describe(node)}")


def _check_power(base: int | float, exponent: int | float) -> None:
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    if base < 0 and exponent != int(exponent):
        raise CalcError("complex result")
    # log10 of the result, before computing it: 9**9**9 would take minutes and gigabytes
    if base not in (0, 1, -1) and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise OverflowError


def _checked(value: int | float) -> int | float:
    if isinstance(value, complex):
        raise CalcError("complex result")
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise OverflowError
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"name {node.id!r:.20}"
    if isinstance(node, ast.Call):
        return "function call"
    if isinstance(node, ast.Attribute):
        return "attribute"
    return type(node).__name__.lower()


def format_value(value: int | float) -> str:
    """Whole values as ints (3.0 -> "3"), others with 10 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class Calculator(ToolEnvironment):
    """The `calculator` environment: `Calculator(metadata, max_calls=4)`, one per episode."""

    call_tag, answer_tag = "calc", "result"

    def __init__(self, metadata: dict[str, Any], max_calls: int = 4):
        super().__init__(max_calls)

    def answer(self, body: str) -> tuple[str, bool]:
        try:
            return format_value(evaluate(body)), False
        except CalcError as e:
            return f"error: {e}", True

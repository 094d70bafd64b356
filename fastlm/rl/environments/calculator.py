"""The built-in calculator tool: a Python arithmetic expression, evaluated without `eval`.

The expression is parsed with `ast` and walked by a small interpreter that knows only numbers, + - * / // %
**, unary signs and a few math functions (abs, min, max, round, sqrt): no names, attributes, subscripts,
strings, containers, comprehensions or lambdas exist for it, so there are no builtins to reach and nothing to
escape into. Limits keep a policy's expression cheap: its length, the tree's depth, the size of every
intermediate number (a power's result size is bounded before it is computed, so 9**9**9 is refused, not
run), the arguments of every function (round's digits: `round(7, -10**59)` would compute 10**(10**59))
and a deadline on the thread's CPU time, checked at every node. The deadline cannot interrupt one
operation, so the bounds on the operands are what keep each operation cheap: every operation on numbers
within the bounds takes microseconds. Every failure is a short "error: ..." string, which
is what the model reads back as the tool's result.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_DIGITS = 60
MAX_MAGNITUDE = 10**MAX_DIGITS  # |value| of any intermediate number
MAX_SECONDS = 0.05  # CPU time of the evaluating thread (a busy machine must not time out a small sum)

BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS: dict[str, tuple[Callable[..., float], int, int]] = {  # name: (function, min args, max args)
    "abs": (abs, 1, 1), "min": (min, 1, 8), "max": (max, 1, 8), "round": (round, 1, 2), "sqrt": (math.sqrt, 1, 1),
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is what the model reads."""


def _number(value: float) -> float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("a number in the expression grew too large")
    return value


def _power(base: float, exponent: float) -> float:
    """base ** exponent, refused when the result's size is out of bounds (checked before computing it)."""
    if base != 0 and abs(base) != 1 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculatorError("a power is too large")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("a fractional power of a negative number is not a real number")
    return result


def _check_round_digits(digits: float) -> None:
    """round(x, n) on an int computes 10**-n, which `round(7, -10**59)` makes endless (and C code that the time
    budget cannot interrupt): n is an integer of at most as many digits as the largest number allowed."""
    if not isinstance(digits, int):
        raise CalculatorError("round's second argument must be an integer")
    if abs(digits) > MAX_DIGITS:
        raise CalculatorError(f"round's second argument must be between -{MAX_DIGITS} and {MAX_DIGITS}")


class _Evaluator:
    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def __call__(self, node: ast.AST, depth: int = 0) -> float:
        if depth > MAX_DEPTH:
            raise CalculatorError("the expression is nested too deeply")
        if time.thread_time() > self.deadline:
            raise CalculatorError("the expression took too long")
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _number(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = self(node.left, depth + 1), self(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                return _number(_power(left, right))
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalculatorError("division by zero")
            return _number(BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](self(node.operand, depth + 1))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
                and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)):
            function, low, high = FUNCTIONS[node.func.id]
            if not low <= len(node.args) <= high:
                raise CalculatorError(f"{node.func.id} takes {low} to {high} arguments")
            arguments = [self(argument, depth + 1) for argument in node.args]
            if node.func.id == "round" and len(arguments) == 2:
                _check_round_digits(arguments[1])
            try:
                return _number(function(*arguments))
            except (ValueError, OverflowError) as error:
                raise CalculatorError(f"{node.func.id}: {error}") from error
        raise CalculatorError(f"'{type(node).__name__}' is not allowed (numbers, + - * / // % **, parentheses and "
                              f"{', '.join(FUNCTIONS)} only)")


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression, or a `CalculatorError`."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise CalculatorError(f"cannot parse the expression ({type(error).__name__})") from error
    try:
        return _Evaluator(time.thread_time() + MAX_SECONDS)(tree.body)
    except ZeroDivisionError as error:
        raise CalculatorError("division by zero") from error
    except (OverflowError, RecursionError) as error:
        raise CalculatorError(f"the expression cannot be evaluated ({type(error).__name__})") from error


def format_number(value: float) -> str:
    """Integers exactly; other floats with 10 significant digits (an integral float prints as an integer)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".10g")


def calculator(expression: str) -> str:
    """The tool: the expression's value as text, or "error: ..." (what the model reads back)."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as error:
        return f"error: {error}"

"""What the math verifier checks around math-verify: a bound on nesting before anything is parsed,
and two second chances for answers math-verify rejects although a careful grader would not.

- `too_deep`: the LaTeX parser and sympy take time that grows fast with nesting: 8 nested
  `\\sin(` took the whole 10 s deadline here, 20 nested braces too, and 5 nested exponents build
  numbers no machine holds. Answers nested deeper than MAX_NESTING brackets or MAX_EXPONENTS
  exponents are refused (bad_input) before parsing, in microseconds; no answer in the test table
  nests deeper than 4.
- `number_in_words`: when the gold is a bare number, an answer that is that number with words or
  units around it in `\\text{}` (`\\text{5 cm}`, `\\text{The answer is } 5`), which math-verify
  reads as a product of symbols. Exactly one number, and no word that changes its meaning (not,
  or, than, least, approximately...).
- `equal_as_constants`: expressions of special constants that sympy's simplification does not
  bring to the gold (`e^{i\\pi}` with i read as a symbol, cos(pi/7)cos(2pi/7)cos(4pi/7)), and
  degrees in trigonometric functions (`\\cos 60^\\circ`, which math-verify reads as cos(60)):
  both sides evaluated to DIGITS digits and compared to within 10^-(DIGITS-10), only when the
  gold has no free symbols and the answer none but i. Decimals count as what they say (0.1 is
  1/10), so a decimal approximation of pi fails as it should.
"""

from __future__ import annotations

import re
from fractions import Fraction

import sympy

MAX_NESTING = 6
MAX_EXPONENTS = 3
DIGITS = 60
_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|textsf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad\b|~|\\\$|\$")
_TOKEN = re.compile(r"\s*(?:(?P<frac>-?\\[dt]?frac\{(?P<fnum>\d+)\}\{(?P<fden>\d+)\})"
                    r"|(?P<num>-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?)"
                    r"|(?P<word>[A-Za-z]+(?:'[a-z]+)?)|(?P<power>\^\s*(?:\{\d+\}|\d))|(?P<punct>[:.,;!?()]))")
_CHANGES_MEANING = {"not", "no", "never", "except", "than", "least", "most", "more", "less", "fewer", "greater",
                    "over", "under", "between", "or", "nor", "neither", "up", "below", "above", "approximately",
                    "about", "around", "nearly", "almost", "roughly", "maybe", "negative", "minus", "plus",
                    "times", "divided", "square", "cube", "root", "half", "double", "twice", "percent"}
_BARE_NUMBER = re.compile(r"^(-?)(?:(\d+(?:\.\d+)?)|\\[dt]?frac(?:\{(\d+)\}\{(\d+)\}|(\d)(\d))|(\d+)/(\d+))$")
_DEGREES = re.compile(r"(\d+(?:\.\d+)?)\s*(?:\^\s*\{?\s*\\circ\s*\}?|°)")
_TRIG = re.compile(r"\\(?:sin|cos|tan|cot|sec|csc)\b")


def too_deep(latex: str) -> bool:
    """Whether brackets ((), [], {}, \\{\\}) nest deeper than MAX_NESTING or exponent groups
    (^{...}) deeper than MAX_EXPONENTS; one pass, no parsing."""
    stack: list[bool] = []  # per open bracket: is it an exponent's group
    exponents, i, n = 0, 0, len(latex)
    while i < n:
        c = latex[i]
        if c in "([{":
            exponent = c == "{" and latex[:i].rstrip().endswith("^")
            stack.append(exponent)
            exponents += exponent
            if len(stack) > MAX_NESTING or exponents > MAX_EXPONENTS:
                return True
        elif c in ")]}" and stack:
            exponents -= stack.pop()
        i += 1
    return False


def bare_number(gold: str) -> Fraction | None:
    """The gold's value when it is a bare number: 12, -0.5, \\frac{3}{4}, 3/4."""
    m = _BARE_NUMBER.match("".join(gold.split()))
    if m is None:
        return None
    sign, decimal, *parts = m.groups()
    num, den = [int(x) for x in parts if x is not None] if not decimal else (0, 1)
    if not decimal and den == 0:
        return None
    value = Fraction(decimal) if decimal else Fraction(num, den)
    return -value if sign else value


def number_in_words(answer: str) -> Fraction | None:
    """The one number of an answer that holds \\text{} words or units around it, else None."""
    if not _TEXT.search(answer):
        return None
    text = _SPACING.sub(" ", _TEXT.sub(lambda m: f" {m.group(1)} ", answer))
    numbers, last, pos = [], None, 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            return None  # anything else (an operator, a command): not just a number in words
        kind = m.lastgroup
        if kind == "frac":
            if int(m.group("fden")) == 0:
                return None
            sign = -1 if m.group("frac").startswith("-") else 1
            numbers.append(sign * Fraction(int(m.group("fnum")), int(m.group("fden"))))
        elif kind == "num":
            numbers.append(Fraction(m.group("num").replace(",", "")))
        elif kind == "word" and m.group("word").lower() in _CHANGES_MEANING:
            return None
        elif kind == "power" and last != "word":
            return None  # an exponent of the number itself
        last, pos = kind, m.end()
    return numbers[0] if len(numbers) == 1 else None


def with_degrees_as_radians(answer: str) -> str | None:
    """The answer with 60^\\circ as (60\\pi/180), when it applies a trigonometric function."""
    if not _TRIG.search(answer) or not _DEGREES.search(answer):
        return None
    return _DEGREES.sub(lambda m: f"({m.group(1)}\\pi/180)", answer)


def equal_as_constants(pred, gold) -> bool:
    """Whether two parsed expressions without variables have the same value (see the module
    docstring); False for anything else."""
    if not (isinstance(pred, sympy.Expr) and isinstance(gold, sympy.Expr)) or gold.free_symbols:
        return False
    if any(s.name != "i" for s in pred.free_symbols):
        return False
    pred = pred.subs({s: sympy.I for s in pred.free_symbols})  # math-verify's i is a plain symbol
    if pred.is_Rational and gold.is_Rational:
        return pred == gold  # exact numbers (e^{i pi} is -1 once i is the imaginary unit)
    a, b = (_exact(x).evalf(DIGITS) for x in (pred, gold))
    if not (a.is_number and b.is_number):
        return False
    return bool(abs(a - b) <= sympy.Float(10, DIGITS) ** (10 - DIGITS) * max(1, abs(b)))


def _exact(expr):
    """Floats as the decimals they were written as (0.1 is 1/10, not its binary neighbour)."""
    floats = expr.atoms(sympy.Float)
    return expr.xreplace({f: sympy.Rational(str(f)) for f in floats}) if floats else expr

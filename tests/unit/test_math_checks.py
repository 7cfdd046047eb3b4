"""The math verifier's checks around math-verify, alone: the nesting bound, bare-number golds, a
number among words, degrees, and equality of constant expressions (tests/unit/test_reward_math.py
grades them through the verifier)."""

from fractions import Fraction

import pytest
import sympy

from asyncrl.reward import math_checks as mc


@pytest.mark.parametrize("latex, deep", [
    ("(" * 6 + ")" * 6, False), ("(" * 7 + ")" * 7, True),
    (r"\{[(\{[(1)]\}\)]\}", False), (r"{[({[(({1}))]})]}", True),  # 8 open at once
    ("2^{2^{2^{2}}}", False), ("2^{2^{2^{2^{2}}}}", True),  # exponent groups: 3 allowed, 4 not
    ("2^ {x} + (((1)))", False), ("))))((((", False),  # unbalanced closers do not count
])
def test_too_deep(latex, deep):
    assert mc.too_deep(latex) is deep


@pytest.mark.parametrize("gold, value", [
    ("12", Fraction(12)), ("-0.5", Fraction(-1, 2)), (r"\frac{3}{4}", Fraction(3, 4)), (r"\dfrac34", Fraction(3, 4)),
    ("3/4", Fraction(3, 4)), (r"- \frac{1}{2}", Fraction(-1, 2)), ("x", None), ("1,000", None), (r"\frac{3}{0}", None),
    (r"\sqrt{2}", None), ("2+3", None),
])
def test_bare_number(gold, value):
    assert mc.bare_number(gold) == value


@pytest.mark.parametrize("answer, value", [
    (r"\text{5 cm}", Fraction(5)), (r"12\,\mathrm{kg}", Fraction(12)), (r"\text{1,024 bytes}", Fraction(1024)),
    (r"-\frac{3}{4}\text{ cups}", Fraction(-3, 4)), (r"\text{area: } 9\text{ m}^2", Fraction(9)),
    ("5", None),  # no \text: math-verify's business
    (r"\text{5 or 6}", None), (r"\text{not 5}", None), (r"\text{5}^2", None), (r"\text{five}", None),
    (r"\text{5} + 1", None), (r"\frac{3}{0}\text{ cups}", None),
])
def test_number_in_words(answer, value):
    assert mc.number_in_words(answer) == value


def test_degrees_only_inside_trigonometric_functions():
    assert mc.with_degrees_as_radians(r"\cos 60^\circ") == r"\cos (60\pi/180)"
    assert mc.with_degrees_as_radians(r"\sin(30^{\circ})+\tan 45°") == r"\sin((30\pi/180))+\tan (45\pi/180)"
    assert mc.with_degrees_as_radians(r"90^\circ") is None


def test_equal_as_constants():
    i, x = sympy.Symbol("i"), sympy.Symbol("x")
    assert mc.equal_as_constants(sympy.exp(sympy.pi * i), sympy.Integer(-1))
    assert mc.equal_as_constants(sympy.cos(sympy.pi / 7) * sympy.cos(2 * sympy.pi / 7) * sympy.cos(4 * sympy.pi / 7),
                                 sympy.Rational(-1, 8))
    assert not mc.equal_as_constants(sympy.Float("3.14159265358979"), sympy.pi)  # a decimal is what it says
    assert not mc.equal_as_constants(sympy.Rational(1, 3), sympy.Float("0.333333333333333"))
    assert not mc.equal_as_constants(x + 1, sympy.Integer(2))  # variables: not a constant expression
    assert not mc.equal_as_constants(sympy.Integer(2), x)
    assert not mc.equal_as_constants(sympy.FiniteSet(1), sympy.Integer(1))

"""The math verifier (Skywork-OR1 section 7.1) against a human grader's verdicts.

Each expected reward is what a careful grader says, not what the code happens to return; where
math-verify disagrees the case is marked xfail(strict=True) with the reason.
"""

import signal
import time
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncrl.reward.math_reward import MathReward

OUTCOMES = {"string_match", "verified", "wrong", "no_boxed", "no_ground_truth", "parse_error",
            "bad_input", "verify_timeout"}


def xfail(param, reason):
    mark = pytest.mark.xfail(strict=True, reason=reason)
    return pytest.param(*param.values, id=param.id, marks=mark)


def case(response, gold, reward, id):
    return pytest.param(response, gold, reward, id=id)


EQUIVALENT = [
    case(r"\boxed{\frac{1}{2}}", "1/2", 1, "frac-vs-slash"),
    case(r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1, "dfrac-vs-frac"),
    case(r"\boxed{0.5}", r"\frac{1}{2}", 1, "decimal-vs-frac"),
    case(r"\boxed{\frac12}", "0.5", 1, "frac-no-braces-vs-decimal"),
    case(r"\boxed{1/2}", r"\frac{1}{2}", 1, "slash-vs-frac"),
    case(r"\boxed{\tfrac{3}{4}}", "0.75", 1, "tfrac-vs-decimal"),
    case(r"\boxed{2.50}", "2.5", 1, "trailing-zero-decimal"),
    case(r"\boxed{2.0}", "2", 1, "float-vs-integer"),
    case(r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 1, "radical-slash-vs-frac"),
    case(r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1, "nested-braces-unrationalized"),
    case(r"\boxed{3\sqrt{2}}", r"\sqrt{18}", 1, "radical-simplified"),
    case(r"\boxed{\sqrt[3]{8}}", "2", 1, "cube-root"),
    case(r"\boxed{2π}", r"2\pi", 1, "unicode-pi"),
    case(r"\boxed{\pi \cdot 2}", r"2\pi", 1, "pi-reordered"),
    case(r"\boxed{1.5\times10^{3}}", "1500", 1, "scientific-times"),
    case(r"\boxed{1.5 \cdot 10^3}", "1500", 1, "scientific-cdot"),
    case(r"\boxed{\{1,2\}}", r"\{2,1\}", 1, "set-order"),
    case(r"\boxed{2, 1}", "1, 2", 1, "answer-list-order"),
    case(r"\boxed{(0,1]}", "(0,1]", 1, "interval-same"),
    case(r"\boxed{x \in (0,1]}", "(0,1]", 1, "interval-with-membership"),
    case(r"\boxed{(1, 2)}", "(1,2)", 1, "tuple-spacing"),
    case(r"\boxed{\left(1,2\right)}", "(1,2)", 1, "tuple-left-right"),
    case(r"\boxed{50\%}", "50", 1, "percent-sign-vs-gold-number-accepted"),
    case(r"\boxed{50}", r"50\%", 1, "number-vs-gold-percent-accepted"),
    case(r"\boxed{0.5}", r"50\%", 1, "decimal-vs-gold-percent-accepted"),
    case(r"\boxed{5\text{ cm}}", "5", 1, "unit-text-cm"),
    case(r"\boxed{5 \text{ dollars}}", "5", 1, "unit-text-dollars"),
    case(r"\boxed{\$5}", "5", 1, "currency-sign"),
    case(r"\boxed{90^\circ}", "90", 1, "degree-sign"),
    case(r"\boxed{1{,}000}", "1000", 1, "thousands-separator-braced"),
    case(r"\boxed{1,000}", "1000", 1, "thousands-separator-comma"),
    case(r"\boxed{-3}", "-3", 1, "negative-integer"),
    case(r"\boxed{-\frac{1}{2}}", "-0.5", 1, "negative-frac-vs-decimal"),
    case(r"\boxed{\frac{-1}{2}}", r"-\frac12", 1, "negative-numerator"),
    case(r"\boxed{x=3}", "3", 1, "equation-vs-value"),
    case(r"\boxed{3}", "x=3", 1, "value-vs-gold-equation"),
    case(r"\boxed{(x+1)^2}", "x^2+2x+1", 1, "polynomial-factored"),
    case(r"\boxed{\begin{pmatrix}1&2\\3&4\end{pmatrix}}", r"\begin{bmatrix}1&2\\3&4\end{bmatrix}",
         1, "matrix-pmatrix-vs-bmatrix"),
    case(r"\boxed{\text{Monday}}", "Monday", 1, "text-answer"),
    case(r"\boxed{\infty}", r"\infty", 1, "infinity"),
    case(r"\boxed{3+2i}", "2i+3", 1, "complex-reordered"),
    case(r"\boxed{x + 1}", "x+1", 1, "whitespace-only-difference"),
]

WRONG = [
    case(r"\boxed{0.33}", r"\frac{1}{3}", 0, "third-vs-rounded-decimal"),
    case(r"\boxed{0.51}", "0.5", 0, "close-decimal"),
    case(r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0, "other-radical"),
    case(r"\boxed{(0,1)}", "[0,1]", 0, "open-vs-closed-interval"),
    case(r"\boxed{[0,1)}", "[0,1]", 0, "half-open-vs-closed-interval"),
    case(r"\boxed{1,3}", "1,2", 0, "list-one-element-differs"),
    case(r"\boxed{1}", "1,2", 0, "list-incomplete"),
    case(r"\boxed{1,2,3}", "1,2", 0, "list-extra-element"),
    case(r"\boxed{-3}", "3", 0, "sign-flipped"),
    case(r"\boxed{12.5}", "12", 0, "decimal-vs-integer"),
    case(r"\boxed{(2,1)}", "(1,2)", 0, "ordered-pair-swapped"),
    case(r"\boxed{x^2+2x}", "x^2+2x+1", 0, "polynomial-missing-term"),
    case(r"\boxed{\pi}", r"2\pi", 0, "pi-missing-factor"),
    case(r"\boxed{6.28}", r"2\pi", 0, "pi-approximated"),
    case(r"\boxed{\begin{pmatrix}1&2\\3&5\end{pmatrix}}", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}",
         0, "matrix-one-entry-differs"),
    case(r"\boxed{\text{Tuesday}}", "Monday", 0, "text-answer-differs"),
]

STRUCTURE = [
    case("The answer is 5.", "5", 0, "no-boxed-answer"),
    case(r"So \boxed{3}. Wait, that is wrong: \boxed{4}", "4", 1, "several-boxed-last-counts"),
    case(r"So \boxed{3}. Wait, that is wrong: \boxed{4}", "3", 0, "several-boxed-earlier-ignored"),
    case(r"<think>maybe \boxed{4}</think> The answer is 4.", "4", 0, "boxed-only-in-reasoning"),
    case(r"<think>maybe \boxed{3}</think> so \boxed{4}", "3", 0, "reasoning-box-differs-final"),
    case(r"<think>maybe \boxed{3}</think> so \boxed{4}", "4", 1, "final-box-after-think"),
    case(r"<think>\boxed{4}</think> \boxed{3}, no: \boxed{4}", "4", 1, "several-boxed-after-think"),
    case(r"plan</think>draft</think> \boxed{7}", "7", 1, "last-think-close-counts"),
    case(r"<think>long reasoning, cut off \boxed{4}", "4", 0, "reasoning-never-closed"),
    case(r"\boxed{\left\{1,2\right\}}", r"\{1,2\}", 1, "nested-braces-set"),
    case(r"The answer is \fbox{7}.", "7", 1, "fbox"),
    case(r"The answer is \boxed 5", "5", 1, "boxed-without-braces"),
    case(r"The answer is $\boxed 15$.", "15", 1, "boxed-without-braces-multi-digit"),
    case(r"\boxed {5}", "5", 1, "boxed-space-before-brace"),
    case(r"\boxed{5}}", "5", 1, "stray-closing-brace-after-box"),
    case(r"\boxed{5}", r"$\boxed{5}$", 1, "gold-boxed-in-dollars"),
    case(r"\boxed{0.5}", r"$\frac{1}{2}$", 1, "gold-in-dollars"),
    case(r"\boxed{0.5}", r"\(\frac{1}{2}\)", 1, "gold-in-paren-delimiters"),
    case(r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0, "unclosed-box"),
    case(r"\boxed{\frac{1}{", "1", 0, "unclosed-frac"),
    case(r"\boxed{\frac{1}{}}", "1", 0, "empty-denominator"),
    case(r"\boxed{}", "1", 0, "empty-box"),
    case(r"\boxed{\sqrt{}}", "0", 0, "empty-sqrt"),
    case(r"\boxedx{5}", "5", 0, "not-a-box-command"),
]

# A number with words or units in \text{} around it, against a bare-number gold: math-verify read
# `\text{5 cm}` as a symbol; the first ten right ones here got 0 before (math_checks.number_in_words).
TEXT_NUMBERS = [
    case(r"\boxed{\text{5 cm}}", "5", 1, "text-number-with-unit-inside"),
    case(r"\boxed{\text{5 apples}}", "5", 1, "text-number-with-noun"),
    case(r"\boxed{\text{The answer is } 5}", "5", 1, "text-sentence-then-number"),
    case(r"\boxed{\text{total: } 42}", "42", 1, "text-label-colon"),
    case(r"\boxed{\text{1,000 people}}", "1000", 1, "text-thousands-separator"),
    case(r"\boxed{\text{2.5 liters}}", r"\frac52", 1, "text-decimal-vs-frac-gold"),
    case(r"\boxed{\text{-3 degrees}}", "-3", 1, "text-negative-number"),
    case(r"\boxed{\text{5 cm}^2}", "5", 1, "text-unit-with-exponent"),
    case(r"\boxed{\text{Tuesday, 5}}", "5", 1, "text-word-comma-number"),
    case(r"\boxed{\mathrm{12\ kg}}", "12", 1, "mathrm-number-and-unit"),
    case(r"\boxed{\text{\$15}}", "15", 1, "text-currency-inside"),
    case(r"\boxed{\text{\frac{3}{4} cup}}", "0.75", 1, "text-fraction-with-unit"),
    case(r"\boxed{\text{not } 5}", "5", 0, "text-negated"),
    case(r"\boxed{5 \text{ or } 6}", "5", 0, "text-two-numbers"),
    case(r"\boxed{\text{at least } 5}", "5", 0, "text-bound-not-value"),
    case(r"\boxed{\text{about } 7 \text{ hours}}", "7", 0, "text-approximate"),
    case(r"\boxed{\text{5 apples}}", "6", 0, "text-number-differs"),
    case(r"\boxed{\text{5}^2 \text{ cm}}", "5", 0, "text-number-squared"),
    case(r"\boxed{\text{5 apples}}", "x+1", 0, "text-gold-not-a-number"),
]

# Equal to the gold only after simplifying special constants (i as the imaginary unit, products
# of cosines) or reading degrees in trigonometric functions; ten of the right ones got 0 before
# (math_checks.equal_as_constants).
SPECIAL_CONSTANTS = [
    case(r"\boxed{e^{i\pi}}", "-1", 1, "euler-identity"),
    case(r"\boxed{e^{\pi i}+1}", "0", 1, "euler-identity-plus-one"),
    case(r"\boxed{i^2}", "-1", 1, "imaginary-unit-squared"),
    case(r"\boxed{i^{i}}", r"e^{-\pi/2}", 1, "i-to-the-i"),
    case(r"\boxed{\cos(\pi/7)\cos(2\pi/7)\cos(4\pi/7)}", r"-\frac18", 1, "cosine-product-sevenths"),
    case(r"\boxed{\tan(\pi/7)\tan(2\pi/7)\tan(3\pi/7)}", r"\sqrt7", 1, "tangent-product-sevenths"),
    case(r"\boxed{\cos 60^\circ}", r"\frac12", 1, "cosine-degrees"),
    case(r"\boxed{\tan 45^{\circ}}", "1", 1, "tangent-degrees-braced"),
    case(r"\boxed{\sin(18^\circ)}", r"\frac{\sqrt5-1}{4}", 1, "sine-18-degrees"),
    case(r"\boxed{\sin(30^\circ)}", "0.5", 1, "sine-degrees-decimal-gold"),
    case(r"\boxed{\cos(\pi/5) \cos(2\pi/5)}", r"\frac14", 1, "cosine-product-fifths"),
    case(r"\boxed{\sin(\pi/14)\sin(3\pi/14)\sin(5\pi/14)}", r"\frac18", 1, "sine-product-fourteenths"),
    case(r"\boxed{e^{i\pi}}", "1", 0, "euler-identity-wrong-sign"),
    case(r"\boxed{e^{i\pi/2}}", "1", 0, "imaginary-is-not-real"),
    case(r"\boxed{(1+i)^2}", "2", 0, "complex-square-is-not-real"),
    case(r"\boxed{\cos 60^\circ}", "0.6", 0, "degrees-value-differs"),
    case(r"\boxed{3.14159}", r"\pi", 0, "pi-rounded-decimal"),
    case(r"\boxed{i+1}", "2", 0, "i-is-not-one"),
    case(r"\boxed{\cos(\pi/7)\cos(2\pi/7)\cos(4\pi/7)}", r"\frac18", 0, "cosine-product-sign"),
]

MATH_VERIFY_GAPS = [
    xfail(case(r"\boxed{1.5e3}", "1500", 1, "e-notation"),
          "math-verify reads 1.5e3 as 1.5*e*3 (Euler's number)"),
    xfail(case(r"\boxed{0 < x \le 1}", "(0,1]", 1, "inequality-vs-gold-interval"),
          "math-verify compares a relation with a set only when the prediction is the set; "
          "allowing it both ways would also equate the ordered pair (1,2) with 1<x<2"),
    xfail(case(r"The roots are \boxed{1} and \boxed{2}", "1, 2", 1, "answer-split-over-boxes"),
          "only the last box counts (the issue's rule); math-verify's boxed='all' would join them"),
]


@pytest.fixture(scope="module")
def reward_fn():
    return MathReward()


CASES = EQUIVALENT + WRONG + STRUCTURE + TEXT_NUMBERS + SPECIAL_CONSTANTS + MATH_VERIFY_GAPS


@pytest.mark.parametrize("response,gold,expected", CASES)
def test_grades_like_a_human(reward_fn, response, gold, expected):
    reward, info = reward_fn(response, {"answer": gold})
    assert info["outcome"] in OUTCOMES
    assert reward == expected, info


def test_case_table_is_large_and_ids_unique():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("response,gold,outcome", [
    (r"\boxed{5}", "5", "string_match"),
    (r"\boxed{5\text{ cm}}", "5", "string_match"),  # math-verify's normalized string is "5"
    (r"\boxed{0.5}", r"\frac12", "verified"),
    (r"\boxed{6}", "5", "wrong"),
    ("five", "5", "no_boxed"),
    (r"\boxed{\frac{1}{}}", "1", "parse_error"),
    (r"\boxed{5", "5", "parse_error"),
])
def test_outcomes(reward_fn, response, gold, outcome):
    reward, info = reward_fn(response, {"answer": gold})
    assert info["outcome"] == outcome
    assert reward == float(outcome in {"string_match", "verified"})


def test_info_carries_the_extracted_answer_truncated(reward_fn):
    assert reward_fn(r"\boxed{ \frac{1}{2} }", {"answer": "0.5"})[1]["answer"] == r"\frac{1}{2}"
    long_answer = "1+" * 300 + "1"
    reward, info = reward_fn(f"\\boxed{{{long_answer}}}", {"answer": "301"})
    assert reward == 1.0 and info["answer"] == long_answer[:200]


@pytest.mark.parametrize("metadata,outcome", [
    ({}, "no_ground_truth"),
    ({"answer": None}, "no_ground_truth"),
    ({"answer": ""}, "no_ground_truth"),
    ({"answer": "  $ $ "}, "no_ground_truth"),
    ({"answer": []}, "no_ground_truth"),
    ({"answer": {"x": 1}}, "bad_input"),
    ({"answer": True}, "bad_input"),
    ({"answer": r"\boxed{5"}, "bad_input"),
    ("5", "bad_input"),
])
def test_missing_or_unusable_gold(reward_fn, metadata, outcome):
    assert reward_fn(r"\boxed{5}", metadata) == (0.0, {"outcome": outcome})


@pytest.mark.parametrize("gold", [5, 5.0, ["4", "5"], ("5",)])
def test_gold_may_be_a_number_or_a_list_of_alternatives(reward_fn, gold):
    assert reward_fn(r"\boxed{5}", {"answer": gold})[0] == 1.0


@pytest.mark.parametrize("response", ["", "   \n", None, b"\\boxed{5}", 5])
def test_empty_or_non_text_response_is_bad_input(reward_fn, response):
    assert reward_fn(response, {"answer": "5"}) == (0.0, {"outcome": "bad_input"})


def test_lone_surrogates(reward_fn):
    garbled = b"\xff\xfe".decode("utf-8", "surrogateescape")  # what non-UTF-8 output decodes to
    reward, info = reward_fn(f"\\boxed{{5{garbled}}}", {"answer": "5"})
    assert (reward, info["outcome"]) == (0.0, "bad_input")
    info["answer"].encode("utf-8")  # safe to log
    assert reward_fn(f"<think>{garbled}</think>\\boxed{{5}}", {"answer": "5"})[0] == 1.0
    assert reward_fn(garbled * 10, {"answer": "5"})[1]["outcome"] == "no_boxed"
    assert reward_fn(r"\boxed{5}", {"answer": "5\udcff"})[1]["outcome"] == "bad_input"


def test_megabyte_responses(reward_fn):
    filler = "x = y + {z}; " * 80_000  # about 1 MB
    assert reward_fn(filler + r"\boxed{5}", {"answer": "5"}) == (1.0, {"outcome": "string_match",
                                                                          "answer": "5"})
    assert reward_fn(filler, {"answer": "5"})[1]["outcome"] == "no_boxed"
    assert reward_fn(r"\boxed{" + "{" * 1_000_000, {"answer": "5"})[1]["outcome"] == "bad_input"
    assert reward_fn(r"\boxed{" + "1" * 2000 + "}", {"answer": "5"})[1]["outcome"] == "bad_input"
    assert reward_fn(r"\boxed " + "1" * 2000, {"answer": "5"})[1]["outcome"] == "bad_input"
    assert reward_fn(r"\boxed{x} " * 100_000, {"answer": "x"})[0] == 1.0


@pytest.mark.parametrize("response", [
    r"\boxed{" + "{" * 400 + "1" + "}" * 400 + "}",
    r"\boxed{" + r"\frac{1}{" * 100 + "1" + "}" * 100 + "}",
    r"\boxed{\begin{pmatrix}1&2\end{bmatrix}}",
    r"\boxed{\\}",
    r"\boxed{\left(}",
    r"\boxed{^_^}",
    r"\boxed{\frac}",
    r"\boxed{\sqrt[}",
    r"\boxed{1/0}",
    r"\boxed{0^0}",
    r"\boxed{\log(0)}",
    r"\boxed{\int}",
    r"\boxed{\begin{cases}x&1\end{cases}}",
    "\\boxed{\x00}",
    r"\boxed{$}",
    r"\boxed{%}",
])
def test_malformed_latex_never_raises(reward_fn, response):
    reward, info = reward_fn(response, {"answer": "1"})
    assert reward in (0.0, 1.0) and info["outcome"] in OUTCOMES


def test_runaway_computation_times_out_and_restores_the_alarm():
    handler = signal.getsignal(signal.SIGALRM)
    reward, info = MathReward(timeout_s=0.5)(r"\boxed{10^{10^{10}}}", {"answer": "1"})
    assert (reward, info["outcome"]) == (0.0, "verify_timeout")
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is handler


def test_leaves_an_alarm_set_by_the_caller_alone(reward_fn):
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 60)
        assert reward_fn(r"\boxed{0.5}", {"answer": r"\frac12"})[0] == 1.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 50
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_works_outside_the_main_thread(reward_fn):
    def grade(gold):
        assert threading.current_thread() is not threading.main_thread()
        return reward_fn(r"\boxed{\frac{\sqrt{2}}{2}}", {"answer": gold})

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(grade, [r"\frac{1}{\sqrt{2}}", r"\sqrt{3}"]))
    assert [(r, i["outcome"]) for r, i in results] == [(1.0, "verified"), (0.0, "wrong")]


@pytest.mark.parametrize("nested", [
    "(" * 50 + "1" + ")" * 50,
    "{" * 20 + "1" + "}" * 20,  # took the whole 10 s deadline
    r"\sin(" * 8 + "1" + ")" * 8,  # likewise
    "2^{" * 5 + "2" + "}" * 5,  # a number no machine holds
    r"\frac{1}{" * 30 + "1" + "}" * 30,
    r"\left[" * 7 + "1" + r"\right]" * 7,
])
def test_deep_nesting_is_refused_before_parsing(reward_fn, nested):
    start = time.perf_counter()
    assert reward_fn(f"\\boxed{{{nested}}}", {"answer": "1"}) == (0.0, {"outcome": "bad_input", "answer": nested[:200]})
    assert time.perf_counter() - start < 0.05
    assert reward_fn(r"\boxed{1}", {"answer": nested})[1]["outcome"] == "bad_input"  # a gold too


@pytest.mark.parametrize("response, gold", [
    (r"\boxed{\frac{1}{\sqrt{2+\sqrt{2+\sqrt{2}}}}}", r"\frac{1}{\sqrt{2+\sqrt{2+\sqrt{2}}}}"),  # depth 5
    (r"\boxed{e^{-\frac{x^{2}}{2}}}", r"\exp(-x^2/2)"),  # exponents nested twice
    (r"\boxed{\left(\frac{\sqrt{3}}{2}, \frac{1}{2}\right)}", r"\left(\frac{\sqrt3}{2},\frac12\right)"),
    (r"\boxed{2^{2^{2^{2}}}}", "65536"),  # three exponents: still graded
])
def test_nesting_within_the_bound_is_graded(reward_fn, response, gold):
    assert reward_fn(response, {"answer": gold})[0] == 1.0

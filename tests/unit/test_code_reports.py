"""What a sandboxed program prints is untrusted: the code verifier's reading of it (the report's
JSON, the tagged values, the comparisons with the expected values) must give `passed` or `failed`
for any output, never raise. A raise there was counted as a verifier error, and one of those in
the first hundred samples stopped a run (reward.max_error_frac). Property-based: hypothesis
draws random and adversarial reports; the tricks that broke it are pinned below as examples."""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncrl.reward.code_reward import CodeReward, CodeTest, parse_tests

NONCE = "0123456789abcdef0123456789abcdef"
TAGS = ["float", "complex", "bytes", "list", "tuple", "set", "frozenset", "dict", "opaque", "nope"]

# the expected sides a dataset may hold
CALL = parse_tests([{"type": "call", "fn": "f", "args": [1], "expected": 3.5}])[0]
CALL_LIST = parse_tests([{"type": "call", "fn": "f", "args": [], "expected": [[1, 2], {"a": 1}]}])[0]
APPS = parse_tests({"inputs": [[1]], "outputs": [[7]], "fn_name": "f"})[0]
ASSERT = parse_tests([{"type": "assert", "code": "assert f(1) == (1, 2)\nassert abs(g() - 0.5) < 1e-6\n"
                                                   "assert h() in {1, 2}\nassert math.isclose(k(), 2.0)"}])[0]
STDIO = CodeTest("stdio", expected="3 4.5\nyes")
TESTS = [CALL, CALL_LIST, APPS, ASSERT, STDIO]

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**300, max_value=10**400),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))


def tagged(children):
    """A dict in the driver's tagged form, with any tag and any payload (forged ones included)."""
    return st.builds(lambda tag, v: {"$": tag, "v": v}, st.sampled_from(TAGS), children)


values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), tagged(children),
    st.dictionaries(st.text(max_size=3), children, max_size=3)), max_leaves=20)
# what the driver writes: [[probe index, value], ...]; and anything else in its place
reports = st.one_of(st.lists(st.tuples(st.integers(-2, 5), values).map(list), max_size=5), values)


def judge(test: CodeTest, stdout: str, tol: float | None) -> str:
    verifier = CodeReward()
    verifier.cfg = verifier.cfg.model_copy(update={"float_tolerance": tol})
    return verifier._judge(test, stdout.encode("utf-8", "surrogatepass"), NONCE)


@settings(max_examples=300, deadline=None)
@given(report=reports, test=st.sampled_from(TESTS), tol=st.sampled_from([None, 1e-6]))
@example(report=[[0, 10**399]], test=CALL, tol=1e-6)  # an int beyond any float, compared within a tolerance
@example(report=7, test=ASSERT, tol=None)  # a scalar where the driver writes a list of probes
@example(report=[[0, {"$": "complex", "v": 5}]], test=CALL, tol=None)
@example(report=[[0, {"$": "dict", "v": [[{"$": "list", "v": []}, 1]]}]], test=CALL_LIST, tol=None)
@example(report=[[1, {"$": "float", "v": "1e999"}]], test=ASSERT, tol=None)
def test_any_report_is_passed_or_failed(report, test, tol):
    stdout = "noise\n" + NONCE + json.dumps(report) + "\nafter"
    assert judge(test, stdout, tol) in ("passed", "failed")


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200), test=st.sampled_from(TESTS), tol=st.sampled_from([None, 1e-6]))
@example(text="\n" + NONCE + "[[0, " + "[" * 100_000 + "]]", test=CALL, tol=None)  # nesting past the recursion limit
@example(text="\n" + NONCE + "[[0, " + "9" * 5000 + "]]", test=CALL, tol=1e-6)  # past int's digit limit
@example(text="1e999999 nan\n-inf", test=STDIO, tol=1e-6)
def test_any_output_is_passed_or_failed(text, test, tol):
    assert judge(test, text, tol) in ("passed", "failed")


@pytest.mark.parametrize("report, test, verdict", [
    ([[0, 3.5]], CALL, "passed"),
    ([[0, 10**399]], CALL, "failed"),
    ([[0, [7]]], APPS, "passed"),
    ([[0, 7]], APPS, "passed"),  # APPS: [x] expected also matches x
    ([[0, {"$": "tuple", "v": [1, 2]}], [1, 0.5], [2, 2], [3, 2.0]], ASSERT, "passed"),
    ([[0, {"$": "tuple", "v": [1, 2]}], [1, 0.5], [2, 3], [3, 2.0]], ASSERT, "failed"),
    ([[0, {"$": "tuple", "v": [1, 2]}], [1, 0.5], [2, 2]], ASSERT, "failed"),  # a probe never reported
    (7, ASSERT, "failed"),
])
def test_reports_are_judged_on_their_values(report, test, verdict):
    """The property above holds for a verifier that fails everything too: these pin that a true
    report still passes."""
    assert judge(test, "x\n" + NONCE + json.dumps(report) + "\n", 1e-6) == verdict

"""The test drivers' pure parts: which asserts become probes (and what stays in the test code the
sandbox sees), the value encoding both sides share, and the comparison made outside."""

import json
import math

import pytest

from asyncrl.reward import code_drivers as cd


@pytest.mark.parametrize("test, probe, check", [
    ("assert f(1) == 3", "f(1)", ("==", 3, {})),
    ("assert 3 == f(1)", "f(1)", ("==", 3, {})),
    ("assert f(1) != -2.5", "f(1)", ("!=", -2.5, {})),
    ("assert f(1) < 10", "f(1)", ("<", 10, {})),
    ("assert 10 > f(1)", "f(1)", ("<", 10, {})),  # mirrored
    ("assert f(1) is None", "f(1)", ("is", None, {})),
    ("assert f(1) in (1, 2)", "f(1)", ("in", (1, 2), {})),
    ("assert 'a' in f(1)", "f(1)", ("contains", "a", {})),
    ("assert 'a' not in f(1)", "f(1)", ("not contains", "a", {})),
    ("assert f([3, 1]) == [1, 3]", "f([3, 1])", ("==", [1, 3], {})),
    ("assert set(f(1)) == set((4, 5))", "set(f(1))", ("==", {4, 5}, {})),
    ("assert sorted(f(1)) == sorted([2, 1])", "sorted(f(1))", ("==", [1, 2], {})),
    ("assert f(1) == float('inf')", "f(1)", ("==", math.inf, {})),
    ("assert f(1) == {'a': (1, 2)}", "f(1)", ("==", {"a": (1, 2)}, {})),
    ("assert math.isclose(f(1), 0.5, rel_tol=1e-3)", "f(1)", ("isclose", 0.5, {"rel_tol": 1e-3})),
    ("assert isclose(0.5, f(1))", "f(1)", ("isclose", 0.5, {})),
    ("assert abs(f(1) - 0.5) < 1e-6", "f(1)", ("absdiff", 0.5, {"tol": 1e-6, "strict": True})),
    ("assert abs(0.5 - f(1)) <= 1e-6", "f(1)", ("absdiff", 0.5, {"tol": 1e-6, "strict": False})),
])
def test_asserts_with_a_constant_side_become_probes(test, probe, check):
    code, checks = cd.rewrite_asserts(test)
    assert code == f"{cd.PROBE}(0, {probe})"
    assert checks == [check]


@pytest.mark.parametrize("test", [
    "assert f(1)",
    "assert not f(1)",
    "assert f(1) == g(1)",
    "assert 0 < f(1) < 10",  # chained
    "assert f(1) == bytes(1000000000)",  # not computed here: bytes(n) allocates n bytes
    "assert f(1) == sorted(x)",  # a name, not a constant
    "assert math.isclose(f(1), g(1))",
    "assert f(1) == bytes(b'ab', 'ascii')",  # keywords or two arguments: not evaluated here
])
def test_other_asserts_stay_inside(test):
    code, checks = cd.rewrite_asserts(test)
    assert (code, checks) == (test, [])


def test_the_rewritten_test_holds_no_expected_value():
    test = "def check(candidate):\n    assert candidate(7) == 987654321\n    assert candidate(8) == 'secret'\ncheck(fib)"
    code, checks = cd.rewrite_asserts(test)
    driver = cd.driver("0" * 32, "assert", {"code": code})
    assert "987654321" not in driver and "secret" not in driver and "candidate(7)" in driver
    assert [c[1] for c in checks] == [987654321, "secret"]
    compile(driver, "driver", "exec")


def test_bad_test_code_raises_syntax_error():
    with pytest.raises(SyntaxError):
        cd.rewrite_asserts("assert f(1 ==")


def encode(value):
    namespace = {}
    exec(cd.ENCODER, namespace)
    return json.loads(json.dumps(namespace["_asyncrl_encode"](value)))


@pytest.mark.parametrize("value", [
    0, -7, 10 ** 30, 2.5, -0.0, math.inf, -math.inf, "text", "", None, True, False, 1 + 2j, b"\x00\xff",
    [1, [2, (3,)]], (1,), (), {1, 2}, frozenset({"a"}), set(), {"a": 1}, {(1, 2): [3]}, {1: None},
])
def test_values_cross_the_boundary_unchanged(value):
    decoded = cd.decode(encode(value))
    assert decoded == value and type(decoded) is type(value)


def test_values_without_an_encoding_equal_nothing():
    class Anything:
        def __eq__(self, other):
            return True

    for value in (Anything(), [Anything()], object(), math.nan):
        assert cd.decode(encode(value)) != value or value is math.nan
    assert cd.decode(encode(math.nan)) != cd.decode(encode(math.nan))  # nan, as in Python
    nested = []
    for _ in range(150):
        nested = [nested]
    assert cd.decode(encode(nested)) != nested  # past the depth limit: opaque


@pytest.mark.parametrize("op, actual, expected, options, result", [
    ("==", (1, 2), (1, 2), {}, True),
    ("==", [1, 2], (1, 2), {}, False),
    ("==", 1, 1.0, {}, True),
    ("==", True, 1, {}, True),  # as Python says
    ("<", "a", 1, {}, False),  # Python raises TypeError: counted as failing
    ("is", None, None, {}, True),
    ("contains", [1, 2], 2, {}, True),
    ("not in", 3, (1, 2), {}, True),
    ("isclose", 0.30000000000000004, 0.3, {}, True),
    ("isclose", 0.31, 0.3, {"abs_tol": 0.001}, False),
    ("absdiff", 0.5000001, 0.5, {"tol": 1e-6, "strict": True}, True),
    ("absdiff", "x", 0.5, {"tol": 1e-6, "strict": True}, False),
])
def test_check_compares_as_python_would(op, actual, expected, options, result):
    assert cd.check(op, actual, expected, options) is result


def test_every_probe_must_report_and_pass():
    checks = [("==", 3, {}), ("==", (1, 2), {})]
    good = [[0, 3], [1, encode((1, 2))], [0, 3]]  # a probe in a loop may report more than once
    assert cd.probes_pass(good, checks)
    assert not cd.probes_pass(good[:1], checks)  # probe 1 never ran: a forged report looks like this
    assert not cd.probes_pass([], checks)
    assert not cd.probes_pass([*good, [0, 4]], checks)
    for forged in ([[5, 3]], [["0", 3]], [[0, {"$": "set", "v": [[1]]}]], ["x"], [[0]]):
        assert not cd.probes_pass(forged, checks)
    assert cd.probes_pass([], [])

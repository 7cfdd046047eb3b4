"""The code verifier's pure parts: code extraction, test parsing, output and value comparison.
Nothing here starts a process (tests/integration/test_sandbox.py runs programs)."""

import json

import pytest

from asyncrl.reward.code_reward import (BadTests, CodeReward, CodeTest, extract_code, outputs_match,
                                        parse_tests, values_match)

F = "```"


@pytest.mark.parametrize("response, default, expected", [
    (f"{F}python\nprint(1)\n{F}", "python", ("print(1)\n", "python")),
    (f"{F}py\nprint(1)\n{F}", "python", ("print(1)\n", "python")),
    (f"{F}cpp\nint main(){{}}\n{F}", "python", ("int main(){}\n", "cpp")),
    (f"{F}C++ title=x\nint main(){{}}\n{F}", "python", ("int main(){}\n", "cpp")),
    (f"{F}python\nprint(1)\n{F} then {F}python\nprint(2)\n{F}", "python", ("print(2)\n", "python")),
    # a tagged block wins over a later untagged one (sample output, typically)
    (f"{F}python\nprint(1)\n{F}\nOutput:\n{F}\n1\n{F}", "python", ("print(1)\n", "python")),
    (f"{F}\nprint(3)\n{F}", "python", ("print(3)\n", "python")),
    (f"{F}\nint main(){{}}\n{F}", "cpp", ("int main(){}\n", "cpp")),
    (f"{F}text\nhello\n{F}", "python", None),
    # code inside the reasoning is a draft: only the answer after </think> counts
    (f"<think>{F}python\nprint(1)\n{F}</think>{F}python\nprint(2)\n{F}", "python", ("print(2)\n", "python")),
    (f"<think>{F}python\nprint(1)\n{F}</think>no code here, sorry.", "python", None),
    (f"<think>{F}python\nprint(1)\n{F} still thinking", "python", None),
    # an unclosed fence (cut off) is not a block; the closed one before it is
    (f"{F}python\nprint(1)\n{F} and {F}python\nprint(2", "python", ("print(1)\n", "python")),
    # no fence: the answer itself if it is Python
    ("<think>hmm</think>\nprint(input())\n", "python", ("\nprint(input())\n", "python")),
    ("print(input())", "python", ("print(input())", "python")),
    ("The answer is to add the numbers.", "python", None),
    ("int main() { return 0; }", "cpp", None),
    ("", "python", None),
    ("   \n", "python", None),
])
def test_extract_code(response, default, expected):
    assert extract_code(response, default) == expected


def test_extract_code_from_a_huge_response_is_linear():
    block = f"{F}python\nprint(1)\n{F}"
    response = "x" * 1_000_000 + F * 1001 + block  # many unmatched fences must not go quadratic
    assert extract_code(response) is not None


STDIO = [{"type": "stdio", "input": "1 2\n", "output": "3\n"}]


@pytest.mark.parametrize("raw, expected", [
    (STDIO, [CodeTest("stdio", stdin="1 2\n", expected="3\n")]),
    (json.dumps(STDIO), [CodeTest("stdio", stdin="1 2\n", expected="3\n")]),
    ([{"type": "stdio", "output": ["a", "b"]}], [CodeTest("stdio", stdin="", expected="a\nb")]),
    ([{"type": "call", "fn": "add", "args": [1, 2], "expected": 3}],
     [CodeTest("call", fn="add", args=[1, 2], expected=3)]),
    ([{"type": "call", "fn": "f", "kwargs": {"x": 1}, "expected": None}],
     [CodeTest("call", fn="f", kwargs={"x": 1}, expected=None)]),
    # the expected value stays here; the sandbox gets a probe (asyncrl.reward.code_drivers)
    ([{"type": "assert", "code": "assert f(1) == 2"}],
     [CodeTest("assert", code="_asyncrl_probe(0, f(1))", checks=(("==", 2, {}),))]),
    ([{"type": "assert", "code": "assert is_ok(1)"}], [CodeTest("assert", code="assert is_ok(1)")]),
    ({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]},
     [CodeTest("stdio", stdin="1 2\n", expected="3\n"), CodeTest("stdio", stdin="3 4\n", expected="7\n")]),
    ({"inputs": [[1, 2], 5], "outputs": [[3], [5]], "fn_name": "add"},
     [CodeTest("call", fn="add", args=[1, 2], expected=[3], unwrap=True),
      CodeTest("call", fn="add", args=[5], expected=[5], unwrap=True)]),
    (json.dumps({"inputs": [[1]], "outputs": [1], "fn_name": "f"}),
     [CodeTest("call", fn="f", args=[1], expected=1, unwrap=True)]),
])
def test_parse_tests_forms(raw, expected):
    assert parse_tests(raw) == expected


@pytest.mark.parametrize("raw, outcome", [
    (None, "no_tests"),
    ([], "no_tests"),
    ("", "no_tests"),
    ("[]", "no_tests"),
    ({"inputs": [], "outputs": []}, "no_tests"),
    ("{not json", "bad_tests"),
    ("[" * 100_000, "bad_tests"),  # deep nesting: RecursionError inside json
    (42, "bad_tests"),
    (["stdin"], "bad_tests"),
    ([{"type": "stdio", "input": "1"}], "bad_tests"),  # no output
    ([{"type": "stdio", "input": 1, "output": "1"}], "bad_tests"),
    ([{"type": "call", "fn": "os.system", "args": [], "expected": 0}], "bad_tests"),  # not an identifier
    ([{"type": "call", "fn": "f", "args": "x", "expected": 0}], "bad_tests"),
    ([{"type": "call", "fn": "f", "args": []}], "bad_tests"),  # no expected
    ([{"type": "assert", "code": "  "}], "bad_tests"),
    ([{"type": "assert", "code": "assert f(1 =="}], "bad_tests"),  # does not parse
    ([{"type": "shell", "cmd": "ls"}], "bad_tests"),
    ({"inputs": ["1"], "outputs": []}, "bad_tests"),
    ({"inputs": [1], "outputs": ["1"]}, "bad_tests"),
    ({"inputs": [[1]], "outputs": [1], "fn_name": "not a name"}, "bad_tests"),
])
def test_parse_tests_rejects(raw, outcome):
    with pytest.raises(BadTests) as err:
        parse_tests(raw)
    assert err.value.outcome == outcome


@pytest.mark.parametrize("actual, expected, tol, match", [
    ("3\n", "3", None, True),
    ("  1   2\n3\r\n", "1 2 3", None, True),
    ("1 2", "1 2 3", None, False),
    ("3", "4", None, False),
    ("0.30000000000000004", "0.3", None, False),
    ("0.30000000000000004", "0.3", 1e-6, True),
    ("1.0000001 x", "1.0 x", 1e-6, True),
    ("1.0000001 x", "1 x", 1e-6, False),  # an expected integer compares exactly, tolerance or not
    ("1000000000", "1000000007", 1e-6, False),  # within 1e-6 relative: the wrong answer it let pass
    ("1e9", "1000000007", 1e-6, False),
    ("-12", "-12", 1e-6, True),
    ("1000000000.0", "1000000007.0", 1e-6, True),  # written as a real number: the tolerance is asked for
    ("1.1", "1", 1e-6, False),
    ("abc", "abd", 1e-6, False),
    ("nan", "nan", 1e-6, True),  # equal tokens are equal, tolerance or not
    ("YES", "yes", None, False),
    ("", "", None, True),
    ("", "0", None, False),
])
def test_outputs_match(actual, expected, tol, match):
    assert outputs_match(actual, expected, tol) is match


@pytest.mark.parametrize("actual, expected, tol, match", [
    ([1, 2], [1, 2], None, True),
    ([[1, 2], 3], [[1, 2], 3], None, True),
    ([1, 2], [2, 1], None, False),
    ([1, 2], [1, 2, 3], None, False),
    ({"a": [1.0]}, {"a": [1]}, None, True),
    ({"a": 1}, {"b": 1}, None, False),
    (0.1 + 0.2, 0.3, None, False),
    (0.1 + 0.2, 0.3, 1e-9, True),
    ([0.1 + 0.2, "x"], [0.3, "x"], 1e-9, True),
    ("3", 3, None, False),
    (10**9, 1000000007, 1e-6, False),  # an expected integer compares exactly, tolerance or not
    (1e9, 1000000007, 1e-6, False),
    (7.0, 7, 1e-6, True),  # equal values
    (10**9, 1000000007.0, 1e-6, True),  # an expected real number: within the tolerance
    (True, 1.0, 1e-6, True),  # True == 1.0 in Python, as before: only the tolerance skips bools
    (True, 1.0000001, 1e-6, False),
    (None, None, None, True),
])
def test_values_match(actual, expected, tol, match):
    assert values_match(actual, expected, tol) is match


@pytest.mark.parametrize("response, metadata, outcome", [
    (None, {"tests": STDIO}, "bad_input"),
    (b"print(3)", {"tests": STDIO}, "bad_input"),
    ("print(3)", None, "bad_input"),
    ("print(3)", {"tests": STDIO, "language": "cobol"}, "bad_input"),
    ("print(3)", {}, "no_tests"),
    ("print(3)", {"tests": "{oops"}, "bad_tests"),
    ("", {"tests": STDIO}, "no_code"),
    ("I cannot solve this.", {"tests": STDIO}, "no_code"),
    (f"{F}python\ndef f(:\n{F}", {"tests": STDIO}, "syntax_error"),
    (f"{F}python\nx = 1\x00\n{F}", {"tests": STDIO}, "syntax_error"),
    ("\udcff\udcfe", {"tests": STDIO}, "no_code"),
    (f"{F}cpp\nint main(){{}}\n{F}", {"tests": [{"type": "call", "fn": "f", "expected": 1}]}, "bad_tests"),
])
def test_outcomes_decided_before_running(response, metadata, outcome):
    reward, info = CodeReward()(response, metadata)
    assert (reward, info["outcome"]) == (0.0, outcome)


def test_a_cpp_compile_gets_the_configured_memory(monkeypatch):
    """compile_memory_mb, not a hidden 2 GiB floor, is what g++ and its /tmp get."""
    from asyncrl.config import CodeRewardConfig, SandboxConfig
    from asyncrl.reward import code_reward
    from asyncrl.reward.sandbox import RunResult

    seen = []

    def compile_only(argv, stdin, limits, workdir, persist=False):
        seen.append((argv[0], limits.memory_mb, limits.wall_time_s))
        return RunResult("crashed", 1, b"", b"error: out of memory", 0.1)

    monkeypatch.setattr(code_reward, "run_sandboxed", compile_only)
    monkeypatch.setattr(code_reward, "GXX", "/usr/bin/g++")
    cfg = CodeRewardConfig(sandbox=SandboxConfig(memory_mb=128, compile_memory_mb=300, compile_time_s=7.0))
    reward, info = CodeReward(cfg)(f"{F}cpp\nint main(){{}}\n{F}", {"tests": [{"type": "stdio", "output": "1"}]})
    assert (reward, info["outcome"]) == (0.0, "compile_error")
    assert seen == [("/usr/bin/g++", 300, 7.0)]

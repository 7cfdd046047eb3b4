"""The code verifier with real programs in the sandbox: every test form against correct, wrong,
crashing, slow and broken solutions (Python and C++), both reward modes, time budgets, limits.
The attacks are in test_sandbox_attacks.py.

Limits are short (wall 2 s, CPU 1 s) so the file runs in seconds.
"""

import dataclasses
import json
import os
import resource
import textwrap
import time
from pathlib import Path

import pytest
from sandbox_support import (F, LIMITS, ROOT, SLACK_S, cpp, nothing_left_behind, py, run_python, verifier,  # noqa: F401
                             workdir)

from asyncrl.config import CodeRewardConfig
from asyncrl.reward import code_reward
from asyncrl.reward.code_reward import CodeReward
from asyncrl.reward.sandbox import isolation, runner, spawn

needs_gxx = pytest.mark.skipif(code_reward.GXX is None, reason="no g++")

PAIRS = [(1, 2), (5, 7), (10, -3)]
ADD_STDIO = [{"type": "stdio", "input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in PAIRS]
ADD_CALL = [{"type": "call", "fn": "add", "args": [a, b], "expected": a + b} for a, b in PAIRS]
ADD_ASSERT = [{"type": "assert", "code": f"assert add({a}, {b}) == {a + b}"} for a, b in PAIRS]


PY_STDIO = {
    "correct": ("a, b = map(int, input().split())\nprint(a + b)", 1.0, "passed"),
    "wrong": ("a, b = map(int, input().split())\nprint(a - b)", 0.0, "failed"),
    "crashing": ("a, b = map(int, input().split())\nprint(a // 0)", 0.0, "crashed"),
    "slow": ("while True:\n    pass", 0.0, "timeout"),
    "syntax": ("def f(:\n    pass", 0.0, "syntax_error"),
}
PY_CALL = {
    "correct": ("def add(a, b):\n    return a + b", 1.0, "passed"),
    "wrong": ("def add(a, b):\n    return a * b", 0.0, "failed"),
    "crashing": ("def add(a, b):\n    raise ValueError(a)", 0.0, "crashed"),
    "slow": ("import time\ndef add(a, b):\n    time.sleep(60)", 0.0, "timeout"),
    "early_exit": ("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b", 0.0, "failed"),
}
PY_ASSERT = {
    "correct": ("def add(a, b):\n    return a + b", 1.0, "passed"),
    "wrong": ("def add(a, b):\n    return a * b", 0.0, "failed"),
    "crashing": ("def add(a, b):\n    return a + c", 0.0, "crashed"),
    "slow": ("def add(a, b):\n    while True:\n        pass", 0.0, "timeout"),
    "early_exit": ("import os\nos._exit(0)\ndef add(a, b):\n    return a + b", 0.0, "failed"),
}
CPP_STDIO = {
    "correct": ("int main() { long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }", 1.0, "passed"),
    "wrong": ("int main() { long a, b; std::cin >> a >> b; std::cout << a - b << '\\n'; }", 0.0, "failed"),
    "crashing": ("int main() { int *p = nullptr; std::cin >> *p; return *p; }", 0.0, "crashed"),
    "exit_code": ("int main() { return 3; }", 0.0, "crashed"),
    "slow": ("int main() { volatile long x = 0; for (;;) x++; }", 0.0, "timeout"),
    "memory": ("int main() { std::vector<char> v(1ull << 36); std::cout << v.size(); }", 0.0, "memory"),
    "not_compiling": ("int main() { return undefined_name; }", 0.0, "compile_error"),
}
CASES = [pytest.param(wrap(code), tests, reward, outcome, id=f"{name}-{kind}", marks=marks)
         for name, wrap, tests, table, marks in [("py-stdio", py, ADD_STDIO, PY_STDIO, ()),
                                                 ("py-call", py, ADD_CALL, PY_CALL, ()),
                                                 ("py-assert", py, ADD_ASSERT, PY_ASSERT, ()),
                                                 ("cpp-stdio", cpp, ADD_STDIO, CPP_STDIO, needs_gxx)]
         for kind, (code, reward, outcome) in table.items()]


@pytest.mark.parametrize("response, tests, reward, outcome", CASES)
def test_forms_and_solutions(response, tests, reward, outcome):
    start = time.monotonic()
    got, info = verifier()(response, {"tests": tests})
    assert (got, info["outcome"]) == (reward, outcome), info
    assert info["outcome"] in code_reward.OUTCOMES
    if outcome == "passed":
        assert info["tests_passed"] == info["tests_run"] == info["tests_total"] == 3
    if outcome == "timeout":  # all_pass stops at the first failure: one wall limit, not three
        assert info["tests_run"] == 1 and time.monotonic() - start < LIMITS.wall_time_s + SLACK_S


@pytest.mark.parametrize("response", [
    py("a, b = map(int, input().split())\nprint(a + b if a != 10 else 0)"),
    pytest.param(cpp("int main() { long a, b; std::cin >> a >> b; std::cout << (a == 10 ? 0 : a + b); }"),
                 marks=needs_gxx),
])
def test_reward_modes(response):
    assert verifier("all_pass")(response, {"tests": ADD_STDIO})[0] == 0.0
    reward, info = verifier("fraction")(response, {"tests": ADD_STDIO})
    assert reward == pytest.approx(2 / 3)
    counts = (info["tests_passed"], info["tests_failed"], info["tests_run"])
    assert (info["outcome"], counts) == ("failed", (2, 1, 3))


def test_fraction_counts_each_status_and_max_tests():
    solution = py("import time\nn = int(input())\nif n == 2: time.sleep(60)\nif n == 3: 1 / 0\nprint(n)")
    tests = [{"type": "stdio", "input": str(n), "output": str(n)} for n in (1, 2, 3, 4, 5)]
    reward, info = verifier("fraction", max_tests=4)(solution, {"tests": tests})
    assert reward == pytest.approx(2 / 4)
    assert {k: info[k] for k in ("tests_total", "tests_passed", "tests_timeout", "tests_crashed")} == {
        "tests_total": 4, "tests_passed": 2, "tests_timeout": 1, "tests_crashed": 1}
    assert info["outcome"] == "timeout"  # the first test that did not pass


def test_time_budget_stops_starting_tests_and_keeps_what_passed():
    # each test passes after 0.8 s; wall limit 2 s, budget 3.5 s: a test starts only while
    # elapsed + 2 <= 3.5, so tests 1 and 2 run (at ~0 s and ~0.8 s), test 3 (at ~1.6 s) does not
    solution = py("import time\ntime.sleep(0.8)\nprint(input())")
    tests = [{"type": "stdio", "input": str(n), "output": str(n)} for n in range(5)]
    budgeted = CodeReward(CodeRewardConfig(mode="fraction", sandbox=LIMITS), time_budget_s=3.5)
    start = time.monotonic()
    reward, info = budgeted(solution, {"tests": tests})
    assert time.monotonic() - start < 3.5
    assert (info["tests_passed"], info["tests_run"], info["tests_not_run"]) == (2, 2, 3)
    assert reward == pytest.approx(2 / 5) and info["outcome"] == "time_budget"


def test_apps_call_form_with_solution_class_and_float_tolerance():
    apps = {"inputs": [[[1, 2, 3]], [[]]], "outputs": [[6.000001], [0]], "fn_name": "total"}
    solution = py("class Solution:\n    def total(self, xs):\n        return float(sum(xs))")
    assert verifier()(solution, {"tests": apps})[0] == 0.0  # exact by default
    assert verifier(float_tolerance=1e-5)(solution, {"tests": json.dumps(apps)}) == (1.0, {
        "outcome": "passed", "language": "python", "tests_total": 2, "tests_passed": 2, "tests_run": 2})


def test_stdio_float_tolerance():
    tests = [{"type": "stdio", "input": "", "output": "0.3333333 2"}]
    assert verifier()(py("print(1 / 3, 2)"), {"tests": tests})[1]["outcome"] == "failed"
    assert verifier(float_tolerance=1e-6)(py("print(1 / 3, 2)"), {"tests": tests})[0] == 1.0


def test_language_from_metadata_and_no_compiler(monkeypatch):
    untagged = f"{F}\nint main() {{ return 0; }}\n{F}"
    tests = [{"type": "stdio", "input": "", "output": ""}]
    if code_reward.GXX is not None:
        assert verifier()(untagged, {"tests": tests, "language": "cpp"})[1]["outcome"] == "passed"
    monkeypatch.setattr(code_reward, "GXX", None)
    assert verifier()(untagged, {"tests": tests, "language": "cpp"}) == (0.0, {"outcome": "no_compiler"})


@pytest.mark.parametrize("response, outcome", [
    ("", "no_code"),
    ("\udcff" * 10, "no_code"),
    (py("s = '\udcff'\nprint(3)"), "passed"),  # the lone surrogate becomes "?"; nothing raises
    ("x" * 100, "crashed"),  # a bare name parses as Python and fails with NameError
    ("x" * 1_000_000, "output_limit"),  # ...whose traceback repeats the 1 MB line on stderr
    (py("print(3)") + "y" * 1_000_000, "passed"),
])
def test_bad_input_has_a_defined_outcome(response, outcome):
    tests = [{"type": "stdio", "input": "", "output": "3"}]
    assert verifier()(response, {"tests": tests})[1]["outcome"] == outcome


@pytest.mark.parametrize("solution, test, passed", [
    ("def f():\n    return (1, 2)", "assert f() == (1, 2)", True),
    ("def f():\n    return [1, 2]", "assert f() == (1, 2)", False),  # as in Python: a list is no tuple
    ("def f():\n    return {2, 1}", "assert f() == set([1, 2])", True),
    ("def f():\n    return 0.1 + 0.2", "import math\nassert math.isclose(f(), 0.3, rel_tol=1e-9)", True),
    ("def f():\n    return 0.1 + 0.2", "assert abs(f() - 0.3) < 1e-9", True),
    ("def f():\n    return 0.1 + 0.2", "assert f() == 0.3", False),
    ("def f():\n    return None", "assert f() is None", True),
    ("def f():\n    return 'abc'", "assert 'b' in f()", True),
    ("def f():\n    return {1: 'a'}", "assert f() == {1: 'a'}", True),
    ("def f():\n    return float('inf')", "assert f() == float('inf')", True),
    # HumanEval's form: asserts inside a check function, called once
    ("def f(x):\n    return x * 2", "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(0) == 0\n"
     "check(f)", True),
    ("def f(x):\n    return x * 2", "def check(candidate):\n    assert candidate(2) == 5\ncheck(f)", False),
    # an assert that never runs cannot pass: every probe must report (a forged report is empty)
    ("def f(x):\n    return x * 2", "def check(candidate):\n    assert candidate(2) == 4", False),
    ("def f(x):\n    return x > 1", "assert f(2)\nassert not f(0)", True),  # no constant side: inside
    ("def f(x):\n    return x > 1", "assert f(0)", False),
])
def test_assert_tests_compare_outside_like_python(solution, test, passed):
    reward, info = verifier()(py(solution), {"tests": [{"type": "assert", "code": test}]})
    assert (reward, info["outcome"]) == ((1.0, "passed") if passed else (0.0, "failed")), info


def test_memory_infinite_loop_sleep_and_output_flood(workdir):
    cases = {
        "x = bytearray(10 ** 10)": "memory",  # over RLIMIT_AS at once
        "x = [0] * 10 ** 9": "memory",
        "while True:\n    pass": "timeout",
        "import time\ntime.sleep(100)": "timeout",
        "import sys\nb = b'x' * (1 << 20)\nwhile True:\n    sys.stdout.buffer.write(b)": "output_limit",
        "import sys\nwhile True:\n    sys.stderr.write('e' * 100000)": "output_limit",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)": "killed",
        "import os\nos.abort()": "crashed",
    }
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for code, outcome in cases.items():
        start = time.monotonic()
        reward, info = verifier()(py(code), {"tests": ADD_STDIO})
        assert (reward, info["outcome"]) == (0.0, outcome), code
        assert time.monotonic() - start < LIMITS.wall_time_s + SLACK_S, code
    result = run_python("while True: print('x' * 10**6)", workdir)
    assert result.status == "output_limit" and len(result.stdout) == LIMITS.max_output_kb << 10
    # the flood was never held in memory here: the test process grew by far less than it printed
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 32 << 10  # KiB


def test_a_cpu_bound_run_ends_at_the_cpu_limit_as_timeout(workdir):
    result = run_python("while True:\n    pass", workdir, wall_time_s=5.0)
    assert result.status == "timeout" and result.returncode in (-24, -9)  # SIGXCPU (or SIGKILL)
    assert result.wall_s < LIMITS.cpu_time_s + 1 + SLACK_S  # the CPU limit, not the wall clock


def test_a_launcher_that_died_is_replaced(workdir):
    assert run_python("print(1)", workdir).stdout == b"1\n"
    from asyncrl.reward.sandbox import runner

    (pool,) = [p for key, p in runner._pools.items() if key == isolation()]
    (launcher,) = pool._free
    launcher.proc.kill()
    launcher.proc.wait()
    first = run_python("print(2)", workdir)  # may find the dead one first: a sandbox error, not a hang
    assert first.status == "sandbox_error" or first.stdout == b"2\n"
    assert run_python("print(3)", workdir).stdout == b"3\n"


@pytest.mark.parametrize("net", [True, False], ids=["bare+net", "bare"])
def test_the_bare_back_end_still_cleans_up(workdir, net):
    """Where no namespace can be made: leftovers found by cgroup (or uid), files left in /tmp
    removed, the network namespace kept when that one can be made."""
    iso = dataclasses.replace(isolation(), backend="bare", userns=not ROOT and net,
                              net_flags=(0 if not net else spawn.CLONE_NEWNET if ROOT else spawn.CLONE_NEWUSER | spawn.CLONE_NEWNET))
    marker = f"asyncrl-marker-{os.getpid()}-{time.time_ns()}"
    code = f"""
        import os, socket
        open("/tmp/{marker}", "w").write("x")
        if os.fork() == 0:
            os.setsid()
            os.execv("/bin/sleep", ["{marker}", "100"])
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=1)
        except OSError as e:
            print(type(e).__name__)"""
    try:
        result = runner._run([code_reward.PYTHON, "-I", "-S", "-c", textwrap.dedent(code)], b"", LIMITS, workdir,
                             False, iso)
        assert result.status == "ok" and result.backend == "bare"
        assert result.stdout == (b"OSError\n" if net else b"ConnectionRefusedError\n")  # no route vs. nobody there
        if ROOT:  # the run's uid owns both: the cgroup (or the uid) finds the process, and the file
            assert not Path(f"/tmp/{marker}").exists()
            assert not [p for p in os.listdir("/proc") if p.isdigit() and marker.encode() in _cmdline(p)]
    finally:
        Path(f"/tmp/{marker}").unlink(missing_ok=True)
        runner.release(iso)


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""

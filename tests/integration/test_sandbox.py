"""The code sandbox with real programs: every test form against correct, wrong, crashing, slow and
broken solutions (Python and C++), both reward modes, and attacks whose containment is checked
from outside the sandbox (listener, files, processes, the test process itself).

Limits are short (wall 2 s, CPU 1 s) so the file runs in seconds. The attacks that rely on the
uid change need root; without it they are skipped with the reason, because the sandbox then does
not protect against them (see asyncrl.reward.sandbox).
"""

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl.config import CodeRewardConfig, SandboxConfig
from asyncrl.reward import code_reward
from asyncrl.reward.code_reward import CodeReward
from asyncrl.reward.sandbox import SANDBOX_UID_BASE, network_mode, processes_of, run_sandboxed

LIMITS = SandboxConfig(wall_time_s=2.0, cpu_time_s=1, memory_mb=256, max_processes=8, max_file_mb=1,
                       max_output_kb=64, compile_time_s=30)
SLACK_S = 1.5
F = "```"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="uid separation needs root; without it the "
                                "sandbox does not contain this attack")
needs_gxx = pytest.mark.skipif(code_reward.GXX is None, reason="no g++")

PAIRS = [(1, 2), (5, 7), (10, -3)]
ADD_STDIO = [{"type": "stdio", "input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in PAIRS]
ADD_CALL = [{"type": "call", "fn": "add", "args": [a, b], "expected": a + b} for a, b in PAIRS]
ADD_ASSERT = [{"type": "assert", "code": f"assert add({a}, {b}) == {a + b}"} for a, b in PAIRS]


def verifier(mode="all_pass", **kw):
    return CodeReward(CodeRewardConfig(mode=mode, sandbox=LIMITS, **kw))


def run_python(code, workdir):
    """run_sandboxed on a Python one-off, without the verifier (to see status, output and uid)."""
    return run_sandboxed([code_reward.PYTHON, "-I", "-S", "-c", textwrap.dedent(code)], b"", LIMITS, workdir)


def py(code):
    return f"Here is my solution.\n{F}python\n{textwrap.dedent(code).strip()}\n{F}\n"


def cpp(code):
    return f"{F}cpp\n#include <iostream>\n#include <vector>\n{textwrap.dedent(code).strip()}\n{F}"


def sandbox_processes():
    """(pid, parent pid, state) of the processes of any sandbox uid (every run has a uid of its
    own above SANDBOX_UID_BASE)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) >= SANDBOX_UID_BASE:
            found.append((int(name), int(fields["PPid"]), fields["State"].strip()[0]))
    return found


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """After every test: no sandbox process alive and no sandbox directory left in the temp dir."""
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("asyncrl-code-*"))
    yield
    left = [(pid, ppid, state) for pid, ppid, state in sandbox_processes()
            if state != "Z" or ppid == os.getpid()]
    assert left == []  # nothing alive, and no zombie that this process failed to reap
    assert set(tmp.glob("asyncrl-code-*")) - before == set()


@pytest.fixture
def workdir():
    """A directory for run_sandboxed called directly (tmp_path's parents are closed to other uids)."""
    path = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-test-"))
    yield path
    shutil.rmtree(path)


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


# --- attacks: each one contained, reward 0, the host checked from outside -----------------------

def test_network_is_isolated(workdir):
    assert network_mode() is not None, "this machine cannot isolate the sandbox's network"
    assert run_python("pass", workdir).network_isolated
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        attack = py(f"""
            import socket
            socket.create_connection(("127.0.0.1", {port}), timeout=1)
            print("connected")""")
        reward, info = verifier()(attack, {"tests": [{"type": "stdio", "input": "", "output": "connected"}]})
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    assert (reward, info["outcome"]) == (0.0, "crashed")


@needs_root
def test_cannot_write_outside_its_directory(tmp_path):
    open_dir = Path(tempfile.mkdtemp())
    open_dir.chmod(0o755)  # reachable for everyone, writable only by its owner (root)
    targets = [tmp_path / "pwned", open_dir / "pwned", Path.cwd() / "pwned"]
    leftover = Path("/tmp") / f"asyncrl-leftover-{os.getpid()}"
    attack = py(f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as e:
                print(e)
        open({str(leftover)!r}, "w").write("left in /tmp")  # world-writable: allowed, cleaned up after
        print("done")""")
    try:
        reward, info = verifier()(attack, {"tests": [{"type": "stdio", "input": "", "output": "done"}]})
        assert [t for t in targets if t.exists()] == []
        assert not leftover.exists()
        assert (reward, info["outcome"]) == (0.0, "failed")  # the permission errors were printed
    finally:
        shutil.rmtree(open_dir)
        for path in [*targets, leftover]:
            path.unlink(missing_ok=True)


@needs_root
def test_cannot_read_secrets_from_the_environment(monkeypatch, workdir):
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", secret)
    holder = subprocess.Popen(["sleep", "30"], env={"ASYNCRL_TEST_SECRET": secret})
    try:
        deadline = time.monotonic() + 5  # readable without the sandbox, once `sleep` has started
        while secret not in Path(f"/proc/{holder.pid}/environ").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        attack = f"""
            import os
            print(dict(os.environ))
            for pid in [os.getppid(), {holder.pid}, {os.getpid()}, *filter(str.isdigit, os.listdir("/proc"))]:
                try:
                    print(open(f"/proc/{{pid}}/environ", "rb").read())
                except OSError:
                    pass"""
        result = run_python(attack, workdir)
        assert result.status == "ok" and b"PATH" in result.stdout  # it ran and printed its own environment
        assert secret.encode() not in result.stdout + result.stderr
        reward, _ = verifier()(py(attack), {"tests": [{"type": "stdio", "input": "", "output": secret}]})
        assert reward == 0.0
    finally:
        holder.kill()
        holder.wait()


@needs_root
def test_fork_bomb_is_contained(workdir):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    result = run_python(bomb, workdir)
    assert time.monotonic() - start < LIMITS.wall_time_s + SLACK_S
    assert result.status == "timeout" and result.uid is not None
    assert processes_of(result.uid) == []
    reward, info = verifier()(py(bomb), {"tests": ADD_STDIO})
    assert (reward, info["outcome"]) == (0.0, "timeout")


def test_memory_infinite_loop_sleep_and_output_flood(workdir):
    cases = {
        "x = bytearray(10 ** 10)": "memory",
        "x = [0] * 10 ** 9": "memory",
        "while True:\n    pass": "timeout",
        "import time\ntime.sleep(100)": "timeout",
        "import sys\nb = b'x' * (1 << 20)\nwhile True:\n    sys.stdout.buffer.write(b)": "output_limit",
        "import sys\nwhile True:\n    sys.stderr.write('e' * 100000)": "output_limit",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)": "killed",
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


@needs_root
def test_cannot_kill_the_parent_or_its_processes(workdir):
    sentinel = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        attack = f"""
            import os, signal
            for action in (lambda: os.kill(os.getppid(), signal.SIGKILL),
                           lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL),
                           lambda: os.killpg({sentinel.pid}, signal.SIGKILL),
                           lambda: os.kill({sentinel.pid}, signal.SIGKILL),
                           lambda: os.kill({os.getpid()}, signal.SIGKILL),
                           lambda: os.kill(1, signal.SIGKILL)):
                try:
                    action()
                except OSError as e:
                    print(e)
            os.kill(-1, signal.SIGKILL)  # every process of this run's uid but itself: none
            print("survived")"""
        result = run_python(attack, workdir)
        assert result.stdout.count(b"Operation not permitted") == 6
        assert result.status == "ok" and result.stdout.endswith(b"survived\n")
        assert verifier()(py(attack), {"tests": ADD_STDIO})[0] == 0.0
        time.sleep(0.1)
        assert sentinel.poll() is None  # alive; and so is this process, which is still running
    finally:
        sentinel.kill()
        sentinel.wait()


def marker_processes(marker):
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                found.append(int(name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("leave_group", [False, True], ids=["child", "setsid-double-fork"])
def test_no_background_process_survives(leave_group):
    if leave_group and os.geteuid() != 0:
        pytest.skip("a child that calls setsid() is only caught by the per-uid sweep, which needs root")
    marker = f"asyncrl-marker-{os.getpid()}-{time.time_ns()}"
    escape = f"""
        import os, time
        if os.fork() == 0:
            if {leave_group}:
                os.setsid()
                if os.fork() != 0:
                    os._exit(0)
            os.execv("/bin/sleep", [{marker!r}, "100"])
        time.sleep(0.3)  # the background process is running by now
        print(3)"""
    # without the sandbox the escape works, and marker_processes sees it
    subprocess.run([sys.executable, "-c", textwrap.dedent(escape)], check=True, stdout=subprocess.DEVNULL)
    try:
        assert marker_processes(marker) != []
    finally:
        for pid in marker_processes(marker):
            os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)  # an orphan of ours once run_sandboxed made this a subreaper
            except ChildProcessError:
                pass
    reward, info = verifier()(py(escape), {"tests": [{"type": "stdio", "input": "", "output": "3"}]})
    assert (reward, info["outcome"]) == (1.0, "passed")  # the solution itself is fine...
    assert marker_processes(marker) == []  # ...but what it left behind is gone

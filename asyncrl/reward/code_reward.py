"""The code verifier: run the response's program against the sample's tests in the sandbox.

    response ─► last ```python / ```cpp block (after </think>) ─► syntax check (ast / g++)
             ─► each test in asyncrl.reward.sandbox ─► reward 1 if all pass, or passed / total

Test forms (metadata["tests"], a list or its JSON string): {"type": "stdio", "input", "output"}
(whitespace-normalized tokens, numbers within cfg.float_tolerance when set), {"type": "call",
"fn", "args", "kwargs", "expected"} (the return value; a LeetCode-style `class Solution` method
also counts), {"type": "assert", "code"} (a script run after the solution, in its namespace). The
APPS/TACO dict {"inputs", "outputs", "fn_name"?} is read as stdio tests, or as call tests when it
has fn_name (then, as in APPS, an expected value wrapped in a one-element list also matches
unwrapped). C++ takes stdio tests only. Outcomes: the module constants below.

Reward hacking: expected values never enter the sandbox. stdio outputs and call results are
compared here; assert tests are rewritten so that each assert with a constant side reports its
value and the comparison is made here too (code_drivers.py, which also says what that does not
cover). Drivers come over stdin and report through a random nonce, so a program that exits early
with status 0 fails; a program that finds the nonce can forge a report, but not the values.

Python runs as /usr/bin/python3 (else this interpreter) with -I -S -B: the solution sees neither
the project nor any site-packages (standard library only). Each test runs in a fresh sandbox
whose run directory is a copy of the solution (asyncrl.reward.sandbox); the host directories
used to prepare them are removed with remove_tree, which nothing the program wrote can defeat.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import CodeRewardConfig
from asyncrl.reward import code_drivers
from asyncrl.reward.sandbox import RunResult, remove_tree, run_sandboxed

OUTCOMES = ("passed", "failed", "syntax_error", "compile_error", "no_code", "no_tests", "bad_tests",
            "bad_input", "no_compiler", "timeout", "memory", "output_limit", "killed", "crashed",
            "sandbox_error", "time_budget", "verifier_limit")
LANGUAGES = {"python": "python", "py": "python", "python3": "python",
             "cpp": "cpp", "c++": "cpp", "cxx": "cpp", "cc": "cpp"}
PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
GXX = shutil.which("g++", path="/usr/bin:/bin")
class BadTests(ValueError):
    """metadata["tests"] is missing (outcome no_tests) or malformed (bad_tests)."""

    def __init__(self, outcome: str, why: str):
        super().__init__(why)
        self.outcome = outcome


@dataclass(frozen=True)
class CodeTest:
    kind: str  # stdio | call | assert
    stdin: str = ""
    expected: Any = None  # stdio: the expected output text; call: the return value
    fn: str = ""
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    code: str = ""  # assert: the test code with probes (code_drivers.rewrite_asserts)
    checks: tuple = ()  # assert: per probe, (op, expected, options), compared here
    unwrap: bool = False  # APPS: `[x]` as expected also matches x


def extract_code(response: str, default_language: str = "python") -> tuple[str, str] | None:
    """(code, language) from the last closed python/cpp fence after the reasoning, else the last
    untagged fence; without fences, the whole answer if it parses as Python. None: no code."""
    head, sep, answer = response.rpartition("</think>")
    if not sep and "<think>" in response:
        return None  # the reasoning never ended: cut off by the length limit
    parts = answer.split("```")  # one linear pass; odd parts are fence contents
    blocks = parts[1:len(parts) - 1:2]  # a trailing unclosed fence is dropped
    untagged = None
    for block in reversed(blocks):
        info, _, code = block.partition("\n")
        tag = info.strip().split(maxsplit=1)[0].lower() if info.strip() else ""
        if tag in LANGUAGES:
            return code, LANGUAGES[tag]
        if not tag and untagged is None:
            untagged = (code, default_language)
    if untagged is not None:
        return untagged
    if blocks or default_language != "python" or not answer.strip() or not _parses(answer):
        return None
    return answer, "python"


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, UnicodeError, RecursionError, MemoryError, OverflowError):
        return False
    return True


def parse_tests(raw: Any) -> list[CodeTest]:
    """The tests in any accepted form (module docstring); raises BadTests."""
    if isinstance(raw, str):
        if not raw.strip():
            raise BadTests("no_tests", "empty tests string")
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise BadTests("bad_tests", f"tests are not JSON: {e}") from None
    if raw is None or (isinstance(raw, (list, dict)) and not raw):
        raise BadTests("no_tests", "no tests")
    if isinstance(raw, dict) and "inputs" in raw and "outputs" in raw:
        return _apps_tests(raw)
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise BadTests("bad_tests", "tests must be a list of dicts or an inputs/outputs dict")
    return [_one_test(t) for t in raw]


def _text(value: Any, what: str) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # some datasets store lines
    if not isinstance(value, str):
        raise BadTests("bad_tests", f"{what} must be a string")
    return value


def _one_test(t: dict) -> CodeTest:
    kind = t.get("type")
    if kind == "stdio" and "output" in t:
        return CodeTest("stdio", stdin=_text(t.get("input", ""), "input"),
                        expected=_text(t["output"], "output"))
    if kind == "call" and "expected" in t and isinstance(t.get("fn"), str) and t["fn"].isidentifier():
        args, kwargs = t.get("args", []), t.get("kwargs", {})
        if isinstance(args, list) and isinstance(kwargs, dict):
            return CodeTest("call", fn=t["fn"], args=args, kwargs=kwargs, expected=t["expected"])
    if kind == "assert" and isinstance(t.get("code"), str) and t["code"].strip():
        try:
            code, checks = code_drivers.rewrite_asserts(t["code"])
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise BadTests("bad_tests", f"assert test does not parse: {e}") from None
        return CodeTest("assert", code=code, checks=tuple(checks))
    raise BadTests("bad_tests", f"malformed test of type {str(kind)[:20]!r}")


def _apps_tests(raw: dict) -> list[CodeTest]:
    inputs, outputs, fn = raw["inputs"], raw["outputs"], raw.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise BadTests("bad_tests", "inputs and outputs must be lists of one length")
    if not inputs:
        raise BadTests("no_tests", "no tests")
    if fn is None:
        return [CodeTest("stdio", stdin=_text(i, "input"), expected=_text(o, "output"))
                for i, o in zip(inputs, outputs)]
    if not isinstance(fn, str) or not fn.isidentifier():
        raise BadTests("bad_tests", "fn_name must be an identifier")
    return [CodeTest("call", fn=fn, args=i if isinstance(i, list) else [i], expected=o, unwrap=True)
            for i, o in zip(inputs, outputs)]


INTEGER = re.compile(r"[+-]?\d+")


def outputs_match(actual: str, expected: str, tol: float | None) -> bool:
    """Whitespace-insensitive token comparison; where tol is set, an expected token that is a real
    number (not an integer) matches any number within tol of it."""
    got, want = actual.split(), expected.split()
    if len(got) != len(want):
        return False
    return all(g == w or (tol is not None and _numbers_close(g, w, tol)) for g, w in zip(got, want))


def _numbers_close(got: str, want: str, tol: float) -> bool:
    """An integer compares exactly (a relative tolerance would pass 10**9 for 1000000007);
    any other number within tol."""
    if INTEGER.fullmatch(want):
        return False  # exact tokens were compared already; "+7" for "7" is not asked for either
    try:
        return math.isclose(float(got), float(want), rel_tol=tol, abs_tol=tol)
    except ValueError:
        return False


def values_match(actual: Any, expected: Any, tol: float | None) -> bool:
    """Equality of JSON values (tuples came back as lists); where tol is set, an expected float
    matches any number within tol of it (an expected integer only itself)."""
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(map(values_match, actual, expected, [tol] * len(actual)))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(values_match(actual[k], expected[k], tol)
                                                        for k in actual)
    if (tol is not None and type(expected) is float and isinstance(actual, (int, float))
            and not isinstance(actual, bool)):
        try:
            return math.isclose(actual, expected, rel_tol=tol, abs_tol=tol)
        except OverflowError:  # an int beyond any float: only equal to itself
            return actual == expected
    return actual == expected


class CodeReward:
    """The `code` verifier (`RewardFn`); see the module docstring."""

    def __init__(self, cfg: CodeRewardConfig | None = None, time_budget_s: float | None = None):
        """time_budget_s: no test is started that could end past this many seconds after the call
        began; the rest count as not run (outcome `time_budget` if all run ones passed), so in
        fraction mode a sample keeps what it passed instead of being killed at the pool's timeout."""
        self.cfg = cfg if cfg is not None else CodeRewardConfig()
        self.time_budget_s = time_budget_s

    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        if not isinstance(response, str) or not isinstance(metadata, dict):
            return 0.0, {"outcome": "bad_input", "error": "response must be str and metadata a dict"}
        response = response.encode("utf-8", "replace").decode("utf-8")  # lone surrogates -> "?"
        language = LANGUAGES.get(str(metadata.get("language") or "python").lower())
        if language is None:
            return 0.0, {"outcome": "bad_input", "error": "unsupported language"}
        try:
            tests = parse_tests(metadata.get("tests"))[: self.cfg.max_tests]
        except BadTests as e:
            return 0.0, {"outcome": e.outcome, "error": str(e)[:200]}
        found = extract_code(response, language)
        if found is None:
            return 0.0, {"outcome": "no_code"}
        code, language = found
        if language == "cpp" and any(t.kind != "stdio" for t in tests):
            return 0.0, {"outcome": "bad_tests", "error": "C++ solutions take stdio tests only"}
        if language == "cpp" and GXX is None:
            return 0.0, {"outcome": "no_compiler"}
        if language == "python" and not _parses(code):
            return 0.0, {"outcome": "syntax_error", "language": language}
        try:
            base = Path(tempfile.mkdtemp(prefix="asyncrl-code-"))
            try:
                os.chmod(base, 0o711)  # sandbox uids may pass through to their own run directories
                return self._score(code, language, tests, base)
            finally:
                remove_tree(base)
        except OSError as e:  # the host could not set a run up (disk full, no processes left)
            return 0.0, {"outcome": "sandbox_error", "error": repr(e)[:200]}

    def _score(self, code: str, language: str, tests: list[CodeTest],
               base: Path) -> tuple[float, dict[str, Any]]:
        """all_pass stops at the first test that crashed, timed out or ran out of memory (what the
        program did, known to it already) but not at a wrong answer: how many tests a sample ran
        can be read by a later sample (through the page cache they share), and a stop after a
        wrong answer would tell it which of its earlier answers were right."""
        start = time.monotonic()
        info: dict[str, Any] = {"language": language, "tests_total": len(tests), "tests_passed": 0}
        program = base / ("solution.py" if language == "python" else "solution.cpp")
        program.write_text(code, encoding="utf-8")
        if language == "cpp":
            result = self._compile(base)
            if result.status != "ok":
                error = result.stderr[-500:].decode("utf-8", "replace")
                info.update(outcome="compile_error", compile_status=result.status, error=error)
                return 0.0, info
            program = base / "build" / "solution"
        statuses = []
        for i, test in enumerate(tests):
            if self._out_of_time(start):
                info["tests_not_run"] = len(tests) - i
                break
            statuses.append(self._run_test(test, program, base))
            info[f"tests_{statuses[-1]}"] = info.get(f"tests_{statuses[-1]}", 0) + 1  # sandbox outcomes
            if statuses[-1] not in ("passed", "failed") and self.cfg.mode == "all_pass":
                break  # the reward is 0 already (a wrong answer does not stop: see below)
        info["tests_run"] = len(statuses)
        failed = next((s for s in statuses if s != "passed"), None)
        info["outcome"] = failed or ("time_budget" if "tests_not_run" in info else "passed")
        if self.cfg.mode == "fraction":
            return info["tests_passed"] / len(tests), info
        return float(info["tests_passed"] == len(tests)), info

    def _out_of_time(self, start: float) -> bool:
        if self.time_budget_s is None:
            return False
        return time.monotonic() - start + self.cfg.sandbox.wall_time_s > self.time_budget_s

    def _compile(self, base: Path) -> RunResult:
        build = base / "build"
        build.mkdir()
        shutil.copy(base / "solution.cpp", build)
        sb = self.cfg.sandbox  # the compiler needs more memory and time than a test run
        limits = sb.model_copy(update={
            "wall_time_s": sb.compile_time_s, "cpu_time_s": math.ceil(sb.compile_time_s),
            "memory_mb": sb.compile_memory_mb, "max_processes": max(sb.max_processes, 8),
            "max_output_kb": max(sb.max_output_kb, 64)})
        return run_sandboxed([GXX, "-O2", "-std=c++17", "-o", "solution", "solution.cpp"], b"", limits, build,
                             persist=True)

    def _run_test(self, test: CodeTest, program: Path, base: Path) -> str:
        """One test in a fresh directory of its own; returns passed, failed or a run status."""
        nonce = secrets.token_hex(16)
        workdir = Path(tempfile.mkdtemp(dir=base))
        try:
            # follow_symlinks=False: root must never copy whatever a symlink made in the sandbox names
            shutil.copy2(program, workdir, follow_symlinks=False)
            python = [PYTHON, "-I", "-S", "-B"]
            if test.kind == "stdio":
                argv = [*python, program.name] if program.suffix == ".py" else [f"./{program.name}"]
                stdin = test.stdin
            elif test.kind == "call":
                argv = [*python, "-"]
                stdin = code_drivers.driver(nonce, "call", {"fn": test.fn, "args": test.args, "kwargs": test.kwargs})
            else:
                argv, stdin = [*python, "-"], code_drivers.driver(nonce, "assert", {"code": test.code})
            result = run_sandboxed(argv, stdin.encode("utf-8", "replace"), self.cfg.sandbox, workdir)
        finally:
            remove_tree(workdir)
        if result.status != "ok":
            return result.status
        try:
            return self._judge(test, result.stdout, nonce)
        except code_drivers.ReportTooCostly:  # a report built to cost the verifier CPU time
            return "verifier_limit"
        except Exception:  # untrusted output made decoding or comparing raise: the test failed,
            return "failed"  # never a verifier error (reward.max_error_frac stops runs for those)

    def _judge(self, test: CodeTest, stdout_bytes: bytes, nonce: str) -> str:
        """passed or failed, from what the program printed: everything here reads untrusted data."""
        stdout = stdout_bytes.decode("utf-8", "replace")
        if test.kind == "stdio":
            return "passed" if outputs_match(stdout, test.expected, self.cfg.float_tolerance) else "failed"
        _, marker, reported = stdout.rpartition("\n" + nonce)
        if not marker:
            return "failed"  # the driver never finished: e.g. the solution exited early
        reported = reported.partition("\n")[0]  # an atexit handler may print after the driver
        try:
            probes = json.loads(reported)
        except (ValueError, RecursionError):  # "fail" (an assert failed), or not JSON
            return "failed"
        if test.kind == "assert":
            return "passed" if code_drivers.probes_pass(probes, list(test.checks)) else "failed"
        return "passed" if self._call_matches(probes, test) else "failed"

    def _call_matches(self, probes: Any, test: CodeTest) -> bool:
        if not (isinstance(probes, list) and len(probes) == 1 and isinstance(probes[0], list) and len(probes[0]) == 2):
            return False
        try:
            actual = _as_json(code_drivers.decode(probes[0][1]))
        except code_drivers.ReportTooCostly:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError, OverflowError):
            return False
        tol, expected = self.cfg.float_tolerance, test.expected
        if values_match(actual, expected, tol):
            return True
        unwrapped = test.unwrap and isinstance(expected, list) and len(expected) == 1
        return unwrapped and values_match(actual, expected[0], tol)


def _as_json(value: Any) -> Any:
    """What a JSON round trip would make of a returned value: tuples as lists (the expected
    value comes from JSON, where a tuple is a list)."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value

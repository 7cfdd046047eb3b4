"""A Python tool: the model runs a program in the code verifier's sandbox and reads its output.

    model: ... let me check. <python>print(sum(i * i for i in range(10)))</python>
    env:   <output>285
           </output>
    model: ... so the answer is \\boxed{285}       (no call: the episode is done)

The program is the body of the `<python>...</python>` that ends the turn (tool_calls.py's
`ending_call`). It runs exactly as a code-verifier test does (reward/code_reward.py
`CodeReward._run_test`): `python3 -I -S -B program.py` with empty stdin, alone in a fresh run
directory that is removed with remove_tree, under `SandboxConfig(**sandbox)`, whose defaults are
the verifier's (`reward.code.sandbox`). Each call is a new process: nothing carries over between
calls but what the model copies into the next program.

The observation is `<output>{stdout}</output>`. A run whose status is not ok (an exception, a
timeout, memory, an output over the limit, a signal; reward/sandbox/__init__.py) also shows the
tail of its stderr (a traceback's last line) and ends with a line `error: {what happened}`; it
counts as a tool error. The text shown is about max_output_chars: stdout's head and stderr's tail
share it, with a `[... N characters cut]` line where something was left out. A sandbox that
could not start the program also counts as a tool error (status sandbox_error): the episode goes
on, and the verifier's reward pool sees the same host.

The call limit is the calculator's (`max_calls`; calculator.py's docstring). Reward: None.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.config import SandboxConfig
from asyncrl.env.tool_calls import ToolEnvironment
from asyncrl.reward.code_reward import PYTHON
from asyncrl.reward.sandbox import RunResult, remove_tree, run_sandboxed


def run_program(code: str, limits: SandboxConfig) -> RunResult:
    """Run a Python program as the code verifier runs a stdio test, with empty stdin."""
    workdir = Path(tempfile.mkdtemp(prefix="asyncrl-python-tool-"))
    try:
        # lone surrogates (a tokenizer's broken pair) -> "?", as the verifier does
        (workdir / "program.py").write_bytes(code.encode("utf-8", "replace"))
        return run_sandboxed([PYTHON, "-I", "-S", "-B", "program.py"], b"", limits, workdir)
    finally:
        remove_tree(workdir)


def describe_failure(result: RunResult, limits: SandboxConfig) -> str:
    """The `error: ...` line of a run that did not end ok."""
    code = result.returncode
    if result.status == "timeout":
        return f"error: timeout (limits: {limits.wall_time_s:g} s, {limits.cpu_time_s} s of CPU)"
    if result.status == "memory":
        return f"error: out of memory (limit: {limits.memory_mb} MiB)"
    if result.status == "output_limit":
        return f"error: output over the limit of {limits.max_output_kb} KiB"
    if result.status == "sandbox_error":
        return "error: the sandbox could not start the program"
    if code is not None and code < 0:
        return f"error: killed by {_signal_name(-code)}"
    return f"error: exit status {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def format_output(result: RunResult, limits: SandboxConfig, max_chars: int) -> str:
    """What `<output>...</output>` holds for a run: stdout's head and, when it failed, stderr's
    tail and the error line, the two outputs within about max_chars together."""
    out = result.stdout.decode("utf-8", "replace")
    err = result.stderr.decode("utf-8", "replace") if result.status != "ok" else ""
    # stderr's tail gets what stdout leaves, and at least half when both are long
    err_chars = min(len(err), max_chars - min(len(out), max_chars // 2))
    out_chars = min(len(out), max_chars - err_chars)
    shown = out[:out_chars]
    if out_chars < len(out):
        shown = _ended(shown) + f"[... {len(out) - out_chars} characters cut]\n"
    if result.status == "ok":
        return shown
    tail = err[len(err) - err_chars:]
    if err_chars < len(err):
        tail = f"[... {len(err) - err_chars} characters cut]\n" + tail
    return f"{_ended(shown)}{_ended(tail)}{describe_failure(result, limits)}\n"


def _ended(text: str) -> str:
    return text + "\n" if text and not text.endswith("\n") else text


class PythonTool(ToolEnvironment):
    """The `python` environment: `PythonTool(metadata, sandbox=None, max_calls=4,
    max_output_chars=400)`, one per episode; `sandbox` holds SandboxConfig fields."""

    call_tag, answer_tag = "python", "output"

    def __init__(self, metadata: dict[str, Any], sandbox: dict[str, Any] | None = None, max_calls: int = 4,
                 max_output_chars: int = 400):
        super().__init__(max_calls)
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be at least 1, got {max_output_chars}")
        self.limits = SandboxConfig(**(sandbox or {}))
        self.max_output_chars = max_output_chars

    def answer(self, body: str) -> tuple[str, bool]:
        if not body.strip():
            return "error: no code", True
        result = run_program(body, self.limits)
        return format_output(result, self.limits, self.max_output_chars), result.status != "ok"

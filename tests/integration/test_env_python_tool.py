"""The python tool environment (asyncrl/env/python_tool.py) running real programs in the code
sandbox, with short limits; sandbox_support's fixture checks after each test that nothing was
left behind (processes, cgroups, mounts, run directories)."""

import os
import textwrap
import time
from pathlib import Path

from sandbox_support import nothing_left_behind, require_isolation  # noqa: F401

import asyncrl
from asyncrl.env.base import Turn
from asyncrl.env.python_tool import PythonTool
from asyncrl.reward.sandbox import remove_tree

SANDBOX = {"wall_time_s": 2.0, "cpu_time_s": 1, "memory_mb": 256, "max_processes": 8}


def call(env, code):
    text = f"Let me run it.\n<python>\n{textwrap.dedent(code).strip()}\n</python>"
    return env.step(Turn(index=0, text=text, token_ids=[], finish_reason="stop"))


def test_a_program_runs_and_its_output_is_shown():
    env = PythonTool({}, sandbox=SANDBOX)
    step = call(env, "print(2 + 3)")
    assert (step.observation, step.done, step.info) == ("<output>5\n</output>", False,
                                                        {"tool_calls": 1, "tool_errors": 0})
    long = call(env, "print('x' * 1000)")
    assert long.observation == f"<output>{'x' * 400}\n[... 601 characters cut]\n</output>"


def test_a_failing_program_shows_its_error():
    step = call(PythonTool({}, sandbox=SANDBOX), """
        print("before")
        {}["missing"]""")
    assert step.observation.startswith("<output>before\nTraceback (most recent call last):\n")
    assert step.observation.endswith("KeyError: 'missing'\nerror: exit status 1\n</output>")
    assert step.info == {"tool_calls": 1, "tool_errors": 1}


def test_an_endless_loop_ends_as_a_timeout_error():
    env = PythonTool({}, sandbox=SANDBOX)
    start = time.monotonic()
    step = call(env, "while True:\n    pass")  # stopped by the CPU limit
    assert time.monotonic() - start < SANDBOX["wall_time_s"] + 1.5
    assert step.observation == "<output>error: timeout (limits: 2 s, 1 s of CPU)\n</output>"
    assert (step.done, step.info) == (False, {"tool_calls": 1, "tool_errors": 1})
    start = time.monotonic()
    step = call(env, "import time\nprint('waiting', flush=True)\ntime.sleep(60)")  # by the wall clock
    assert time.monotonic() - start < SANDBOX["wall_time_s"] + 1.5
    assert step.observation == "<output>waiting\nerror: timeout (limits: 2 s, 1 s of CPU)\n</output>"
    assert step.info == {"tool_calls": 1, "tool_errors": 1}


def test_the_host_is_not_readable_through_the_tool(nothing_left_behind):  # noqa: F811
    """test_sandbox_attacks.py's attack of the same name, sent as the model's program: the
    project's source, a world-readable file of another run and this process's environment are
    not there."""
    require_isolation()
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    other_run = nothing_left_behind / "runs" / "other-run"
    other_run.mkdir(parents=True)
    (other_run / "ground_truth.jsonl").write_text(secret)
    for d in [other_run.parent.parent, other_run.parent, other_run]:
        d.chmod(0o755)
    (other_run / "ground_truth.jsonl").chmod(0o644)
    source = Path(asyncrl.__file__).resolve().parent / "env" / "python_tool.py"
    paths = [str(source), str(source.parents[2]), str(other_run / "ground_truth.jsonl"),
             f"/proc/{os.getpid()}/environ"]
    try:
        step = call(PythonTool({}, sandbox=SANDBOX, max_output_chars=2000), f"""
            import os
            for path in {paths!r}:
                try:
                    print(path, "read", open(path, "rb").read()[:100] if os.path.isfile(path) else os.listdir(path))
                except OSError as e:
                    print(path, type(e).__name__)""")
    finally:
        remove_tree(other_run.parent)
    assert step.observation == "<output>" + "".join(f"{p} FileNotFoundError\n" for p in paths) + "</output>"
    assert secret not in step.observation

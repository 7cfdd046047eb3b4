"""A worker's output (C-level writes too) lands in the run's logs/ when asked, else stays put."""

import re
import subprocess
import sys

from pathlib import Path

from asyncrl.observe.worker_logs import ENV, log_env

ROOT = Path(__file__).resolve().parents[2]  # this checkout's asyncrl, in the child too

CODE = ("import os, sys\n"
        "from asyncrl.observe.worker_logs import redirect_output\n"
        "print('before', flush=True)\n"
        "print(redirect_output(), file=sys.stderr, flush=True)\n"
        "print('python out', flush=True)\n"
        "os.write(2, b'fd two\\n')\n")


def test_output_goes_to_the_named_file(tmp_path):
    env = log_env(tmp_path / "run", "actor-3", "file")
    assert env == {ENV: str((tmp_path / "run").resolve() / "logs" / "actor-3.log")}
    proc = subprocess.run([sys.executable, "-c", CODE], env={**env, "PATH": "", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "before\n" and proc.stderr == ""
    first, *rest = (tmp_path / "run/logs/actor-3.log").read_text().splitlines()
    # the file says which process on which node wrote it (a run's processes may be on several)
    assert re.fullmatch(r"--- actor-3: pid \d+ on \S+ \(no Ray\)", first), first
    assert rest == [env[ENV], "python out", "fd two"]


def test_console_mode_or_no_variable_leaves_output_alone(tmp_path):
    assert log_env(tmp_path, "learner", "console") == {}
    proc = subprocess.run([sys.executable, "-c", CODE], env={"PATH": ""}, capture_output=True, text=True)
    assert proc.stdout == "before\npython out\n" and proc.stderr == "None\nfd two\n"

"""The cluster path, as a user runs it: `ray start --head`, then `ray job submit` of launch/run.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def ray_cli(*args, timeout=600, env=None):
    ray = shutil.which("ray", path=str(BIN)) or "ray"
    return subprocess.run([ray, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_ray_job_submit_runs_launch_to_completion(tmp_path, tiny_model_path):
    # Ray >= 2.5x turns on token auth for `ray start`; the job client must be told to use it.
    # the job's `python` must be this environment's, as it is for a user with the venv active
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = ray_cli("start", "--head", "--num-cpus", "4", "--port", "6391", "--dashboard-port", "8271", env=env)
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        job = ray_cli("job", "submit", "--address", "http://127.0.0.1:8271", "--working-dir", ".", "--",
                      "python", "launch/run.py", "total_steps=2", "buffer.token_budget=64", "name=job",
                      f"observe.output_dir={tmp_path}", "observe.console=lines", "save_final=false", env=env)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout + job.stderr
        summary = json.loads((tmp_path / "job" / "summary.json").read_text())
        assert summary["steps"] == 2
    finally:
        ray_cli("stop", "--force", env=env)

"""The real entry point, as a user runs it: launch/run.py with the default config, very short,
on the cluster path of docs/guides/ray-cluster.md (`ray start --head --block`, a wait for the job
agent, `ray job submit`, the head stopped by a signal); then the saved policy in the tools.
launch/run.py starting a cluster of its own is what tests/e2e/test_recipe_runs.py and
test_first_hour.py run (the same entry point and run code), so this one run serves both checks."""

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from asyncrl.tiny.task import TinyTaskSpec, all_problems

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY = shutil.which("ray", path=str(BIN)) or "ray"
JOBS = "http://127.0.0.1:8271"  # the head's dashboard, where `ray job` commands go
AGENT_WAIT_S = 240


def ray_cli(*args, timeout=600, env=None):
    return subprocess.run([RAY, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@contextmanager
def ray_head(env, log: Path):
    """`ray start --head --block` in the background, as the guide starts it. Its SIGTERM stops this
    cluster's processes only; `ray stop` would stop every Ray on the machine, other runs' too."""
    # the agent's HTTP port on a free one: another Ray on this machine (any run's ray.init) may
    # hold the default 52365, and then this head's job agent never answers
    with log.open("w") as out:
        head = subprocess.Popen([RAY, "start", "--head", "--block", "--num-cpus", "4", "--port", "6391",
                                 "--dashboard-port", JOBS.rsplit(":", 1)[1], "--dashboard-agent-listen-port", "0"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield head
    finally:
        head.terminate()
        try:
            head.wait(timeout=90)  # it drains the node (up to 30 s), then stops its processes
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        # a killed head leaves its address as the machine's "current cluster", which a plain
        # ray.init() would then try to join (the tests' own start local clusters regardless)
        current = Path("/tmp/ray/ray_current_cluster")
        if current.is_file() and current.read_text().strip().endswith(":6391"):
            current.unlink()


def wait_for_job_agent(head: subprocess.Popen, log: Path, env, timeout_s: float = AGENT_WAIT_S) -> None:
    """Until the head's job agent accepts a job (an empty one), as the guide waits: it answers some
    seconds after `ray start` says the runtime started, and a `ray job submit` before that fails
    with "No available agent to submit job". Fails the test, saying why, when it never answers."""
    deadline, last = time.monotonic() + timeout_s, "no answer yet"
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"`ray start --head` exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        try:
            probe = ray_cli("job", "submit", "--address", JOBS, "--no-wait", "--", "true", timeout=60, env=env)
        except subprocess.TimeoutExpired:
            last = "`ray job submit` timed out after 60 s"
            continue
        if probe.returncode == 0:
            return
        last = ((probe.stderr.strip() or probe.stdout.strip()).splitlines() or ["(nothing)"])[-1]
        time.sleep(2)
    pytest.fail(f"the job agent of the Ray head at {JOBS} did not accept a job in {timeout_s:.0f} s; "
                f"the last `ray job submit` said: {last}. The dashboard_agent.log in the head's session "
                f"directory (/tmp/ray/session_*) says why, e.g. its HTTP port taken by another Ray; "
                f"`ray start` printed:\n{log.read_text()[-2000:]}")


# Ray >= 2.5x turns on token auth for `ray start`; the job client must be told to use it.
# the job's `python` must be this environment's, as it is for a user with the venv active
ENV = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One `ray start --head` for this module's jobs, as a user submits job after job to one
    cluster (a head's start, job agent and stop: 9 s here, measured as the fixture's setup and teardown)."""
    log = tmp_path_factory.mktemp("head") / "ray-head.log"
    with ray_head(ENV, log) as head:
        wait_for_job_agent(head, log, ENV)
        yield


def submit(*args, **kw):
    """`ray job submit` of `args` to the module's head (the `cluster` fixture); the CLI's result."""
    return ray_cli("job", "submit", "--address", JOBS, *args, env=ENV, **kw)


def tool(command, *args):
    """`asyncrl <command>` started (not waited for): its `communicate()` gives stdout and stderr."""
    asyncrl = str(Path(sys.executable).with_name("asyncrl"))  # the command the install put beside this Python
    return subprocess.Popen([asyncrl, command, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.usefixtures("cluster")
def test_launch_run_as_a_ray_job_trains_saves_and_the_policy_generates_in_vllm(tmp_path, tiny_model_path):
    job = submit("--working-dir", ".", "--", "python", "launch/run.py", "total_steps=3", "buffer.token_budget=64",
                 "name=e2e", f"observe.output_dir={tmp_path}", "observe.console=lines", "sync.probe_every=1")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "succeeded" in job.stdout + job.stderr
    run_dir = tmp_path / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert "reward, first fifth" in job.stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any((run_dir / "tensorboard").iterdir())
    final = run_dir / "final"
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()

    # The two tools start an engine each; they run side by side (starting an engine is mostly
    # single-threaded imports, and this machine has two cores).
    gen = tool("sample", "--model", str(final), "--num", "16", "--json")
    ev = tool("evaluate", "--model", str(final), "--n", "2", "--json")
    gen_out, gen_err = gen.communicate(timeout=300)
    assert gen.returncode == 0, gen_out[-3000:] + gen_err[-3000:]
    result = json.loads(gen_out.strip().splitlines()[-1])
    assert result["num_samples"] == 16 and result["mean_response_tokens"] > 0
    assert 0.0 <= result["accuracy"] <= 1.0

    # The same held-out evaluation as in training, on the saved policy: the run's config.yaml is
    # found from final/, so the data is the built-in task's held-out split, every problem once.
    ev_out, ev_err = ev.communicate(timeout=300)
    assert ev.returncode == 0, ev_out[-3000:] + ev_err[-3000:]
    metrics = json.loads(ev_out.strip().splitlines()[-1])
    assert metrics["config"] == str(run_dir / "config.yaml")
    assert 0.0 <= metrics["avg@2"] <= metrics["pass@2"] <= 1.0  # 0/1 rewards: avg@2 is pass@1
    assert metrics["num_prompts"] == len(all_problems(TinyTaskSpec(), "eval"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "3*4=", "answer": "12"}\n{"prompt": "3*5=", "solution": "15"}\n')
    ev = tool("evaluate", "--model", str(final), "--data", str(bad), "--json")
    _, ev_err = ev.communicate(timeout=120)
    assert ev.returncode == 2, ev_err[-2000:]
    assert f"{bad}:2: no 'answer' field" in ev_err


@pytest.mark.usefixtures("cluster")
def test_ray_job_stop_writes_a_checkpoint_and_a_resubmitted_job_resumes_from_it(tmp_path, tiny_model_path):
    """`ray job stop` sends SIGTERM and, 3 s later, SIGKILL: the run stops after its running step
    with a checkpoint within that, and the same job submitted again with resume=auto continues."""
    run_dir = tmp_path / "stopped"
    args = ["python", "launch/run.py", "buffer.token_budget=64", "name=stopped", f"observe.output_dir={tmp_path}",
            "observe.console=lines", "observe.tensorboard=false", "checkpoint.every_steps=0", "save_final=false"]
    first = submit("--no-wait", "--submission-id", "asyncrl-stopped", "--working-dir", ".", "--", *args,
                   "total_steps=1000")
    assert first.returncode == 0, first.stderr[-2000:]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not ((run_dir / "metrics.jsonl").exists()
                                               and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.2)
    stop = ray_cli("job", "stop", "--address", JOBS, "asyncrl-stopped", env=ENV)
    assert stop.returncode == 0, stop.stdout[-2000:] + stop.stderr[-2000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    end = events[-1]
    assert (end["event"], end["status"], end["reason"]) == ("end", "interrupted", "SIGTERM"), events[-3:]
    stopped_at = end["step"]
    assert stopped_at >= 3 and (run_dir / "checkpoints" / f"step_{stopped_at}" / "COMPLETE").exists()
    again = submit("--working-dir", ".", "--", *args, f"total_steps={stopped_at + 3}", "resume=auto")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"at step {stopped_at}" in again.stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, stopped_at + 4))


@pytest.mark.parametrize("override, named", [
    ("buffer.token_budget=-5", "buffer.token_budget"),
    ("reward.type=import:asyncrl.no_such_module:score", "reward.type: reward function"),
    ("reward.by_source={gsm8k: answer_tagg}", "unknown verifier 'answer_tagg'"),
])
def test_bad_config_fails_fast_naming_the_field(override, named):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "launch/run.py", override], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr
    assert time.monotonic() - start < 60  # before Ray or any engine starts

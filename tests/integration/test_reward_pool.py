"""The reward pool with real worker processes: results come back, hangs are cut at the timeout,
crashes and exceptions cost one sample's reward, workers are replaced, nothing is lost."""

import json
import os
import time

import pytest

from asyncrl.config import CodeRewardConfig, SandboxConfig
from asyncrl.reward.code_reward import CodeReward
from asyncrl.reward.fault_injection import ORDINARY, memory_cycle, scripted
from asyncrl.reward.pool import RewardPool


def scripted_factory():
    return scripted


def collect(pool, n, limit_s=30.0):
    out, t0 = [], time.monotonic()
    while len(out) < n:
        assert time.monotonic() - t0 < limit_s, f"only {len(out)} of {n} results"
        out.extend(pool.poll(0.05))
    return {r.key: r for r in out}


@pytest.fixture
def pool():
    p = RewardPool(scripted_factory, num_workers=2, timeout_s=1.0)
    yield p
    p.close()


def test_results_come_back_for_every_submission(pool):
    assert pool.wait_ready(30) and pool.stats.workers_started == 2
    for i in range(20):
        pool.submit(i, "text", {"reward": i / 20})
    got = collect(pool, 20)
    assert sorted(got) == list(range(20))
    assert all(got[i].reward == pytest.approx(i / 20) and got[i].info["outcome"] == "scripted" for i in got)
    assert pool.stats.completed == pool.stats.submitted == 20 and pool.num_pending == 0


def test_a_hang_is_cut_at_the_timeout_and_the_rest_goes_on(pool):
    pool.submit("hang", "x", {"behave": "hang"})
    for i in range(6):
        pool.submit(i, "x", {"reward": 1.0})
    t0 = time.monotonic()
    got = collect(pool, 7)
    assert got["hang"].reward == 0.0 and got["hang"].info["outcome"] == "timeout"
    assert 1.0 <= got["hang"].latency_s < 4.0 and time.monotonic() - t0 < 6.0
    assert all(got[i].reward == 1.0 for i in range(6))  # served by the other worker meanwhile
    assert pool.stats.timeouts == 1 and pool.stats.workers_started == 3
    pool.submit("after", "x", {"reward": 0.5})  # the replacement works
    assert collect(pool, 1)["after"].reward == 0.5


def test_crashes_and_exceptions_cost_one_sample_each(pool):
    pool.submit("crash", "x", {"behave": "crash"})
    pool.submit("raise", "x", {"behave": "raise"})
    pool.submit("ok", "x", {"reward": 1.0})
    got = collect(pool, 3)
    assert got["crash"].reward == 0.0 and got["crash"].info["outcome"] == "worker_crash"
    assert got["raise"].reward == 0.0 and got["raise"].info["outcome"] == "verifier_error"
    assert "verifier bug" in got["raise"].info["error"]
    assert got["ok"].reward == 1.0
    assert pool.stats.crashes == 1 and pool.stats.outcomes["verifier_error"] == 1


def test_close_leaves_no_worker_alive():
    pool = RewardPool(scripted_factory, num_workers=2, timeout_s=5.0)
    pool.submit("hang", "x", {"behave": "hang"})
    pool.poll(0.2)
    procs = [w.proc for w in pool._workers]
    pool.close()
    assert not any(p.is_alive() for p in procs)


def test_a_worker_deaf_to_sigterm_is_killed_without_blocking_the_caller():
    pool = RewardPool(scripted_factory, num_workers=1, timeout_s=0.5, kill_grace_s=1.0)
    try:
        pool.submit("stubborn", "x", {"behave": "stubborn"})
        pool.submit("next", "x", {"reward": 1.0})
        stuck = pool._workers[0].proc
        out, slowest_poll, t0 = [], 0.0, time.monotonic()
        while len(out) < 2 or stuck.is_alive():
            assert time.monotonic() - t0 < 10, "the stubborn worker was never killed"
            t = time.monotonic()
            out += pool.poll(0.05)
            slowest_poll = max(slowest_poll, time.monotonic() - t)
        got = {r.key: r for r in out}
        assert got["stubborn"].info["outcome"] == "timeout" and got["next"].reward == 1.0
        assert stuck.exitcode == -9  # SIGTERM was ignored, SIGKILL after the grace
        assert slowest_poll < 0.5  # the pool never waited for it
    finally:
        pool.close()


def failing_factory():
    raise ImportError("no module named 'grader'")


def test_a_verifier_that_cannot_be_built_stops_the_pool_with_its_error():
    pool = RewardPool(failing_factory, num_workers=1, timeout_s=1.0)
    try:
        pool.submit("x", "x", {})
        with pytest.raises(RuntimeError, match="could not build its verifier: ImportError"):
            collect(pool, 1, limit_s=10)
        assert pool.stats.workers_started == 1  # no restart loop
    finally:
        pool.close()


def warm_up(pool, n=4):
    """A few calls, so the pool has timed its verifier (it batches only once it knows it is fast)."""
    pool.submit_many([(f"warm{i}", "x", {"reward": 1.0}) for i in range(n)])
    collect(pool, n)
    assert pool._mean_call_s is not None and pool._mean_call_s < 0.01


@pytest.fixture
def warm_pool(request):
    """A pool whose verifier is known to be fast: calls waiting together go in one batch."""
    workers, timeout_s = request.param
    p = RewardPool(scripted_factory, num_workers=workers, timeout_s=timeout_s)
    warm_up(p)
    yield p
    p.close()


@pytest.mark.parametrize("warm_pool", [(2, 5.0)], indirect=True)
def test_fast_calls_go_in_batches_and_every_result_is_exact(warm_pool):
    warm_pool.submit_many([(i, "x", {"reward": i / 500}) for i in range(500)])
    got = collect(warm_pool, 500)
    assert sorted(got) == list(range(500))
    assert all(got[i].reward == pytest.approx(i / 500) for i in got)
    assert warm_pool.stats.completed == warm_pool.stats.submitted == 504 and warm_pool.num_pending == 0
    assert warm_pool.stats.workers_started == 2


@pytest.mark.parametrize("warm_pool", [(1, 1.0)], indirect=True)
def test_a_hang_inside_a_batch_times_out_alone_and_the_calls_behind_it_run_on_a_replacement(warm_pool):
    calls = [(f"before{i}", "x", {"reward": 1.0}) for i in range(3)] + [("hang", "x", {"behave": "hang"})]
    calls += [(f"after{i}", "x", {"reward": 0.5}) for i in range(3)]
    warm_pool.submit_many(calls)  # one worker, a fast verifier: one batch of 7
    got = collect(warm_pool, 7)
    assert got["hang"].info["outcome"] == "timeout" and 1.0 <= got["hang"].latency_s < 3.0
    assert all(got[f"before{i}"].reward == 1.0 and got[f"after{i}"].reward == 0.5 for i in range(3))
    assert warm_pool.stats.timeouts == 1 and warm_pool.stats.workers_started == 2


@pytest.mark.parametrize("warm_pool", [(2, 60.0)], indirect=True)
def test_a_hang_inside_a_batch_holds_only_itself_while_another_worker_is_free(warm_pool):
    """In the loop, the calls behind a hang are other groups' samples: held for the timeout, they
    kept the run a step short for as long. Two workers, a 60 s timeout: the 4 calls handed out
    with the hang (2 finished before it, 2 not begun) come back from the other worker at once."""
    calls = [(f"before{i}", "x", {"reward": 1.0}) for i in range(2)] + [("hang", "x", {"behave": "hang"})]
    calls += [(f"after{i}", "x", {"reward": 0.5}) for i in range(5)]
    warm_pool.submit_many(calls)  # shares of 4 and 4: the hang is in the first worker's batch
    got = collect(warm_pool, 7, limit_s=10)
    assert sorted(got) == sorted(k for k, *_ in calls if k != "hang")
    assert all(got[f"before{i}"].reward == 1.0 for i in range(2)) and all(got[f"after{i}"].reward == 0.5 for i in range(5))
    assert warm_pool.num_pending == 1 and warm_pool.stats.timeouts == 0 and warm_pool.stats.workers_started == 2


@pytest.mark.parametrize("warm_pool", [(1, 1.0)], indirect=True)
def test_each_call_of_a_batch_has_its_own_clock(warm_pool):
    """Two calls of 0.6 s in one batch, timeout 1 s: a batch-wide clock would cut the second."""
    warm_pool.submit_many([(i, "x", {"reward": 1.0, "sleep_s": 0.6}) for i in range(2)])
    got = collect(warm_pool, 2)
    assert [got[i].info["outcome"] for i in range(2)] == ["scripted", "scripted"]
    assert warm_pool.stats.timeouts == 0


@pytest.mark.parametrize("warm_pool", [(1, 5.0)], indirect=True)
def test_a_crash_inside_a_batch_costs_one_call(warm_pool):
    warm_pool.submit_many([("ok1", "x", {"reward": 1.0}), ("crash", "x", {"behave": "crash"}),
                           ("ok2", "x", {"reward": 1.0}), ("ok3", "x", {"reward": 1.0})])
    got = collect(warm_pool, 4)
    assert got["crash"].info["outcome"] == "worker_crash"
    assert [got[k].reward for k in ("ok1", "ok2", "ok3")] == [1.0, 1.0, 1.0]
    assert warm_pool.stats.crashes == 1


def code_factory():
    from asyncrl.config import CodeRewardConfig, SandboxConfig
    from asyncrl.reward.code_reward import CodeReward

    return CodeReward(CodeRewardConfig(sandbox=SandboxConfig(wall_time_s=30)))  # no time budget: the pool cuts


def test_a_code_sample_past_the_timeout_takes_its_sandbox_down_with_the_worker():
    import os
    from pathlib import Path

    marker = f"asyncrl-marker-{os.getpid()}-{time.time_ns()}"
    hang = f"```python\nimport os\nos.execv('/bin/sleep', [{marker[:8]!r} + {marker[8:]!r}, '100'])\n```"
    correct = "```python\nprint(sum(map(int, input().split())))\n```"

    def running():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                found += [pid] if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() else []
            except OSError:
                pass
        return found

    pool = RewardPool(code_factory, num_workers=1, timeout_s=3.0)
    try:
        pool.submit("hang", hang, {"tests": [{"type": "stdio", "input": "", "output": ""}]})
        deadline = time.monotonic() + 3
        while not running():
            assert time.monotonic() < deadline, "the sandboxed program never started"
            time.sleep(0.02)
        got = collect(pool, 1)
        assert got["hang"].info["outcome"] == "timeout" and pool.stats.workers_started == 2
        deadline = time.monotonic() + 5
        while running():
            assert time.monotonic() < deadline, "the sandboxed program outlived its worker"
            time.sleep(0.05)
        pool.submit("next", correct, {"tests": [{"type": "stdio", "input": "1 2", "output": "3"}]})
        assert collect(pool, 1)["next"].reward == 1.0  # the replacement runs code
    finally:
        pool.close()


OFFLINE_SCORE = """
import json, sys
from pathlib import Path
from asyncrl.lab.offline.eval_policy import load_run_config, reward_pool
cfg, _ = load_run_config(sys.argv[1], say=lambda _: None)
pool = reward_pool(cfg, [])
pool.submit(0, "12", {"answer": "12", "data_source": "unknown"})
pool.submit(1, "13", {"answer": "12", "data_source": "unknown"})
got = []
while len(got) < 2:
    got += pool.poll(1.0)
pool.close()
print(json.dumps({r.key: [r.reward, r.info["outcome"]] for r in got}))
"""


def test_an_offline_tool_imports_the_reward_module_the_run_imported(tmp_path, tiny_model_path):
    """A reward module beside the user's recipe: the run finds it there (reward.import_path in its
    config.yaml), and so does an offline tool loading a saved policy from another directory, with no
    PYTHONPATH, in its reward worker processes."""
    import os
    import shutil
    import subprocess
    import sys

    from asyncrl.config import load_config, write_resolved

    task = tmp_path / "mytask"
    task.mkdir()
    (task / "my_reward.py").write_text("def score(response, metadata):\n"
                                       "    ok = response == metadata['answer']\n"
                                       "    return float(ok), {'outcome': 'mine' if ok else 'not mine'}\n")
    (task / "sub.yaml").write_text("name: sub\nreward:\n  type: import:my_reward:score\n")
    run = tmp_path / "runs/sub"
    write_resolved(load_config(task / "sub.yaml"), run)  # what a run writes
    shutil.copytree(tiny_model_path, run / "final")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCORE, str(run / "final")], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"0": [1.0, "mine"], "1": [0.0, "not mine"]}


def code_verifier_512():
    return CodeReward(CodeRewardConfig(sandbox=SandboxConfig(memory_mb=512, wall_time_s=20.0)))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the memory of a run is a cgroup's only as root")
def test_through_the_pool_samples_behind_a_memory_cycle_score_as_alone():
    """One attack in every 10 samples, 3 rounds, one reward worker (so every sample runs on the
    launcher the attack used): each ordinary sample passes, and no launcher is lost (that would
    be a sandbox_error). Before, 5-9 of the 9 samples behind an attack scored memory or
    sandbox_error (tests/integration/test_sandbox_budgets.py has the attack run by run)."""
    pool = RewardPool(code_verifier_512, num_workers=1, timeout_s=60.0)
    try:
        three = {"tests": [{"type": "stdio", "input": "", "output": "3"}]}
        calls = [(f"{r}-{i}", fenced(memory_cycle(496) if i == 0 else ORDINARY), three)
                 for r in range(3) for i in range(10)]
        pool.submit_many(calls)
        results, deadline = {}, time.monotonic() + 120
        while len(results) < len(calls):
            assert time.monotonic() < deadline, f"{len(results)} of {len(calls)} results"
            results.update({r.key: r for r in pool.poll(0.1)})
    finally:
        pool.close()
    ordinary = [results[k] for k, *_ in calls if not k.endswith("-0")]
    assert [(r.reward, r.info["outcome"]) for r in ordinary] == [(1.0, "passed")] * 27
    assert all(results[f"{r}-0"].info["outcome"] == "failed" for r in range(3))  # ran, printed "parked"


def fenced(code):
    return f"```python\n{code.strip()}\n```"

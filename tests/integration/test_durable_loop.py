"""The real loop (Ray, fake engines) when actors die or the pool is resized mid-run: the run
completes every step, lost groups are regenerated, and the sample accounting balances."""

import json
import os
import signal
import threading
import time

import pytest
import ray

from asyncrl.config import load_config
from asyncrl.orchestrator.orchestrator import Orchestrator


def config(tmp_path, model, *extra):
    return load_config(None, [
        f"model.path={model}", "rollout.engine=fake", "buffer.token_budget=48", "buffer.max_staleness=1",
        "algo.drop_zero_variance_groups=false", "observe.console=off", "observe.tensorboard=false",
        f"observe.output_dir={tmp_path}", "save_final=false", "checkpoint.every_steps=0",
        "reward.type=import:asyncrl.reward.fault_injection:by_response_hash", *extra])


def run_with_operator(cfg, operator):
    orch = Orchestrator(cfg)
    thread = threading.Thread(target=operator, args=(orch,), daemon=True)
    thread.start()
    try:
        orch.run()
        stats = orch.pool.stats()
    finally:
        orch.shutdown()
    thread.join(timeout=5)
    events = [json.loads(x) for x in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    return orch, stats, events


def wait_rows(orch, n):
    while len(orch.history) < n:
        time.sleep(0.01)


def assert_accounting(orch):
    a = orch.driver.ledger.accounting()
    assert a["received"] == a["kept"] + a["rejected"] + a["discarded"] + a["orphaned"] + a["live"], a
    t = orch.driver.ledger.token_accounting()
    assert t["in"] == t["out"] + t["dropped_stale"] + t["buffered"]


def test_a_killed_actor_is_replaced_and_the_run_completes(ray_cluster, tmp_path, small_model):
    cfg = config(tmp_path, small_model, "rollout.num_actors=2", "total_steps=120")
    killed = []

    def operator(orch):
        wait_rows(orch, 4)
        pid = ray.get(orch.pool.actors[1].get_stats.remote())["pid"]
        os.kill(pid, signal.SIGKILL)  # as `kill -9` of the actor's process
        killed.append(pid)

    orch, stats, events = run_with_operator(cfg, operator)
    assert killed and len(orch.history) == 120
    assert [h["learner/loss_tokens"] for h in orch.history] == [48] * 120
    lost = [e for e in events if e["event"] == "actor_lost"]
    assert [e["actor"] for e in lost] == [1]
    # its replacement joined once it held the weights, and the end summary names the loss
    assert [(e["actor"], e["actors"]) for e in events if e["event"] == "actor_joined"] == [(1, 2)]
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    assert [(a["step"], a["actor"]) for a in summary["actors_lost"]] == [(lost[0]["step"], 1)]
    assert orch.history[-1]["rollout/actors"] == 2 and killed[0] not in {s["pid"] for s in stats}
    assert all(s["version"] == 120 for s in stats)  # the replacement got every later push
    counts = [h["rollout/actors"] for h in orch.history]
    assert 1 in counts  # the run went on with one actor while the replacement started
    assert max(h["staleness/async_max"] for h in orch.history) <= 1  # the bound, when a response enters training
    assert max(h["staleness/max"] for h in orch.history) <= 2  # + the step a split response's rest follows by
    assert_accounting(orch)


@pytest.mark.parametrize("fault", ["kill -9", "engine failure"])
def test_the_only_actor_lost_is_replaced_and_the_run_completes(ray_cluster, tmp_path, small_model, fault):
    # With one actor nothing else feeds the steps or gets a call that would fail: the loss must be
    # noticed by itself and the replacement must join without waiting for a step boundary.
    cfg = config(tmp_path, small_model, "rollout.num_actors=1", "total_steps=30", "observe.stall_timeout_s=60")
    pids = []

    def break_engine(actor):  # nested: shipped to the actor by value, not by module name
        """Every later request fails, as when a vLLM engine core dies under a live actor process."""
        async def dead(*args):
            raise RuntimeError("EngineDeadError: engine core died")

        actor.engine.generate = dead

    def operator(orch):
        wait_rows(orch, 4)
        actor = orch.pool.actors[0]
        pids.append(ray.get(actor.get_stats.remote())["pid"])
        if fault == "kill -9":
            os.kill(pids[0], signal.SIGKILL)
        else:
            ray.get(actor.__ray_call__.remote(break_engine))

    orch, stats, events = run_with_operator(cfg, operator)
    assert len(orch.history) == 30 and [h["learner/loss_tokens"] for h in orch.history] == [48] * 30
    lost = [e for e in events if e["event"] == "actor_lost"]
    assert [e["actor"] for e in lost] == [0]
    assert ("engine core died" in lost[0]["reason"]) == (fault == "engine failure")
    assert len(stats) == 1 and stats[0]["pid"] != pids[0] and stats[0]["version"] == 30
    assert_accounting(orch)


def test_the_pool_grows_and_shrinks_on_request_without_touching_the_learner(ray_cluster, tmp_path, small_model):
    cfg = config(tmp_path, small_model, "rollout.num_actors=1", "total_steps=200")

    def operator(orch):
        wait_rows(orch, 3)
        (cfg.run_dir / "SCALE_ACTORS").write_text("2")
        while orch.history[-1]["rollout/actors"] < 2:
            time.sleep(0.01)
        wait_rows(orch, len(orch.history) + 3)
        (cfg.run_dir / "SCALE_ACTORS").write_text("1")

    orch, stats, events = run_with_operator(cfg, operator)
    scale = [e for e in events if e["event"] == "scale"]
    assert [(e["actors"], e["started"], e["stopped"]) for e in scale] == [(2, [1], []), (1, [], [1])]
    joined = [e for e in events if e["event"] == "actor_joined"]
    assert [(e["actor"], e["actors"]) for e in joined] == [(1, 2)] and joined[0]["step"] >= scale[0]["step"]
    counts = [h["rollout/actors"] for h in orch.history]
    assert 2 in counts and counts[-1] == 1 and len(orch.history) == 200
    assert len(stats) == 1 and stats[0]["version"] == 200
    assert_accounting(orch)

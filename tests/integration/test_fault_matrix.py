"""tools/fault_matrix.py on fake engines: every injected failure ends in a completed run (or a
clean stop and a resume that completes it) with the sample accounting balanced."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_fault_is_survived_and_accounted(tmp_path, tiny_model_path):
    proc = subprocess.run([sys.executable, "tools/fault_matrix.py", "--json", "--steps", "12",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["scenario"] for r in rows] == ["kill_actor", "kill_actor_in_push", "sigterm_then_resume",
                                             "kill_learner_then_resume", "kill_learner_twice", "reward_worker_crash",
                                             "malformed_frame", "sync_timeout", "sigstop_actor", "checkpoint_write_fails",
                                             "crafted_reports", "memory_cycles"], proc.stderr[-3000:]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]  # each failing row whole
    assert proc.returncode == 0
    by = {r["scenario"]: r for r in rows}
    assert by["kill_actor"]["actors_lost"] == 1 and by["kill_actor_in_push"]["actors_lost"] == 1
    assert by["sync_timeout"]["actors_lost"] == 1 and by["sigstop_actor"]["actors_lost"] == 1
    assert by["sigterm_then_resume"]["outcome"].startswith("stopped (SIGTERM)")
    assert by["kill_learner_then_resume"]["outcome"].startswith("stopped (learner died)")
    assert by["kill_learner_then_resume"]["checkpoints"] >= 1
    # restarted in place from the newest checkpoint, twice (fault.max_restarts 2): no resume needed
    assert by["kill_learner_twice"]["outcome"] == "completed" and by["kill_learner_twice"]["learner_restarts"] == 2
    assert by["reward_worker_crash"]["reward_crashes"] > 0
    assert by["malformed_frame"]["frames_dropped"] == 3
    # a full disk on the driver's side, then a learner that cannot write: said, and the run goes on
    assert by["checkpoint_write_fails"]["checkpoints_failed"] == 2 and by["checkpoint_write_fails"]["checkpoints"] >= 2
    # one code sample in ten reported a value built to make the verifier raise: scored 0, no error
    assert by["crafted_reports"]["crafted_steps"] > 0 and by["crafted_reports"]["verifier_errors"] == 0
    # one sandboxed sample in ten parked its memory past its end: every other one still passed
    cycles = by["memory_cycles"]
    assert cycles["memory_cycles"] > 0 and cycles["honest_samples"] == cycles["honest_passed"] > 0

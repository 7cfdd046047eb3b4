"""One live run per run directory (a flock the kernel drops with the process), and a directory an
earlier run left is entered only to continue it."""

import json
import signal
import subprocess
import sys

import pytest

from asyncrl.config import ConfigError
from asyncrl.orchestrator.run_lock import LOCK_FILE, claim_run_dir, previous_run

HOLD = ("import sys, time; from pathlib import Path; from asyncrl.orchestrator.run_lock import claim_run_dir; "
        "claim_run_dir(Path(sys.argv[1]), None); print('held', flush=True); time.sleep(600)")


def test_a_held_directory_is_refused_until_its_holder_releases_it(tmp_path):
    lock = claim_run_dir(tmp_path / "r", None)
    holder = json.loads((tmp_path / "r" / LOCK_FILE).read_text())
    with pytest.raises(ConfigError, match=f"in use by a live run \\(pid {holder['pid']} on {holder['host']}, started "):
        claim_run_dir(tmp_path / "r", "auto")  # not even to resume it: two writers either way
    lock.release()
    claim_run_dir(tmp_path / "r", None).release()  # the directory holds no run's files yet: free


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "r")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match="in use by a live run"):
        claim_run_dir(tmp_path / "r", None)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    claim_run_dir(tmp_path / "r", None).release()


def test_a_directory_with_an_earlier_runs_files_needs_resume(tmp_path):
    run = tmp_path / "r"
    assert previous_run(run) is None
    (run / "checkpoints/step_50").mkdir(parents=True)
    (run / "checkpoints/step_50/COMPLETE").write_text('{"step": 50}')
    (run / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    (run / "summary.json").write_text("{}")
    assert previous_run(run) == "2 metric rows, newest checkpoint step_50, finished"
    with pytest.raises(ConfigError) as e:
        claim_run_dir(run, None)
    assert str(e.value) == (f"run directory {run} already holds a run (2 metric rows, newest checkpoint step_50, "
                            f"finished); continue it with resume=auto, start another with name=<new name>, or remove "
                            f"{run} to start over")
    claim_run_dir(run, "auto").release()
    claim_run_dir(run, str(run / "checkpoints/step_50")).release()


def test_a_run_that_ended_before_it_started_leaves_the_directory_to_the_same_command(tmp_path):
    """A start stopped (or failed) while its engines loaded wrote only its `end` event: the same
    command starts again without resume=; once a run began (`start`), the directory is its."""
    run = tmp_path / "r"
    run.mkdir()
    end = json.dumps({"step": 0, "event": "end", "status": "interrupted", "reason": "SIGTERM during start-up"})
    (run / "events.jsonl").write_text(end + "\n" + '{"step": 0, "ev')  # and a line cut short by a kill
    (run / "metrics.jsonl").write_text("")
    assert previous_run(run) is None
    claim_run_dir(run, None).release()
    (run / "events.jsonl").write_text(end + "\n" + json.dumps({"step": 0, "event": "start"}) + "\n")
    assert previous_run(run) == "0 metric rows"
    with pytest.raises(ConfigError, match="already holds a run"):
        claim_run_dir(run, None)

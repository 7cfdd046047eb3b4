"""A run's start and shutdown (orchestrator/lifecycle.py): what started is shut down, in reverse,
whatever fails on the way. Fake parts stand in for the processes here; the real start, take-over
and learner restart run in tests/integration (test_warm_runs.py, test_fault_matrix.py)."""

from types import SimpleNamespace

import pytest

from asyncrl.config import load_config
from asyncrl.orchestrator import lifecycle


def test_shut_down_runs_every_closer_in_order_and_says_which_failed():
    done, said = [], []

    def broken():
        done.append("learner")
        raise RuntimeError("rank 1 gone")

    lifecycle.shut_down(said.append, broken, None, lambda: done.append("pool"), lambda: done.append("lock"))
    assert done == ["learner", "pool", "lock"]  # the failure and the part never started stop nothing
    assert len(said) == 1 and "broken" in said[0] and "rank 1 gone" in said[0]


def test_a_start_that_fails_shuts_down_what_it_started_in_reverse(monkeypatch, tmp_path):
    closed = []

    def part(name):
        return SimpleNamespace(close=lambda: closed.append(name), shutdown=lambda: closed.append(name),
                               endpoint="tcp://127.0.0.1:1", answer_storage_probe=None)

    procs = lifecycle.Processes(learner=part("learner"), pool=part("pool"), weight_sync=None)
    monkeypatch.setattr(lifecycle.components, "resolve_model_path", lambda cfg, log: "base")
    monkeypatch.setattr(lifecycle.components, "node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(lifecycle.components, "tiny_spec", lambda cfg: None)
    monkeypatch.setattr(lifecycle, "build_driver", lambda *a, teacher: part("driver"))  # no teacher: no algo.distill
    monkeypatch.setattr(lifecycle, "FrameReceiver", lambda *a, **k: part("samples"))
    monkeypatch.setattr(lifecycle, "start_processes", lambda *a: procs)

    def no_shared_storage(run_dir, probe):
        raise RuntimeError("the run directory is not shared")

    monkeypatch.setattr(lifecycle.checkpoint, "check_shared", no_shared_storage)
    cfg = load_config(None)
    with pytest.raises(RuntimeError, match="not shared"):
        lifecycle.start_run(cfg, tmp_path, None, None, metrics=None, say=lambda m: None)
    assert closed == ["learner", "pool", "samples", "driver"]

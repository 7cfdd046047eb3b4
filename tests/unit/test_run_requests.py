"""Requests made by creating files in the run directory: applied once, at a step boundary, and
never from a file that is still being written."""

from asyncrl.orchestrator.requests import SCALE_FILE, RunRequests


class Pool:
    def __init__(self):
        self.calls = []

    def scale_to(self, n):
        self.calls.append(n)
        return [1], []


class Ledger:
    def requeue_actor(self, actor):
        return 0


class Metrics:
    def __init__(self):
        self.events = []

    def event(self, step, name, **fields):
        self.events.append((step, name, fields))


def make(tmp_path):
    said, metrics = [], Metrics()
    return RunRequests(tmp_path, metrics, say=said.append), said, metrics


def test_an_empty_scale_file_is_left_for_the_next_step(tmp_path):
    # `echo 2 > SCALE_ACTORS` creates the file before writing: a step boundary between the two
    # must not take the empty file as a bad request and delete it.
    req, said, metrics = make(tmp_path)
    pool = Pool()
    (tmp_path / SCALE_FILE).write_text("")
    req.apply_scale(pool, Ledger(), step=3)
    assert (tmp_path / SCALE_FILE).exists() and pool.calls == [] and said == []
    (tmp_path / SCALE_FILE).write_text("2\n")
    req.apply_scale(pool, Ledger(), step=4)
    assert not (tmp_path / SCALE_FILE).exists() and pool.calls == [2]
    assert metrics.events == [(4, "scale", {"actors": 2, "started": [1], "stopped": [], "groups_requeued": 0})]


def test_a_bad_scale_request_is_warned_and_removed(tmp_path):
    req, said, metrics = make(tmp_path)
    pool = Pool()
    (tmp_path / SCALE_FILE).write_text("zero")
    req.apply_scale(pool, Ledger(), step=1)
    assert not (tmp_path / SCALE_FILE).exists() and pool.calls == [] and metrics.events == []
    assert len(said) == 1 and "'zero'" in said[0]

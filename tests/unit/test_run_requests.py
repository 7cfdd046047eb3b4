"""Requests made by creating files in the run directory: applied once, at a step boundary, and
never from a file that is still being written."""

import pytest

from asyncrl.orchestrator.driver import Progress
from asyncrl.orchestrator.requests import SCALE_FILE, RunRequests, RunStalled, StallFacts, stall_diagnosis


class Pool:
    def __init__(self):
        self.calls = []

    def scale_to(self, n):
        self.calls.append(n)
        return [1], []


def requeue_actor(actor):
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
    req.apply_scale(pool, requeue_actor, step=3)
    assert (tmp_path / SCALE_FILE).exists() and pool.calls == [] and said == []
    (tmp_path / SCALE_FILE).write_text("2\n")
    req.apply_scale(pool, requeue_actor, step=4)
    assert not (tmp_path / SCALE_FILE).exists() and pool.calls == [2]
    assert metrics.events == [(4, "scale", {"actors": 2, "started": [1], "stopped": [], "groups_requeued": 0})]


def test_a_bad_scale_request_is_warned_and_removed(tmp_path):
    req, said, metrics = make(tmp_path)
    pool = Pool()
    (tmp_path / SCALE_FILE).write_text("zero")
    req.apply_scale(pool, requeue_actor, step=1)
    assert not (tmp_path / SCALE_FILE).exists() and pool.calls == [] and metrics.events == []
    assert len(said) == 1 and "'zero'" in said[0]


def test_a_stall_with_labels_missing_names_them_before_the_task(tmp_path):
    """Every group dropped with equal rewards while the records carry no answer: the diagnosis
    names the misnamed label first (a reward comparing with None scores everything alike)."""
    import json
    from asyncrl.config import load_config
    from asyncrl.observe.metrics import MetricsWriter
    from asyncrl.orchestrator.driver import build_driver
    from asyncrl.tiny.tokenizer import save_tokenizer

    save_tokenizer(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", **({"target": "x"} if a < 1 else {})}) + "\n"
                            for a in range(4)))
    cfg = load_config(None, ["data.type=jsonl", f"data.path={data}", "data.answer_field=target", "eval.every_steps=0",
                             "reward.type=import:asyncrl.reward.fault_injection:by_response_hash",
                             "reward.num_workers=1", "observe.tensorboard=false", "model.max_model_len=64"])
    driver = build_driver(cfg, str(tmp_path), MetricsWriter(tmp_path / "run", tensorboard=False), say=lambda _: None)
    try:
        stats = driver.ledger.assembler.stats
        stats.groups_complete = stats.groups_zero_variance = 5
        said = stall_diagnosis(StallFacts(driver.progress(), 40, 1, cfg.data.answer_field))
        assert said.startswith("answer is None on 3 of 4 records (data.answer_field='target'), so a reward that "
                               "compares with it scores every response alike; else every complete group had equal "
                               "rewards"), said
        stats.groups_zero_variance = 4  # some group had a signal: the labels are not the stall's cause
        assert "answer is None" not in stall_diagnosis(StallFacts(driver.progress(), 40, 1, cfg.data.answer_field))
    finally:
        driver.rewards.close()


def test_a_stall_is_warned_every_minute_and_ends_the_run_at_its_timeout(tmp_path):
    """The facts are gathered only when something is said (they read every record)."""
    req, said, _ = make(tmp_path)
    asked = []

    def facts():
        asked.append(1)
        return StallFacts(Progress(0, 0, 0, 64, 2, 0, 0, 0, [], (0, 0)), 0, 1, "answer")

    start = req._last_warn_t
    req.check_stall(start + 30, start, 300, facts)
    assert said == [] and asked == []
    req.check_stall(start + 61, start, 300, facts)
    req.check_stall(start + 90, start, 300, facts)  # within a minute of the last warning
    assert len(said) == 1 and asked == [1]
    assert said[0].startswith("warning: no optimizer step for 61s (the run stops after 300s): no sample has arrived")
    assert "0/64 loss tokens buffered, 2 groups in flight on 1 actor(s)" in said[0]
    with pytest.raises(RunStalled, match=r"no optimizer step for 300s \(observe.stall_timeout_s=300\)"):
        req.check_stall(start + 300, start, 300, facts)


def test_a_stall_names_what_holds_the_episodes_up_in_the_actors():
    facts = StallFacts(Progress(0, 0, 0, 64, 2, 0, 0, 0, [], (0, 0)), 0, 1, "answer",
                       stuck=("actor 0: 64 environment step(s) still running past env.step_timeout_s=30s",))
    said = stall_diagnosis(facts)
    assert said.startswith("episodes are held up in the actors (actor 0: 64 environment step(s) still running")
    assert "else: no sample has arrived" in said

"""MetricsWriter: every row and event carries a wall-clock `time`; example completions go to
samples.jsonl (and a markdown table whose cells cannot break the table)."""

import json
import time

from asyncrl.observe.metrics import MetricsWriter, read_metrics, samples_table

EXAMPLE = {"prompt_id": "p1", "response": "x = 1\ny = 2", "reward": 1.0, "outcome": "verified", "version": 3,
           "finish_reason": "stop", "data_source": "math"}


def lines(path):
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_rows_and_events_carry_increasing_unix_time(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    before = time.time()
    w.log(1, {"reward/mean": 0.5, "note": "text is not a metric"})
    w.event(1, "start", actors=2)
    time.sleep(0.01)
    w.log(2, {"reward/mean": 0.75})
    after = time.time()
    w.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [list(r) for r in rows] == [["step", "time", "reward/mean"]] * 2
    assert before <= rows[0]["time"] < rows[1]["time"] <= after
    (event,) = lines(tmp_path / "events.jsonl")
    assert event["step"] == 1 and event["event"] == "start" and event["actors"] == 2
    assert rows[0]["time"] <= event["time"] <= rows[1]["time"]


def test_samples_go_to_samples_jsonl_one_line_each_and_truncate_with_the_rows(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.log_samples(1, [EXAMPLE, {**EXAMPLE, "prompt_id": "p2", "reward": 0.0}])
    w.log_samples(2, [])  # nothing kept this step: nothing written
    w.log_samples(3, [{**EXAMPLE, "prompt_id": "p3"}])
    w.close()
    got = lines(tmp_path / "samples.jsonl")
    assert [(g["step"], g["prompt_id"], g["reward"]) for g in got] == [(1, "p1", 1.0), (1, "p2", 0.0), (3, "p3", 1.0)]
    assert {k: v for k, v in got[0].items() if k not in ("step", "time")} == EXAMPLE
    assert isinstance(got[0]["time"], float) and got[0]["time"] == got[1]["time"]
    MetricsWriter.truncate(tmp_path, last_step=2)  # a resume from step 2 writes step 3 again
    assert [g["prompt_id"] for g in lines(tmp_path / "samples.jsonl")] == ["p1", "p2"]


def test_samples_table_escapes_cell_breaking_characters():
    table = samples_table([{**EXAMPLE, "prompt": "6*7=", "response": "a | b\nc"}, {"prompt_id": "p2"}])
    assert table.splitlines() == [
        "| prompt_id | data_source | version | reward | outcome | finish_reason | prompt | response |",
        "|---|---|---|---|---|---|---|---|",
        "| p1 | math | 3 | 1.0 | verified | stop | 6*7= | a \\| b<br>c |",
        "| p2 | None | None | None | None | None | None | None |"]


def test_rewind_drops_the_rows_after_a_step_and_the_next_rows_follow_them(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        w.log(step, {"reward/mean": step / 10})
        w.log_samples(step, [{**EXAMPLE, "prompt_id": f"p{step}"}])
    w.rewind(1)  # a learner restarted from the checkpoint of step 1
    w.log(2, {"reward/mean": 0.25})
    w.log_samples(2, [{**EXAMPLE, "prompt_id": "again"}])
    w.close()
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 0.1), (2, 0.25)]
    assert [(s["step"], s["prompt_id"]) for s in lines(tmp_path / "samples.jsonl")] == [(1, "p1"), (2, "again")]

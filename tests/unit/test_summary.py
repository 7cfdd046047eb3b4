"""The end-of-run summary: staleness is told apart into reuse of rollout batches and asynchrony."""

from asyncrl.observe.summary import format_summary, summarize


def row(reward, total, async_, reuse):
    return {"reward/mean": reward, "staleness/max": total, "staleness/async_max": async_,
            "staleness/reuse_max": reuse, "learner/loss_tokens": 10}


def test_summary_reports_the_largest_lag_of_each_kind():
    history = [row(0.0, 1, 1, 0), row(0.5, 3, 1, 2), row(1.0, 2, 2, 0), {"reward/mean": None}]
    s = summarize(history, wall_s=12.34)
    assert (s["max_staleness_seen"], s["max_async_staleness_seen"], s["max_reuse_lag_seen"]) == (3, 2, 2)
    assert s["tokens_trained"] == 30 and s["wall_s"] == 12.3


def test_format_names_the_parts_only_when_batches_are_reused():
    reused = summarize([row(0.0, 15, 0, 15)], wall_s=1.0)
    assert "max staleness: 15 (15 after entering training, 0 asynchronous)\n" in format_summary(reused, "runs/x")
    streaming = summarize([row(0.0, 2, 2, 0)], wall_s=1.0)
    text = format_summary(streaming, "runs/x")
    assert "max staleness: 2\n" in text and "reusing" not in text


def test_a_history_from_before_the_split_still_summarizes():
    s = summarize([{"reward/mean": 1.0, "staleness/max": 4}], wall_s=1.0)
    assert (s["max_staleness_seen"], s["max_async_staleness_seen"], s["max_reuse_lag_seen"]) == (4, 0, 0)
    assert "max staleness: 4\n" in format_summary(s, "runs/x")


def test_progress_line_keeps_the_latest_heldout_score(capsys):
    from asyncrl.observe.console import ProgressDisplay

    display = ProgressDisplay(total_steps=3, mode="lines", line_every_s=0)
    display.update({"step": 1, "reward/mean": 0.5})
    display.update({"step": 2, "eval/avg@8": 0.25})
    display.update({"step": 3})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("held-out=-") and "reward=0.500" in lines[0]
    assert lines[1].endswith("held-out=0.250") and lines[2].endswith("held-out=0.250")


def test_a_resumed_run_tells_both_times_and_a_lost_actor_is_named():
    s = summarize([row(0.0, 1, 1, 0)], wall_s=100.0)
    s.update(resumed_at_step=40, wall_s_since_resume=30.5,
             actors_lost=[{"step": 12, "actor": 1, "reason": "the actor's process died"}])
    text = format_summary(s, "runs/x")
    assert "asyncrl run finished: 1 steps in 100.0s (30.5s since the resume at step 40)\n" in text
    assert "  rollout actors lost: 1 (actor 1 at step 12: the actor's process died)\n" in text
    assert "lost" not in format_summary(summarize([row(0.0, 1, 1, 0)], wall_s=1.0), "runs/x")

"""StepStats: the reward metrics of a step (per data source, verifier latency, sandbox outcomes of
the code verifier's tests) are computed from the samples scored since the last flush, then reset;
a few completions are kept as examples; a trained token's lag splits into reuse and asynchrony."""


from collections import Counter

import msgpack
import pytest

from asyncrl.buffer.base import ResponseCursor
from asyncrl.buffer.group_assembler import AssemblerStats, GroupAssembler
from asyncrl.buffer.rollout_batch import RolloutBatchBuffer
from asyncrl.buffer.token_buffer import TokenBuffer
from asyncrl.orchestrator.ledger import GroupLedger, Shaping
from asyncrl.orchestrator.step_stats import StepStats
from asyncrl.types import Group, Sample, ScoredSample


PIPELINE: dict = {}  # the buffer's and stream's gauges and counters: passed through (test below)


def sample(source, n_tokens=3, prompt_id="p", version=0, finish="stop"):
    return Sample(prompt_id, "g", 0, [1], [2] * n_tokens, [0.0] * n_tokens, [version] * n_tokens, finish, 0,
                  metadata={"data_source": source})


def one_response_group(gid, versions):
    s = Sample(gid, gid, 0, [1], [2] * len(versions), [0.0] * len(versions), list(versions), "stop", 0)
    return Group(gid, [ScoredSample(s, 1.0)], [1.0])


STALENESS = ("staleness/mean", "staleness/max", "staleness/async_mean", "staleness/async_max", "staleness/reuse_max")


def staleness(row):
    return tuple(row[k] for k in STALENESS)


def test_reward_metrics_per_source_latency_and_sandbox_outcomes():
    stats = StepStats()
    stats.add_sample(sample("math"), 1.0, {"outcome": "verified"}, latency_s=0.01)
    stats.add_sample(sample("math"), 0.0, {"outcome": "timeout"}, latency_s=0.5)
    stats.add_sample(sample("code"), 0.5, {"outcome": "failed", "tests_total": 4, "tests_run": 4,
                                           "tests_passed": 2, "tests_failed": 1, "tests_timeout": 1},
                     latency_s=0.2)
    stats.add_sample(sample("code"), 0.0, {"outcome": "memory", "tests_total": 4, "tests_run": 1,
                                           "tests_passed": 0, "tests_memory": 1}, latency_s=0.09)
    row = stats.flush(PIPELINE)
    assert row["reward/mean"] == pytest.approx(1.5 / 4)
    assert row["reward/by_source/math"] == pytest.approx(0.5)
    assert row["reward/by_source/code"] == pytest.approx(0.25)
    assert row["reward/latency_mean_s"] == pytest.approx(0.8 / 4)
    assert row["reward/latency_max_s"] == pytest.approx(0.5)
    assert row["reward/outcome_timeout"] == pytest.approx(0.25)
    sandbox = {k: v for k, v in row.items() if k.startswith("reward/sandbox_tests_")}
    assert sandbox == {"reward/sandbox_tests_passed": 2, "reward/sandbox_tests_failed": 1,
                       "reward/sandbox_tests_timeout": 1, "reward/sandbox_tests_memory": 1}
    # counted once, then reset; the columns stay (a plot needs every row to have them)
    after = stats.flush(PIPELINE)
    assert after.keys() == row.keys() and after["reward/num_samples"] == 0 and stats.total_samples == 4
    assert {k: v for k, v in after.items() if k.startswith("reward/sandbox_tests_")} == dict.fromkeys(sandbox, 0)
    assert after["reward/latency_mean_s"] is None and after["reward/by_source/code"] is None
    assert after["reward/outcome_timeout"] is None  # no samples: no fraction
    stats.add_sample(sample("math"), 1.0, {"outcome": "verified"}, latency_s=0.01)
    third = stats.flush(PIPELINE)
    assert third["reward/outcome_timeout"] == 0 and third["reward/outcome_verified"] == 1.0
    assert third["reward/by_source/math"] == 1.0 and third["reward/by_source/code"] is None


def test_running_totals_end_in_total():
    ledger = GroupLedger(TokenBuffer(16, 1), GroupAssembler(), Shaping(), 2)
    ledger.assembler.stats = AssemblerStats(groups_complete=2, groups_zero_variance=1)
    ledger.counts.samples_duplicate = 3
    ledger.buffer.add_group(one_response_group("g", [0, 0, 0, 0, 0]))
    row = StepStats().flush({**ledger.token_metrics(), "rollout/frames_dropped_total": 4})
    assert row["buffer/loss_tokens"] == 5  # a gauge: what the buffer holds now
    totals = {k: v for k, v in row.items() if k.endswith("_total")}
    assert {k: totals[k] for k in ("rollout/samples_total", "buffer/responses_in_total",
                                   "buffer/groups_zero_variance_total", "buffer/groups_complete_total",
                                   "buffer/duplicate_samples_total", "rollout/frames_dropped_total")} == {
        "rollout/samples_total": 0, "buffer/responses_in_total": 1, "buffer/groups_zero_variance_total": 1,
        "buffer/groups_complete_total": 2, "buffer/duplicate_samples_total": 3, "rollout/frames_dropped_total": 4}
    assert all(k.startswith("buffer/") for k in totals.keys() - {"rollout/samples_total", "rollout/frames_dropped_total"})


def test_examples_are_capped_and_taken_once():
    stats = StepStats(examples_per_step=2)
    stats.add_sample(sample("math", prompt_id="p0"), 1.0, {"outcome": "verified"})  # no text: not an example
    stats.add_sample(sample("math", n_tokens=1, prompt_id="p1", version=3), 1.0, {"outcome": "verified"}, completion="42",
                     prompt="6*7=")
    stats.add_sample(sample("code", n_tokens=5, prompt_id="p2", finish="length"), 0.0, {}, completion="def f(")
    row = stats.flush(PIPELINE)
    assert not any("example" in k or "sample_text" in k for k in row)  # examples never go in the row
    assert stats.take_examples() == [
        {"prompt_id": "p1", "prompt": "6*7=", "response": "42", "response_tokens": 1, "reward": 1.0,
         "outcome": "verified", "version": 3, "finish_reason": "stop", "data_source": "math"},
        {"prompt_id": "p2", "prompt": None, "response": "def f(", "response_tokens": 5, "reward": 0.0, "outcome": None,
         "version": 0, "finish_reason": "length", "data_source": "code"}]
    assert stats.take_examples() == [] and stats.wants_example()
    empty = Sample("p4", "g", 0, [1], [], [], [], "stop", 0)  # an empty response has no version
    stats.add_sample(empty, 0.0, {"outcome": "wrong"}, completion="")
    assert stats.take_examples() == [{"prompt_id": "p4", "prompt": None, "response": "", "response_tokens": 0,
                                      "reward": 0.0, "outcome": "wrong",
                                      "version": None, "finish_reason": "stop", "data_source": None}]


def test_examples_are_a_uniform_sample_of_the_window_not_the_first_to_finish():
    # the router's way: ask, then pass the text only if asked for; 10 completions a window, 2 kept:
    # each position is kept with probability 2/10 (the first ones would always be, by arrival)
    stats, kept = StepStats(examples_per_step=2), Counter()
    windows = 3000
    for _ in range(windows):
        for i in range(10):
            want = stats.wants_example()
            stats.add_sample(sample("math", prompt_id=f"p{i}"), 1.0, {}, completion="x" if want else None)
        kept.update(e["prompt_id"] for e in stats.take_examples())
    assert sum(kept.values()) == 2 * windows
    for i in range(10):
        assert kept[f"p{i}"] / windows == pytest.approx(0.2, abs=0.03)


def test_rollout_batch_lag_splits_into_reuse_and_asynchrony():
    # One rollout batch of 2 groups, D_T = D_R (every step trains all of it), N_reuse 3: N_SGD = 3
    # steps at learner versions 4, 5, 6. Generated at versions a: [1, 2], b: [3, 3, 3]; sealed at 4.
    buf = RolloutBatchBuffer(token_budget=8, max_staleness=5, rollout_batch_prompts=2, minibatch_prompts=2,
                             num_reuse=3)
    buf.add_group(one_response_group("a", [1, 2]))
    buf.add_group(one_response_group("b", [3, 3, 3]))
    stats = StepStats()
    rows = []
    for version in (4, 5, 6):
        stats.add_batch(buf.next_batch(version), version, buf.batch_start_version)
        assert buf.batch_start_version == 4
        rows.append(stats.flush(PIPELINE))
    assert buf.next_batch(7) is None
    # async lags 4 - [1, 2, 3, 3, 3] = [3, 2, 1, 1, 1] at every step (mean 8/5); reuse = version - 4
    # step at 4: lags [3, 2, 1, 1, 1]; at 5: [4, 3, 2, 2, 2] (mean 13/5); at 6: [5, 4, 3, 3, 3] (18/5)
    assert [staleness(r) for r in rows] == [
        pytest.approx((1.6, 3, 1.6, 3, 0)), pytest.approx((2.6, 4, 1.6, 3, 1)), pytest.approx((3.6, 5, 1.6, 3, 2))]


def test_streaming_buffer_lag_is_all_asynchronous():
    buf = TokenBuffer(token_budget=4, max_staleness=3)
    buf.add_group(one_response_group("a", [1, 1, 2, 2]))
    stats = StepStats()
    assert buf.batch_start_version is None
    stats.add_batch(buf.next_batch(3), 3, buf.batch_start_version)
    # lags 3 - [1, 1, 2, 2] = [2, 2, 1, 1]
    assert staleness(stats.flush(PIPELINE)) == (1.5, 2, 1.5, 2, 0)
    assert staleness(stats.flush(PIPELINE)) == (0.0, 0, 0.0, 0, 0)  # no batch: no lag


def test_state_dict_keeps_the_lag_window_and_not_the_examples():
    stats = StepStats()
    stats.add_sample(sample("math"), 1.0, {"outcome": "verified"}, completion="x")
    chunk = ResponseCursor(one_response_group("a", [1, 2]).samples[0].sample, 1.0).chunk(2)
    stats.add_batch([chunk], 5, batch_start_version=3)
    state = msgpack.unpackb(msgpack.packb(stats.state_dict()), strict_map_key=False)  # as checkpoint.py saves it
    fresh = StepStats()
    fresh.load_state_dict(state)
    assert fresh.take_examples() == []
    # lags 5 - [1, 2] = [4, 3]; async 3 - [1, 2] = [2, 1]; reuse 5 - 3 = 2
    assert staleness(fresh.flush(PIPELINE)) == (3.5, 4, 1.5, 2, 2)
    # a checkpoint from before lags were counted by value held them token by token
    state["window"]["lags"], state["window"]["async_lags"] = [4, 3], [2, 1]
    older = StepStats()
    older.load_state_dict(state)
    assert staleness(older.flush(PIPELINE)) == (3.5, 4, 1.5, 2, 2)


def test_a_user_functions_own_info_is_averaged_and_kept_with_the_examples():
    stats = StepStats(examples_per_step=1)
    mine = "import:my_reward:score"
    stats.add_sample(sample("s"), 1.0, {"outcome": "custom", "verifier": mine, "format_ok": True, "dist": 0.5,
                                        "parsed": "12"}, completion="12", prompt="3*4=")
    stats.add_sample(sample("s"), 0.0, {"outcome": "custom", "verifier": mine, "format_ok": False, "dist": 2.0})
    stats.add_sample(sample("s"), 0.0, {"outcome": "custom", "verifier": mine, "dist": float("nan")})
    # a built-in verifier's numbers are not user metrics
    stats.add_sample(sample("s"), 1.0, {"outcome": "verified", "verifier": "math_verify", "dist": 100.0})
    row = stats.flush({})
    assert row["reward/info/format_ok"] == 0.5 and row["reward/info/dist"] == 1.25  # (0.5 + 2) / 2, NaN left out
    assert "reward/info/parsed" not in row  # not a number
    [example] = stats.take_examples()
    assert example["info"] == {"format_ok": True, "dist": 0.5, "parsed": "12"}
    assert stats.flush({})["reward/info/dist"] is None  # a column seen before stays, empty


def test_a_split_responses_rest_lags_by_reuse_and_the_asynchronous_lag_stays_within_the_bound():
    # max_staleness 0: "a" (6 tokens, version 0) enters training at 0 with 4 tokens; its rest trains
    # at 1. Its lag 1 there is the step it followed its prefix by, not asynchrony.
    buf = TokenBuffer(token_budget=4, max_staleness=0)
    buf.add_group(one_response_group("a", [0] * 6))
    stats = StepStats()
    stats.add_batch(buf.next_batch(0), 0, buf.batch_start_version)
    assert staleness(stats.flush(PIPELINE)) == (0.0, 0, 0.0, 0, 0)
    buf.add_group(one_response_group("b", [1, 1]))
    stats.add_batch(buf.next_batch(1), 1, buf.batch_start_version)
    # lags [1, 1, 0, 0]; async [0, 0, 0, 0]; reuse max 1
    assert staleness(stats.flush(PIPELINE)) == (0.5, 1, 0.0, 0, 1)

"""StepStats: the reward metrics of a step (per data source, verifier latency, sandbox outcomes of
the code verifier's tests) are computed from the samples scored since the last flush, then reset."""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from asyncrl.orchestrator.step_stats import StepStats
from asyncrl.types import Sample


@dataclass
class _BufferStats:
    groups_added: int = 0


BUFFER = SimpleNamespace(num_loss_tokens=0, stats=_BufferStats())
ASSEMBLER = SimpleNamespace(stats=SimpleNamespace(groups_zero_variance=0, groups_complete=0, duplicates=0))
RECEIVER = SimpleNamespace(num_dropped=0)


def sample(source, n_tokens=3):
    return Sample("p", "g", 0, [1], [2] * n_tokens, [0.0] * n_tokens, [0] * n_tokens, "stop", 0,
                  metadata={"data_source": source})


def test_reward_metrics_per_source_latency_and_sandbox_outcomes():
    stats = StepStats()
    stats.add_sample(sample("math"), 1.0, {"outcome": "verified"}, latency_s=0.01)
    stats.add_sample(sample("math"), 0.0, {"outcome": "timeout"}, latency_s=0.5)
    stats.add_sample(sample("code"), 0.5, {"outcome": "failed", "tests_total": 4, "tests_run": 4,
                                           "tests_passed": 2, "tests_failed": 1, "tests_timeout": 1},
                     latency_s=0.2)
    stats.add_sample(sample("code"), 0.0, {"outcome": "memory", "tests_total": 4, "tests_run": 1,
                                           "tests_passed": 0, "tests_memory": 1}, latency_s=0.09)
    row = stats.flush(BUFFER, ASSEMBLER, RECEIVER)
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
    after = stats.flush(BUFFER, ASSEMBLER, RECEIVER)
    assert after.keys() == row.keys() and after["reward/num_samples"] == 0 and stats.total_samples == 4
    assert {k: v for k, v in after.items() if k.startswith("reward/sandbox_tests_")} == dict.fromkeys(sandbox, 0)
    assert after["reward/latency_mean_s"] is None and after["reward/by_source/code"] is None
    assert after["reward/outcome_timeout"] is None  # no samples: no fraction
    stats.add_sample(sample("math"), 1.0, {"outcome": "verified"}, latency_s=0.01)
    third = stats.flush(BUFFER, ASSEMBLER, RECEIVER)
    assert third["reward/outcome_timeout"] == 0 and third["reward/outcome_verified"] == 1.0
    assert third["reward/by_source/math"] == 1.0 and third["reward/by_source/code"] is None
